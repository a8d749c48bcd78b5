"""`rollout()`: an episode that recomputes instead of storing, memory flat in the number of steps.

`rollout(step_fn, psi0, steps)` runs `psi <- noise(step_fn(psi), t)` for t = 0 .. steps-1 like the
stock trainer's episode. The arguments are checked here, the policy (policy.py) picks a schedule
(schedule.py), and one autograd Function (episode.py) stands for the whole episode: its
backward is the reverse pass (reverse.py). With checkpoint="none", or without grad, the steps
run as the stock loop does.
"""

from typing import Callable, List, Optional, Sequence, Union

import torch

from .buffers import StepBuffers
from .episode import Episode, EpisodeFunction, StepUnit
from .escapes import Leftovers, StepFrame
from .intermediates import keep_block_intermediates
from .leaves import leaves_reached, next_sequence_nr
from .policy import STEP, Policy
from .replay import AutocastState, RngStates
from .schedule import holds_every_graph, schedule_for
from .state import State, checked_carry
from .step_graph import StepGraph


def rollout(
    step_fn: Callable,
    psi0: torch.Tensor,
    steps: int,
    *,
    checkpoint: Union[str, Policy] = STEP,
    slots: Optional[int] = None,
    budget=None,
    noise: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
    record_every: Optional[int] = None,
    preserve_rng_state: bool = True,
    carry: Optional[Sequence[Optional[torch.Tensor]]] = None,
    check_recompute: bool = True,
):
    """Run an episode of `steps` steps from `psi0`; returns `(psi_T, history)`, and with `carry`
    `(psi_T, history, carry_T)`.

    step_fn(psi) -> psi: one step of the engine (the stock `motor.evolve_step` takes psi only);
      it must return a tensor of psi's shape, dtype and device. Parameters it reaches through its
      closure get their gradients. The backward runs it again, so it must compute the same
      function again: random draws are replayed (see preserve_rng_state), other state is not.
      A recomputing checkpoint refuses a step_fn that changes psi or the carry in place (it keeps
      them to recompute from); tensors it writes that outlive it (BatchNorm's statistics) are
      found at every step and end as plain autograd leaves them. A tensor step_fn hands out other
      than through psi or the carry (an activity penalty a hook appends to a list) comes from a
      forward that keeps no graph: a backward reaching the step through it raises
      EscapedTensorError naming the step; sum such terms in the carry, or use checkpoint="none".
      A `qca_lowmem.StepGraph(step_fn)` runs, for psi on a GPU, each step that is not kept as a
      full graph as replays of captured CUDA graphs (same kernels, no launch overhead).
    noise(psi, t) -> psi: applied after step t, e.g. a `qca_lowmem.NoiseSchedule`, whose random
      numbers are keyed by (seed, t) and replay by construction, with no generator state.
    checkpoint: "none" (plain autograd, the stock behaviour: memory grows with steps), "step"
      (keeps each step's input psi, recomputes each step once in backward) or "revolve"
      (binomial checkpointing: keeps at most `slots` states, psi0 included, whatever `steps`;
      recomputes more, following the optimal Griewank-Walther schedule), or "auto" (keeps the
      full graph of as many of the last steps as `budget` bytes of saved tensors allow and
      recomputes the others as "step"; revolve when not even one state per step fits).
    budget: with checkpoint="auto", the bytes the episode may keep for backward: an int, a size
      such as "2GiB", or "free" (psi on CUDA: the device's free memory after plan's 10% margin
      and one step's working set).
    record_every: history holds psi after steps t == 0, t == steps-1 and t % record_every == 0
      (default max(1, steps // 10), as the stock trainer); history[-1] is psi_T. Its entries are
      differentiable: a loss may use any of them.
    preserve_rng_state: as torch.utils.checkpoint's, and wider: the states of torch's CPU
      generator (and psi's CUDA device's), NumPy's and Python's global generators before each
      step are kept (on the host) and restored around the step's recomputes, so steps or noise
      drawing from them (dropout, the users' noise injector and its numpy coin) replay the same
      numbers; the global generators are left as the forward left them, as plain autograd leaves
      them. Not needed with a NoiseSchedule and deterministic steps.

    carry: state the step keeps besides psi, as a tuple of tensors (None entries allowed, e.g. a
      memory not made yet): step_fn is then called as step_fn(psi, carry) -> (psi, carry) with a
      tuple of the same length. Each kept step keeps its carry with its psi, and a recompute gets
      the carry the forward step got. Carried tensors that require grad get gradients through
      the carry (carry_T may enter the loss, carry entries that require grad get theirs); a step
      that detaches them (a memory outside the graph, as the users' engine) gets none, as stock.
      A StepGraph captures the carried step too, for the carry of step 1 on (a first step whose
      memory is None runs eagerly).
    check_recompute: compare each recomputed step's output with the state the episode already
      holds (every step with "step", the last and each step after a state the schedule holds
      with "revolve"), and raise `qca_lowmem.RecomputeMismatchError` naming the step and the
      difference when it exceeds sqrt(eps) of the dtype, relative to the state's largest
      value: a step that is not a function of (psi, carry) alone would give wrong gradients.
      The differences stay on the device and are read once at the end of the backward. With
      "revolve" the check holds one state (psi and carry) more while reversing. False skips it.

    Under torch.no_grad() (or when nothing requires grad) no state is kept at all.
    """
    if not callable(step_fn):
        raise TypeError(f"rollout: step_fn must be callable, got {type(step_fn).__name__}")
    if not isinstance(psi0, torch.Tensor):
        raise TypeError(f"rollout: psi0 must be a tensor, got {type(psi0).__name__}")
    if psi0.device.type == "meta":
        raise ValueError(f"rollout: psi0 is on the meta device (shape {tuple(psi0.shape)}, no data): "
                         "give a state on the CPU or a GPU")
    if not (psi0.is_complex() or psi0.is_floating_point()):
        raise TypeError(f"rollout: psi0 must be a complex or floating tensor, got dtype={psi0.dtype} shape={tuple(psi0.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"rollout: steps must be an int >= 1, got {steps!r}")
    if isinstance(checkpoint, Policy):
        if slots is not None or budget is not None:
            raise ValueError(f"rollout: checkpoint is a Policy ({checkpoint.describe()}), which holds its own slots and "
                             f"budget; got slots={slots!r}, budget={budget!r} as well")
        policy = checkpoint
    else:
        policy = Policy.of(checkpoint, slots, budget)
    policy.check_device(psi0.device)
    if record_every is None:
        record_every = max(1, steps // 10)
    elif isinstance(record_every, bool) or not isinstance(record_every, int) or record_every < 1:
        raise ValueError(f"rollout: record_every must be an int >= 1 or None, got {record_every!r}")
    if noise is not None and not callable(noise):
        raise TypeError(f"rollout: noise must be callable as noise(psi, t) (e.g. a NoiseSchedule), got {type(noise).__name__}")
    if not isinstance(check_recompute, bool):
        raise TypeError(f"rollout: check_recompute must be True or False, got {check_recompute!r}")
    carried = carry is not None
    state0 = State(psi0, checked_carry(carry, "carry") if carried else ())
    unit = StepUnit(step_fn, noise, carried)
    psi_T, history, carry_T = _episode(unit, state0, steps, policy, history_steps(steps, record_every),
                                       preserve_rng_state, check_recompute)
    return (psi_T, history, carry_T) if carried else (psi_T, history)


def history_steps(steps: int, record_every: int) -> List[int]:
    """The steps whose output the history holds: 0, the last, and every `record_every`-th."""
    return [t for t in range(steps) if t == 0 or t == steps - 1 or t % record_every == 0]


def _episode(unit: StepUnit, state0: State, steps: int, policy: Policy, recorded: List[int],
             preserve_rng_state: bool, check_recompute: bool):
    """(psi_T, history, carry_T) of the episode under `policy`."""
    if not policy.recomputes or not torch.is_grad_enabled():
        return _run_plain(unit, state0, 0, steps, recorded, [])
    rng = RngStates(state0.psi.device, preserve_rng_state)
    unit.refuse_in_place = policy.checkpoint
    # A budget may hold every step's graph, the probed steps' too: they keep theirs until that is
    # known. Their inputs are copies of the state, so only a state that needs no gradient allows it.
    may_run_plain = policy.budget is not None and not isinstance(unit.step_fn, StepGraph) \
        and not any(state0.needs_grad())
    probed, params, step_bytes, buffers, graphs, leftovers = _probe(unit, state0, steps, rng,
                                                                    measure=policy.budget is not None,
                                                                    keep_graphs=may_run_plain)
    if not params and not any(state0.needs_grad()):
        # Nothing to differentiate so far: the rest runs as plain autograd, which keeps no graph
        # unless a later step reaches a parameter.
        unit.refuse_in_place = None
        return _run_plain(unit, probed[-1], len(probed), steps, recorded, _history_of(probed, recorded, steps))
    if graphs is not None and len(graphs) == 1 and holds_every_graph(policy, steps, step_bytes, state0.psi.device):
        # Plain autograd on from step 0's graph: nothing to recompute, so nothing to watch. (Probed
        # steps after the first start from a copy of the state: their graphs are not one chain.)
        unit.refuse_in_place = None
        with keep_block_intermediates():
            return _run_plain(unit, graphs[0], 1, steps, recorded, _history_of(graphs, recorded, steps))
    del graphs
    # What the probed steps made and handed out besides their state (escapes.py): the other steps then run with grad too.
    grad_forward = leftovers.any(unit.weight_casts.copies())
    del leftovers
    autocast = AutocastState(sorted({"cpu", state0.psi.device.type}))
    if isinstance(unit.step_fn, StepGraph):
        with buffers.unchanged():
            unit.capture = unit.step_fn.for_rollout(probed[-1], unit.step, params, autocast)
    # After the capture: a budget of "free" then sees the memory its graphs' pool took.
    schedule = schedule_for(policy, steps, step_bytes, probed[-1].nbytes(), state0.psi.device, check_recompute,
                            probed=len(probed))
    plan = Episode(unit, schedule, rng, recorded, policy.checkpoint, probed, params, state0, check_recompute,
                   buffers, autocast, grad_forward)
    plan.run(state0)
    result = EpisodeFunction.apply(plan, state0.psi, *state0.carry, *plan.params)
    n_history = len(plan.history_steps)
    psi_T, history = result[0], list(result[1:1 + n_history])
    history.append(psi_T)
    carry_T = iter(result[1 + n_history:])
    return psi_T, history, tuple(next(carry_T) if present else None for present in plan.carry_T_present)


def _probe(unit: StepUnit, state0: State, steps: int, rng: RngStates, measure: bool, keep_graphs: bool = False):
    """The episode's first steps run with grad enabled: their graphs tell which leaves
    (parameters) the episode depends on, and, with `measure`, what one step's full graph keeps
    (blocks keeping their intermediates), each storage counted once. Nothing they would save for
    backward is kept. Step 0 alone, or, while its carry is not made yet (None entries: a first
    step that skips what later ones run), up to the first step with the whole carry. They also
    find the tensors a step writes that outlive it (buffers.py).
    Returns (their output states, the leaves, bytes of the largest full graph with its output,
    the written tensors as StepBuffers, with `keep_graphs` their output states with their
    graphs, else None, and the tensors they made as Leftovers)."""
    probed, params, step_bytes, writes, leftovers = [], [], 0, [], Leftovers()
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
                                                    {id(x) for x in inputs.tensors()}, marker)
                   if id(leaf) not in found]
        state = outputs.detached()
        probed.append(state)
        if keep_graphs:
            graphs.append(outputs)
        step_bytes = max(step_bytes, sum(saved) + state.nbytes())
        if all(c is not None for c in inputs.carry):
            break
    return probed, params, step_bytes, StepBuffers.of_probes(writes), graphs, leftovers


def _history_of(states: List[State], recorded: List[int], steps: int) -> list:
    """The history entries of the first steps' output states (the last step's is psi_T, added at the end)."""
    return [state.psi for t, state in enumerate(states) if t in recorded and t != steps - 1]


def _run_plain(unit: StepUnit, state: State, start: int, steps: int, recorded: List[int], history: list):
    """The stock loop from step `start` (history holds the records before it) under the current
    grad mode: (psi_T, history, carry_T); history[-1] is psi_T."""
    recorded = set(recorded)
    for t in range(start, steps):
        state = unit(state, t)
        if t in recorded and t != steps - 1:
            history.append(state.psi)
    history.append(state.psi)
    return state.psi, history, state.carry
