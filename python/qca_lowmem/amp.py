"""A drop-in `torch.amp.GradScaler` on the qca_lowmem loss-scaler kernels (the compute-dtype
switches, `parse_amp_dtype`, `autocast` and the rest, are precision.py's).

`GradScaler` keeps torch's constructor, methods, stage errors, per-optimizer state, disabled
behaviour and state_dict format (it subclasses `torch.amp.GradScaler`, so torch's scaler loads
its state_dict and vice versa), and replaces the arithmetic with the C/CUDA kernels:

- unscale + non-finite check in one multi-tensor pass (`torch.ops.qca_lowmem.amp_unscale_`),
  for float32, float64, float16, bfloat16 and complex gradients (torch's kernel rejects complex);
  the same pass keeps each gradient's sum of squares, so `GradScaler.clip_grad_norm_(...,
  reuse_unscale_norm=True)` clips without a second pass over the gradients;
- the scale update (`torch.ops.qca_lowmem.amp_update_scale_`), torch's rule bit for bit.

The kernels' wrappers (`unscale_`, `mul_`, `update_scale_`) are qca_lowmem.ops.scaler's.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from typing import Any, Iterable, Optional, Union

import numpy
import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator

from .ops import has_cuda_kernels
from .ops.scaler import mul_, unscale_, update_scale_

__all__ = ["GradScaler"]


def _norm_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """dtype of torch.linalg.vector_norm of a gradient of this dtype."""
    return grad_dtype.to_real() if grad_dtype.is_complex else grad_dtype


class _Unscaled:
    """What one unscale (or non-finite check) of an optimizer's gradients left behind.

    groups: per (device, dtype), the tensors the kernel processed and their sums of squares.
    where: id(param) -> (param, grad, grad version after the kernel, group index, index).
    clippable: the gradients were really unscaled (not just checked) and none is sparse, so a
    clip may reuse the sums while the gradients stay as the kernel left them.
    """

    __slots__ = ("groups", "where", "clippable")

    def __init__(self):
        self.groups: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self.where: dict[int, tuple] = {}
        self.clippable = True


class _Skipped:
    """What overflow_report needs of a skipped step: no gradient, parameter or optimizer, so the
    step's gradients are freed when the caller drops them, as with torch's scaler.

    sums: per group of `_Unscaled.groups`, its sums of squares (NaN where a value was not finite).
    entries: (default name, id of the parameter, group index, index), in the optimizer's order.
    """

    __slots__ = ("sums", "entries")

    def __init__(self, opt_index: int, result: _Unscaled, optimizer: torch.optim.Optimizer):
        self.sums = [sumsq for _, sumsq in result.groups]
        self.entries = [
            (f"optimizer[{opt_index}].param_groups[{g}].params[{i}]", id(param), *entry[3:])
            for g, group in enumerate(optimizer.param_groups)
            for i, param in enumerate(group["params"])
            if (entry := result.where.get(id(param))) is not None
        ]


def _runs_our_kernels(device: Any) -> bool:
    """Whether a scaler for `device` ("cpu:0" and torch.device("cuda", 1) included) runs our kernels;
    another backend, a build without CUDA or a name torch cannot read runs torch's."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        return False
    return kind == "cpu" or (kind == "cuda" and has_cuda_kernels())


def _check_update_settings(growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
    """The types torch's update() takes (its op's float, float and int; TypeError otherwise): our
    kernel's wrapper converts its arguments, which would truncate a growth_interval of 2.5. Torch's
    float arguments take a NumPy bool too (not a numbers.Real)."""
    for name, value in (("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
        number = isinstance(value, (numbers.Real, numpy.bool_)) or (
            isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and not value.requires_grad
        )
        if not number:
            raise TypeError(f"GradScaler.update: {name} must be a real number, got {value!r}")
    integer = (isinstance(growth_interval, numbers.Integral) and not isinstance(growth_interval, bool)) or (
        isinstance(growth_interval, torch.Tensor)
        and growth_interval.dim() == 0
        and not growth_interval.is_floating_point()
        and not growth_interval.is_complex()
        and growth_interval.dtype is not torch.bool
    )
    if not integer:
        raise TypeError(f"GradScaler.update: growth_interval must be an int, got {growth_interval!r}")


class GradScaler(torch.amp.GradScaler):
    """Drop-in for :class:`torch.amp.GradScaler` whose unscale, non-finite check and scale update
    run in qca_lowmem's C/CUDA kernels, with complex, bfloat16 and float16 gradients.

    Same constructor, methods, errors, state_dict and disabled behaviour as torch's scaler; see its
    documentation. Additions:

    - ``allow_fp16_grads=False``: torch refuses to unscale float16 gradients (pure-fp16
      training); pass True to allow them.
    - :meth:`clip_grad_norm_`: clips, with the gradient norm computed while unscaling when asked.
    - :meth:`overflow_report`: which parameters had non-finite gradients in a skipped step.

    Synchronization: :meth:`scale`, :meth:`unscale_` and :meth:`update` never wait for the device
    (they can be captured in a CUDA graph); :meth:`step` reads the skip decision once per call.

    On a device without qca_lowmem kernels (a build without CUDA, another backend) the scaler
    runs torch's own kernels: same results, no complex gradients, no fused clip, no report.

    Sparse gradients are unscaled through their ``_values()`` in our kernel, as torch does
    (float16 ones are coalesced first); :meth:`clip_grad_norm_` hands them to
    ``torch.nn.utils.clip_grad_norm_``. Optimizers with ``_step_supports_amp_scaling`` follow
    torch's own path (our kernel does their non-finite check).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        allow_fp16_grads: bool = False,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._allow_fp16_grads = allow_fp16_grads
        self._native = _runs_our_kernels(device)
        self._overflow_pending: list[_Skipped] = []
        self._overflow_last: list[_Skipped] = []

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_overflow_pending"], state["_overflow_last"] = [], []  # ids of this process's parameters
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._native = _runs_our_kernels(self._device)

    # torch's unscale_ (allow_fp16=False) and _check_inf_per_device (allow_fp16=True, grads stay
    # scaled) both come here; only the former leaves gradients a clip can reuse.
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if not self._native:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self._allow_fp16_grads)
        unscaling = not allow_fp16
        allow_fp16 = allow_fp16 or self._allow_fp16_grads
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        result = _Unscaled()
        result.clippable = unscaling
        # (device, dtype) -> (params, tensors the kernel processes)
        grouped: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = defaultdict(lambda: ([], []))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                    grad = param.grad
                    if grad is None:
                        continue
                    if (not allow_fp16) and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # Overflow is likeliest after summing duplicates, so check coalesced values.
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                        result.clippable = False
                    params, tensors = grouped[(grad.device, grad.dtype)]
                    params.append(param)
                    tensors.append(grad)

            for group_index, ((device, _), (params, tensors)) in enumerate(grouped.items()):
                sumsq = unscale_(tensors, per_device_found_inf.get(device), per_device_inv_scale.get(device), True)
                result.groups.append((tensors, sumsq))
                for index, param in enumerate(params):
                    grad = param.grad
                    result.where[id(param)] = (param, grad, grad._version, group_index, index)

        self._per_optimizer_states[id(optimizer)]["qca"] = result
        return per_device_found_inf._per_device_tensors

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        found = list(optimizer_state["found_inf_per_device"].values())
        if len(found) == 1:
            total = found[0]
        else:  # add on one device so that the decision costs a single synchronization
            target = found[0].device
            total = torch.stack([f.to(target, non_blocking=True) for f in found]).sum()
        if not total.item():
            return optimizer.step(*args, **kwargs)
        result = optimizer_state.get("qca")
        if result is not None:  # None: found_inf from torch's kernels, which keep no sums
            self._overflow_pending.append(_Skipped(self._optimizer_index(optimizer), result, optimizer))
        return None

    def _optimizer_index(self, optimizer) -> int:
        return list(self._per_optimizer_states.keys()).index(id(optimizer))

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Update the scale factor, as :meth:`torch.amp.GradScaler.update` (see there), in our
        kernel. Never synchronizes."""
        if not self._enabled:
            return
        if not self._native:
            super().update(new_scale)
            self._overflow_last, self._overflow_pending = self._overflow_pending, []
            return

        _scale, _growth_tracker = self._check_scale_growth_tracker("update")

        if new_scale is not None:
            if self._scale is None:
                raise AssertionError("_scale is None in update")
            if isinstance(new_scale, float):
                self._scale.fill_(new_scale)
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale)
        else:
            _check_update_settings(self._growth_factor, self._backoff_factor, self._growth_interval)
            found_infs = [
                found_inf.to(device=_scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf_combined = found_infs[0]
            if len(found_infs) > 1:
                for i in range(1, len(found_infs)):
                    found_inf_combined += found_infs[i]
            update_scale_(
                _scale,
                _growth_tracker,
                found_inf_combined,
                float(self._growth_factor),
                float(self._backoff_factor),
                int(self._growth_interval),
            )

        self._overflow_last, self._overflow_pending = self._overflow_pending, []
        self._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)

    def _reusable_sums(self, params: list[torch.Tensor]):
        """For the gradients of `params`, as (groups of (tensors, sums of squares, indices or None
        for all), first gradient) when unscale_ left every one of them untouched; else None."""
        unscaled = [
            state["qca"]
            for state in self._per_optimizer_states.values()
            if state["stage"] is OptState.UNSCALED and "qca" in state and state["qca"].clippable
        ]
        # A parameter listed twice counts twice in torch's norm and is clipped twice: torch's path then.
        if not unscaled or len({id(p) for p in params}) != len(params):
            return None
        picked: dict[tuple[int, int], list[int]] = {}
        first_grad = None
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            for result_index, result in enumerate(unscaled):
                entry = result.where.get(id(p))
                if entry is not None:
                    break
            if entry is None or entry[1] is not grad or grad._version != entry[2]:
                return None
            if first_grad is None:
                first_grad = grad
            picked.setdefault((result_index, entry[3]), []).append(entry[4])
        if first_grad is None:
            return None
        groups = []
        for (result_index, group_index), indices in picked.items():
            tensors, sumsq = unscaled[result_index].groups[group_index]
            if len(indices) == len(tensors):
                groups.append((tensors, sumsq, None))
            else:
                groups.append(([tensors[i] for i in indices], sumsq, indices))
        return groups, first_grad

    def clip_grad_norm_(
        self,
        parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
        *,
        reuse_unscale_norm: bool = False,
    ) -> torch.Tensor:
        """:func:`torch.nn.utils.clip_grad_norm_`; with ``reuse_unscale_norm=True``, from the
        norms computed by :meth:`unscale_`.

        By default the norm is measured from the gradients, as torch does: a gradient changed
        since ``unscale_`` through ``.data`` (old-style value clipping) keeps its version, so no
        check could prove a kept norm current. With ``reuse_unscale_norm=True`` (the caller
        vouches that nothing touched the gradients since ``unscale_`` but in-place ops, which the
        versions show), the total 2-norm comes from the sums of squares kept during unscaling
        (accumulated in float64, so it equals torch's to the rounding of the norm's dtype) and
        only the clipping multiply touches the gradients (and not even that when the clip factor
        is 1); for other norms, gradients not unscaled by this scaler, changed in place since, or
        sparse, it is ``torch.nn.utils.clip_grad_norm_`` all the same. Returns the total norm, as
        torch does. Never synchronizes unless ``error_if_nonfinite``.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        reusable = None
        if reuse_unscale_norm and self._enabled and float(norm_type) == 2.0:
            reusable = self._reusable_sums(params)
        if reusable is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        groups, first_grad = reusable

        with torch.no_grad():
            first_device = first_grad.device
            norm_dtype = None
            partial_sums = []
            for tensors, sumsq, indices in groups:
                dtype = _norm_dtype(tensors[0].dtype)
                norm_dtype = dtype if norm_dtype is None else torch.promote_types(norm_dtype, dtype)
                # indexing by Python ints keeps index lists off the device (no host-to-device copy)
                picked = sumsq if indices is None else torch.stack([sumsq[i] for i in indices])
                partial_sums.append(picked.sum().to(first_device, non_blocking=True))
            total_sq = partial_sums[0] if len(partial_sums) == 1 else torch.stack(partial_sums).sum()
            total_norm = total_sq.sqrt().to(norm_dtype)

            if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
                raise RuntimeError(
                    f"The total norm of order {float(norm_type)} for gradients from "
                    "`parameters` is non-finite, so it cannot be clipped. To disable "
                    "this error and scale the gradients by the non-finite norm anyway, "
                    "set `error_if_nonfinite=False`"
                )

            clip_coef = float(max_norm) / (total_norm + 1e-6)
            clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
            for tensors, _, _ in groups:
                # bumps the versions, so a later clip of the same grads measures them again
                mul_(tensors, clip_coef_clamped.to(device=tensors[0].device, dtype=torch.float32))
        return total_norm

    def overflow_report(self, model: Optional[torch.nn.Module] = None) -> list[str]:
        """Parameters whose gradients held inf or NaN in the last skipped optimizer step.

        Looks at the step() calls of the current iteration, or, after update(), of the previous
        one. Names come from ``model.named_parameters()`` when a model is given, otherwise they
        read ``optimizer[k].param_groups[g].params[i]`` (k counts optimizers in the order the scaler
        first saw them in the iteration).
        Synchronizes with the device. Empty when no step was skipped.
        """
        skipped = self._overflow_pending or self._overflow_last
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        report = []
        for record in skipped:
            nonfinite = [torch.isnan(sumsq).tolist() for sumsq in record.sums]
            for default_name, param_id, group_index, index in record.entries:
                if nonfinite[group_index][index]:
                    report.append(names.get(param_id, default_name))
        return report
