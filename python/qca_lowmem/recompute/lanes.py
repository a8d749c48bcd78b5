"""A lane of a StepGraph's capture (step_graph.py): one copy of the step's two graphs and the static
tensors they read and write, warmed up, checked and captured on its own stream and pool."""

from typing import Callable, List, Optional, Sequence

import torch

from .buffers import StepBuffers, storage_key
from .cuda_graphs import CaptureFailed, capture_errors_explained, random_draws_refused
from .leaves import leaves_reached, next_sequence_nr
from .param_grads import Accumulators, deposited_into
from .state import State, check_like_psi, differentiable

WARMUP_STEPS = 3  # eager runs on a side stream before capture: lazy inits, cuDNN/cuBLAS handles


def _requires_grad(tensor) -> bool:
    return tensor is not None and tensor.requires_grad


class Lane:
    """psi and the carry in, the step's psi and carry out; in the backward, the gradients flowing
    into those outputs and the gradients w.r.t. psi and the carry in. Each lane has its own
    graphs, memory pool and stream (a cuBLAS workspace is kept per stream), so two lanes' graphs
    may run at once."""

    def __init__(self, state: State, graphs):
        self.graphs = graphs
        self.static_in = state.psi.detach().clone().requires_grad_(True)
        self.static_carry_in = tuple(
            None if c is None else c.detach().clone().requires_grad_(differentiable(c)) for c in state.carry)

    def inputs(self) -> List[torch.Tensor]:
        return [self.static_in, *(c for c in self.static_carry_in if _requires_grad(c))]

    def warm_up(self, forward, params, known_writes: Optional[Sequence[torch.Tensor]] = None,
                settings: Optional[Callable[[], object]] = None) -> None:
        """Eager runs of the step on the lane's stream before capturing: lazy initialisations, the
        stream's cuDNN and cuBLAS workspaces. With `known_writes` the first run is watched: see
        `_refuse_unseen`."""
        with self.graphs.warming_up(), random_draws_refused(self.static_in.device):
            for run in range(WARMUP_STEPS):
                if run == 0 and known_writes is not None:
                    out, carry_out = self._refuse_unseen(forward, params, known_writes, settings)
                else:
                    out, carry_out = forward(self)
                check_like_psi(out, self.static_in, "step_fn", None)
                if not out.requires_grad:
                    raise ValueError("StepGraph: step_fn's output does not require grad: nothing to capture a "
                                     "backward for")
                outputs = [out, *(c for c in carry_out if _requires_grad(c))]
                torch.autograd.grad(outputs, self.inputs() + params, [torch.zeros_like(o) for o in outputs],
                                    allow_unused=True)
                del out, carry_out, outputs

    def _refuse_unseen(self, forward, params, known_writes, settings):
        """The step run once, watched. A replay would compute no gradient for a leaf outside
        `params` (the leaves the episode's first steps reached), and the episode would not keep,
        load or put back a tensor written outside `known_writes` (the tensors they wrote): where the
        step, from the state captured, does either, its writes are undone and the capture refused
        (the episode then runs this configuration eagerly, which finds both). So is a step whose
        call changes what `settings()` returns (the plain values its objects hold: a counter kept
        on a module), which a replay, running no Python, would not change."""
        before = None if settings is None else settings()
        finder = StepBuffers.finder()
        marker = next_sequence_nr()
        with finder:
            out, carry_out = forward(self)
        if settings is not None and settings() != before:
            raise CaptureFailed("StepGraph: a call of step_fn changed a value its objects hold (a counter kept on a "
                                "module), which a replay, running no Python, would not; rolling this configuration "
                                "out eagerly.")
        known = {storage_key(x) for x in known_writes}
        unseen_writes = [(x, before) for x, before in finder.written() if storage_key(x) not in known]
        with torch.no_grad():
            for tensor, before in unseen_writes:
                tensor.copy_(before)
        leaves = leaves_reached([x for x in (out, *carry_out) if _requires_grad(x)],
                                {id(x) for x in self.inputs() + list(params)}, marker)
        if unseen_writes or leaves:
            what = (f"writes a tensor (a storage of {unseen_writes[0][0].numel()} bytes)" if unseen_writes else
                    f"reaches a tensor requiring grad (shape {tuple(leaves[0].shape)})")
            raise CaptureFailed(f"StepGraph: from the state it is captured at, step_fn {what} that the episode's "
                                "first steps did not, which a replay would not account for; rolling this "
                                "configuration out eagerly.")
        return out, carry_out

    def capture(self, forward, capture) -> None:
        """Both graphs recorded; the parameters' gradients added to `capture`'s accumulators."""
        graphs = self.graphs
        with capture_errors_explained():
            static_outputs, self.replay_forward = graphs.capture(lambda: forward(self))
            out, carry_out = static_outputs
            self.static_grad_out = torch.zeros_like(out)
            self.static_grad_carry_out = tuple(torch.zeros_like(c) if _requires_grad(c) else None
                                               for c in carry_out)
            (self.static_grad_in, self.static_grad_carry_in), self.replay_backward = graphs.capture(
                lambda: self._backward(graphs.live(static_outputs), capture))
        # Kept with their autograd graph, the outputs would keep the parameters' AccumulateGrad
        # nodes made on the capture's side stream, and every later backward on the caller's stream
        # that reaches a parameter would sync with it (torch warns so). The replays need only the
        # memory; the nodes are made anew on the stream that accumulates.
        self.static_out = out.detach()
        self.static_carry_out = tuple(None if c is None else c.detach() for c in carry_out)

    def _backward(self, outputs, capture):
        """The body of the backward graph: gradients w.r.t. psi and the carry in returned, the
        parameters' added to the capture's accumulators."""
        out, carry_out = outputs
        differentiated = [(out, self.static_grad_out)] + [
            (c, g) for c, g in zip(carry_out, self.static_grad_carry_out) if g is not None]
        inputs = self.inputs()
        params = capture.params
        # A half-precision weight copy's gradient is taken as it is (deposit()), and added to its
        # fp32 accumulator with the other parameters' gradients in one accumulate_ at the end:
        # one launch a step, with no cast before it.
        with deposited_into(Accumulators(params, capture.accumulators), params) as deposits:
            grads = torch.autograd.grad([o for o, _ in differentiated], inputs + params,
                                        [g for _, g in differentiated], allow_unused=True)
        by_input = iter(grads[1:len(inputs)])
        grad_carry_in = tuple(next(by_input) if _requires_grad(c) else None for c in self.static_carry_in)
        for i, g in enumerate(grads[len(inputs):]):
            if g is not None:
                deposits.add(i, g)
        deposits.flush()
        capture.reached = deposits.reached
        return grads[0], grad_carry_in

    def load(self, psi: torch.Tensor, carry: tuple) -> None:
        """psi and the carry into the static inputs, then the forward replayed."""
        with torch.no_grad():
            self.static_in.copy_(psi)
            for static, c in zip(self.static_carry_in, carry):
                if static is not None:
                    static.copy_(c)
        self.replay_forward()

