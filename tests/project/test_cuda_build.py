"""A build with the CUDA kernels (QCA_LOWMEM_CUDA=1 against a CUDA build of torch) links, loads
on a machine without a GPU, and registers a CUDA kernel for every op that has a CPU one. CI builds
it in its own environment and runs the ops, library and switch tests against it
(.ci/cuda_build); in a CPU-only build these tests skip."""

import subprocess
import sys

import pytest
import torch

import qca_lowmem
from qca_lowmem import _build_info

pytestmark = pytest.mark.skipif(not _build_info.WITH_CUDA, reason="qca_lowmem was built without CUDA")
DEVICE_KEYS = {"CPU": "CUDA", "SparseCPU": "SparseCUDA"}


def test_the_build_records_torchs_cuda():
    assert _build_info.CUDA_VERSION == torch.version.cuda


def test_every_op_with_a_cpu_kernel_has_a_cuda_kernel():
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("qca_lowmem::")]
    pairs = [(op, cpu, cuda) for op in ops for cpu, cuda in DEVICE_KEYS.items()
             if torch._C._dispatch_has_kernel_for_dispatch_key(op, cpu)]
    assert len({op for op, _, _ in pairs}) >= 12  # the QCA step, noise, GroupNorm+ELU and scaler ops
    missing = [f"{op} ({cuda})" for op, _, cuda in pairs
               if not torch._C._dispatch_has_kernel_for_dispatch_key(op, cuda)]
    assert not missing, missing


@pytest.mark.slow
def test_doctor_reports_the_cuda_kernels():
    result = subprocess.run([sys.executable, "-m", "qca_lowmem", "doctor"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert any(line.split() == ["_C", "has", "CUDA", "kernels", "yes"] for line in result.stdout.splitlines()), result.stdout
    assert qca_lowmem.__version__ in result.stdout
