"""Build of qca_lowmem: C kernels as a static library, ATen glue as the `_C` extension, and CUDA
kernels when the installed torch and toolkit allow it (QCA_LOWMEM_CUDA=auto|0|1)."""

import glob
import os
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
        "# Written by setup.py at build time; checked by qca_lowmem._loader at import.",
        f"TORCH_VERSION = {torch.__version__!r}",
        f"WITH_CUDA = {with_cuda!r}",
        f"CUDA_VERSION = {(torch.version.cuda if with_cuda else None)!r}",
        f"CUDA_ARCH_LIST = {arch_list!r}",
        "",
    ]
    (ROOT / "python" / "qca_lowmem" / "_build_info.py").write_text("\n".join(lines))


class BuildExtensionWithKernels(BuildExtension):
    """Builds the C kernel library first, also for `build_ext --inplace` and editable installs."""

    def run(self):
        self.run_command("build_clib")
        super().run()


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
# libstdc++ as a shared library, as torch links it: some toolchain wrappers link it statically,
# and a private copy in _C next to torch's shared one crashed in iostreams (every error message
# with a number: a segfault instead of a RuntimeError). Named before the driver's own libraries,
# the shared one resolves every symbol.
link_flags = ["-lstdc++"]

if with_cuda:
    cuda_sources = relative((ROOT / "csrc" / "kernels").glob("*.cu"))
    cuda_glue = relative((ROOT / "csrc" / "ops").glob("*_cuda.cpp"))
    extension = CUDAExtension(
        "qca_lowmem._C",
        sources=glue + cuda_glue + cuda_sources,
        include_dirs=include_dirs,
        define_macros=[("QCA_LOWMEM_WITH_CUDA", "1")],
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
                "cflags": ["-std=c11", "-O3", "-fPIC", "-Wall", "-Wextra", "-g0"],
            },
        )
    ],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtensionWithKernels},
    # Objects of the C kernels apart from the extension's: groupnorm_elu.c and groupnorm_elu.cu
    # would both be groupnorm_elu.o, and a rebuild in the same tree took one for the other.
    options={"build_clib": {"build_temp": str(Path("build") / "temp.kernels")}},
)
