"""Builds the emulator library: the CUDA kernel files compiled as C++ against cuda_emu.h (their
loads and stores instrumented for the race detector), the emulator runtime, the C kernels and
the test driver, linked into one shared library loaded with ctypes. Objects are cached under
build/cuda_emu by a hash of their inputs, so only what changed is recompiled."""

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KERNELS = ROOT / "csrc" / "kernels"
CACHE = ROOT / "build" / "cuda_emu"

CXX = os.environ.get("CXX") or shutil.which("g++") or "g++"
CC = os.environ.get("CC") or shutil.which("gcc") or "gcc"
INCLUDES = ["-I", str(ROOT / "include"), "-I", str(KERNELS), "-I", str(HERE)]
# -fsanitize=thread only for its instrumentation: every load and store calls __tsan_*, which
# runtime.cpp implements (the ThreadSanitizer runtime is not linked); line tables (-g1) for the
# reports' file:line. No FMA contraction: the emulated kernels round every product, as the _rn
# intrinsics do.
CUDA_FLAGS = [CXX, "-std=c++17", "-O2", "-g1", "-fPIC", "-x", "c++", "-DQCA_CUDA_EMULATION",
              "-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0",
              "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", *INCLUDES]
# The C kernels as setup.py builds them.
C_FLAGS = [CC, "-std=c11", "-O3", "-fno-trapping-math", "-fPIC", "-Wall", "-Wextra", "-Wno-psabi", "-I",
           str(ROOT / "include")]
CXX_FLAGS = [CXX, "-std=c++20", "-O2", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
             "-Werror=missing-field-initializers", *INCLUDES]


def _headers_digest():
    h = hashlib.sha256()
    for pattern_root, patterns in ((KERNELS, ("*.h", "*.cuh", "*.inc")),
                                   (ROOT / "include" / "qca_lowmem", ("*.h",)),
                                   (HERE, ("*.h",))):
        for pattern in patterns:
            for path in sorted(pattern_root.glob(pattern)):
                h.update(path.name.encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _compile(flags, source, headers):
    key = hashlib.sha256("\0".join(flags).encode() + source.read_bytes() + headers.encode())
    obj = CACHE / "obj" / f"{source.stem}-{key.hexdigest()[:20]}.o"
    if not obj.exists():
        obj.parent.mkdir(parents=True, exist_ok=True)
        tmp = obj.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([*flags, "-c", str(source), "-o", str(tmp)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source} for the emulator failed:\n{result.stderr}")
        tmp.replace(obj)
    return obj


def build(cuda_sources=None, jobs=2):
    """Path of the library built from `cuda_sources` (default: every csrc/kernels/*.cu) and the
    emulator's own test kernels."""
    cuda_sources = sorted(cuda_sources or KERNELS.glob("*.cu")) + [HERE / "selftest.cu"]
    headers = _headers_digest()
    units = [(CUDA_FLAGS, s) for s in cuda_sources]
    units += [(C_FLAGS, s) for s in sorted(KERNELS.glob("*.c"))]
    units += [(CXX_FLAGS, HERE / "runtime.cpp"), (CXX_FLAGS, HERE / "driver.cpp")]
    # The longest compile (GroupNorm+ELU's many instantiations) first.
    units.sort(key=lambda u: -u[1].stat().st_size)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objects = list(pool.map(lambda u: _compile(u[0], u[1], headers), units))
    key = hashlib.sha256("\0".join(sorted(str(o) for o in objects)).encode()).hexdigest()[:20]
    library = CACHE / f"libqca_emu-{key}.so"
    if not library.exists():
        tmp = library.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([CXX, "-shared", "-o", str(tmp), *map(str, objects), "-ldl"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"linking the emulator library failed:\n{result.stderr}")
        tmp.replace(library)
    return library
