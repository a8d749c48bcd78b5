"""The CUDA code compiles on a machine without a GPU: every .cu with plain `nvcc -c` (no torch
headers), and the CUDA glue through the host compiler against torch's headers."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
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
