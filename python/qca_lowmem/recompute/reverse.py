"""The reverse pass of an episode: one step at a time, last step first, whatever the schedule.

For each step the schedule hands over what the forward kept for it. The pass gets the step's
outputs and a vector-Jacobian product from one of three ways of running a step:

- recomputed eagerly: the step runs again with grad from its kept input state (same autocast
  state, same random numbers, blocks keeping their intermediates);
- replayed on a capture (a StepGraph, step_graph.py): the captured forward and backward graphs, the
  noise after the step eager;
- kept graphs (checkpoint="auto"'s last steps): the chain of graphs the forward built, reversed in
  one backward as plain autograd would, nothing recomputed.

The pass itself owns what they share: the gradients flowing into each step's outputs, the
recompute check (check.py), and the first step's inputs, whose gradients are returned
only where psi0 or a carry entry requires grad. Parameter gradients reach the episode's
ParamGradSink through the parameters' hooks, or the capture's accumulators.
"""

from typing import Callable, Optional, Tuple

import torch

from .intermediates import keep_block_intermediates
from .leaves import leaves_reached, next_sequence_nr
from .replay import step_recomputed
from .state import State


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _vjp(inputs: State, pairs, sink, retain_graph: bool = False) -> State:
    """The gradients w.r.t. `inputs` of a graph whose outputs get gradients as (output, gradient)
    `pairs`; the parameters' go to their hooks, into the episode's ParamGradSink `sink`."""
    wrt = [x for x in inputs.tensors() if x is not None and x.requires_grad]
    if pairs and (wrt or sink.params):
        found = torch.autograd.grad([v for v, _ in pairs], wrt + sink.params, [g for _, g in pairs],
                                    allow_unused=True, retain_graph=retain_graph)
        sink.flush()
    else:
        found = [None] * len(wrt)
    by_input = {id(x): g for x, g in zip(wrt, found)}
    return State(by_input.get(id(inputs.psi)), tuple(None if c is None else by_input.get(id(c)) for c in inputs.carry))


def graph_vjp(inputs: State, outputs: State, sink) -> Callable[[State], State]:
    """The vector-Jacobian product of a step whose graph runs from `inputs` to `outputs`."""

    def vjp(grads: State) -> State:
        return _vjp(inputs, [(value, grad) for value, grad in zip(outputs.tensors(), grads.tensors())
                             if grad is not None and value is not None and value.requires_grad], sink)

    return vjp


class Rerun:
    """The episode's step (an episode.StepUnit) and what running it again as its forward ran
    needs: the generators' states before each step, the forward's autocast state and the tensors
    the steps write that outlive them (buffers.py)."""

    def __init__(self, unit, rng, autocast, buffers, grad: bool):
        self.unit = unit
        self.rng = rng
        self.autocast = autocast
        self.buffers = buffers
        self.grad = grad  # whether the forward's steps ran with grad (probe.EpisodeStart.grad_forward)

    def advance(self, state: State, start: int, stop: int) -> State:
        """The state at step `stop` from the one at step `start`, as the forward ran: without a
        graph, or with one per step, dropped at its end, where the forward's steps ran with grad."""
        with torch.set_grad_enabled(self.grad), self.autocast():
            for t in range(start, stop):
                self.buffers.load(t)
                with self.rng.replay(t), step_recomputed():
                    state = self.unit(state.as_inputs(True) if self.grad else state, t)
                state = state.detached() if self.grad else state
        return state

    def with_grad(self, t: int, inputs: State) -> State:
        """Step t on `inputs` with grad, as its forward ran (autocast, random draws), blocks keeping
        their intermediates."""
        with torch.enable_grad(), self.autocast(), keep_block_intermediates(), self.rng.replay(t), step_recomputed():
            return self.unit(inputs, t)


class StepReverser:
    """The gradients flowing back along the episode: w.r.t. the state after the step being
    reversed, then, once it is reversed, w.r.t. its input state. `incoming`: step -> State of the
    gradients flowing into its output; `input_needs_grad`: psi0's then each carry entry's (the
    first step's input gradients are returned only there); `check`: the recompute check, with
    `final` (steps, the final state) when it keeps that."""

    def __init__(self, rerun: Rerun, policy, incoming: dict, sink, input_needs_grad, check=None,
                 final: Optional[Tuple[int, State]] = None):
        self.rerun = rerun
        self.policy = policy  # the errors name it
        self.sink = sink  # the episode's ParamGradSink
        self.incoming = incoming
        self.input_needs_grad = input_needs_grad
        self.grads = State(None, (None,) * (len(input_needs_grad) - 1))
        self.check = check
        # The state after the step reversed next, when known: (step index, state).
        self.next_state: Optional[Tuple[int, State]] = final

    def advance(self, state: State, start: int, stop: int) -> State:
        return self.rerun.advance(state, start, stop)

    def backprop(self, t: int, state: State, upcoming: Optional[State] = None) -> None:
        """Reverse step t given the input state the forward kept (or re-advanced): the gradients
        then refer to it. `upcoming`: the input state of step t-1, where the schedule already holds
        it (a capture with two lanes then recomputes step t-1 while step t's backward runs)."""
        self._take_incoming(t)
        expected = self.next_state[1] if self.next_state is not None and self.next_state[0] == t + 1 else None
        self.next_state = (t, state) if self.check is not None else None
        if all(g is None for g in self.grads.tensors()):
            return  # nothing of the loss depends on this step's output
        capture = self.rerun.unit.capture
        if capture is not None and capture.takes(state.carry):
            outputs, vjp = self._replayed(t, state, upcoming)
        else:
            outputs, vjp = self._recomputed(t, state)
        if expected is not None:
            self.check.add(t, outputs, expected, state)
        self._set_grads(t, vjp(self.grads))

    def backprop_graph(self, kept) -> None:
        """Reverse the steps whose graph the forward kept (an episode.KeptGraph), in one backward:
        the gradient flowing into each step's output (the history's, the last step's) enters it
        there, as in plain autograd. Nothing is recomputed, so nothing is checked."""
        first, last = kept.start, kept.start + len(kept.outputs) - 1
        pairs = []
        for t, outputs in zip(range(first, last + 1), kept.outputs):
            g = self.incoming.pop(t, None)
            if t == last:
                self._take_incoming(t, g)
                g = self.grads
            if g is not None:
                pairs += [(value, grad) for value, grad in zip(outputs.tensors(), g.tensors())
                          if grad is not None and value is not None and value.requires_grad]
        self.next_state = (first, kept.inputs) if self.check is not None else None
        self._find_leaves([x for state in kept.outputs for x in state.tensors()], kept.inputs, kept.marker, first)
        kept.trap.allowed = True
        try:
            # Retained: a tensor that left a kept step may still lead the caller's backward into
            # these graphs, which then ends at the trap, not at torch's freed buffers. They are
            # freed with the KeptGraph when the episode's backward returns.
            grads = _vjp(kept.inputs, pairs, self.sink, retain_graph=True)
        finally:
            kept.trap.allowed = False
        kept.outputs = []  # their graphs freed now, as a backward that retains nothing frees them
        self._set_grads(first, grads)

    def _take_incoming(self, t: int, g: Optional[State] = None) -> None:
        g = self.incoming.pop(t, None) if g is None else g
        if g is not None:
            self.grads = State(_add(self.grads.psi, g.psi), tuple(map(_add, self.grads.carry, g.carry)))

    def _set_grads(self, t: int, grads: State) -> None:
        if t == 0:  # psi0 and the carry entries that do not require grad get none
            needs = self.input_needs_grad
            grads = State(grads.psi if needs[0] else None,
                          tuple(g if n else None for g, n in zip(grads.carry, needs[1:])))
        self.grads = grads

    def _recomputed(self, t: int, state: State):
        self.rerun.buffers.load(t)
        # Inputs requiring grad at every step, step 0 too (its gradients are dropped where psi0 or
        # the carry needs none): the step then sees what the forward's saw (escapes.py).
        inputs = state.as_inputs(True)
        marker = next_sequence_nr()
        outputs = self.rerun.with_grad(t, inputs)
        self._find_leaves(outputs.tensors(), inputs, marker, t)
        return outputs, graph_vjp(inputs, outputs, self.sink)

    def _find_leaves(self, outputs, inputs: State, marker: int, t: int) -> None:
        """Refuse a leaf this step's graph reaches that no forward step read (the forward's watch,
        watch.py, gave the Function every leaf they read): the step is not the function it was."""
        known = {id(p) for p in self.sink.params}
        found = leaves_reached([x for x in outputs if x is not None and x.grad_fn is not None],
                               {id(x) for x in inputs.tensors()} | known, marker)
        if found:
            raise RuntimeError(f"rollout(checkpoint={self.policy.checkpoint!r}): the recompute of step {t} reached a tensor "
                               f"requiring grad (shape {tuple(found[0].shape)}) that no step of the forward read: "
                               "step_fn must compute the same function of (psi, carry) each time it runs, and a leaf "
                               "it makes itself (x = psi.detach().requires_grad_()) is read only by checkpoint='none'")

    def _replayed(self, t: int, state: State, upcoming: Optional[State]):
        """Step t on the capture's graphs: its forward replayed (or run ahead), the noise after it
        eager; step t-1's forward run ahead on upcoming where the capture can."""
        rerun = self.rerun
        unit = rerun.unit
        rerun.buffers.load(t)
        out, out_carry = unit.capture.output_for_backward(t, *state)
        # Buffers are loaded before each step's recompute on this stream: such steps are not run ahead.
        if upcoming is not None and not rerun.buffers.tensors and unit.capture.takes(upcoming.carry):
            unit.capture.run_ahead(t - 1, *upcoming)
        noisy = out
        if unit.noise is not None:
            out = out.requires_grad_(True)
            with torch.enable_grad(), rerun.autocast(), rerun.rng.replay(t), step_recomputed():
                noisy = unit.add_noise(out, t)

        def vjp(grads: State) -> State:
            grad_out = grads.psi
            if noisy is not out and grad_out is not None:
                grad_out = torch.autograd.grad(noisy, out, grad_out, allow_unused=True)[0] if noisy.requires_grad \
                    else None
            if grad_out is None and all(g is None for g in grads.carry):
                return State(None, (None,) * len(grads.carry))
            return State(*unit.capture.backward(grad_out, grads.carry))

        return State(noisy, out_carry), vjp

    def grads_of_inputs(self):
        """After the last step reversed: the gradients of psi0 and each carry entry (None where
        it does not require grad)."""
        return self.grads.tensors()

    def verify(self) -> None:
        """Raise RecomputeMismatchError when a checked recompute differed from the forward."""
        if self.check is not None:
            self.check.verify()
