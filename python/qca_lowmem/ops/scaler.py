"""The loss-scaler ops (C family `scaler`): typed wrappers and fake kernels of
torch.ops.qca_lowmem.amp_unscale_, amp_mul_ and amp_update_scale_, and of accumulate_, the
gradient accumulation on the same multi-tensor engine. The GradScaler built on them is in amp.py;
the recomputing rollouts accumulate their parameters' gradients with accumulate_
(recompute/param_grads.py). They mutate their arguments in place and have no autograd."""

from __future__ import annotations

import torch

from ._checks import check_one_device, check_same_device, describe

_lib = torch.ops.qca_lowmem


def _check_list_devices(tensors, list_name, scalars, op):
    """The scaler glue's device rule: the list on one device, the scalars on the list's."""
    check_one_device(tensors, list_name, op)
    ref_name, ref = ("the first tensor of the list", tensors[0]) if tensors else scalars[0]
    for name, t in scalars:
        check_same_device(ref, ref_name, t, name, op)


@torch.library.register_fake("qca_lowmem::amp_unscale_")
def _unscale_fake(grads, found_inf, inv_scale, compute_sumsq=False):
    _check_list_devices(grads, "grads", [("inv_scale", inv_scale), ("found_inf", found_inf)], "amp_unscale_")
    return inv_scale.new_empty((len(grads) if compute_sumsq else 0,), dtype=torch.float64)


@torch.library.register_fake("qca_lowmem::amp_mul_")
def _mul_fake(tensors, factor):
    _check_list_devices(tensors, "tensors", [("factor", factor)], "amp_mul_")
    return None


@torch.library.register_fake("qca_lowmem::amp_update_scale_")
def _update_scale_fake(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    for name, t in (("growth_tracker", growth_tracker), ("found_inf", found_inf)):
        check_same_device(scale, "scale", t, name, "amp_update_scale_")
    return None


@torch.library.register_fake("qca_lowmem::accumulate_")
def _accumulate_fake(accumulators, grads):
    torch._check(len(accumulators) == len(grads), lambda: "accumulate_: accumulators and grads must be lists of "
                 f"one length, got {len(accumulators)} and {len(grads)}")
    for i, (acc, grad) in enumerate(zip(accumulators, grads)):
        for name, t in ((f"accumulators[{i}]", acc), (f"grads[{i}]", grad)):
            check_same_device(accumulators[0], "accumulators[0]", t, name, "accumulate_")
        torch._check(acc.shape == grad.shape, lambda: f"accumulate_: grads[{i}] must have the shape of "
                     f"accumulators[{i}] ({list(acc.shape)}), got {describe(grad)}")
    return None


def accumulate_(accumulators: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """`accumulators[i].add_(grads[i])` for every i, bit for bit (a NaN's payload aside), in one
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
    place, as `torch._foreach_mul_` does; a factor of exactly 1 touches no memory."""
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
