"""The CUDA code compiles on a machine without a GPU: every .cu with plain `nvcc -c` (no torch
headers), and the CUDA glue through the host compiler against torch's headers; the kernels that
must give the C kernels' bits compile to code nvcc cannot contract into FMAs."""

import os
import shutil
import struct
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted((ROOT / "csrc" / "kernels").glob("*.cu"))
CUDA_GLUE = sorted((ROOT / "csrc" / "ops").glob("*_cuda.cpp"))


def _nvcc():
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else shutil.which("nvcc")


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def test_there_is_cuda_code():
    assert CU_FILES and CUDA_GLUE


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_with_plain_nvcc(source, tmp_path):
    result = subprocess.run(
        [NVCC, "-c", "-I", str(ROOT / "include"), str(source), "-o", str(tmp_path / "out.o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.o").stat().st_size > 0


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("source", CUDA_GLUE, ids=lambda p: p.name)
def test_cuda_glue_compiles(source, tmp_path):
    torch_dir = Path(torch.__file__).parent
    cuda_include = Path(NVCC).resolve().parents[1] / "include"
    # A CPU build of torch ships the c10/cuda headers but not this one generated header.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    command = [
        shutil.which("c++") or "g++",
        "-std=c++20",
        "-fsyntax-only",
        "-DQCA_LOWMEM_WITH_CUDA=1",
        "-I", str(ROOT / "include"),
        "-I", str(tmp_path),
        "-I", str(torch_dir / "include"),
        "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        "-I", str(cuda_include),
        "-I", sysconfig.get_paths()["include"],
        str(source),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd (glibc Linux)")
def test_extension_uses_the_shared_libstdcxx():
    """A private static copy next to torch's shared libstdc++ crashed in iostreams (seen on a GPU
    machine whose compiler wrapper linked it statically): every error message segfaulted."""
    import qca_lowmem._C as native

    result = subprocess.run(["ldd", native.__file__], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "libstdc++.so" in result.stdout, result.stdout


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd (glibc Linux)")
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch without OpenMP")
def test_extension_parallel_for_uses_torchs_openmp_runtime():
    """at::parallel_for is inline and OpenMP in torch's build: without -fopenmp the glue ran every
    CPU kernel on one thread. The runtime it links must be the one torch loaded, not a second."""
    import qca_lowmem._C as native

    result = subprocess.run(["ldd", native.__file__], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "libgomp" in result.stdout, result.stdout
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(mapped) == 1, mapped


def text_sections(cubin):
    """{name: bytes} of the machine-code sections of an ELF64 cubin."""
    data = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]

    def name(h):
        start = names_offset + h[0]
        return data[start:data.index(b"\0", start)].decode()

    return {name(h): data[h[4]:h[4] + h[5]] for h in headers if name(h).startswith(".text")}


def machine_code(source, fmad, tmp_path):
    cubin = tmp_path / f"{source.stem}-{fmad}.cubin"
    result = subprocess.run([NVCC, "-cubin", "-arch=sm_80", f"-fmad={fmad}", "-I", str(ROOT / "include"),
                             str(source), "-o", str(cubin)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return text_sections(cubin)


@pytest.mark.slow
@needs_nvcc
def test_fma_contraction_shows_in_the_machine_code(tmp_path):
    """The check below can fail: a kernel with `a * b + c` compiles differently without FMA."""
    source = tmp_path / "fused.cu"
    source.write_text("__global__ void k(float* p) { p[0] = p[1] * p[2] + p[3]; }\n")
    assert machine_code(source, "true", tmp_path) != machine_code(source, "false", tmp_path)


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("name", ["qca_step.cu", "noise.cu"])
def test_kernels_matching_c_bit_for_bit_have_nothing_to_fuse(name, tmp_path):
    """The QCA step and the noise must give the C kernels' bits, so nvcc may not fuse a product
    and an add into one FMA (C never does): their machine code is the same with and without
    -fmad (their products go through qca_lowmem_cuda::mul_rn)."""
    source = ROOT / "csrc" / "kernels" / name
    fused, unfused = machine_code(source, "true", tmp_path), machine_code(source, "false", tmp_path)
    assert fused and fused == unfused
