"""Every Python block in README.md and docs/api.md runs as pasted, each in a fresh interpreter with
only the package importable, from an empty folder. A block carrying `# needs a GPU` is skipped
only where there is no GPU."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qca_lowmem

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, ROOT / "docs" / "api.md"]
NEEDS_GPU = "# needs a GPU"
pytestmark = pytest.mark.slow  # every block in a fresh interpreter


def python_blocks(text: str):
    """(line number, code) of every ```python block."""
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)]


BLOCKS = [(f"{path.relative_to(ROOT)}:{line}", code) for path in DOCUMENTS for line, code in
          python_blocks(path.read_text())]


def test_each_document_has_python_blocks_and_the_extractor_finds_them():
    assert all(python_blocks(path.read_text()) for path in DOCUMENTS)
    text = "intro\n```python\nprint(1)\n```\n```bash\nls\n```\n```python\n# needs a GPU\nx = 2\n```\n"
    assert python_blocks(text) == [(3, "print(1)\n"), (9, "# needs a GPU\nx = 2\n")]


def block_environment(code: str) -> dict:
    """A fresh interpreter's environment for a block: only the package importable, one thread, no
    GPU visible unless the block uses one; skips a block that needs a GPU where there is none."""
    if NEEDS_GPU in code and not torch.cuda.is_available():
        pytest.skip("the block needs a GPU and none is visible")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QCA_LOWMEM")}
    env.update(PYTHONPATH=str(Path(qca_lowmem.__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    if "cuda" not in code:
        env["CUDA_VISIBLE_DEVICES"] = ""  # as on a CPU-only machine
    return env


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_the_block_runs_as_pasted(where, code, tmp_path):
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=block_environment(code),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where}:\n{code}\n{done.stderr[-3000:]}"
    assert "Warning" not in done.stderr, f"{where} warns:\n{done.stderr[-3000:]}"


# Feeds a block to an interactive interpreter line by line, as a paste into `python` does; a
# syntax error (a `with` body followed at once by a dedented line, say) or an exception exits.
CONSOLE = """
import code, sys

class Console(code.InteractiveConsole):
    def showsyntaxerror(self, filename=None, **kwargs):
        super().showsyntaxerror(filename)
        sys.exit(3)

    def showtraceback(self):
        super().showtraceback()
        sys.exit(4)

console = Console()
for line in sys.stdin.read().splitlines():
    console.push(line)
console.push("")
"""


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_the_block_runs_pasted_into_the_interpreter(where, code, tmp_path):
    done = subprocess.run([sys.executable, "-c", CONSOLE], input=code, cwd=tmp_path, env=block_environment(code),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where}, pasted:\n{code}\n{done.stderr[-3000:]}"


def test_the_console_sees_what_a_paste_breaks(tmp_path):
    done = subprocess.run([sys.executable, "-c", CONSOLE], input="import contextlib\nwith contextlib.nullcontext():\n"
                          "    pass\nprint(1)\n", cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "SyntaxError" in done.stderr


def test_the_readme_names_no_commit():
    """Of ours, that is: the users' commit the patch applies to is named (test_atheria_patch.py)."""
    theirs = json.loads((ROOT / "tests" / "fixtures" / "atheria_pipeline_train.json").read_text())["commit"]
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", README.read_text()) if re.search(r"[a-f]", h)
              and re.search(r"\d", h) and not theirs.startswith(h)]
    assert not hashes, f"commit hashes belong in docs/benchmarks.md, not the README: {hashes}"


def test_the_readme_stays_short():
    """What users read first; the API reference lives in docs/api.md."""
    assert len(README.read_text().splitlines()) < 200
