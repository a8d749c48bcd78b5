"""Build decisions and the import-time check of the recorded build facts."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import qca_lowmem
import qca_lowmem.stock
from qca_lowmem import _build_info
from qca_lowmem.ops import _loader

ROOT = Path(__file__).resolve().parents[2]


def test_build_facts_recorded():
    assert _build_info.TORCH_VERSION == torch.__version__
    assert _build_info.WITH_CUDA == _loader.has_cuda_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("qca_lowmem::qca_update", "CPU")


def test_torch_mismatch_says_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.0.0")
    with pytest.raises(ImportError, match=r"built against torch 1\.0\.0 but torch .* is running; rebuild .*"
                       + re.escape(_loader.REBUILD_COMMAND)):
        _loader.load_native()


def _import_copy_with(tmp_path, replace_c):
    """Imports a copy of the installed package whose _C is missing or replaced, in a fresh interpreter."""
    package = Path(qca_lowmem.__file__).parent
    copy = tmp_path / "qca_lowmem"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    replace_c(copy)
    # An editable install's finder would supply the source tree's _C to the copy: only the copy is imported.
    only_the_copy = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in f.__module__]; "
                     "import qca_lowmem")
    return subprocess.run([sys.executable, "-c", only_the_copy], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})


def _assert_one_line_rebuild_hint(result, says):
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and says in last and last.endswith(_loader.REBUILD_COMMAND), result.stderr
    assert "circular import" not in result.stderr and "During handling" not in result.stderr, result.stderr


@pytest.mark.slow
def test_missing_native_library_says_how_to_rebuild(tmp_path):
    result = _import_copy_with(tmp_path, lambda copy: None)
    _assert_one_line_rebuild_hint(result, "native library _C is missing from")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_unloadable_native_library_says_how_to_rebuild(tmp_path):
    """A _C built for another torch fails in the dynamic loader on a symbol this torch lacks."""
    source = tmp_path / "c.c"
    source.write_text("void symbol_of_another_torch(void);\nvoid *PyInit__C(void) { symbol_of_another_torch(); return 0; }\n")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")

    def build_c(copy):
        subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(copy / f"_C{suffix}")], check=True)

    result = _import_copy_with(tmp_path, build_c)
    _assert_one_line_rebuild_hint(result, "undefined symbol: symbol_of_another_torch")


def _setup_py(env_value):
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=ROOT,
        env={"QCA_LOWMEM_CUDA": env_value, "PATH": "/usr/bin:/bin", "CUDA_HOME": ""},
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch can build CUDA")
def test_forcing_cuda_without_cuda_fails_loudly():
    result = _setup_py("1")
    assert result.returncode != 0
    assert "QCA_LOWMEM_CUDA=1 but the CUDA kernels cannot be built" in result.stderr
    assert "was built without CUDA" in result.stderr


@pytest.mark.slow
def test_bad_cuda_switch_is_rejected():
    result = _setup_py("maybe")
    assert result.returncode != 0 and "QCA_LOWMEM_CUDA must be auto, 0 or 1, got 'maybe'" in result.stderr


def test_version():
    assert qca_lowmem.__version__


def test_stock_computation_uses_no_kernels():
    """qca_lowmem.stock is the oracle the kernels are tested against: plain torch only (and
    NumPy's generator, which the users' noise tosses its coin with)."""
    import ast

    tree = ast.parse(Path(qca_lowmem.stock.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    relative = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative and imported <= {"math", "numpy", "typing", "torch"}, (relative, imported)
    assert "torch.ops" not in Path(qca_lowmem.stock.__file__).read_text()
