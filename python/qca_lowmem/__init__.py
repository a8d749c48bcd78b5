"""qca_lowmem: train a neural quantum cellular automaton on small GPUs without shrinking the model.

Fused C/CUDA kernels exposed as torch custom ops (torch.ops.qca_lowmem.*), recompute instead of
storing, and a complex-safe mixed-precision loss scaler. See README.md and docs/design.md.
"""

# Layers, each importing only those below it (docs/design.md, "Layout"): ops/ (the op families
# over the native library, loaded by ops/__init__); the model and precision here (blocks, U-Net,
# stock, precision, amp) and recompute/ (the rollout); atheria/ (the switch for the users'
# trainers); trainer/ (the reference trainer and the qca-lowmem command), not imported here.
from . import amp
from ._version import __version__  # noqa: F401  (re-exported: qca_lowmem.__version__)
from .atheria import disable, enable, enable_from_config
from .blocks import FusedConvBlock
from .ops import keeps_values
from .ops.groupnorm_elu import groupnorm_elu
from .ops.noise import NoiseSchedule, bit_flip, noise_coin, phase_flip
from .ops.qca_step import qca_pack, qca_update
from .recompute import (
    CaptureFallbackWarning,
    RecomputeMismatchError,
    StepGraph,
    block_keeps_intermediates,
    keep_block_intermediates,
    peak_saved_bytes,
    recomputing,
    rollout,
    saved_bytes,
    shared_weight_casts,
)
from .unet import ConversionReport, UNetUnitary, convert

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
    "keeps_values",
    "noise_coin",
    "peak_saved_bytes",
    "phase_flip",
    "qca_pack",
    "qca_update",
    "recomputing",
    "rollout",
    "saved_bytes",
    "shared_weight_casts",
]
