"""The C API's CPU and CUDA launchers keep one contract for arguments the ATen glue never sends
(the glue validates first), called here through ctypes on the loaded library. The ctypes
structures are checked against the header's layout, as a C compiler sees it."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import qca_lowmem._C as native_module
import torch

from helpers import DEVICES

QCA_F32 = 0
QCA_BF16 = 3
BAD_DTYPE = 7
QCA_OK = 0
QCA_ERR_UNSUPPORTED_DTYPE = 2


class Grid(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("height", ctypes.c_int64), ("width", ctypes.c_int64),
                ("d", ctypes.c_int64)]


class PackParams(ctypes.Structure):  # qca_pack_params
    _fields_ = [("grid", Grid), ("state_dtype", ctypes.c_int), ("psi", ctypes.c_void_p),
                ("psi_stride", ctypes.c_int64 * 4), ("x_dtype", ctypes.c_int),
                ("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64 * 4)]


INCLUDE = Path(__file__).resolve().parents[2] / "include"
C_COMPILER = shutil.which("cc") or shutil.which("gcc")


def probe(header, expressions, tmp_path):
    """The value of each C expression, from a program compiled against the header."""
    lines = "".join(f'printf("%lld\\n", (long long)({e}));\n' for e in expressions)
    source = tmp_path / "probe.c"
    source.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{header}"\n'
                      f"int main(void) {{\n{lines}return 0;\n}}\n")
    binary = tmp_path / "probe"
    subprocess.run([C_COMPILER, "-std=c11", "-I", str(INCLUDE), str(source), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


@pytest.mark.skipif(C_COMPILER is None, reason="needs a C compiler")
@pytest.mark.parametrize("structure,name", [(Grid, "qca_grid"), (PackParams, "qca_pack_params")])
def test_ctypes_structures_match_the_header(structure, name, tmp_path):
    fields = [field for field, _ in structure._fields_]
    expected = probe("qca_lowmem/qca_step.h", [f"sizeof({name})"] + [f"offsetof({name}, {f})" for f in fields], tmp_path)
    assert [ctypes.sizeof(structure)] + [getattr(structure, field).offset for field in fields] == expected


@pytest.mark.skipif(C_COMPILER is None, reason="needs a C compiler")
def test_constants_match_the_header(tmp_path):
    names = ["QCA_F32", "QCA_BF16", "QCA_OK", "QCA_ERR_UNSUPPORTED_DTYPE"]
    assert [globals()[name] for name in names] == probe("qca_lowmem/common.h", names, tmp_path)


def pack_params(psi, x, x_dtype):
    return PackParams(Grid(*psi.shape), QCA_F32, psi.data_ptr(), (ctypes.c_int64 * 4)(*psi.stride()),
                      x_dtype, x.data_ptr(), (ctypes.c_int64 * 4)(*x.stride()))


def call_pack(library, device, params):
    if device == "cpu":
        fn = library.qca_pack_cpu
        fn.argtypes = [ctypes.POINTER(PackParams), ctypes.c_int64, ctypes.c_int64]
        n_cells = params.grid.batch * params.grid.height * params.grid.width
        return fn(ctypes.byref(params), 0, n_cells)
    fn = library.qca_pack_cuda
    fn.argtypes = [ctypes.POINTER(PackParams), ctypes.c_void_p, ctypes.c_void_p]
    error = ctypes.c_int(0)
    status = fn(ctypes.byref(params), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                ctypes.byref(error))
    torch.cuda.synchronize()
    return status


@pytest.mark.parametrize("device", DEVICES)
def test_pack_launcher_rejects_an_unknown_x_dtype(device):
    library = ctypes.CDLL(native_module.__file__)
    psi = torch.randn(1, 3, 4, 2, dtype=torch.complex64, device=device)
    x = torch.full((1, 4, 3, 4), 5.0, device=device)
    status = call_pack(library, device, pack_params(psi, x, BAD_DTYPE))
    assert status == QCA_ERR_UNSUPPORTED_DTYPE
    assert torch.equal(x, torch.full_like(x, 5.0))  # nothing written
    # and the same call with a known dtype packs psi
    assert call_pack(library, device, pack_params(psi, x, QCA_F32)) == QCA_OK
    torch.testing.assert_close(x, torch.cat([psi.real, psi.imag], dim=3).permute(0, 3, 1, 2))


@pytest.mark.slow
def test_the_cpu_kernels_hold_no_fused_multiply_add():
    # Every clone (SSE2, AVX2, AVX-512F) must round products on their own, as the CUDA kernels'
    # mul_rn does: the QCA step's bits equal the GPU's, and the clones give each other's bits.
    # AVX-512F has FMA instructions; C11 mode must keep the compiler from contracting into them.
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump")
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", native_module.__file__],
                          capture_output=True, text=True, check=True).stdout
    assert "vaddps" in code and "vdivps" in code  # vectorised kernels were disassembled
    fused = [line for line in code.splitlines() if "vfmadd" in line or "vfmsub" in line
             or "vfnmadd" in line or "vfnmsub" in line]
    assert fused == []
