"""The loss-scaler ops (C family `scaler`): typed wrappers and fake kernels of
torch.ops.qca_lowmem.amp_unscale_, amp_mul_ and amp_update_scale_, and of accumulate_, the
gradient accumulation on the same multi-tensor engine. The GradScaler built on them is in amp.py;
the recomputing rollouts accumulate their parameters' gradients with accumulate_
(recompute/param_grads.py). They mutate their arguments in place and have no autograd."""

from __future__ import annotations

import torch

from ._checks import REAL_FLOATS, check_one_device, check_same_device, describe, dtype_name

_lib = torch.ops.qca_lowmem


_KERNEL_DTYPES = (*REAL_FLOATS, torch.complex64, torch.complex128)


def _check_unscale_args(tensors, list_name, scalars, op):
    """scaler.cpp's prepare_unscale, with its messages: the list of one dtype the kernels take, on
    one device; the scalars one-element float32 tensors on the list's device."""
    if tensors:
        torch._check(tensors[0].dtype in _KERNEL_DTYPES,
                     lambda: f"{op}: {list_name} must hold float32, float64, float16, bfloat16, complex64 or complex128 "
                             f"tensors, got {describe(tensors[0])}")
    check_one_device(tensors, list_name, op)
    for i, t in enumerate(tensors):
        torch._check(t.dtype == tensors[0].dtype,
                     lambda: f"{op}: every tensor of {list_name} must have one dtype ({dtype_name(tensors[0].dtype)}, "
                             f"from {list_name}[0]); {list_name}[{i}] is {describe(t)}")
    ref_name, ref = ("the first tensor of the list", tensors[0]) if tensors else scalars[0]
    for name, t in scalars:
        torch._check(t.dtype == torch.float32 and t.numel() == 1,
                     lambda: f"{op}: {name} must be a one-element Float tensor, got {describe(t)}")
        check_same_device(ref, ref_name, t, name, op)


@torch.library.register_fake("qca_lowmem::amp_unscale_")
def _unscale_fake(grads, found_inf, inv_scale, compute_sumsq=False):
    _check_unscale_args(grads, "grads", [("inv_scale", inv_scale), ("found_inf", found_inf)], "amp_unscale_")
    return inv_scale.new_empty((len(grads) if compute_sumsq else 0,), dtype=torch.float64)


@torch.library.register_fake("qca_lowmem::amp_mul_")
def _mul_fake(tensors, factor):
    _check_unscale_args(tensors, "tensors", [("factor", factor)], "amp_mul_")
    return None


@torch.library.register_fake("qca_lowmem::amp_update_scale_")
def _update_scale_fake(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    for name, t in (("growth_tracker", growth_tracker), ("found_inf", found_inf)):
        check_same_device(scale, "scale", t, name, "amp_update_scale_")
    return None


@torch.library.register_fake("qca_lowmem::accumulate_")
def _accumulate_fake(accumulators, grads):
    """scaler.cpp's prepare_accumulate (check_pair), with its messages."""
    op = "accumulate_"
    torch._check(len(accumulators) == len(grads), lambda: f"{op}: accumulators and grads must be lists of "
                 f"one length, got {len(accumulators)} and {len(grads)}")
    for i, (acc, grad) in enumerate(zip(accumulators, grads)):
        for name, t in (("accumulators", acc), ("grads", grad)):
            torch._check(t.dtype in _KERNEL_DTYPES, lambda: f"{op}: {name}[{i}] must be a float32, float64, float16, "
                         f"bfloat16, complex64 or complex128 tensor, got {describe(t)}")
            torch._check(t.device == accumulators[0].device,
                         lambda: f"{op}: every tensor must be on the device of accumulators[0] "
                                 f"({accumulators[0].device}); {name}[{i}] is {describe(t)}")
        torch._check(acc.shape == grad.shape, lambda: f"{op}: grads[{i}] must have the shape of "
                     f"accumulators[{i}] ({list(acc.shape)}), got {describe(grad)}")
        torch._check(acc.is_complex() == grad.is_complex(), lambda: f"{op}: accumulators[{i}] and grads[{i}] must be "
                     f"both complex or both real, got {describe(acc)} and {describe(grad)}")
    return None


def accumulate_(accumulators: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """`accumulators[i].add_(grads[i])` for every i, bit for bit (a NaN's payload aside; a complex
    sum with a NaN part keeps its other part, where torch's makes both NaN), in one
    pass over the lists (one CUDA launch for up to 64 pairs): each pair of its own floating dtypes
    (a half-precision gradient into a float32 accumulator, say, with no cast before the add), one
    shape, one device for all. The sum is taken in float, or in double where either dtype is
    float64, and rounded once into the accumulator. No accumulator may share memory with another
    accumulator or with another pair's gradient."""
    if accumulators or grads:  # torch dispatches on the tensors: with none, it finds no kernel
        _lib.accumulate_(accumulators, grads)


def unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, compute_sumsq: bool = False
) -> torch.Tensor:
    """Multiply every tensor of `grads` (one device, one dtype, dense) by `inv_scale` in place.

    `found_inf` (one-element float32) is set to 1 when any value is inf or NaN before the
    multiply, and never cleared. `inv_scale` is a one-element float32 tensor; when it is exactly 1
    nothing is written. Returns, when `compute_sumsq`, a float64 tensor with each gradient's sum
    of squares after unscaling (complex: sum of |z|^2), NaN for gradients that held a non-finite
    value; otherwise an empty tensor.
    """
    return _lib.amp_unscale_(grads, found_inf, inv_scale, compute_sumsq)


def mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor (one device, one dtype, dense) by a one-element float32 tensor in
    place, as `torch._foreach_mul_` does (a complex value's parts each by the factor: (inf+0j) * 0.5
    is inf+0j, where torch's complex product gives inf+nanj); a factor of exactly 1 touches no memory."""
    _lib.amp_mul_(tensors, factor)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """`torch._amp_update_scale_` in place on device tensors (no host synchronization)."""
    _lib.amp_update_scale_(scale, growth_tracker, found_inf, float(growth_factor), float(backoff_factor), int(growth_interval))
