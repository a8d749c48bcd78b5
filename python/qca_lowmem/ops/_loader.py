"""Loads the native library after checking it was built for the torch that is running."""

import importlib.util
import os

import torch

from .. import _torch_private as torch_private

# --no-deps: --force-reinstall would otherwise replace the environment's torch with the index's newest;
# --no-cache-dir: a wheel pip cached from an earlier build may be for another torch.
REBUILD_COMMAND = "pip install --force-reinstall --no-deps --no-cache-dir ."
# _C and _build_info live at the package top, beside the layers (setup.py builds them there).
_PACKAGE = __package__.rpartition(".")[0]
REBUILD_HINT = f"rebuild it in this environment, in the qca_lowmem source directory: {REBUILD_COMMAND}"


def load_native():
    try:
        from .. import _build_info
    except ImportError:
        raise ImportError(f"qca_lowmem's native library is not built; {REBUILD_HINT}") from None
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"qca_lowmem was built against torch {_build_info.TORCH_VERSION} but torch "
            f"{torch.__version__} is running; {REBUILD_HINT}"
        )
    if importlib.util.find_spec(f"{_PACKAGE}._C") is None:
        raise ImportError(f"qca_lowmem's native library _C is missing from {os.path.dirname(_build_info.__file__)}; "
                          f"{REBUILD_HINT}")
    try:
        from .. import _C  # noqa: F401  (loading it registers torch.ops.qca_lowmem)
    except ImportError as e:  # undefined symbols: built for another torch than the one running
        raise ImportError(f"qca_lowmem's native library failed to load ({e}); {REBUILD_HINT}") from None
    return _build_info


def has_cuda_kernels():
    """True when the loaded library registered CUDA kernels (built with CUDA)."""
    return torch_private.has_kernel_for("qca_lowmem::qca_update", "CUDA")
