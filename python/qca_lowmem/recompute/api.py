"""`rollout()`: an episode that recomputes instead of storing, memory flat in the number of steps.

`rollout(step_fn, psi0, steps)` runs `psi <- noise(step_fn(psi), t)` for t = 0 .. steps-1 like the
stock trainer's episode. The arguments are checked here; schedule.choose picks the policy's
schedule, running the episode's first steps with grad as it needs them (probe.py). Plain autograd
runs the stock loop here; any other schedule runs as one autograd Function (episode.py) that stands
for the whole episode: its backward is the reverse pass (reverse.py).
"""

import contextlib
import numbers
from typing import Callable, List, Optional, Sequence, Union

import torch

from .. import _torch_private as torch_private
from .compiled import compiled_in_step
from .episode import Episode, EpisodeFunction, StepUnit
from .intermediates import keep_block_intermediates
from .policy import NONE, STEP, Policy
from .probe import EpisodeStart
from .replay import RngStates
from .schedule import PlainAutograd, choose
from .state import State, checked_carry


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

    Under torch.no_grad() (or when nothing requires grad) no state is kept at all. Under a mode or
    saved-tensors hook of the caller's that may change values (a perturbation, a compression;
    torch's own, such as save_on_cpu, are kept) a checkpoint other than "none" refuses: the
    episode runs and saves other ops than plain autograd, so its result would differ. Inside a
    torch.func transform (vmap, grad, ...) it refuses, whatever the checkpoint.
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
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:  # NumPy's ints too
        raise ValueError(f"rollout: steps must be an int >= 1, got {steps!r}")
    steps = int(steps)
    if isinstance(checkpoint, Policy):
        if slots is not None or budget is not None:
            raise ValueError(f"rollout: checkpoint is a Policy ({checkpoint.describe()}), which holds its own slots and "
                             f"budget; got slots={slots!r}, budget={budget!r} as well")
        policy = checkpoint
    else:
        policy = Policy.of(checkpoint, slots, budget)
    policy.check_device(psi0.device)
    compiled = None
    if policy.checkpoint != NONE and torch.is_grad_enabled():
        compiled = compiled_in_step(step_fn) or (compiled_in_step(noise, "noise") if noise is not None else None)
    if compiled is not None:
        raise RuntimeError(
            f"rollout(checkpoint={policy.checkpoint!r}): {compiled}, which this episode would run uncompiled: it runs "
            "its steps under hooks of its own that torch.compile does not trace, so they would round and draw random "
            "numbers otherwise than plain autograd's compiled graph (and torch.compile would run that code eagerly "
            "from then on). Pass it uncompiled (qca_lowmem.StepGraph(step) replays a step as CUDA graphs), or use "
            "checkpoint='none'")
    if record_every is None:
        record_every = max(1, steps // 10)
    elif isinstance(record_every, bool) or not isinstance(record_every, int) or record_every < 1:
        raise ValueError(f"rollout: record_every must be an int >= 1 or None, got {record_every!r}")
    if noise is not None and not callable(noise):
        raise TypeError(f"rollout: noise must be callable as noise(psi, t) (e.g. a NoiseSchedule), got {type(noise).__name__}")
    if not isinstance(check_recompute, bool):
        raise TypeError(f"rollout: check_recompute must be True or False, got {check_recompute!r}")
    if torch_private.functorch_transforms_active():
        raise RuntimeError(
            "rollout: called inside a torch.func transform (vmap, grad, jvp, jacrev, ...), under which its episode "
            "(a probe of its first steps, an autograd Function, recomputes in backward) cannot run: inside the "
            "transform, loop the step yourself (`for t in range(steps): psi = step_fn(psi)`), or take the "
            "episode's gradients with loss.backward() or torch.autograd.grad")
    if torch_private.forward_ad_active():
        raise RuntimeError(
            "rollout: called inside a forward-mode AD level (torch.autograd.forward_ad.dual_level), whose "
            "tangents its episode (an autograd Function, recomputes in backward) cannot carry: inside the level, "
            "loop the step yourself (`for t in range(steps): psi = step_fn(psi)`)")
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
    start = EpisodeStart(unit, state0, steps, RngStates(state0.psi.device, preserve_rng_state))
    schedule = choose(policy, start, check_recompute)
    if isinstance(schedule, PlainAutograd):
        return _run_plain(unit, state0, schedule, steps, recorded)
    plan = Episode(policy, schedule, start, recorded, check_recompute)
    plan.run(state0)
    result = EpisodeFunction.apply(plan, state0.psi, *state0.carry, *plan.params)
    return plan.layout.results(result)


def _run_plain(unit: StepUnit, state0: State, schedule: PlainAutograd, steps: int, recorded: List[int]):
    """The stock loop, on from the steps the schedule has run, under the current grad mode:
    (psi_T, history, carry_T); history[-1] is psi_T. Nothing is recomputed, so nothing is watched."""
    unit.refuse_in_place = unit.refuse_input_hooks = None
    done = schedule.done
    history = [state.psi for t, state in enumerate(done) if t in recorded and t != steps - 1]
    state = done[-1] if done else state0
    recorded = set(recorded)
    with keep_block_intermediates() if schedule.keep_intermediates else contextlib.nullcontext():
        for t in range(len(done), steps):
            state = unit(state, t)
            if t in recorded and t != steps - 1:
                history.append(state.psi)
    history.append(state.psi)
    return state.psi, history, state.carry
