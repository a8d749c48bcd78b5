"""Build decisions and the import-time check of the recorded build facts."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qca_lowmem
import qca_lowmem.stock
from qca_lowmem import _build_info, _loader

ROOT = Path(__file__).resolve().parents[1]


def test_build_facts_recorded():
    assert _build_info.TORCH_VERSION == torch.__version__
    assert _build_info.WITH_CUDA == _loader.has_cuda_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("qca_lowmem::qca_update", "CPU")


def test_torch_mismatch_says_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.0.0")
    with pytest.raises(ImportError, match=r"built against torch 1\.0\.0 but torch .* is running; rebuild .*pip install --no-build-isolation"):
        _loader.load_native()


def _setup_py(env_value):
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=ROOT,
        env={"QCA_LOWMEM_CUDA": env_value, "PATH": "/usr/bin:/bin", "CUDA_HOME": ""},
        capture_output=True,
        text=True,
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch can build CUDA")
def test_forcing_cuda_without_cuda_fails_loudly():
    result = _setup_py("1")
    assert result.returncode != 0
    assert "QCA_LOWMEM_CUDA=1 but the CUDA kernels cannot be built" in result.stderr
    assert "was built without CUDA" in result.stderr


def test_bad_cuda_switch_is_rejected():
    result = _setup_py("maybe")
    assert result.returncode != 0 and "QCA_LOWMEM_CUDA must be auto, 0 or 1, got 'maybe'" in result.stderr


def test_version():
    assert qca_lowmem.__version__


def test_stock_computation_uses_no_kernels():
    """qca_lowmem.stock is the oracle the kernels are tested against: plain torch only."""
    import ast

    tree = ast.parse(Path(qca_lowmem.stock.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    relative = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative and imported <= {"math", "typing", "torch"}, (relative, imported)
    assert "torch.ops" not in Path(qca_lowmem.stock.__file__).read_text()
