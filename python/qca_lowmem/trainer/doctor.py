"""`qca-lowmem doctor`: what this environment has, and what to fix for low-memory training."""

import importlib.util
import os
import sys
from typing import List, Tuple

import torch

from ..precision import native_amp_dtype
from ..units import format_bytes

SMALL_GPU = 4 * 2**30


def report() -> Tuple[List[Tuple[str, str]], List[str]]:
    """(facts as (name, value), things to fix)."""
    from .. import _build_info
    from .._version import __version__
    from ..ops import REBUILD_COMMAND, has_cuda_kernels

    facts, fixes = [], []
    facts.append(("python", sys.version.split()[0]))
    facts.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"))
    facts.append(("qca_lowmem", f"{__version__} at {os.path.dirname(_build_info.__file__)}"))
    facts.append(("built against", f"torch {_build_info.TORCH_VERSION}, CUDA {_build_info.CUDA_VERSION or 'none'}"))
    cuda_kernels = has_cuda_kernels()
    facts.append(("_C has CUDA kernels", "yes" if cuda_kernels else "no"))

    available = torch.cuda.is_available()
    facts.append(("CUDA available", "yes" if available else "no"))
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            facts.append((f"GPU {index}", f"{props.name}, {format_bytes(props.total_memory)}, "
                                           f"compute capability {props.major}.{props.minor}"))
            facts.append((f"GPU {index} precision", half_precision_of(index, props)))
            if props.total_memory < SMALL_GPU:
                fixes.append(f"GPU {index} has {format_bytes(props.total_memory)}: train with --config small_gpu, "
                             f"or run `qca-lowmem plan --gpu-mem {props.total_memory / 2**30:.2f}GiB` to pick a policy")
        if not cuda_kernels:
            fixes.append("a GPU is present but qca_lowmem was built without CUDA kernels: set CUDA_HOME to a CUDA "
                         "toolkit matching torch's CUDA and rebuild in the qca_lowmem source directory: "
                         f"QCA_LOWMEM_CUDA=1 {REBUILD_COMMAND}")
    elif torch.version.cuda:
        fixes.append("torch is a CUDA build but sees no GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    else:
        fixes.append("torch is a CPU-only build: to train on a GPU, install a CUDA build of torch, then rebuild "
                     f"qca_lowmem against it in its source directory ({REBUILD_COMMAND})")

    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    facts.append(("allocator settings", alloc or "unset (qca-lowmem train sets expandable_segments:True)"))
    if available and (not alloc or "expandable_segments:True" not in alloc):
        fixes.append("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python "
                     "(less fragmentation on small GPUs; qca-lowmem train does it for you)")

    # What the README promises after run.sh: a run's TensorBoard logs and bench's plot included.
    for module, package, why in (("tqdm", "tqdm", "progress bars"), ("yaml", "PyYAML", "YAML configs"),
                                 ("matplotlib", "matplotlib", "bench's plot, bench_<device>.png"),
                                 ("tensorboard", "tensorboard", "TensorBoard logs in each run folder")):
        present = importlib.util.find_spec(module) is not None
        facts.append((module, "yes" if present else "no"))
        if not present:
            fixes.append(f"pip install {package} ({why})")
    return facts, fixes


def half_precision_of(index: int, props) -> str:
    """What amp_dtype bf16 and fp16 run as on GPU `index`, and why (the trainer's rule)."""
    native, _ = native_amp_dtype(torch.bfloat16, torch.device("cuda", index))
    if native == torch.bfloat16:
        return "bf16 and fp16 as asked (compute capability 8.0 or higher: native bf16)"
    return (f"fp16 with the loss scaler, also when bf16 is asked (compute capability {props.major}.{props.minor} "
            "is below 8.0: bf16 would be emulated, slower than fp32)")


def main_doctor() -> int:
    facts, fixes = report()
    width = max(len(name) for name, _ in facts)
    for name, value in facts:
        print(f"{name:<{width}}  {value}")
    if fixes:
        print("\nto fix:")
        for fix in fixes:
            print(f"  - {fix}")
    else:
        print("\nnothing to fix")
    return 0
