"""Schedules: how an episode runs under its policy, and the one place that picks it (`choose`).
One `Schedule` subclass per policy (its `mode`), plain autograd included:

- `PlainAutograd` (checkpoint="none"): the stock loop, autograd keeping every step's graph. Every
  policy runs as it without grad or when nothing needs a gradient, and "auto" when its budget
  holds every step's full graph.
- `EveryStep` ("step"): the input state of every step is kept and each step is recomputed once,
  last step first.
- `Revolve` ("revolve"): at most `slots` states (psi0 included), placed and re-advanced by the
  binomial schedule of revolve.py.
- `Auto` ("auto"): the last steps keep their whole graph (blocks keeping their intermediates) and
  are differentiated through it, nothing recomputed (the first steps the backward needs, and
  frees), the others as "step"; as many as the budget holds, or revolve below one state a step.

A recomputing schedule runs over the same episode Function (episode.py) and the same reverse pass
(reverse.py): it tells the forward `keeps_state(t)` / `keeps_graph(t)` for the input of step t,
and reverses by calling `reverser.backprop(t, state, upcoming)` for t from the last step down
with the state the forward kept for t (and for t-1 where it holds it), re-advancing states with
`reverser.advance(state, start, stop)` where it keeps fewer, and `reverser.backprop_graph(kept)`
for steps whose graph the forward kept.
Its class makes it for an episode (`for_episode`) from what the episode's first steps measured
(probe.py), asked for with `measures_step`.
"""

from typing import Dict, Optional, Sequence

import torch

from ..ops import foreign_context
from . import revolve
from .memory import free_budget
from .policy import AUTO, NONE, REVOLVE, STEP, Policy


class Schedule:
    """How an episode runs under the policy whose checkpoint name is `mode`: a subclass that names
    one is the schedule `choose` picks for that policy."""

    mode: str
    _by_mode: Dict[str, type] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "mode" in cls.__dict__:
            Schedule._by_mode[cls.mode] = cls


class PlainAutograd(Schedule):
    """The stock loop under the current grad mode, from the states of the steps already run (the
    probe's, `done`); with `keep_intermediates`, blocks keep theirs (the steps' full graphs)."""

    mode = NONE

    def __init__(self, done: Sequence = (), keep_intermediates: bool = False):
        self.done = list(done)
        self.keep_intermediates = keep_intermediates


class Recomputing(Schedule):
    """A schedule run by the episode Function: what the forward keeps, how the reverse visits the
    steps (the module's docstring), made for an episode by its class."""

    steps: int
    measures_step = False  # for_episode reads a step's full-graph bytes: the probe counts them

    @classmethod
    def for_episode(cls, policy: Policy, start, check_recompute: bool) -> "Recomputing":
        """The schedule of `policy` for the episode `start` (a probe.EpisodeStart, probed and
        prepared); `check_recompute`: the recompute check keeps the final state."""
        raise NotImplementedError

    @classmethod
    def holds_every_graph(cls, policy: Policy, start) -> bool:
        """Whether the policy keeps every step's full graph, the probe having kept step 0's: the
        episode is then plain autograd on from it, nothing recomputed."""
        return False

    def keeps_state(self, t: int) -> bool:
        raise NotImplementedError

    def keeps_graph(self, t: int) -> bool:
        return False

    def recomputes(self, t: int) -> bool:
        """Whether step t is recomputed in backward (its recompute is then checked)."""
        return not self.keeps_graph(t)

    def reverse(self, kept: dict, reverser) -> None:
        raise NotImplementedError


class EveryStep(Recomputing):
    mode = STEP

    def __init__(self, steps: int):
        self.steps = steps

    @classmethod
    def for_episode(cls, policy: Policy, start, check_recompute: bool) -> Recomputing:
        return cls(start.steps)

    def keeps_state(self, t: int) -> bool:
        return True

    def reverse(self, kept: dict, reverser) -> None:
        for t in reversed(range(self.steps)):
            reverser.backprop(t, kept.pop(t), kept.get(t - 1))  # popped: each state freed once reversed


class Revolve(Recomputing):
    mode = REVOLVE

    def __init__(self, steps: int, slots: int):
        self.steps = steps
        self.slots = slots
        self.kept = {0, *revolve.first_sweep(steps, slots)}

    @classmethod
    def for_episode(cls, policy: Policy, start, check_recompute: bool) -> Recomputing:
        return cls(start.steps, policy.slots)

    def keeps_state(self, t: int) -> bool:
        return t in self.kept

    def reverse(self, kept: dict, reverser) -> None:
        revolve.reverse(self.steps, self.slots, kept, reverser)


class Auto(Recomputing):
    """The full graphs of the last `full_graphs` steps, one state per step before them."""

    mode = AUTO
    measures_step = True

    def __init__(self, steps: int, full_graphs: int):
        self.steps = steps
        self.graphs_from = steps - full_graphs

    @classmethod
    def for_episode(cls, policy: Policy, start, check_recompute: bool) -> Recomputing:
        probed = start.probed
        return cls.for_bytes(start.steps, probed.step_bytes, probed.states[-1].nbytes(),
                             _budget_bytes(policy, start.state0.psi.device, probed.step_bytes),
                             keeps_final_state=check_recompute, probed=len(probed.states))

    @classmethod
    def for_bytes(cls, steps: int, step_bytes: int, state_bytes: int, budget: int, keeps_final_state: bool,
                  probed: int) -> Recomputing:
        """The schedule of a budget of `budget` bytes, spent on states (`state_bytes` each) and
        full graphs (`step_bytes` each, with the output state); the recompute check's last state
        comes out of it (`keeps_final_state`). The first `probed` steps, which ran before it was
        chosen, keep no graph: they are recomputed."""
        if keeps_final_state:
            budget = max(0, budget - state_bytes)
        full_graphs, slots = budget_split(steps, state_bytes, step_bytes, budget, most_graphs=steps - probed)
        return Revolve(steps, slots) if slots is not None else cls(steps, full_graphs)

    @classmethod
    def holds_every_graph(cls, policy: Policy, start) -> bool:
        # Probed steps after the first start from a copy of the state: their graphs are not one chain.
        probed = start.probed
        return probed.graphs is not None and len(probed.graphs) == 1 and \
            _budget_bytes(policy, start.state0.psi.device, probed.step_bytes) >= start.steps * probed.step_bytes

    def keeps_state(self, t: int) -> bool:
        return t < self.graphs_from

    def keeps_graph(self, t: int) -> bool:
        return t >= self.graphs_from

    def reverse(self, kept: dict, reverser) -> None:
        if self.graphs_from < self.steps:
            reverser.backprop_graph(kept.pop(self.graphs_from))
        for t in reversed(range(self.graphs_from)):
            reverser.backprop(t, kept.pop(t), kept.get(t - 1))


def choose(policy: Policy, start, check_recompute: bool) -> Schedule:
    """The schedule of an episode (a probe.EpisodeStart) under `policy`, running its probe and
    preparing its forward as the choice needs them. Plain autograd without grad, and when the
    probed steps reach no parameter and the state needs no gradient (the rest then keeps no graph
    unless a later step reaches a parameter)."""
    kind = Schedule._by_mode[policy.checkpoint]
    if kind is PlainAutograd or not torch.is_grad_enabled():
        return PlainAutograd()
    _refuse_foreign_context(policy)
    probed = start.probe(policy, kind.measures_step)
    if start.differentiates_nothing():
        return PlainAutograd(probed.states)
    if kind.holds_every_graph(policy, start):
        return PlainAutograd(probed.graphs, keep_intermediates=True)
    start.prepare_forward()
    return kind.for_episode(policy, start, check_recompute)


def _refuse_foreign_context(policy: Policy) -> None:
    """The episode runs other ops than plain autograd (its steps again in backward, under hooks of
    its own) and saves other tensors, so a mode or pack hook of the caller's that changes values
    would change the result."""
    what = foreign_context()
    if what is not None:
        raise RuntimeError(
            f"rollout(checkpoint={policy.checkpoint!r}): called under the {what}, which may change values (a "
            "perturbation, a cast, a compression): the episode runs its steps again in backward and saves other "
            "tensors than plain autograd, so its result would differ from plain autograd's under it. Run it "
            "outside it (the episode keeps about one state a step already) or with checkpoint='none'; torch's own "
            "modes and hooks (a default device, save_on_cpu, checkpoint) are kept. To measure what autograd keeps: "
            "qca_lowmem.saved_bytes or qca_lowmem.peak_saved_bytes")


def budget_split(steps: int, state_bytes: int, step_bytes: int, budget: int, most_graphs: Optional[int] = None):
    """(full_graphs, slots) for a budget of `budget` bytes: the full graphs of the last
    `full_graphs` steps (at most `most_graphs`) and one state per step before them; or, when one
    state per step does not fit, revolve with `slots` (full_graphs 0)."""
    most_graphs = steps if most_graphs is None else most_graphs
    if budget < steps * state_bytes:
        return 0, max(1, budget // state_bytes)
    if step_bytes <= state_bytes:
        return most_graphs, None
    return min(most_graphs, (budget - steps * state_bytes) // (step_bytes - state_bytes)), None


def _budget_bytes(policy: Policy, device: torch.device, step_bytes: int) -> int:
    return free_budget(device, step_bytes) if policy.reads_free_memory else policy.budget
