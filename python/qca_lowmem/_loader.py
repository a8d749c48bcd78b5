"""Loads the native library after checking it was built for the torch that is running."""

import torch

REBUILD_HINT = "rebuild it in this environment with: pip install --no-build-isolation --force-reinstall ."


def load_native():
    try:
        from . import _build_info
    except ImportError as e:
        raise ImportError(f"qca_lowmem's native library is not built; {REBUILD_HINT}") from e
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"qca_lowmem was built against torch {_build_info.TORCH_VERSION} but torch "
            f"{torch.__version__} is running; {REBUILD_HINT}"
        )
    try:
        from . import _C  # noqa: F401  (loading it registers torch.ops.qca_lowmem)
    except ImportError as e:
        raise ImportError(f"qca_lowmem's native library failed to load ({e}); {REBUILD_HINT}") from e
    return _build_info


def has_cuda_kernels():
    """True when the loaded library registered CUDA kernels (built with CUDA)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("qca_lowmem::qca_update", "CUDA")
