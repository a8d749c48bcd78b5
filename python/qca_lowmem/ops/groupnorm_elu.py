"""The GroupNorm + ELU ops (C family `groupnorm_elu`): typed wrapper, fake kernels and autograd
of torch.ops.qca_lowmem.groupnorm_elu, groupnorm_elu_apply and groupnorm_elu_backward."""

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import REAL_FLOATS, check_eps, check_same_device, describe, dtype_name, refuse_func_transforms
from ._double_backward import reference_backward, second_order_requested

_lib = torch.ops.qca_lowmem


def groupnorm_elu(x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float = 1e-5) -> Tensor:
    """ELU(GroupNorm(x)) in one fused kernel, as nn.GroupNorm(groups, C, eps) then nn.ELU().

    x: (N, C, H, W) float32/float16/bfloat16 (float64 on the CPU too), NCHW or channels_last;
    the output has the layout of x. Statistics are float32 (float64 for float64 x); weight and
    bias may be wider than x (fp32 affine under autocast). Differentiable: backward saves x and
    the statistics and recomputes the ELU derivative.
    """
    refuse_func_transforms("qca_lowmem.groupnorm_elu", x, weight, bias)
    return _lib.groupnorm_elu(x, weight, bias, int(groups), float(eps))[0]


def output_layout(x: Tensor) -> torch.memory_format:
    """The layout the kernels write, and the block's activations follow: x's own when it is NCHW
    or channels_last dense, else NCHW."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def stat_dtype(x: Tensor) -> torch.dtype:
    """The statistics' dtype: float64 for float64 x, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# The glue's checks (groupnorm_elu.cpp: checked_input, check_groups, checked_affine, checked_stats)
# with its messages, each fake calling them in its op's order, so meta refuses what the kernels refuse.


def _check_input(x, op):
    torch._check(x.dtype in REAL_FLOATS, lambda: f"{op}: x must be float32, float64, float16 or bfloat16, got {describe(x)}")
    torch._check(x.dim() == 4, lambda: f"{op}: x must have 4 dimensions (N, C, H, W), got {describe(x)}")
    torch._check(x.shape[1] >= 1, lambda: f"{op}: x must have at least one channel, got {describe(x)}")


def _check_groups(x, groups, op):
    channels = x.shape[1]
    torch._check(groups >= 1 and channels % groups == 0,
                 lambda: f"{op}: groups must be positive and divide the channels of x ({channels}), got {groups}")


def _check_affine(x, weight, bias, op):
    channels = x.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        check_same_device(x, "x", t, name, op)
        torch._check(t.dtype in REAL_FLOATS,
                     lambda: f"{op}: {name} must be float32, float64, float16 or bfloat16, got {describe(t)}")
        torch._check(t.dim() == 1 and t.shape[0] == channels,
                     lambda: f"{op}: {name} must have shape (C,) with C = {channels} (the channels of x), got {describe(t)}")
    torch._check(bias.dtype == weight.dtype,
                 lambda: f"{op}: weight and bias must have the same dtype, got weight {describe(weight)} and bias "
                         f"{describe(bias)}")


def _check_stats(x, mean, rstd, op):
    stat = stat_dtype(x)
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_same_device(x, "x", t, name, op)
        torch._check(t.dtype == stat, lambda: f"{op}: {name} must be {dtype_name(stat)} (statistics of a "
                                              f"{dtype_name(x.dtype)} x), got {describe(t)}")
        torch._check(t.dim() == 2 and t.shape[0] == x.shape[0] and t.shape[1] >= 1,
                     lambda: f"{op}: {name} must have shape (N, groups) with N = {x.shape[0]}, got {describe(t)}")
        _check_groups(x, t.shape[1], op)
    torch._check(mean.shape == rstd.shape,
                 lambda: f"{op}: mean and rstd must have the same shape, got {describe(mean)} and {describe(rstd)}")


@torch.library.register_fake("qca_lowmem::groupnorm_elu")
def _groupnorm_elu_fake(x, weight, bias, groups, eps=1e-5):
    op = "groupnorm_elu"
    check_eps(eps, "eps", op)
    _check_input(x, op)
    _check_affine(x, weight, bias, op)
    _check_groups(x, groups, op)
    y = torch.empty_like(x, memory_format=output_layout(x))
    mean = x.new_empty((x.shape[0], groups), dtype=stat_dtype(x))
    return y, mean, torch.empty_like(mean)


@torch.library.register_fake("qca_lowmem::groupnorm_elu_apply")
def _groupnorm_elu_apply_fake(x, weight, bias, mean, rstd):
    op = "groupnorm_elu_apply"
    _check_input(x, op)
    _check_stats(x, mean, rstd, op)
    _check_affine(x, weight, bias, op)
    return torch.empty_like(x, memory_format=output_layout(x))


@torch.library.register_fake("qca_lowmem::groupnorm_elu_backward")
def _groupnorm_elu_backward_fake(grad_y, x, weight, bias, mean, rstd):
    op = "groupnorm_elu_backward"
    _check_input(x, op)
    check_same_device(x, "x", grad_y, "grad_y", op)
    torch._check(grad_y.shape == x.shape and grad_y.dtype == x.dtype,
                 lambda: f"{op}: grad_y must have the shape and dtype of x ({describe(x)}), got {describe(grad_y)}")
    _check_affine(x, weight, bias, op)
    _check_stats(x, mean, rstd, op)
    return torch.empty_like(x, memory_format=output_layout(x)), torch.empty_like(weight), torch.empty_like(bias)


def reference(x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float) -> Tensor:
    """groupnorm_elu in torch ops (the kernels' precision: statistics dtype, output in x's)."""
    stat = stat_dtype(x)
    return F.elu(F.group_norm(x.to(stat), groups, weight.to(stat), bias.to(stat), eps)).to(x.dtype)


def _groupnorm_elu_setup_context(ctx, inputs, output):
    x, weight, bias, groups, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.groups, ctx.eps = groups, eps
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # no zeros made for the statistics' (absent) gradients


def _groupnorm_elu_backward(ctx, grad_y, grad_mean, grad_rstd):
    if grad_y is None:
        return None, None, None, None, None
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if second_order_requested():
        return reference_backward(ctx, reference, (x, weight, bias, ctx.groups, ctx.eps), grad_y)
    grad_x, grad_weight, grad_bias = _lib.groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd)
    return (
        grad_x if ctx.needs_input_grad[0] else None,
        grad_weight if ctx.needs_input_grad[1] else None,
        grad_bias if ctx.needs_input_grad[2] else None,
        None,
        None,
    )


torch.library.register_autograd(
    "qca_lowmem::groupnorm_elu", _groupnorm_elu_backward, setup_context=_groupnorm_elu_setup_context
)
