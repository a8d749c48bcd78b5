"""Build of qca_lowmem: C kernels as a static library, ATen glue as the `_C` extension, and CUDA
kernels when the installed torch and toolkit allow it (QCA_LOWMEM_CUDA=auto|0|1)."""

import glob
import os
import shlex
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent.resolve()
# Turing (the users' small cards) to Hopper, plus Hopper's PTX, which the driver compiles for
# newer GPUs (Blackwell and on) when the library is loaded there.
DEFAULT_CUDA_ARCHS = "7.5;8.0;8.6;8.9;9.0+PTX"


def relative(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


def find_cuda_toolkit():
    """A toolkit to build with (bin/nvcc, include/cuda_runtime.h, libcudart): torch's guess, else
    the usual places; the one found becomes torch's CUDA_HOME for this build. torch takes the
    parent of the nvcc on PATH, which for a wrapper script (/usr/local/bin/nvcc) is no toolkit."""

    def complete(home):
        return bool(home and os.path.exists(f"{home}/bin/nvcc")
                    and os.path.exists(f"{home}/include/cuda_runtime.h")
                    and any(glob.glob(f"{home}/{d}/libcudart*") for d in ("lib64", "lib", "targets/*/lib")))

    candidates = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]
    home = next((c for c in candidates if complete(c)), None)
    if home and home != cpp_extension.CUDA_HOME:
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = home
    return home


def decide_cuda():
    """(build CUDA?, reason). Decided from torch.version.cuda and the toolkit, never from a GPU."""
    mode = os.environ.get("QCA_LOWMEM_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"QCA_LOWMEM_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, "QCA_LOWMEM_CUDA=0"
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} was built without CUDA")
    elif find_cuda_toolkit() is None:
        missing.append("no CUDA toolkit (bin/nvcc, include/cuda_runtime.h, libcudart) at "
                       f"{cpp_extension.CUDA_HOME or 'the nvcc on PATH'} or /usr/local/cuda*: "
                       "set CUDA_HOME to the toolkit's directory")
    if missing:
        if mode == "1":
            raise SystemExit("QCA_LOWMEM_CUDA=1 but the CUDA kernels cannot be built: " + "; ".join(missing))
        return False, "; ".join(missing)
    return True, f"torch CUDA {torch.version.cuda}, toolkit at {cpp_extension.CUDA_HOME}"


def cuda_arch_list():
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"], "from TORCH_CUDA_ARCH_LIST"
    if torch.cuda.is_available():
        return None, "torch's default for the visible GPU"
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    return DEFAULT_CUDA_ARCHS, "no GPU visible: Turing to Hopper, and Hopper's PTX for newer GPUs"


def write_build_info(with_cuda, arch_list):
    """Recorded build facts, checked at import against the running torch."""
    lines = [
        "# Written by setup.py at build time; checked by qca_lowmem.ops._loader at import.",
        f"TORCH_VERSION = {torch.__version__!r}",
        f"WITH_CUDA = {with_cuda!r}",
        f"CUDA_VERSION = {(torch.version.cuda if with_cuda else None)!r}",
        f"CUDA_ARCH_LIST = {arch_list!r}",
        "",
    ]
    (ROOT / "python" / "qca_lowmem" / "_build_info.py").write_text("\n".join(lines))


def shared_libstdcxx():
    """The shared libstdc++ torch runs with: the one this process loaded with torch (or, where
    /proc is missing, the compiler's), by path; -lstdc++ when neither can be found."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isabs(path):
                    return path
    except OSError:
        pass
    compiler = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")
    try:
        found = subprocess.run(compiler + ["-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        found = ""
    return found if os.path.isabs(found) and os.path.exists(found) else "-lstdc++"


def elf_needed(path):
    """The DT_NEEDED entries of a 64-bit ELF shared object, or None for another format."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    order = "<" if data[5] == 1 else ">"
    (section_offset,) = struct.unpack_from(order + "Q", data, 0x28)
    entry_size, count = struct.unpack_from(order + "HH", data, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, align, entsize)
    sections = [struct.unpack_from(order + "IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    needed = []
    for section in sections:
        if section[1] != 6:  # SHT_DYNAMIC
            continue
        strings = sections[section[6]][4]
        for offset in range(section[4], section[4] + section[5], 16):
            tag, value = struct.unpack_from(order + "qQ", data, offset)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strings + value
                needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


class BuildExtensionWithKernels(BuildExtension):
    """Builds the C kernel library first, also for `build_ext --inplace` and editable installs;
    refuses an extension that carries its own copy of libstdc++."""

    def run(self):
        self.run_command("build_clib")
        super().run()
        for ext in self.extensions:
            needed = elf_needed(self.get_ext_fullpath(ext.name))
            if needed is not None and not any(name.startswith("libstdc++.so") for name in needed):
                raise SystemExit(
                    "qca_lowmem: the C++ compiler linked libstdc++ statically into the extension (a private copy "
                    "next to torch's crashes on the first error message); build with a plain g++, e.g. "
                    "CXX=/usr/bin/g++, and install again."
                )


with_cuda, reason = decide_cuda()
arch_list = None
if with_cuda:
    arch_list, arch_reason = cuda_arch_list()
    print(f"qca_lowmem: building with CUDA ({reason}); architectures: {arch_list or 'default'} ({arch_reason})")
else:
    print(f"qca_lowmem: building the CPU library only ({reason})")
write_build_info(with_cuda, arch_list)

c_kernels = relative((ROOT / "csrc" / "kernels").glob("*.c"))
glue = [p for p in relative((ROOT / "csrc" / "ops").glob("*.cpp")) if not p.endswith("_cuda.cpp")]
include_dirs = [str(ROOT / "include")]
# The C++ standard is the one torch asks for; no debug information (Python's own CFLAGS carry -g,
# which made most of _C's size: ATen's templates).
cxx_flags = ["-O3", "-Wall", "-g0"]
# at::parallel_for is inline: with torch's OpenMP backend its `#pragma omp parallel` is compiled
# into the glue, and without -fopenmp it runs serially (the CPU kernels used one thread whatever
# torch.set_num_threads said). Linked with -fopenmp, the glue's libgomp.so.1 is the one torch has
# already loaded (the same soname).
openmp_flags = ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []
cxx_flags += openmp_flags
# libstdc++ as a shared library, as torch links it: some toolchain wrappers link it statically,
# and a private copy in _C next to torch's shared one crashed in iostreams (every error message
# with a number: a segfault instead of a RuntimeError). Naming the shared object by its path
# binds it whatever static flags a wrapper adds; the build then checks the result.
link_flags = [shared_libstdcxx()] + openmp_flags

if with_cuda:
    cuda_sources = relative((ROOT / "csrc" / "kernels").glob("*.cu"))
    cuda_glue = relative((ROOT / "csrc" / "ops").glob("*_cuda.cpp"))
    extension = CUDAExtension(
        "qca_lowmem._C",
        sources=glue + cuda_glue + cuda_sources,
        include_dirs=include_dirs,
        # -lineinfo: device line tables (small) for the profilers and compute-sanitizer
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
        extra_link_args=link_flags,
    )
else:
    extension = CppExtension(
        "qca_lowmem._C",
        sources=glue,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )

setup(
    libraries=[
        (
            "qca_lowmem_kernels",
            {
                "sources": c_kernels,
                "include_dirs": include_dirs,
                # -fno-trapping-math: we never read floating-point exception flags, and without
                # it GCC keeps branches (no vector code) around selects such as ELU's.
                # -Wno-psabi: qca_step.c's vectors of 8 floats go by value into inline functions;
                # GCC notes that their ABI differs without AVX, which no call between objects sees.
                "cflags": ["-std=c11", "-O3", "-fno-trapping-math", "-fPIC", "-Wall", "-Wextra", "-Wno-psabi",
                           "-g0"],
            },
        )
    ],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtensionWithKernels},
    # Objects of the C kernels apart from the extension's: groupnorm_elu.c and groupnorm_elu.cu
    # would both be groupnorm_elu.o, and a rebuild in the same tree took one for the other.
    options={"build_clib": {"build_temp": str(Path("build") / "temp.kernels")}},
)
