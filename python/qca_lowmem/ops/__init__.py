"""The op families' Python faces: typed wrappers over torch.ops.qca_lowmem.*, their fake kernels
and autograd (one module per C/CUDA family, and conv_block.py for the block ops defined in Python
around them), and the helpers they share.

The lowest layer of the package: it imports only torch, the native library and `stock` (the
reference the ops' double backward runs through). The helpers that the library above uses too
(input checks, second order, the native library's build, whether a module call is just its
forward) are named here; their modules, whose names start with an underscore, are this package's
own. The watch's contract and what runs hidden from it is a public module, `watchers`, which the
library's watch (recompute/watch.py) builds on:

- `qca_step`: the QCA step ops (pack, update) and the fused step on them (`fused_step`).
- `noise`: the noise ops (phase flip, bit flip, coin) and the stock noise schedule on them.
- `groupnorm_elu`: the GroupNorm + ELU ops.
- `conv_block`: the fused U-Net ConvBlock as two custom ops.
- `scaler`: the loss-scaler ops under `amp.GradScaler`.
- `step_difference`: the recompute check's measure of a step.
- `max_pool`: the U-Net's 2x2 max pooling, torch's bits without its indices.
- `watchers`: the watch's contract (`WatchingDispatchMode`), what runs hidden from it and how.
- `_checks`: argument checks shared with the C glue.
- `_double_backward`: second-order gradients of the fused ops.
- `_forwards`: whether a module call is just its class's forward, now (no hook, no replaced method),
  whether a block's call is stock's ConvBlock's, by its code, and whether the caller's context lets
  a fused path stand for stock's ops (no mode or saved-tensors hook of theirs).
- `_loader`: the native library, loaded after checking its build.
"""

from ._loader import REBUILD_COMMAND, has_cuda_kernels, load_native

# The one place the native library is loaded: it registers torch.ops.qca_lowmem, which the op
# modules wrap. Importing any op module runs this first.
load_native()

from ._checks import check_same_device, refuse_func_transforms  # noqa: E402
from ._double_backward import reference_backward, second_order_requested  # noqa: E402
from ._forwards import (  # noqa: E402
    calls_are_forwards,
    calls_checked_by_caller,
    calls_plain,
    foreign_context,
    fused_call_stands_for,
    keeps_values,
    plain_torch_layer,
    recomputes_unhooked,
    refuse_foreign_mode_in_backward,
    same_code,
    stands_for_stock,
    step_function_replaced,
    stock_block_call,
    stock_forward_call,
    torch_layers_unchanged,
)

__all__ = [
    "REBUILD_COMMAND",
    "calls_are_forwards",
    "calls_checked_by_caller",
    "calls_plain",
    "check_same_device",
    "foreign_context",
    "fused_call_stands_for",
    "has_cuda_kernels",
    "keeps_values",
    "load_native",
    "plain_torch_layer",
    "recomputes_unhooked",
    "reference_backward",
    "refuse_foreign_mode_in_backward",
    "refuse_func_transforms",
    "same_code",
    "second_order_requested",
    "stands_for_stock",
    "stock_block_call",
    "step_function_replaced",
    "stock_forward_call",
    "torch_layers_unchanged",
]
