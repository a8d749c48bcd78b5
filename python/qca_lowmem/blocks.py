"""The fused U-Net ConvBlock, on the GroupNorm + ELU ops (groupnorm_elu.py).

`FusedConvBlock` computes the stock block, Conv3x3 -> GroupNorm -> ELU -> Conv3x3 -> GroupNorm ->
ELU, with the parameters and state_dict keys of the stock `ConvBlock`. Its forward keeps for
backward only the block input and the per-group statistics; backward recomputes conv1 -> GN+ELU
-> conv2 and runs the fused backward kernels. Inside a step-level recompute
(`qca_lowmem.keep_block_intermediates()`) or with `recompute=False` it keeps its intermediates
instead, so the convolutions never run a third time.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import check_same_device, reference_backward, refuse_func_transforms, second_order_requested
from .rollout.intermediates import block_keeps_intermediates
from .amp import autocast_dtype
from .rollout.weight_casts import cast_weight
from . import stock
from .ops.groupnorm_elu import output_layout, stat_dtype
from .ops.groupnorm_elu import reference as groupnorm_elu_reference

_lib = torch.ops.qca_lowmem


# ---- The whole block as custom ops: one that recomputes, one that keeps its intermediates. ----
# Both take the conv weights already in the compute dtype (the autocast dtype when autocast is
# on) and the GroupNorm affine in its own dtype, so backward replays exactly the forward's
# precision whatever autocast state it runs under.


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
    return torch._C._AutoDispatchBelowAutograd()


def _check_block_devices(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias):
    for name, t in dict(conv1_weight=conv1_weight, norm1_weight=norm1_weight, norm1_bias=norm1_bias,
                        conv2_weight=conv2_weight, norm2_weight=norm2_weight, norm2_bias=norm2_bias).items():
        check_same_device(x, "x", t, name, "conv_block")


def _block_forward(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias,
                   groups1, groups2, eps1, eps2):
    _check_block_devices(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias)
    layout = output_layout(x)
    with _below_autograd():
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
    _check_block_devices(x, conv1_weight, norm1_weight, norm1_bias, conv2_weight, norm2_weight, norm2_bias)
    torch._check(x.dim() == 4, lambda: f"conv_block: x must have 4 dimensions (N, C, H, W), got shape {tuple(x.shape)}")
    torch._check(conv1_weight.shape[1] == x.shape[1],
                 lambda: f"conv_block: conv1_weight expects {conv1_weight.shape[1]} input channels, x has {x.shape[1]}")
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


def _conv_block_backward(ctx, grad_y, *_grad_stats):
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


def _conv_block_keep_backward(ctx, grad_y, *_grad_intermediates):
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
    """Plain eager execution on one device: no torch.compile, dispatch mode or functorch
    transform, and no tensor with its own __torch_function__; there the Function above is the
    op's autograd exactly, and everything else sees the op itself (a device mix, its checks)."""
    device = tensors[0].device
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
                or torch._C._are_functorch_transforms_active() or torch.overrides.has_torch_function(tensors)
                or any(t.device != device for t in tensors))


class FusedConvBlock(nn.Module):
    """Drop-in for the stock U-Net `ConvBlock(in_channels, out_channels, mid_channels)`.

    Same parameters and state_dict keys (`conv_block.0.weight`, `conv_block.1.weight/bias`,
    `conv_block.3.weight`, `conv_block.4.weight/bias`) and the same GroupNorm group rule; the
    `conv_block` Sequential holds them, but forward runs the fused path. With `recompute=True`
    (default) backward recomputes the block from its saved input unless
    `qca_lowmem.keep_block_intermediates()` is active; with `recompute=False` it always keeps
    its intermediates (still with the fused GroupNorm+ELU kernels).
    """

    def __init__(self, in_channels: int, out_channels: int, mid_channels: Optional[int] = None, *,
                 recompute: bool = True):
        super().__init__()
        # The stock block's own layers: its parameters, keys and initialisation by construction.
        self.conv_block = stock.ConvBlock(in_channels, out_channels, mid_channels).conv_block
        self.recompute = recompute

    @classmethod
    def from_stock(cls, block: nn.Module, *, recompute: bool = True) -> "FusedConvBlock":
        """A fused block around `block.conv_block` itself: the very same layers and Parameters."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.conv_block = block.conv_block
        fused.recompute = recompute
        return fused

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}"

    def forward(self, x: Tensor, *, keep_intermediates: Optional[bool] = None) -> Tensor:
        """`keep_intermediates` overrides the block's own choice (for callers that recompute
        around the block themselves); None: keep them when `recompute` is False or inside
        `keep_block_intermediates()`."""
        refuse_func_transforms("qca_lowmem.FusedConvBlock", x, *self.parameters())
        conv1, norm1, _, conv2, norm2, _ = self.conv_block
        conv1_weight, conv2_weight = conv1.weight, conv2.weight
        compute_dtype = autocast_dtype(x.device.type)
        if compute_dtype is not None:
            # What autocast does for the stock convolutions: float64 is left alone. The weights
            # come from the episode's copies when a rollout runs the block (rollout/weight_casts.py).
            if x.dtype != torch.float64:
                x = x.to(compute_dtype)
            conv1_weight, conv2_weight = (
                t if t.dtype == torch.float64 else cast_weight(t, compute_dtype) for t in (conv1_weight, conv2_weight))
        args = (x, conv1_weight, norm1.weight, norm1.bias, conv2_weight, norm2.weight, norm2.bias,
                norm1.num_groups, norm2.num_groups, float(norm1.eps), float(norm2.eps))
        if keep_intermediates is None:
            keep_intermediates = not self.recompute or block_keeps_intermediates()
        if _plain_eager(args[:7]):
            function = _ConvBlockKeepFunction if keep_intermediates else _ConvBlockFunction
            return function.apply(*args)[0]
        return (conv_block_keep if keep_intermediates else conv_block)(*args)[0]
