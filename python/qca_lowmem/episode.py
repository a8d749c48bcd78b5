"""Episode rollout that recomputes instead of storing: memory flat in the number of steps.

`rollout(step_fn, psi0, steps)` runs `psi <- noise(step_fn(psi), t)` for t = 0 .. steps-1 like the
stock trainer's episode. With checkpoint="step" or "revolve" the forward builds no graph; one
custom autograd Function stands for the whole episode and its backward re-runs one step at a time
with grad enabled (same autocast state, same noise) and backpropagates through it.

Parameters are found, not listed: the first step runs with grad enabled and its graph is walked
to the leaf tensors it reaches (the parameters of step_fn's closure). They become inputs of the
episode's Function, so autograd accumulates each one's gradient once per backward (DDP's hooks
fire once) and `torch.autograd.grad(loss, params)` works too. Inside the backward, a parameter's
per-step gradient goes into a private buffer through a temporary hook that stands in for the
parameter's own hooks, which therefore also run once, at the end.

State besides psi (a ConvLSTM's h and c) travels as a `carry` tuple: kept with psi at each kept
step and handed back to the step when it is recomputed. The reverse pass and its check that each
recompute reproduces the forward are in episode_reverse.py.
"""

from typing import Callable, List, Optional, Sequence

import torch

from .ops._double_backward import second_order_requested
from .episode_reverse import StepReverser, differentiable
from .step_graph import StepGraph
from . import revolve
from .param_grads import ParamGradSink
from .replay import AutocastState, RngStates
from . import weight_casts
from .auto_checkpoint import check_budget, rollout_with_budget

CHECKPOINT_MODES = ("none", "step", "revolve", "auto")


def check_checkpoint(checkpoint, slots, caller: str = "rollout", budget=None) -> None:
    """Raise ValueError, prefixed by `caller`, unless (checkpoint, slots, budget) is a policy
    rollout takes."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"{caller}: checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    check_budget(checkpoint, budget, caller)
    if checkpoint == "revolve":
        if slots is None:
            raise ValueError(f"{caller}: checkpoint='revolve' needs slots >= 1 (the number of states to keep)")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"{caller}: slots must be an int >= 1 (states kept, psi0 included), got {slots!r}")
    elif slots is not None:
        raise ValueError(f"{caller}: slots applies only to checkpoint='revolve', got slots={slots!r} with checkpoint={checkpoint!r}")


def rollout(
    step_fn: Callable,
    psi0: torch.Tensor,
    steps: int,
    *,
    checkpoint: str = "step",
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
      A `qca_lowmem.StepGraph(step_fn)` runs, for psi on a GPU with checkpoint "step" or
      "revolve", each step as replays of captured CUDA graphs (same kernels, no launch overhead).
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
    preserve_rng_state: as torch.utils.checkpoint's: the CPU generator's state (and that of
      psi's CUDA device) before each step is kept (on the host) and restored around the step's
      recomputes, so steps or noise drawing from torch's generators (dropout, the stock
      NoiseInjector) replay the same numbers; the global generators are left as the forward left
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
    check_checkpoint(checkpoint, slots, budget=budget)
    if record_every is None:
        record_every = max(1, steps // 10)
    elif isinstance(record_every, bool) or not isinstance(record_every, int) or record_every < 1:
        raise ValueError(f"rollout: record_every must be an int >= 1 or None, got {record_every!r}")
    if noise is not None and not callable(noise):
        raise TypeError(f"rollout: noise must be callable as noise(psi, t) (e.g. a NoiseSchedule), got {type(noise).__name__}")
    if not isinstance(check_recompute, bool):
        raise TypeError(f"rollout: check_recompute must be True or False, got {check_recompute!r}")
    carried = carry is not None
    carry0 = _checked_carry(carry, "carry", None) if carried else ()

    if checkpoint == "auto":
        return rollout_with_budget(rollout, step_fn, psi0, steps, budget, noise=noise, record_every=record_every,
                                   preserve_rng_state=preserve_rng_state, check_recompute=check_recompute,
                                   carry=carry0 if carried else None)
    unit = _StepUnit(step_fn, noise, carried)
    recorded = [t for t in range(steps) if t == 0 or t == steps - 1 or t % record_every == 0]
    if checkpoint == "none" or not torch.is_grad_enabled():
        return _returned(*_run_plain(unit, (psi0, carry0), 0, steps, recorded, []), carried)

    # Step 0 with grad enabled: its graph tells which leaves (parameters) the episode depends on.
    # Only the graph's shape is needed, so nothing it would save for backward is kept.
    marker = _next_sequence_nr()
    rng = RngStates(psi0.device, preserve_rng_state)
    rng.record()
    psi_in = psi0.detach().requires_grad_(True)
    carry_in = tuple(c.detach().requires_grad_(True) if differentiable(c) else c for c in carry0)
    with torch.autograd.graph.saved_tensors_hooks(_discard, _discard):
        psi1, carry1 = unit(psi_in, carry_in, 0)
    params = _leaves_reached([psi1, *carry1], {id(x) for x in (psi_in, *carry_in)}, marker)
    state1 = (psi1.detach(), tuple(c.detach() if c is not None else None for c in carry1))
    carry0_needs_grad = [c is not None and c.requires_grad for c in carry0]
    if not params and not psi0.requires_grad and not any(carry0_needs_grad):
        with torch.no_grad():
            return _returned(*_run_plain(unit, state1, 1, steps, recorded, [state1[0]] if steps > 1 else []), carried)

    plan = _Episode(unit, rng, steps, recorded, checkpoint, slots, state1, params, psi0.requires_grad,
                    carry0_needs_grad, check_recompute)
    if isinstance(step_fn, StepGraph):
        unit.capture = step_fn.for_rollout(state1[0], state1[1] if carried else None, params, plan.autocast)
    outputs = _EpisodeFunction.apply(plan, psi0, *carry0, *params)
    n_history = len(plan.history_steps)
    psi_T, history = outputs[0], list(outputs[1:1 + n_history])
    history.append(psi_T)
    carry_T = iter(outputs[1 + n_history:])
    return _returned(psi_T, history, tuple(next(carry_T) if present else None for present in plan.carry_T_present),
                     carried)


def _returned(psi_T, history, carry_T, carried):
    return (psi_T, history, carry_T) if carried else (psi_T, history)


def _checked_carry(carry, what: str, like) -> tuple:
    """carry as a tuple of tensors or None, of the length of `like` when given."""
    if not isinstance(carry, (tuple, list)) or not all(c is None or isinstance(c, torch.Tensor) for c in carry):
        got = type(carry).__name__ if not isinstance(carry, (tuple, list)) else [type(c).__name__ for c in carry]
        raise TypeError(f"rollout: {what} must be a tuple of tensors (None entries allowed), got {got}")
    if like is not None and len(carry) != len(like):
        raise ValueError(f"rollout: {what} must keep the carry's length {len(like)}, got {len(carry)} entries")
    return tuple(carry)


class _StepUnit:
    """One step of the episode: step_fn then noise, with the checks that keep psi's type;
    (psi, carry) -> (psi, carry), the carry () when the rollout has none.

    With a capture (a StepGraph's, see step_graph.py), steps taken without grad replay its
    forward graph; the backward asks the capture directly (StepReverser)."""

    def __init__(self, step_fn, noise, carried: bool):
        self.step_fn = step_fn
        self.noise = noise
        self.carried = carried
        self.capture = None
        # The episode's half-precision weights, cast once (or once per shared_weight_casts() scope).
        self.weight_casts = weight_casts.for_episode()

    def __call__(self, psi: torch.Tensor, carry: tuple, t: int):
        if self.capture is not None and not torch.is_grad_enabled() and self.capture.takes(carry):
            out, carry = self.capture.forward(psi, carry)
            return self.add_noise(out, t), carry
        if self.carried:
            with self.weight_casts.active():
                result = self.step_fn(psi, carry)
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise TypeError(f"rollout: with carry=..., step_fn(psi, carry) must return (psi, carry); at step {t} "
                                f"it returned {type(result).__name__}")
            out, carry = result[0], _checked_carry(result[1], f"the carry step_fn returned at step {t}", carry)
        else:
            with self.weight_casts.active():
                out = self.step_fn(psi)
        _check_state(out, psi, "step_fn", t)
        return self.add_noise(out, t), carry

    def add_noise(self, out: torch.Tensor, t: int) -> torch.Tensor:
        if self.noise is None:
            return out
        noisy = self.noise(out, t)
        _check_state(noisy, out, "noise", t)
        return noisy


def _check_state(out, psi, name, t):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"rollout: {name} must return a tensor like psi, at step {t} it returned {type(out).__name__}")
    if out.shape != psi.shape or out.dtype != psi.dtype or out.device != psi.device:
        raise ValueError(
            f"rollout: {name} must keep psi's shape, dtype and device; at step {t} it got psi "
            f"shape={tuple(psi.shape)} dtype={psi.dtype} device={psi.device} and returned "
            f"shape={tuple(out.shape)} dtype={out.dtype} device={out.device}"
        )


def _run_plain(unit, state, start, steps, recorded, history):
    """The stock loop from step `start` with state (psi, carry) (history holds the records
    before it) under the current grad mode: (psi_T, history, carry_T); history[-1] is psi_T."""
    recorded = set(recorded)
    psi, carry = state
    for t in range(start, steps):
        psi, carry = unit(psi, carry, t)
        if t in recorded and t != steps - 1:
            history.append(psi)
    history.append(psi)
    return psi, history, carry


def _discard(_):
    return None


def _next_sequence_nr() -> int:
    """Autograd nodes created from now on in this thread have a sequence number >= this."""
    with torch.enable_grad():
        node = torch.zeros((), requires_grad=True).view(()).grad_fn
    return node._sequence_nr() + 1


def _leaves_reached(outputs, inputs: set, marker: int) -> List[torch.Tensor]:
    """The leaf tensors requiring grad that the graphs of `outputs` reach, other than the
    tensors whose ids are in `inputs`."""
    leaves, seen_leaves, visited = [], set(), set()
    stack = [out.grad_fn for out in outputs if out is not None]
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the edge into a leaf
        if variable is not None:
            if id(variable) not in inputs and id(variable) not in seen_leaves:
                seen_leaves.add(id(variable))
                leaves.append(variable)
            continue
        if node._sequence_nr() < marker:
            raise RuntimeError(
                "rollout: step_fn uses a tensor that requires grad but was computed outside "
                f"step_fn (its autograd node {node.name()} predates the step). Only leaf tensors "
                "(parameters) can be reached through the closure, since the recompute runs after "
                "the rest of the graph may be freed: compute that tensor inside step_fn, or detach it."
            )
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class _Episode:
    """Everything the episode's Function needs besides tensors."""

    def __init__(self, unit, rng, steps, recorded, mode, slots, state1, params, psi0_needs_grad, carry0_needs_grad,
                 check_recompute):
        self.unit = unit
        self.rng = rng
        self.steps = steps
        self.history_steps = [t for t in recorded if t != steps - 1]
        self.mode = mode
        self.slots = slots
        self.state1 = state1
        # The parameters stay here, not in save_for_backward: saved-tensor hooks (save_on_cpu,
        # saved_bytes) would hand back copies, which the recomputed steps never use.
        self.params = params
        self.param_versions = [p._version for p in params]
        self.psi0_needs_grad = psi0_needs_grad
        self.carry0_needs_grad = carry0_needs_grad
        self.carry_width = len(carry0_needs_grad)
        self.carry_T_present: List[bool] = []  # which carry_T entries are outputs (not None)
        self.check_recompute = check_recompute
        self.autocast = AutocastState(sorted({"cpu", state1[0].device.type}))
        self.stored_steps: List[int] = []  # which states are saved, in saved order

    def advance(self, state, start, stop):
        """The state (psi, carry) at step `stop` from the one at step `start`, without a graph
        (as the forward ran)."""
        psi, carry = state
        with torch.no_grad(), self.autocast():
            for t in range(start, stop):
                with self.rng.replay(t):
                    psi, carry = self.unit(psi, carry, t)
        return psi, carry


class _EpisodeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Episode, psi0: torch.Tensor, *inputs: Optional[torch.Tensor]):
        steps = plan.steps
        carry0 = tuple(inputs[:plan.carry_width])
        if plan.mode == "step":
            keep = set(range(steps))
        else:
            keep = {0, *revolve.first_sweep(steps, plan.slots)}
        history_steps = set(plan.history_steps)
        stored, history = [(psi0, carry0)], []
        psi, carry = plan.state1
        plan.state1 = None
        for t in range(1, steps + 1):
            # (psi, carry) is the state after step t-1, the input of step t.
            if t - 1 in history_steps:
                history.append(psi)
            if t == steps:
                break
            if t in keep:
                stored.append((psi, carry))
            plan.rng.record()
            psi, carry = plan.unit(psi, carry, t)
        plan.stored_steps = sorted(keep)
        plan.carry_T_present = [c is not None for c in carry]
        outputs = [psi, *history, *(c for c in carry if c is not None)]
        # An output must not be an input or another output (an identity step would make it so).
        seen = {id(x) for x in (psi0, *carry0) if x is not None}
        for i, out in enumerate(outputs):
            if id(out) in seen:
                outputs[i] = out.clone()
            seen.add(id(outputs[i]))
        if plan.check_recompute:
            carry_out = iter(outputs[1 + len(history):])
            stored.append((outputs[0], tuple(next(carry_out) if c is not None else None for c in carry)))
        ctx.plan = plan
        ctx.save_for_backward(*(x for psi_t, carry_t in stored for x in (psi_t, *carry_t)))
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_psi_T, *grads):
        plan: _Episode = ctx.plan
        if second_order_requested():
            # Each step's graph lives only while its reverse step runs: no graph can span them.
            raise RuntimeError(f"rollout(checkpoint={plan.mode!r}): no second-order gradients (create_graph=True): "
                               "this mode keeps no graph across steps; use checkpoint='none' (plain autograd)")
        width = 1 + plan.carry_width
        saved = ctx.saved_tensors
        flat = [(saved[i], tuple(saved[i + 1:i + width])) for i in range(0, len(saved), width)]
        states = dict(zip(plan.stored_steps, flat))
        final_state = flat[-1] if plan.check_recompute else None
        params = plan.params
        for p, version in zip(params, plan.param_versions):
            if p._version != version:
                raise RuntimeError(
                    f"rollout: a parameter of shape {tuple(p.shape)} was modified by an inplace operation "
                    f"between the episode's forward and its backward (version {version} -> {p._version}), "
                    "e.g. an optimizer step; the recompute would not reproduce the forward"
                )
        n_history = len(plan.history_steps)
        no_carry_grads = [None] * plan.carry_width
        incoming = {t: (g, no_carry_grads) for t, g in zip(plan.history_steps, grads[:n_history]) if g is not None}
        carry_grads = iter(grads[n_history:])
        grad_carry_T = [next(carry_grads) if present else None for present in plan.carry_T_present]
        if grad_psi_T is not None or any(g is not None for g in grad_carry_T):
            incoming[plan.steps - 1] = (grad_psi_T, grad_carry_T)

        capture = plan.unit.capture
        if capture is not None:
            capture.zero_accumulators()
        sink = ParamGradSink(params)  # steps run eagerly (all, or a capture's first) add theirs here
        reverser = StepReverser(plan, incoming, params, final_state)
        with sink:
            if plan.mode == "step":
                for t in reversed(range(plan.steps)):
                    reverser.backprop(t, states[t])
            else:
                revolve.reverse(plan, states, reverser)
        del states, flat, final_state
        reverser.verify()
        if capture is not None:
            for i, grad in enumerate(capture.parameter_grads()):
                if grad is not None:
                    sink.add(i, grad)
        buffers = sink.take()
        grad_carry0 = [g if needs else None for g, needs in zip(reverser.grad_carry, plan.carry0_needs_grad)]
        return (None, reverser.grad if plan.psi0_needs_grad else None, *grad_carry0, *buffers)
