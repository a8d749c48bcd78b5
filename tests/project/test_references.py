"""Every file and module that the docs and the code's comments and docstrings name exists: a
moved or renamed file leaves no stale reference behind."""

import ast
import importlib
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACKED = [p for p in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
           if (ROOT / p).is_file()]
TRACKED_SET = set(TRACKED)
BASENAMES = {Path(p).name for p in TRACKED}
# Made by the build or by a run, not tracked; the toolchain's headers; a naming pattern; the
# users' own code (github Jonakss/Atheria) and their files.
OUTSIDE = {"_build_info.py", "episode_cpu.json", "bench_cpu.json", "cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h",
           "math.h", "_cuda.cpp", "qc_trainer_v3.py", "pipeline_train.py", "motor_factory.py", "config.json", "my.yaml"}
FILE = re.compile(r"(?<![\w/.*-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|cu|cuh|c|h|cpp|inc|json|yaml|sh|toml))(?![\w/])")
MODULE = re.compile(r"(?<![\w.])(qca_lowmem(?:\.\w+)+)")

# The docs whole; of the code, what it says to people (comments, docstrings), not its strings.
SOURCES = [p for p in TRACKED if not p.startswith("tests/") and (
    p.endswith((".md", ".py", ".sh")) or p.startswith(".ci/"))]


def file_exists(name: str, source: str) -> bool:
    if Path(name).name in OUTSIDE or "foo" in name or Path(name).stem.isupper():  # foo, NAME: placeholders
        return True
    if "/" not in name:
        return name in BASENAMES
    here = (ROOT / source).parent
    candidates = [ROOT / name, here / name]
    if any(c.resolve().relative_to(ROOT).as_posix() in TRACKED_SET for c in candidates if c.resolve().is_relative_to(ROOT)):
        return True
    # A path named from inside the package or the C tree (recompute/graph.py, kernels/noise.cu).
    return any(p.endswith("/" + name.lstrip("./")) for p in TRACKED)


def module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def prose(path: str) -> str:
    text = (ROOT / path).read_text(errors="replace")
    if not path.endswith(".py"):
        return text
    lines = text.splitlines()
    kept = [""] * len(lines)  # line numbers stay those of the file
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            kept[token.start[0] - 1] += token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for i in range(first.lineno - 1, first.end_lineno):
                    kept[i] += " " + lines[i]
    return "\n".join(kept)


def references(path: str):
    text = prose(path)
    for match in FILE.finditer(text):
        yield "file", match.group(1), text.count("\n", 0, match.start()) + 1
    for match in MODULE.finditer(text):
        yield "module", match.group(1).rstrip("."), text.count("\n", 0, match.start()) + 1


@pytest.mark.parametrize("path", SOURCES)
def test_every_named_file_and_module_exists(path):
    stale = []
    for kind, name, line in references(path):
        if any(c in name for c in "<*{"):
            continue
        ok = file_exists(name, path) if kind == "file" else module_exists(name)
        if not ok:
            stale.append(f"line {line}: {name}")
    assert not stale, f"{path} names files or modules that do not exist: {stale}"


def test_the_check_sees_a_stale_reference(tmp_path):
    assert not file_exists("auto_checkpoint.py", "docs/design.md")
    assert not file_exists("qca_lowmem/episode_reverse.py", "docs/design.md")
    assert file_exists("recompute/graph.py", "docs/design.md") and file_exists("../csrc/ops/glue.h", "docs/design.md")
    assert not module_exists("qca_lowmem.step_graph") and module_exists("qca_lowmem.recompute.graph.StepGraph")
