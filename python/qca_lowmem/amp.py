"""Mixed-precision loss scaling on the qca_lowmem kernels: a drop-in `torch.amp.GradScaler`.

`GradScaler` keeps torch's constructor, methods, stage errors, per-optimizer state, disabled
behaviour and state_dict format (it subclasses `torch.amp.GradScaler`, so torch's scaler loads
its state_dict and vice versa), and replaces the arithmetic with the C/CUDA kernels:

- unscale + non-finite check in one multi-tensor pass (`torch.ops.qca_lowmem.amp_unscale_`),
  for float32, float64, float16, bfloat16 and complex gradients (torch's kernel rejects complex);
  the same pass keeps each gradient's sum of squares, so `GradScaler.clip_grad_norm_` clips
  without a second pass over the gradients;
- the scale update (`torch.ops.qca_lowmem.amp_update_scale_`), torch's rule bit for bit.

The low-level ops are also exposed here as `unscale_`, `mul_` and `update_scale_`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional, Union

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator

from ._loader import load_native

load_native()

_lib = torch.ops.qca_lowmem

__all__ = ["GradScaler", "mul_", "unscale_", "update_scale_"]


@torch.library.register_fake("qca_lowmem::amp_unscale_")
def _unscale_fake(grads, found_inf, inv_scale, compute_sumsq=False):
    return inv_scale.new_empty((len(grads) if compute_sumsq else 0,), dtype=torch.float64)


@torch.library.register_fake("qca_lowmem::amp_mul_")
def _mul_fake(tensors, factor):
    return None


@torch.library.register_fake("qca_lowmem::amp_update_scale_")
def _update_scale_fake(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    return None


# Like torch's own in-place ops (and torch.library.custom_op), bump the version counters of what
# the kernels write, so autograd notices when a tensor it saved was modified.
_impl_lib = torch.library.Library("qca_lowmem", "IMPL")


def _register_version_bump(name: str, mutated) -> None:
    op = getattr(_lib, name).default

    def bump_then_redispatch(keyset, *args, **kwargs):
        torch.autograd.graph.increment_version(mutated(args))
        return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)

    _impl_lib.impl(name, bump_then_redispatch, "ADInplaceOrView", with_keyset=True)


_register_version_bump("amp_unscale_", lambda args: [*args[0], args[1]])
_register_version_bump("amp_mul_", lambda args: list(args[0]))
_register_version_bump("amp_update_scale_", lambda args: [args[0], args[1]])


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


def _is_dense(t: torch.Tensor) -> bool:
    """Elements fill [data_ptr, data_ptr + numel) without overlap, in some order of dimensions."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _norm_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """dtype of torch.linalg.vector_norm of a gradient of this dtype."""
    return grad_dtype.to_real() if grad_dtype.is_complex else grad_dtype


class _GradRecord:
    """A gradient as unscale_ left it, with its sum of squares (an element of a device tensor)."""

    __slots__ = ("param", "grad", "version", "sumsq", "index", "clippable")

    def __init__(self, param, grad, sumsq, index, clippable):
        self.param, self.grad, self.sumsq, self.index = param, grad, sumsq, index
        self.version = grad._version
        self.clippable = clippable

    def unchanged(self, param) -> bool:
        return self.clippable and param.grad is self.grad and self.grad._version == self.version


class GradScaler(torch.amp.GradScaler):
    """Drop-in for :class:`torch.amp.GradScaler` whose unscale, non-finite check and scale update
    run in qca_lowmem's C/CUDA kernels, with complex, bfloat16 and float16 gradients.

    Same constructor, methods, errors, state_dict and disabled behaviour as torch's scaler; see its
    documentation. Additions:

    - ``allow_fp16_grads=False``: torch refuses to unscale float16 gradients (pure-fp16
      training); pass True to allow them.
    - :meth:`clip_grad_norm_`: clips with the gradient norm computed while unscaling.
    - :meth:`overflow_report`: which parameters had non-finite gradients in a skipped step.

    Synchronization: :meth:`scale`, :meth:`unscale_` and :meth:`update` never wait for the device
    (they can be captured in a CUDA graph); :meth:`step` reads the skip decision once per call.

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
        self._overflow_pending: list[tuple[int, list[_GradRecord], torch.optim.Optimizer]] = []
        self._overflow_last: list[tuple[int, list[_GradRecord], torch.optim.Optimizer]] = []

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_overflow_pending"], state["_overflow_last"] = [], []  # they hold optimizers and grads
        return state

    # torch's unscale_ (allow_fp16=False) and _check_inf_per_device (allow_fp16=True, grads stay
    # scaled) both come here; only the former leaves gradients a clip can reuse.
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        unscaling = not allow_fp16
        allow_fp16 = allow_fp16 or self._allow_fp16_grads
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        # (device, dtype) -> [(param, tensor the kernel sees, dense stand-in or None, sparse)]
        groups: dict[tuple[torch.device, torch.dtype], list] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                    if param.grad is None:
                        continue
                    if (not allow_fp16) and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    sparse = param.grad.is_sparse
                    if sparse:
                        # Overflow is likeliest after summing duplicates, so check coalesced values.
                        if param.grad.dtype is torch.float16:
                            param.grad = param.grad.coalesce()
                        to_unscale = param.grad._values()
                    else:
                        to_unscale = param.grad
                    stand_in = None if _is_dense(to_unscale) else to_unscale.contiguous()
                    groups[(to_unscale.device, to_unscale.dtype)].append((param, to_unscale, stand_in, sparse))

            records: list[_GradRecord] = []
            for (device, _), entries in groups.items():
                tensors = [t if s is None else s for _, t, s, _ in entries]
                sumsq = _lib.amp_unscale_(
                    tensors, per_device_found_inf.get(device), per_device_inv_scale.get(device), True
                )
                for index, (param, to_unscale, stand_in, sparse) in enumerate(entries):
                    if stand_in is not None:
                        to_unscale.copy_(stand_in)
                    records.append(_GradRecord(param, param.grad, sumsq, index, unscaling and not sparse))

        state = self._per_optimizer_states[id(optimizer)]
        state["qca_records"] = records
        state["qca_unscaled"] = unscaling
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
        self._overflow_pending.append((self._optimizer_index(optimizer), optimizer_state.get("qca_records", []), optimizer))
        return None

    def _optimizer_index(self, optimizer) -> int:
        return list(self._per_optimizer_states.keys()).index(id(optimizer))

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Update the scale factor, as :meth:`torch.amp.GradScaler.update` (see there), in our
        kernel. Never synchronizes."""
        if not self._enabled:
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
            _lib.amp_update_scale_(
                _scale,
                _growth_tracker,
                found_inf_combined,
                float(self._growth_factor),
                float(self._backoff_factor),
                int(self._growth_interval),
            )

        self._overflow_last, self._overflow_pending = self._overflow_pending, []
        self._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)

    def _cached_records(self, params: list[torch.Tensor]) -> Optional[list[_GradRecord]]:
        """The records of unscale_ for these parameters' gradients, if every one is still as
        unscale_ left it; None otherwise."""
        by_param = {}
        for state in self._per_optimizer_states.values():
            if state["stage"] is OptState.UNSCALED and state.get("qca_unscaled"):
                for record in state["qca_records"]:
                    by_param[id(record.param)] = record
        records = []
        for p in params:
            record = by_param.get(id(p))
            if record is None or not record.unchanged(p):
                return None
            records.append(record)
        return records

    def clip_grad_norm_(
        self,
        parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        """:func:`torch.nn.utils.clip_grad_norm_` reusing the norms computed by :meth:`unscale_`.

        After ``scaler.unscale_(optimizer)``, the total 2-norm comes from the sums of squares
        kept during unscaling (accumulated in float64, so it equals torch's to the rounding of
        the norm's dtype) and only the clipping multiply touches the gradients (and not even that
        when the clip factor is 1). Otherwise (other norms, gradients not unscaled by this
        scaler, changed since, or sparse) this is ``torch.nn.utils.clip_grad_norm_`` itself.
        Returns the total norm, as torch does.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        with_grads = [p for p in params if p.grad is not None]
        records = None
        if self._enabled and float(norm_type) == 2.0 and with_grads:
            records = self._cached_records(with_grads)
        if records is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

        with torch.no_grad():
            first_device = with_grads[0].grad.device
            norm_dtype = _norm_dtype(with_grads[0].grad.dtype)
            for p in with_grads[1:]:
                norm_dtype = torch.promote_types(norm_dtype, _norm_dtype(p.grad.dtype))
            by_sumsq: dict[int, tuple[torch.Tensor, list[int]]] = {}
            for record in records:
                by_sumsq.setdefault(id(record.sumsq), (record.sumsq, []))[1].append(record.index)
            partial_sums = []
            for sumsq, indices in by_sumsq.values():
                # indexing by Python ints keeps index lists off the device (no host-to-device copy)
                picked = sumsq if len(indices) == sumsq.numel() else torch.stack([sumsq[i] for i in indices])
                partial_sums.append(picked.sum().to(first_device, non_blocking=True))
            total_norm = torch.stack(partial_sums).sum().sqrt().to(norm_dtype)

            if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
                raise RuntimeError(
                    f"The total norm of order {float(norm_type)} for gradients from "
                    "`parameters` is non-finite, so it cannot be clipped. To disable "
                    "this error and scale the gradients by the non-finite norm anyway, "
                    "set `error_if_nonfinite=False`"
                )

            clip_coef = float(max_norm) / (total_norm + 1e-6)
            clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for p in with_grads:
                groups[(p.grad.device, p.grad.dtype)].append(p.grad)
            for (device, _), grads in groups.items():
                # bumps the versions, so a later clip of the same grads recomputes their norm
                _lib.amp_mul_(grads, clip_coef_clamped.to(device=device, dtype=torch.float32))
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
        for opt_index, records, optimizer in skipped:
            positions = {
                id(p): f"optimizer[{opt_index}].param_groups[{g}].params[{i}]"
                for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])
            }
            flags: dict[int, list[bool]] = {}
            for record in records:
                if id(record.sumsq) not in flags:
                    flags[id(record.sumsq)] = torch.isnan(record.sumsq).tolist()
                if flags[id(record.sumsq)][record.index]:
                    report.append(names.get(id(record.param), positions.get(id(record.param), "?")))
        return report
