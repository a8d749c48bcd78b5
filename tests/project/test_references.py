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
EXTENSIONS = ("py", "md", "cu", "cuh", "c", "h", "cpp", "inc", "json", "yaml", "sh", "toml")
FILE = re.compile(r"(?<![\w/.*-])((?:[\w.-]+/)*[\w-]+\.(?:" + "|".join(EXTENSIONS) + r"))(?![\w/])")
MODULE = re.compile(r"(?<![\w.])(qca_lowmem(?:\.\w+)+)")
# A module of the package named by its last part and an attribute, in backquotes: `switch.enable`.
SHORT = re.compile(r"`([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`")
# Short forms that name the users' objects, not a module of ours of the same name.
OBJECT_ATTRIBUTES = {"state.psi", "state.h_state", "state.c_state", "state._reset_state_random", "checkpoint.pt"}
C_SOURCES = (".c", ".h", ".cu", ".cuh", ".cpp", ".inc")
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)

# The docs whole; of the code, what it says to people (comments, docstrings), not its strings.
SOURCES = [p for p in TRACKED if not p.startswith("tests/") and (
    p.endswith((".md", ".py", ".sh") + C_SOURCES) or p.startswith(".ci/"))]
PACKAGE_MODULES = {}  # last part of a module's name -> its dotted names
for _path in sorted((ROOT / "python" / "qca_lowmem").rglob("*.py")):
    _parts = list(_path.relative_to(ROOT / "python").with_suffix("").parts)
    if _parts[-1] == "__init__":
        _parts.pop()
    PACKAGE_MODULES.setdefault(_parts[-1], []).append(".".join(_parts))


def file_exists(name: str, source: str) -> bool:
    if Path(name).name in OUTSIDE or "foo" in name or Path(name).stem.isupper():  # foo, NAME: placeholders
        return True
    if name.startswith("src/") and not (ROOT / "src").exists():  # a path in the users' repository
        return True
    if "/" not in name:
        return name in BASENAMES
    here = (ROOT / source).parent
    candidates = [ROOT / name, here / name]
    if any(c.resolve().relative_to(ROOT).as_posix() in TRACKED_SET for c in candidates if c.resolve().is_relative_to(ROOT)):
        return True
    # A path named from inside the package or the C tree (recompute/step_graph.py, kernels/noise.cu).
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


def short_form_exists(stem: str, name: str) -> bool:
    """`stem.name`: true unless stem is the last part of a package module's name and no such
    module has `name`."""
    if f"{stem}.{name}" in OBJECT_ATTRIBUTES or name in EXTENSIONS or stem not in PACKAGE_MODULES:
        return True
    return any(module_exists(f"{module}.{name}") for module in PACKAGE_MODULES[stem])


def prose(path: str) -> str:
    return prose_of_text((ROOT / path).read_text(errors="replace"), path)


def prose_of_text(text: str, path: str) -> str:
    if path.endswith(C_SOURCES):  # comments only, line numbers kept
        kept = [c if c == "\n" else " " for c in text]
        for match in C_COMMENT.finditer(text):
            kept[match.start():match.end()] = list(match.group(0))
        return "".join(kept)
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
    return references_in(prose(path))


def references_in(text: str):
    for match in FILE.finditer(text):
        yield "file", match.group(1), text.count("\n", 0, match.start()) + 1
    for match in MODULE.finditer(text):
        yield "module", match.group(1).rstrip("."), text.count("\n", 0, match.start()) + 1
    for match in SHORT.finditer(text):
        yield "short", match.group(1, 2), text.count("\n", 0, match.start()) + 1


@pytest.mark.parametrize("path", SOURCES)
def test_every_named_file_and_module_exists(path):
    stale = []
    for kind, name, line in references(path):
        if kind == "short":
            if not short_form_exists(*name):
                stale.append(f"line {line}: {'.'.join(name)}")
            continue
        if any(c in name for c in "<*{"):
            continue
        ok = file_exists(name, path) if kind == "file" else module_exists(name)
        if not ok:
            stale.append(f"line {line}: {name}")
    assert not stale, f"{path} names files or modules that do not exist: {stale}"


def test_the_check_sees_a_stale_reference(tmp_path):
    assert not file_exists("auto_checkpoint.py", "docs/design.md")
    assert not file_exists("qca_lowmem/episode_reverse.py", "docs/design.md")
    assert file_exists("recompute/step_graph.py", "docs/design.md") and file_exists("../csrc/ops/glue.h", "docs/design.md")
    assert not module_exists("qca_lowmem.step_graph") and module_exists("qca_lowmem.recompute.step_graph.StepGraph")
    assert not module_exists("qca_lowmem.recompute.graph") and not file_exists("recompute/graph.py", "docs/design.md")
    assert not short_form_exists("switch", "parse_flag") and short_form_exists("config_section", "parse_flag")
    comments = prose_of_text("// see python/qca_lowmem/qca_step.py\nint f(const char* s = \"a/b.py\");\n", "x.c")
    assert [name for _, name, _ in references_in(comments)] == ["python/qca_lowmem/qca_step.py"]
    assert not file_exists("python/qca_lowmem/qca_step.py", "csrc/ops/library.cpp")
