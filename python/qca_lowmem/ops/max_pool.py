"""The 2x2 max pooling ops (C family `max_pool`): typed wrapper, fake kernels and autograd of
torch.ops.qca_lowmem.max_pool2x2 and max_pool2x2_backward.

`max_pool2x2(x)` is torch's `F.max_pool2d(x, 2)` (stride 2, no padding, floor), its values and
its gradient bit for bit, in one launch each on CUDA, without the int64 indices torch writes in
the forward and reads in the backward: the backward saves x alone (which its caller keeps
anyway in the U-Net: the skip connection) and finds each window's pick again
(include/qca_lowmem/max_pool.h). Where torch's CUDA channels_last kernels take a window of
-infinities' gradient somewhere else than its CPU and NCHW ones, the CUDA kernel does as torch's
does there.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_same_device, describe, refuse_func_transforms
from ._double_backward import reference_backward, second_order_requested
from .watchers import call_unwatched

_lib = torch.ops.qca_lowmem

POOLED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def max_pool2x2(x: Tensor) -> Tensor:
    """F.max_pool2d(x, 2) for x (N, C, H, W) of float16, bfloat16, float32 or float64, H and W at
    least 2; the output is channels_last where x is (and is not NCHW-contiguous), else NCHW."""
    refuse_func_transforms("qca_lowmem.max_pool2x2", x)
    return call_unwatched(_lib.max_pool2x2, (x,))


def layout(x: Tensor) -> torch.memory_format:
    """The layout the kernels read x in and write y and grad_x in."""
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def _check_input(x, op):
    torch._check(x.dtype in POOLED_DTYPES,
                 lambda: f"{op}: x must be a float16, bfloat16, float32 or float64 tensor, got {describe(x)}")
    torch._check(x.dim() == 4, lambda: f"{op}: x must have 4 dimensions (N, C, H, W), got {describe(x)}")
    torch._check(x.shape[2] >= 2 and x.shape[3] >= 2,
                 lambda: f"{op}: x's height and width must be at least 2 (one 2x2 window), got {describe(x)}")


def _pooled(x):
    n, c, h, w = x.shape
    return torch.empty((n, c, h // 2, w // 2), dtype=x.dtype, device=x.device, memory_format=layout(x))


@torch.library.register_fake("qca_lowmem::max_pool2x2")
def _max_pool2x2_fake(x):
    _check_input(x, "max_pool2x2")
    return _pooled(x)


@torch.library.register_fake("qca_lowmem::max_pool2x2_backward")
def _max_pool2x2_backward_fake(grad_y, x):
    op = "max_pool2x2_backward"
    _check_input(x, op)
    check_same_device(x, "x", grad_y, "grad_y", op)
    pooled = _pooled(x)
    torch._check(grad_y.shape == pooled.shape and grad_y.dtype == x.dtype,
                 lambda: f"{op}: grad_y must have x's dtype and the pooled shape ({x.dtype}, {list(pooled.shape)}), "
                         f"got {describe(grad_y)}")
    return torch.empty_like(x, memory_format=layout(x))


def reference(x: Tensor) -> Tensor:
    return F.max_pool2d(x, 2)


def _max_pool2x2_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _max_pool2x2_backward(ctx, grad_y):
    (x,) = ctx.saved_tensors
    if second_order_requested():
        return reference_backward(ctx, reference, (x,), grad_y)
    return _lib.max_pool2x2_backward(grad_y, x)


torch.library.register_autograd(
    "qca_lowmem::max_pool2x2", _max_pool2x2_backward, setup_context=_max_pool2x2_setup_context
)
