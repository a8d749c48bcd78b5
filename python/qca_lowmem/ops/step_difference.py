"""The step difference op (C family `step_difference`): the typed wrapper and fake kernel of
torch.ops.qca_lowmem.step_difference, the recompute check's measure of a step
(recompute/check.py).

How far a recomputed step output lies from the forward's, relative to what the forward step
changed: max|actual - expected| (0 where equal or both NaN; the modulus for complex elements) over
max(max|expected - before| where finite, the float32 tiny), one float32 on the tensors' device
(include/qca_lowmem/step_difference.h). On CUDA it is two launches where torch's ops for the same
measure take fifteen, and no host wait: the check reads every step's value once, at the end of
the backward. Not differentiable.
"""

from typing import Optional

import torch

from ._checks import check_same_device, describe
from .watchers import call_unwatched

_lib = torch.ops.qca_lowmem

MEASURED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def step_difference(actual: torch.Tensor, expected: torch.Tensor, before: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|actual - expected| / max(max|expected - before|, tiny) as a float32 scalar tensor
    (module docstring); `before` None measures the change as `expected` itself."""
    if before is None:
        return call_unwatched(_lib.step_difference, (actual, expected), None)
    return call_unwatched(_lib.step_difference, (actual, expected, before))


def _check_like_actual(actual, t, name):
    check_same_device(actual, "actual", t, name, "step_difference")
    torch._check(t.dtype == actual.dtype and t.shape == actual.shape,
                 lambda: f"step_difference: {name} must have actual's dtype and shape ({actual.dtype}, "
                         f"{list(actual.shape)}), got {describe(t)}")


@torch.library.register_fake("qca_lowmem::step_difference")
def _step_difference_fake(actual, expected, before):
    torch._check(actual.dtype in MEASURED_DTYPES,
                 lambda: "step_difference: actual must be a float16, bfloat16, float32, float64, complex64 or "
                         f"complex128 tensor, got {describe(actual)}")
    _check_like_actual(actual, expected, "expected")
    if before is not None:
        _check_like_actual(actual, before, "before")
    return actual.new_empty((), dtype=torch.float32)
