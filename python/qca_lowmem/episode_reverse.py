"""The reverse pass of a recomputing episode: one step at a time, each recompute checked against
the state the forward (or the revolve schedule) already holds.

A step is recomputed from the state it saw in the forward. When the step is not a pure function
of that state (it reads memory kept on an object, a counter, a nondeterministic kernel), the
recompute silently differs and so do the gradients. So each recomputed step's output is compared
with the next state when that is at hand: in "step" mode every step's (the forward kept them all,
and psi_T), in "revolve" mode each step's whose successor is the input of the step reversed just
before (held one step longer for that). The differences stay on the device; one read at the end
of the backward raises `RecomputeMismatchError` before any gradient is handed back.
"""

from typing import List, Optional, Tuple

import torch

from .recompute import keep_block_intermediates


class RecomputeMismatchError(RuntimeError):
    """A step recomputed in backward gave another result than the forward's."""


def differentiable(tensor) -> bool:
    """Whether a state entry can carry a gradient (None and integer tensors cannot)."""
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


def _tolerance(tensor: torch.Tensor) -> float:
    """Rounding, even amplified a thousandfold, stays under sqrt(eps) of the dtype; a step that
    depends on state outside its inputs differs by far more."""
    if not differentiable(tensor):
        return 0.0
    real = tensor.real if tensor.is_complex() else tensor
    return torch.finfo(real.dtype).eps ** 0.5


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """max|actual - expected| / max|expected| as a float32 scalar on the device; NaN where only
    one side is NaN, 0 where both are."""
    if not differentiable(expected):
        return (actual != expected).any().to(torch.float32)
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    difference = torch.where(same, 0.0, (actual - expected).abs()).amax()
    scale = expected.abs().nan_to_num(0.0, 0.0, 0.0).amax().clamp_min(torch.finfo(torch.float32).tiny)
    return (difference / scale).to(torch.float32)


class _Comparisons:
    """The recompute check's per-step differences, read once at the end of the backward."""

    def __init__(self, mode: str):
        self.mode = mode
        self.steps: List[int] = []
        self.names: List[List[str]] = []
        self.differences: List[torch.Tensor] = []
        self.tolerances: List[List[float]] = []

    def add(self, t: int, recomputed, expected) -> None:
        names, differences, tolerances = [], [], []
        for name, actual, wanted in recomputed_pairs(recomputed, expected):
            if (actual is None) != (wanted is None) or (actual is not None and (
                    actual.shape != wanted.shape or actual.dtype != wanted.dtype)):
                raise self.error(t, f"{name} {_describe(actual)} where the forward had {_describe(wanted)}")
            if actual is None:
                continue
            names.append(name)
            difference = _relative_difference(actual.detach(), wanted.detach())
            differences.append(difference.to(differences[0].device) if differences else difference)
            tolerances.append(_tolerance(wanted))
        self.steps.append(t)
        self.names.append(names)
        self.differences.append(torch.stack(differences))
        self.tolerances.append(tolerances)

    def verify(self) -> None:
        if not self.steps:
            return
        values = torch.cat(self.differences).tolist()  # the check's only host sync
        failures, i = [], 0
        for t, names, tolerances in zip(self.steps, self.names, self.tolerances):
            for name, tolerance in zip(names, tolerances):
                if not values[i] <= tolerance:  # NaN fails too
                    failures.append((t, name, values[i], tolerance))
                i += 1
        if failures:
            t, name, value, tolerance = min(failures)
            more = f" ({len(failures)} step outputs differ in all)" if len(failures) > 1 else ""
            raise self.error(t, f"{name} differs from the forward's by max|diff|/max|forward| = {value:.3g} "
                                f"(tolerance {tolerance:.3g}){more}")

    def error(self, t: int, what: str) -> RecomputeMismatchError:
        return RecomputeMismatchError(
            f"rollout(checkpoint={self.mode!r}): the recompute of step {t} in backward does not reproduce the "
            f"forward: {what}. The step is not a function of its inputs alone, so its gradients would be wrong. "
            "Likely causes: state kept outside psi (a memory such as ConvLSTM h/c read from and written to an "
            "object, a counter): pass it through rollout(..., carry=...); or a nondeterministic kernel. "
            "checkpoint='none' recomputes nothing; check_recompute=False switches this check off."
        )


def recomputed_pairs(recomputed, expected):
    """(name, recomputed, expected) for psi and each carried tensor."""
    (psi, carry), (psi_expected, carry_expected) = recomputed, expected
    yield "psi", psi, psi_expected
    for i, (actual, wanted) in enumerate(zip(carry, carry_expected)):
        yield f"carry[{i}]", actual, wanted


def _describe(tensor) -> str:
    return "None" if tensor is None else f"shape={tuple(tensor.shape)} dtype={tensor.dtype}"


class StepReverser:
    """The gradients flowing back along the episode, one step at a time (steps in reverse): the
    gradient w.r.t. psi and w.r.t. each carried tensor after the step being reversed."""

    def __init__(self, plan, incoming, params, final_state=None):
        self.plan = plan
        self.incoming = incoming  # step -> (grad psi, grads of the carry) flowing into its output
        self.params = params
        self.grad: Optional[torch.Tensor] = None
        self.grad_carry: List[Optional[torch.Tensor]] = [None] * plan.carry_width
        self.comparisons = _Comparisons(plan.mode) if plan.check_recompute else None
        # The state after the step reversed next, when known: (step index, (psi, carry)).
        self.next_state: Optional[Tuple[int, tuple]] = (plan.steps, final_state) if final_state else None

    def backprop(self, t: int, state: tuple) -> None:
        """Reverse step t given its input state (psi, carry): the gradients now refer to it."""
        g = self.incoming.pop(t, None)
        if g is not None:
            self.grad = _add(self.grad, g[0])
            self.grad_carry = [_add(a, b) for a, b in zip(self.grad_carry, g[1])]
        expected = self.next_state[1] if self.next_state is not None and self.next_state[0] == t + 1 else None
        self.next_state = (t, state) if self.comparisons is not None else None
        if self.grad is None and all(g is None for g in self.grad_carry):
            return  # nothing of the loss depends on this step's output
        plan = self.plan
        if plan.unit.capture is not None and plan.unit.capture.takes(state[1]):
            self._backprop_captured(t, state, expected)
            return
        psi, carry = state
        first = t == 0
        psi_in = psi.detach().requires_grad_(not first or plan.psi0_needs_grad)
        carry_in = tuple(c.detach().requires_grad_(not first or needs) if differentiable(c) else c
                         for c, needs in zip(carry, plan.carry0_needs_grad))
        with torch.enable_grad(), plan.autocast(), keep_block_intermediates(), plan.rng.replay(t):
            out, out_carry = plan.unit(psi_in, carry_in, t)
        if expected is not None:
            self.comparisons.add(t, (out, out_carry), expected)
        outputs, grads = [], []
        for value, grad in zip((out, *out_carry), (self.grad, *self.grad_carry)):
            if grad is not None and value is not None and value.requires_grad:
                outputs.append(value)
                grads.append(grad)
        inputs = [x for x in (psi_in, *carry_in) if x is not None and x.requires_grad]
        found = torch.autograd.grad(outputs, inputs + self.params, grads, allow_unused=True) if outputs and (
            inputs or self.params) else [None] * (len(inputs) + len(self.params))
        by_input = {id(x): g for x, g in zip(inputs, found)}
        self.grad = by_input.get(id(psi_in))
        self.grad_carry = [by_input.get(id(c)) if c is not None else None for c in carry_in]

    def _backprop_captured(self, t: int, state: tuple, expected) -> None:
        """backprop through the capture's graphs; the noise after the step stays eager."""
        plan = self.plan
        unit = plan.unit
        out, out_carry = unit.capture.output_for_backward(*state)
        noisy = out
        if unit.noise is not None:
            out = out.requires_grad_(True)
            with torch.enable_grad(), plan.autocast(), plan.rng.replay(t):
                noisy = unit.add_noise(out, t)
        if expected is not None:
            self.comparisons.add(t, (noisy, out_carry), expected)
        grad_out = self.grad
        if noisy is not out and grad_out is not None:
            grad_out = torch.autograd.grad(noisy, out, grad_out, allow_unused=True)[0] if noisy.requires_grad else None
        if grad_out is None and all(g is None for g in self.grad_carry):
            self.grad = None
            return
        grad_in, grad_carry_in = unit.capture.backward(grad_out, tuple(self.grad_carry))
        first = t == 0
        self.grad = grad_in if not first or plan.psi0_needs_grad else None
        self.grad_carry = [g if not first or needs else None for g, needs in zip(grad_carry_in, plan.carry0_needs_grad)]

    def verify(self) -> None:
        """Raise RecomputeMismatchError when a checked recompute differed from the forward."""
        if self.comparisons is not None:
            self.comparisons.verify()


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b
