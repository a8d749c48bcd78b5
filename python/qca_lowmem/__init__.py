"""qca_lowmem: train a neural quantum cellular automaton on small GPUs without shrinking the model.

Fused C/CUDA kernels exposed as torch custom ops (torch.ops.qca_lowmem.*), recompute instead of
storing, and a complex-safe mixed-precision loss scaler. See README.md and docs/design.md.
"""

# Three layers, each importing only those below it (docs/design.md, "Layout"): ops/ (the op
# families over the native library, loaded by ops/__init__), the library (the rollout/ package
# and the modules here: blocks, U-Net, scaler, integration), and trainer/ (the reference trainer and the qca-lowmem
# command), which this file does not import.
from . import amp
from ._version import __version__  # noqa: F401  (re-exported: qca_lowmem.__version__)
from .blocks import FusedConvBlock
from .ops.groupnorm_elu import groupnorm_elu
from .integration import disable, enable
from .lowmem_config import enable_from_config
from .ops.noise import NoiseSchedule, bit_flip, noise_coin, phase_flip
from .ops.qca_step import qca_pack, qca_update
from .unet import ConversionReport, UNetUnitary, convert
# Last: binds `rollout` to the function, over the package of the same name imported above.
from .rollout import (CaptureFallbackWarning, RecomputeMismatchError, StepGraph, block_keeps_intermediates,
                      keep_block_intermediates, rollout, saved_bytes, shared_weight_casts)

__all__ = [
    "CaptureFallbackWarning",
    "ConversionReport",
    "FusedConvBlock",
    "NoiseSchedule",
    "RecomputeMismatchError",
    "StepGraph",
    "UNetUnitary",
    "amp",
    "bit_flip",
    "block_keeps_intermediates",
    "convert",
    "disable",
    "enable",
    "enable_from_config",
    "groupnorm_elu",
    "keep_block_intermediates",
    "noise_coin",
    "phase_flip",
    "qca_pack",
    "qca_update",
    "rollout",
    "saved_bytes",
    "shared_weight_casts",
]
