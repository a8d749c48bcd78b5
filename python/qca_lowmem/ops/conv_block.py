"""The fused U-Net ConvBlock as two custom ops, `qca_lowmem::conv_block` (keeps the block input
and the per-group statistics, recomputes conv1 -> GN+ELU -> conv2 in backward) and
`conv_block_keep` (keeps its intermediates): Conv3x3 -> GroupNorm -> ELU -> Conv3x3 -> GroupNorm
-> ELU on the GroupNorm+ELU ops (groupnorm_elu.py) and torch's convolutions. Defined in Python:
the block is torch's convs around this package's C/CUDA ops. The module around them,
`FusedConvBlock`, is blocks.py.
"""

import functools
from contextlib import nullcontext
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _torch_private as torch_private
from ._checks import REAL_FLOATS, check_eps, check_same_device, describe, dtype_name
from ._double_backward import reference_backward, second_order_requested
from ._forwards import refuse_foreign_mode_in_backward
from .groupnorm_elu import output_layout, stat_dtype
from .groupnorm_elu import reference as groupnorm_elu_reference
from .watchers import eager_watchers, run_hidden

_lib = torch.ops.qca_lowmem


# ---- The whole block as custom ops: one that recomputes, one that keeps its intermediates. ----
# Both take x and the conv weights already in the compute dtype (the autocast dtype when autocast
# is on; weights in another are refused) and the GroupNorm affine in its own dtype, and run their
# convs with autocast off, so backward replays exactly the forward's precision whatever autocast
# state either runs under.


def _conv3x3(x: Tensor, weight: Tensor) -> Tensor:
    return F.conv2d(x, weight, None, 1, 1)


def _conv3x3_backward(grad_out: Tensor, x: Tensor, weight: Tensor, needs_x: bool, needs_weight: bool):
    """(grad_x, grad_weight) of _conv3x3, each None unless asked for."""
    grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(
        grad_out, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [needs_x, needs_weight, False])
    return grad_x, grad_weight


def _below_autograd():
    """The ops inside a block's forward and first-order backward record no autograd history (the
    block's own autograd covers them), so they skip the autograd layer: for groupnorm_elu that
    layer is Python, about 20 us a call on a CPU, more than a small call's kernel."""
    return torch_private.below_autograd()


def _check_block_devices(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias):
    device = x.device
    if (conv1_weight.device == device and norm1_weight.device == device and norm1_bias.device == device
            and conv2_weight.device == device and norm2_weight.device == device and norm2_bias.device == device):
        return  # the checks below name the tensor; they cost more than a small block's kernels
    for name, t in dict(conv1_weight=conv1_weight, norm1_weight=norm1_weight, norm1_bias=norm1_bias,
                        conv2_weight=conv2_weight, norm2_weight=norm2_weight, norm2_bias=norm2_bias).items():
        check_same_device(x, "x", t, name, "conv_block")


def _check_block_args(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                      groups1, groups2, eps1, eps2):
    """What the block's forward (eager) and its fake both refuse, naming the argument: the ops
    inside would name theirs, or nothing (a 1x1 conv gives a bigger output in eager, another shape
    on meta); conv weights in a dtype other than x's, which autocast would cast in the forward
    alone. Plain `if`s: torch._check costs 1.4 us a call on a CPU, 20 calls here, where a small
    block's forward takes about 50 us."""
    op = "conv_block"
    _check_block_devices(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias)
    if x.dtype not in REAL_FLOATS:
        raise RuntimeError(f"{op}: x must be float32, float64, float16 or bfloat16, got {describe(x)}")
    if x.dim() != 4:
        raise RuntimeError(f"{op}: x must have 4 dimensions (N, C, H, W), got {describe(x)}")
    channels = x.shape[1]
    for i, conv_weight, norm_weight, norm_bias, groups, eps, source in (
            (1, conv1_weight, norm1_weight, norm1_bias, groups1, eps1, "x"),
            (2, conv2_weight, norm2_weight, norm2_bias, groups2, eps2, "conv1_weight's output")):
        shape = conv_weight.shape
        if not (len(shape) == 4 and shape[0] >= 1 and shape[1] == channels and shape[2] == 3 and shape[3] == 3):
            raise RuntimeError(f"{op}: conv{i}_weight must have shape (C{i}, {channels}, 3, 3) with C{i} >= 1, 3x3 kernels "
                               f"over the {channels} channels of {source}, got {describe(conv_weight)}")
        if conv_weight.dtype != x.dtype:
            raise RuntimeError(f"{op}: conv{i}_weight must have the dtype of x ({dtype_name(x.dtype)}), got "
                               f"{describe(conv_weight)}")
        channels = shape[0]
        for name, t in ((f"norm{i}_weight", norm_weight), (f"norm{i}_bias", norm_bias)):
            if t.dtype not in REAL_FLOATS:
                raise RuntimeError(f"{op}: {name} must be float32, float64, float16 or bfloat16, got {describe(t)}")
            if t.shape != (channels,):
                raise RuntimeError(f"{op}: {name} must have shape ({channels},), the output channels of conv{i}_weight, "
                                   f"got {describe(t)}")
        if norm_bias.dtype != norm_weight.dtype:
            raise RuntimeError(f"{op}: norm{i}_weight and norm{i}_bias must have the same dtype, got "
                               f"{describe(norm_weight)} and {describe(norm_bias)}")
        if not (groups >= 1 and channels % groups == 0):
            raise RuntimeError(f"{op}: groups{i} must be positive and divide the output channels of conv{i}_weight "
                               f"({channels}), got {groups}")
        check_eps(eps, f"eps{i}", op)


def _convs_without_autocast(device_type: str):
    """The block's convs in the dtypes given, as the backward's recompute runs them: a caller's
    autocast would cast in the forward alone. Entered only where autocast is on (4 us a call)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


def _block_forward(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                   groups1, groups2, eps1, eps2):
    _check_block_args(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                      groups1, groups2, eps1, eps2)
    layout = output_layout(x)
    with _convs_without_autocast(x.device.type), _below_autograd():
        h1 = _conv3x3(x, conv1_weight).contiguous(memory_format=layout)
        a1, mean1, rstd1 = _lib.groupnorm_elu(h1, norm1_weight, norm1_bias, groups1, eps1)
        h2 = _conv3x3(a1, conv2_weight).contiguous(memory_format=layout)
        y, mean2, rstd2 = _lib.groupnorm_elu(h2, norm2_weight, norm2_bias, groups2, eps2)
    return y, h1, a1, h2, mean1, rstd1, mean2, rstd2


def _conv_block(
    x: Tensor, conv1_weight: Tensor, norm1_weight: Tensor, norm1_bias: Tensor, conv2_weight: Tensor,
    norm2_weight: Tensor, norm2_bias: Tensor, groups1: int, groups2: int, eps1: float, eps2: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Stock ConvBlock forward; returns (y, mean1, rstd1, mean2, rstd2). Backward recomputes."""
    y, _, _, _, mean1, rstd1, mean2, rstd2 = _block_forward(
        x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
        groups1, groups2, eps1, eps2)
    return y, mean1, rstd1, mean2, rstd2


def _conv_block_keep(
    x: Tensor, conv1_weight: Tensor, norm1_weight: Tensor, norm1_bias: Tensor, conv2_weight: Tensor,
    norm2_weight: Tensor, norm2_bias: Tensor, groups1: int, groups2: int, eps1: float, eps2: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Stock ConvBlock forward that also returns its intermediates for backward:
    (y, h1, a1, h2, mean1, rstd1, mean2, rstd2) with h = conv output, a1 = first GN+ELU output."""
    return _block_forward(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight,
                          norm2_bias, groups1, groups2, eps1, eps2)


conv_block = torch.library.custom_op("qca_lowmem::conv_block", mutates_args=())(_conv_block)
conv_block_keep = torch.library.custom_op("qca_lowmem::conv_block_keep", mutates_args=())(_conv_block_keep)


def _block_fake(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                groups1, groups2, eps1, eps2):
    _check_block_args(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                      groups1, groups2, eps1, eps2)
    n, _, h, w = x.shape
    layout = output_layout(x)
    h1 = x.new_empty((n, conv1_weight.shape[0], h, w)).contiguous(memory_format=layout)
    h2 = x.new_empty((n, conv2_weight.shape[0], h, w)).contiguous(memory_format=layout)
    stat = stat_dtype(x)
    stats1 = [x.new_empty((n, groups1), dtype=stat) for _ in range(2)]
    stats2 = [x.new_empty((n, groups2), dtype=stat) for _ in range(2)]
    return torch.empty_like(h2), h1, torch.empty_like(h1), h2, *stats1, *stats2


@conv_block.register_fake
def _conv_block_fake(*args):
    y, _, _, _, mean1, rstd1, mean2, rstd2 = _block_fake(*args)
    return y, mean1, rstd1, mean2, rstd2


@conv_block_keep.register_fake
def _conv_block_keep_fake(*args):
    return _block_fake(*args)


def _block_reference(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                     groups1, groups2, eps1, eps2):
    """The block in torch ops, in the precision the custom ops compute it."""
    a1 = groupnorm_elu_reference(_conv3x3(x, conv1_weight), norm1_weight, norm1_bias, groups1, eps1)
    return groupnorm_elu_reference(_conv3x3(a1, conv2_weight), norm2_weight, norm2_bias, groups2, eps2)


def _second_order_block_backward(ctx, grad_y, x, weights):
    with torch.autocast(x.device.type, enabled=False):
        return reference_backward(ctx, _block_reference, (x, *weights, *ctx.norm_settings), grad_y)


_BLOCK_INPUTS = 11  # x, six weights, groups1, groups2, eps1, eps2


def _block_backward(ctx, grad_y, x, h1, a1, h2, weights, stats):
    conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias = weights
    mean1, rstd1, mean2, rstd2 = stats
    needs = ctx.needs_input_grad
    with _below_autograd():
        grad_h2, grad_norm2_weight, grad_norm2_bias = _lib.groupnorm_elu_backward(
            grad_y, h2, norm2_weight, norm2_bias, mean2, rstd2)
        grad_a1, grad_conv2_weight = _conv3x3_backward(grad_h2, a1, conv2_weight, True, needs[4])
        grad_h1, grad_norm1_weight, grad_norm1_bias = _lib.groupnorm_elu_backward(
            grad_a1, h1, norm1_weight, norm1_bias, mean1, rstd1)
        grad_x, grad_conv1_weight = _conv3x3_backward(grad_h1, x, conv1_weight, needs[0], needs[1])
    return (
        grad_x,
        grad_conv1_weight,
        grad_norm1_weight if needs[2] else None,
        grad_norm1_bias if needs[3] else None,
        grad_conv2_weight,
        grad_norm2_weight if needs[5] else None,
        grad_norm2_bias if needs[6] else None,
        None, None, None, None,
    )


def _conv_block_setup_context(ctx, inputs, output):
    x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias = inputs[:7]
    _, mean1, rstd1, mean2, rstd2 = output
    ctx.save_for_backward(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight,
                          norm2_bias, mean1, rstd1, mean2, rstd2)
    ctx.norm_settings = inputs[7:]
    ctx.set_materialize_grads(False)  # the statistics get no gradient: no zeros made for them


def _conv_block_backward(ctx, grad_y, *_grad_stats):
    if grad_y is None:
        return (None,) * _BLOCK_INPUTS
    refuse_foreign_mode_in_backward("qca_lowmem.FusedConvBlock", "its recompute and fused backward kernels")
    x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias, *stats = ctx.saved_tensors
    weights = (conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias)
    if second_order_requested():
        return _second_order_block_backward(ctx, grad_y, x, weights)
    mean1, rstd1, mean2, rstd2 = stats
    # Recompute with the statistics of the forward: the same activations, one pass less.
    with torch.autocast(x.device.type, enabled=False), _below_autograd():
        layout = output_layout(x)
        h1 = _conv3x3(x, conv1_weight).contiguous(memory_format=layout)
        a1 = _lib.groupnorm_elu_apply(h1, norm1_weight, norm1_bias, mean1, rstd1)
        h2 = _conv3x3(a1, conv2_weight).contiguous(memory_format=layout)
    return _block_backward(ctx, grad_y, x, h1, a1, h2, weights, stats)


def _conv_block_keep_setup_context(ctx, inputs, output):
    x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias = inputs[:7]
    _, h1, a1, h2, mean1, rstd1, mean2, rstd2 = output
    ctx.save_for_backward(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight,
                          norm2_bias, h1, a1, h2, mean1, rstd1, mean2, rstd2)
    ctx.norm_settings = inputs[7:]
    ctx.set_materialize_grads(False)  # the intermediates and statistics get no gradient: no zeros made


def _conv_block_keep_backward(ctx, grad_y, *_grad_intermediates):
    if grad_y is None:
        return (None,) * _BLOCK_INPUTS
    refuse_foreign_mode_in_backward("qca_lowmem.FusedConvBlock", "its fused backward kernels")
    saved = ctx.saved_tensors
    x, weights, (h1, a1, h2), stats = saved[0], saved[1:7], saved[7:10], saved[10:]
    if second_order_requested():
        return _second_order_block_backward(ctx, grad_y, x, weights)
    return _block_backward(ctx, grad_y, x, h1, a1, h2, weights, stats)


conv_block.register_autograd(_conv_block_backward, setup_context=_conv_block_setup_context)
conv_block_keep.register_autograd(_conv_block_keep_backward, setup_context=_conv_block_keep_setup_context)


def _eager_function(name, forward, setup_context, backward):
    """The op's autograd as a plain autograd.Function: the same forward, setup_context and
    backward, without the custom op's dispatch and autograd wrappers around them (on a CPU about
    0.3 ms a block per forward and backward, most of a small block's own time). setup_context is
    called from forward rather than declared: a Function that declares it has its arguments
    bound with inspect.signature on every apply (about 0.1 ms)."""

    def forward_and_setup(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    methods = {"forward": staticmethod(forward_and_setup), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


_ConvBlockFunction = _eager_function("_ConvBlockFunction", _conv_block, _conv_block_setup_context,
                                     _conv_block_backward)
_ConvBlockKeepFunction = _eager_function("_ConvBlockKeepFunction", _conv_block_keep,
                                         _conv_block_keep_setup_context, _conv_block_keep_backward)


def _plain_eager(tensors) -> bool:
    """No functorch transform, no tensor with its own __torch_function__, one device: there, in
    eager execution (and under no dispatch mode but watchers, conv_block_forward) the Function
    above is the op's autograd exactly, and everything else sees the op itself (a device mix, its
    checks)."""
    device = tensors[0].device
    return not (torch_private.functorch_transforms_active() or torch.overrides.has_torch_function(tensors)
                or any(t.device != device for t in tensors))


def conv_block_forward(x: Tensor, conv1_weight: Tensor, norm1_weight: Tensor, norm1_bias: Tensor,
                       conv2_weight: Tensor, norm2_weight: Tensor, norm2_bias: Tensor, groups1: int, groups2: int,
                       eps1: float, eps2: float, keep_intermediates: bool) -> Tensor:
    """The block's output through conv_block (recomputing in backward) or conv_block_keep; in
    plain eager execution through their autograd.Functions, without the custom ops' wrappers,
    hidden from watchers (it reads its arguments and writes only what it returns)."""
    args = (x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
            groups1, groups2, eps1, eps2)
    watchers = eager_watchers()
    if watchers is None or not _plain_eager(args[:7]):
        return (conv_block_keep if keep_intermediates else conv_block)(*args)[0]
    if torch.is_grad_enabled() and any(t.requires_grad for t in args[:7]):
        run = (_ConvBlockKeepFunction if keep_intermediates else _ConvBlockFunction).apply
    else:
        run = _block_forward  # nothing for autograd to record: no Function to apply
    if watchers:
        return run_hidden(functools.partial(run, *args), args[:7], watchers)[0]
    return run(*args)[0]
