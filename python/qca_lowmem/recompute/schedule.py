"""Schedules: which states an episode keeps in its forward and in which order the reverse pass
visits its steps. Each policy that recomputes is one of them, over the same episode Function
(episode.py) and the same reverse pass (reverse.py):

- `EveryStep`: the input state of every step is kept and each step is recomputed once, last
  step first. With `full_graphs=k` (checkpoint="auto") the last k steps keep their whole graph
  instead (blocks keeping their intermediates) and are differentiated through it, nothing
  recomputed: the first steps the backward needs, and frees.
- `Revolve`: at most `slots` states (psi0 included), placed and re-advanced by the binomial
  schedule of revolve.py.

A schedule tells the forward `keeps_state(t)` / `keeps_graph(t)` for the input of step t, and
reverses by calling `reverser.backprop(t, state)` for t from the last step down with the state
the forward kept for t, re-advancing states with `reverser.advance(state, start, stop)` where it
keeps fewer, and `reverser.backprop_graph(kept)` for steps whose graph the forward kept.
"""

from typing import Optional

import torch

from . import revolve
from .memory import free_budget
from .policy import Policy


class Schedule:
    steps: int

    def keeps_state(self, t: int) -> bool:
        raise NotImplementedError

    def keeps_graph(self, t: int) -> bool:
        return False

    def recomputes(self, t: int) -> bool:
        """Whether step t is recomputed in backward (its recompute is then checked)."""
        return not self.keeps_graph(t)

    def reverse(self, kept: dict, reverser) -> None:
        raise NotImplementedError


class EveryStep(Schedule):
    def __init__(self, steps: int, full_graphs: int = 0):
        self.steps = steps
        self.graphs_from = steps - full_graphs

    def keeps_state(self, t: int) -> bool:
        return t < self.graphs_from

    def keeps_graph(self, t: int) -> bool:
        return t >= self.graphs_from

    def reverse(self, kept: dict, reverser) -> None:
        if self.graphs_from < self.steps:
            reverser.backprop_graph(kept.pop(self.graphs_from))
        for t in reversed(range(self.graphs_from)):
            reverser.backprop(t, kept.pop(t))  # popped: each state freed once reversed


class Revolve(Schedule):
    def __init__(self, steps: int, slots: int):
        self.steps = steps
        self.slots = slots
        self.kept = {0, *revolve.first_sweep(steps, slots)}

    def keeps_state(self, t: int) -> bool:
        return t in self.kept

    def reverse(self, kept: dict, reverser) -> None:
        revolve.reverse(self.steps, self.slots, kept, reverser)


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


def holds_every_graph(policy: Policy, steps: int, step_bytes: int, device: torch.device) -> bool:
    """Whether the policy's budget holds every step's full graph with its output: the episode is
    then plain autograd (blocks keeping their intermediates), nothing recomputed."""
    return policy.budget is not None and _budget_bytes(policy, device, step_bytes) >= steps * step_bytes


def schedule_for(policy: Policy, steps: int, step_bytes: int, state_bytes: int, device: torch.device,
                 keeps_final_state: bool, probed: int) -> Schedule:
    """The schedule of a recomputing policy (plain autograd has none). A budget is spent on
    states (`state_bytes` each) and full graphs (`step_bytes` each, with the output state), and
    the recompute check's last state comes out of it (`keeps_final_state`). The first `probed`
    steps, which ran before it was chosen, keep no graph: they are recomputed."""
    if policy.slots is not None:
        return Revolve(steps, policy.slots)
    if policy.budget is None:
        return EveryStep(steps)
    budget = _budget_bytes(policy, device, step_bytes)
    if keeps_final_state:
        budget = max(0, budget - state_bytes)
    full_graphs, slots = budget_split(steps, state_bytes, step_bytes, budget, most_graphs=steps - probed)
    if slots is not None:
        return Revolve(steps, slots)
    return EveryStep(steps, full_graphs)

