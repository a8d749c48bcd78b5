"""An episode before its schedule is chosen (schedule.choose asks for each part): its first steps
run with grad (the probe), what they find and measure, and what a recomputing forward then needs.

The probe runs step 0 alone, or, while the carry is not made yet (None entries: a first step that
skips what later ones run), up to the first step with the whole carry. Their graphs tell which
leaves (parameters) the episode depends on and, when the schedule asks, what one step's full
graph keeps (blocks keeping their intermediates), each storage counted once; nothing they would
save for backward is kept. They also find the tensors a step writes that outlive it (buffers.py)
and the tensors a step hands out besides its state (escapes.py).
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

from .buffers import StepBuffers
from .escapes import Leftovers, StepFrame
from .intermediates import keep_block_intermediates
from .leaves import leaves_reached, next_sequence_nr
from .replay import AutocastState, RngStates
from .state import State
from .step_graph import StepGraph


@dataclass
class Probe:
    """What the probed steps found."""

    states: List[State]  # their output states, detached
    params: List[torch.Tensor]  # the leaves they reach
    step_bytes: int  # the bytes of the largest full graph (measured, else none) with its output
    buffers: StepBuffers  # the tensors they write that outlive them
    graphs: Optional[List[State]]  # kept: their output states with their graphs; else None
    leftovers: Optional[Leftovers]  # the tensors they made, until the forward is prepared
    # a module's backward hook in their graphs: torch's module call wraps its tensors for those
    # only with grad on, and the wrapped ones may come out in another layout, rounding otherwise after
    backward_hooked: bool


class EpisodeStart:
    """The episode's step (an episode.StepUnit), input state, length and generators' states; the
    probe's findings (`probed`) once run, then, once the episode is known to recompute, whether the
    forward's steps run with grad, its autocast state and the step's capture."""

    def __init__(self, unit, state0: State, steps: int, rng: RngStates):
        self.unit = unit
        self.state0 = state0
        self.steps = steps
        self.rng = rng
        self.probed: Optional[Probe] = None
        self.grad_forward = False
        self.autocast: Optional[AutocastState] = None

    def probe(self, policy, measure: bool) -> Probe:
        """Run the first steps under `policy`, refusing a step that changes its input in place.
        With `measure` they count a step's full graph and, where the episode may turn out to be
        plain autograd from step 0's graph, keep it: their inputs are copies of the state, so only
        a state that needs no gradient, and a step that is not a `StepGraph`, allow that."""
        self.unit.refuse_in_place = self.unit.refuse_input_hooks = policy
        keep_graphs = measure and not isinstance(self.unit.step_fn, StepGraph) and not any(self.state0.needs_grad())
        self.probed = _probe(self.unit, self.state0, self.steps, self.rng, measure, keep_graphs)
        return self.probed

    def differentiates_nothing(self) -> bool:
        """Whether no probed step reached a parameter and the state needs no gradient."""
        return not self.probed.params and not any(self.state0.needs_grad())

    def prepare_forward(self) -> None:
        """For a recomputing forward: the probe's graphs dropped; whether what the probed steps
        made outlives them besides their state (escapes.py: the other steps then run with grad
        too); the autocast state; a `StepGraph`'s capture (before a budget of "free" is read, so
        that it sees the memory the capture's pool took)."""
        probed, unit = self.probed, self.unit
        probed.graphs = None
        self.grad_forward = probed.leftovers.any(unit.weight_casts.copies()) or probed.backward_hooked
        probed.leftovers = None
        self.autocast = AutocastState(sorted({"cpu", self.state0.psi.device.type}))
        if isinstance(unit.step_fn, StepGraph):
            with probed.buffers.unchanged():
                unit.capture = unit.step_fn.for_rollout(probed.states[-1], unit.step, probed.params, self.autocast,
                                                        probed.buffers.tensors)


def _probe(unit, state0: State, steps: int, rng: RngStates, measure: bool, keep_graphs: bool) -> Probe:
    probed, params, step_bytes, writes, leftovers, node_names = [], [], 0, [], Leftovers(), {}
    graphs = [] if keep_graphs else None
    state = state0
    for t in range(steps):
        marker = next_sequence_nr()
        rng.record()
        saved = []
        frame = StepFrame(unit.refuse_in_place, t, saved if measure else None, keep=keep_graphs)
        inputs = frame.inputs(state)
        finder = StepBuffers.finder()
        with keep_block_intermediates(measure), frame, finder:
            outputs = unit(inputs, t)
        writes.append(finder.written())
        leftovers.add(finder.made.values(), outputs, finder.before, frame.kept)
        found = {id(p) for p in params}
        params += [leaf for leaf in leaves_reached([x for x in outputs.tensors() if x is not None],
                                                    {id(x) for x in inputs.tensors()}, marker, node_names)
                   if id(leaf) not in found]
        _refuse_static_ddp(node_names, unit.refuse_in_place)
        state = outputs.detached()
        probed.append(state)
        if keep_graphs:
            graphs.append(outputs)
        step_bytes = max(step_bytes, sum(saved) + state.nbytes())
        if all(c is not None for c in inputs.carry):
            break
    return Probe(probed, params, step_bytes, StepBuffers.of_probes(writes), graphs, leftovers,
                 "BackwardHookFunctionBackward" in node_names)


def _refuse_static_ddp(node_names: dict, policy) -> None:
    """A DistributedDataParallel(static_graph=True) module in the step: its first backward, met
    inside the episode's recompute, queues the gradients' all-reduce there, and that backward ends
    before the episode hands the parameters theirs, so DDP takes them for unused and never reduces
    them (each rank kept its own gradients, silently)."""
    sink = node_names.get("_DDPSinkBackward")
    ddp = getattr(sink, "ddp_weakref", lambda: None)() if sink is not None else None
    if ddp is not None and getattr(ddp, "static_graph", False):
        raise RuntimeError(
            f"rollout(checkpoint={policy.checkpoint!r}): the step runs a DistributedDataParallel module with "
            "static_graph=True, whose all-reduce of the gradients the episode's recomputes would leave undone: "
            "use static_graph=False (find_unused_parameters=True works too), or checkpoint='none'")
