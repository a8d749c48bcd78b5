"""The check that each recomputed step reproduces its forward.

A step is recomputed from the state it saw in the forward. When the step is not a pure function
of that state (it reads memory kept on an object, a counter, a nondeterministic kernel), the
recompute silently differs and so do the gradients. So the reverse pass compares each recomputed
step's output with the next state when that is at hand: with one state per step every step's
(the forward kept them all, and the final state), with revolve each step's whose successor is the
input of the step reversed just before (held one step longer for that). The differences stay on
the device; one read at the end of the backward raises `RecomputeMismatchError` before any
gradient is handed back.

What it compares is what the step changed: the recompute's output against the forward's, relative
to the largest change the forward step made to that entry (its output less its input; a carry
entry that has no input yet, against itself). A U-Net whose output starts near zero changes psi
by 1e-5 a step: relative to psi, a forgotten memory hides under psi's rounding; relative to the
change, it does not. On the CPU a recompute runs the same kernels on the same data and must give
the same bits: any difference fails. On a GPU a kernel may be chosen anew (cuDNN's algorithms per
thread), so rounding of the precision the step computes in (the autocast dtype, else psi's; for
float32, TF32's where cuDNN or matmuls may use it, as they do by default) is allowed: 16 units of
it, relative to the change.
"""

from typing import List, Optional

import torch

from ..ops.step_difference import MEASURED_DTYPES, step_difference
from .state import State, describe, differentiable


class RecomputeMismatchError(RuntimeError):
    """A step recomputed in backward gave another result than the forward's."""


ROUNDING_UNITS = 16  # of the compute precision, relative to a step's change, allowed on a GPU
WHAT_IT_SEES = ("The check compares what each recomputed step changed with what its forward changed: on the "
                "CPU bit for bit, on a GPU within 16 units of rounding of the precision the step computes in, "
                "relative to the change; a difference smaller than that (or in a step the schedule does not "
                "check) is not seen, nor one in the gradient alone (a detach, no_grad or custom Function's "
                "backward switched by state kept outside the step).")


def _tolerance(tensor: torch.Tensor, compute_dtype: Optional[torch.dtype]) -> float:
    """0 on the CPU (the same kernels give the same bits); on a GPU, rounding of the precision
    the step computes in."""
    if tensor.device.type == "cpu" or not differentiable(tensor):
        return 0.0
    real = tensor.real if tensor.is_complex() else tensor
    dtype = compute_dtype if compute_dtype is not None else real.dtype
    eps = max(torch.finfo(dtype).eps, torch.finfo(real.dtype).eps)
    if dtype == torch.float32 and _tf32_allowed():
        eps = max(eps, TF32_EPS)  # fp32 convs and matmuls then round to TF32's 10-bit mantissa
    return ROUNDING_UNITS * eps


TF32_EPS = 2.0**-10


def _tf32_allowed() -> bool:
    """Whether float32 convolutions or matmuls may compute in TF32 (cuDNN's default: on), where
    another algorithm, picked per thread with cudnn.benchmark, rounds differently."""
    return torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest"


_ZERO = torch.zeros((), dtype=torch.float32)


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor, before: Optional[torch.Tensor]) -> torch.Tensor:
    """max|actual - expected| / max|expected - before| (the change the forward step made; the
    size of `expected` where there is no `before`) as a float32 scalar on the device; NaN where
    only one side is NaN, 0 where both are: `step_difference`, one op (two kernels on CUDA)."""
    if not differentiable(expected):
        return (actual != expected).any().to(torch.float32)
    if expected.dtype not in MEASURED_DTYPES:  # float8, complex32: measured in single precision
        wide = torch.complex64 if expected.is_complex() else torch.float32
        actual, expected, before = (None if t is None else t.to(wide) for t in (actual, expected, before))
    return step_difference(actual, expected, before)


class RecomputeCheck:
    """The per-step differences of one backward, read once at its end."""

    def __init__(self, policy, compute_dtype: Optional[torch.dtype]):
        self.policy = policy  # the error names it
        self.compute_dtype = compute_dtype  # the autocast dtype of psi's device, None without
        self.steps: List[int] = []
        self.names: List[List[str]] = []
        self.differences: List[torch.Tensor] = []  # scalars on the device, every step's in turn
        self.tolerances: List[List[float]] = []

    def add(self, t: int, recomputed: State, expected: State, before: State) -> None:
        """Step t's recomputed output against the forward's (`expected`), given its input."""
        names, differences, tolerances = [], [], []
        for (name, actual), (_, wanted), (_, old) in zip(recomputed.entries(), expected.entries(), before.entries()):
            if (actual is None) != (wanted is None) or (actual is not None and (
                    actual.shape != wanted.shape or actual.dtype != wanted.dtype)):
                raise self.error(t, f"{name} {describe(actual)} where the forward had {describe(wanted)}")
            if actual is None:
                continue
            names.append(name)
            if old is not None and (old.shape != wanted.shape or old.dtype != wanted.dtype):
                old = None
            tolerance = _tolerance(wanted, self.compute_dtype)
            if tolerance == 0.0 and actual.device.type == "cpu" and torch.equal(actual, wanted):
                difference = _ZERO  # the common case, at a tenth of the cost (no host sync on the CPU)
            else:
                difference = _relative_difference(actual.detach(), wanted.detach(), None if old is None else old.detach())
            differences.append(difference)  # (moved to one device in verify())
            tolerances.append(tolerance)
        self.steps.append(t)
        self.names.append(names)
        self.differences += differences  # stacked once, in verify(): no op a step
        self.tolerances.append(tolerances)

    def verify(self) -> None:
        if not self.differences:
            return
        device = self.differences[0].device
        values = torch.stack([d.to(device) for d in self.differences]).tolist()  # the check's only host sync
        failures, i = [], 0
        for t, names, tolerances in zip(self.steps, self.names, self.tolerances):
            for name, tolerance in zip(names, tolerances):
                if not values[i] <= tolerance:  # NaN fails too
                    failures.append((t, name, values[i], tolerance))
                i += 1
        if failures:
            t, name, value, tolerance = min(failures)
            more = f" ({len(failures)} step outputs differ in all)" if len(failures) > 1 else ""
            raise self.error(t, f"{name} differs from the forward's by max|diff|/max|forward change| = {value:.3g} "
                                f"(tolerance {tolerance:.3g}){more}")

    def error(self, t: int, what: str) -> RecomputeMismatchError:
        return RecomputeMismatchError(
            f"rollout(checkpoint={self.policy.checkpoint!r}): the recompute of step {t} in backward does not reproduce the "
            f"forward: {what}. The step is not a function of its inputs alone, so its gradients would be wrong. "
            "Likely causes: state kept outside psi (a memory such as ConvLSTM h/c read from and written to an "
            "object, a counter): pass it through rollout(..., carry=...); a nondeterministic kernel; or another "
            "thread drawing from the global generators the recompute replays (rollouts in two threads). "
            "checkpoint='none' recomputes nothing; check_recompute=False switches this check off. " + WHAT_IT_SEES
        )
