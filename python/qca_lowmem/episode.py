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
"""

import contextlib
from typing import Callable, List, Optional, Tuple

import torch

from .ops._double_backward import second_order_requested
from .recompute import keep_block_intermediates
from .step_graph import StepGraph
from . import revolve
from .param_grads import ParamGradSink
from .weight_casts import WeightCasts
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
    step_fn: Callable[[torch.Tensor], torch.Tensor],
    psi0: torch.Tensor,
    steps: int,
    *,
    checkpoint: str = "step",
    slots: Optional[int] = None,
    budget=None,
    noise: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
    record_every: Optional[int] = None,
    preserve_rng_state: bool = True,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Run an episode of `steps` steps from `psi0`; returns `(psi_T, history)`.

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

    Under torch.no_grad() (or when nothing requires grad) no state is kept at all.
    """
    if not callable(step_fn):
        raise TypeError(f"rollout: step_fn must be callable, got {type(step_fn).__name__}")
    if not isinstance(psi0, torch.Tensor):
        raise TypeError(f"rollout: psi0 must be a tensor, got {type(psi0).__name__}")
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

    if checkpoint == "auto":
        return rollout_with_budget(rollout, step_fn, psi0, steps, budget, noise=noise, record_every=record_every,
                                   preserve_rng_state=preserve_rng_state)
    unit = _StepUnit(step_fn, noise)
    recorded = [t for t in range(steps) if t == 0 or t == steps - 1 or t % record_every == 0]
    if checkpoint == "none" or not torch.is_grad_enabled():
        return _run_plain(unit, psi0, 0, steps, recorded, [])

    # Step 0 with grad enabled: its graph tells which leaves (parameters) the episode depends on.
    # Only the graph's shape is needed, so nothing it would save for backward is kept.
    marker = _next_sequence_nr()
    rng = _RngStates(psi0.device, preserve_rng_state)
    rng.record()
    psi_in = psi0.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(_discard, _discard):
        psi1 = unit(psi_in, 0)
    params = _leaves_reached(psi1, psi_in, marker)
    psi1 = psi1.detach()
    if not params and not psi0.requires_grad:
        with torch.no_grad():
            return _run_plain(unit, psi1, 1, steps, recorded, [psi1] if steps > 1 else [])

    plan = _Episode(unit, rng, steps, recorded, checkpoint, slots, psi1, params, psi0.requires_grad)
    if isinstance(step_fn, StepGraph):
        unit.capture = step_fn.for_rollout(psi1, params, plan.autocast)
    outputs = _EpisodeFunction.apply(plan, psi0, *params)
    psi_T, history = outputs[0], list(outputs[1:])
    history.append(psi_T)
    return psi_T, history


class _StepUnit:
    """One step of the episode: step_fn then noise, with the checks that keep psi's type.

    With a capture (a StepGraph's, see _step_graph.py), steps taken without grad replay its
    forward graph; the backward asks the capture directly (_GradCarry)."""

    def __init__(self, step_fn, noise):
        self.step_fn = step_fn
        self.noise = noise
        self.capture = None
        self.weight_casts = WeightCasts()  # the episode's half-precision weights, cast once

    def __call__(self, psi: torch.Tensor, t: int) -> torch.Tensor:
        if self.capture is not None and not torch.is_grad_enabled():
            out = self.capture.forward(psi)
        else:
            with self.weight_casts.active():
                out = self.step_fn(psi)
            _check_state(out, psi, "step_fn", t)
        return self.add_noise(out, t)

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


def _run_plain(unit, psi, start, steps, recorded, history):
    """The stock loop from step `start` (history holds the records before it) under the current
    grad mode; history[-1] is psi_T."""
    recorded = set(recorded)
    for t in range(start, steps):
        psi = unit(psi, t)
        if t in recorded and t != steps - 1:
            history.append(psi)
    history.append(psi)
    return psi, history


def _discard(_):
    return None


def _next_sequence_nr() -> int:
    """Autograd nodes created from now on in this thread have a sequence number >= this."""
    with torch.enable_grad():
        node = torch.zeros((), requires_grad=True).view(()).grad_fn
    return node._sequence_nr() + 1


def _leaves_reached(output: torch.Tensor, psi_in: torch.Tensor, marker: int) -> List[torch.Tensor]:
    """The leaf tensors requiring grad that `output`'s graph reaches, other than psi_in."""
    leaves, seen_leaves, visited = [], set(), set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the edge into a leaf
        if variable is not None:
            if variable is not psi_in and id(variable) not in seen_leaves:
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


class _AutocastState:
    """The autocast state of the forward, re-entered around each recompute."""

    def __init__(self, device_types):
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.states = [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in device_types]

    def __call__(self):
        return self._entered(self.cache_enabled)

    def without_cache(self):
        """The same state with autocast's cast cache off, as CUDA graph capture requires (the
        casts are the same, only not shared between calls)."""
        return self._entered(False)

    @contextlib.contextmanager
    def _entered(self, cache_enabled):
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.states:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled))
            yield


class _RngStates:
    """The generators' states before each step of the forward, replayed around recomputes."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda_device = device if device.type == "cuda" else None
        self.states = []

    def record(self) -> None:
        if self.enabled:
            cuda = torch.cuda.get_rng_state(self.cuda_device) if self.cuda_device is not None else None
            self.states.append((torch.get_rng_state(), cuda))

    @contextlib.contextmanager
    def replay(self, t: int):
        if not self.enabled:
            yield
            return
        cpu, cuda = self.states[t]
        with torch.random.fork_rng(devices=[self.cuda_device] if cuda is not None else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.cuda_device)
            yield


class _Episode:
    """Everything the episode's Function needs besides tensors."""

    def __init__(self, unit, rng, steps, recorded, mode, slots, psi1, params, psi0_needs_grad):
        self.unit = unit
        self.rng = rng
        self.steps = steps
        self.history_steps = [t for t in recorded if t != steps - 1]
        self.mode = mode
        self.slots = slots
        self.psi1 = psi1
        # The parameters stay here, not in save_for_backward: saved-tensor hooks (save_on_cpu,
        # saved_bytes) would hand back copies, which the recomputed steps never use.
        self.params = params
        self.param_versions = [p._version for p in params]
        self.psi0_needs_grad = psi0_needs_grad
        self.autocast = _AutocastState(sorted({"cpu", psi1.device.type}))
        self.stored_steps: List[int] = []  # which states are saved, in saved order

    def advance(self, psi, start, stop):
        """psi at step `stop` from psi at step `start`, without a graph (as the forward ran)."""
        with torch.no_grad(), self.autocast():
            for t in range(start, stop):
                with self.rng.replay(t):
                    psi = self.unit(psi, t)
        return psi


class _EpisodeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Episode, psi0: torch.Tensor, *params: torch.Tensor):
        steps = plan.steps
        if plan.mode == "step":
            keep = set(range(steps))
        else:
            keep = {0, *revolve.first_sweep(steps, plan.slots)}
        history_steps = set(plan.history_steps)
        stored, history = [psi0], []
        psi = plan.psi1
        plan.psi1 = None
        for t in range(1, steps + 1):
            # psi is the state after step t-1, the input of step t.
            if t - 1 in history_steps:
                history.append(psi)
            if t == steps:
                break
            if t in keep:
                stored.append(psi)
            plan.rng.record()
            psi = plan.unit(psi, t)
        plan.stored_steps = sorted(keep)
        outputs = [psi, *history]
        # An output must not be an input or another output (an identity step would make it so).
        seen = {id(psi0)}
        for i, out in enumerate(outputs):
            if id(out) in seen:
                outputs[i] = out.clone()
            seen.add(id(outputs[i]))
        ctx.plan = plan
        ctx.save_for_backward(*stored)
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_psi_T, *grad_history):
        plan: _Episode = ctx.plan
        if second_order_requested():
            # Each step's graph lives only while its reverse step runs: no graph can span them.
            raise RuntimeError(f"rollout(checkpoint={plan.mode!r}): no second-order gradients (create_graph=True): "
                               "this mode keeps no graph across steps; use checkpoint='none' (plain autograd)")
        states = dict(zip(plan.stored_steps, ctx.saved_tensors))
        params = plan.params
        for p, version in zip(params, plan.param_versions):
            if p._version != version:
                raise RuntimeError(
                    f"rollout: a parameter of shape {tuple(p.shape)} was modified by an inplace operation "
                    f"between the episode's forward and its backward (version {version} -> {p._version}), "
                    "e.g. an optimizer step; the recompute would not reproduce the forward"
                )
        incoming = {t: g for t, g in zip(plan.history_steps, grad_history) if g is not None}
        if grad_psi_T is not None:
            incoming[plan.steps - 1] = grad_psi_T

        capture = plan.unit.capture
        if capture is not None:
            capture.zero_accumulators()
        sink = ParamGradSink(params) if capture is None else contextlib.nullcontext()
        carry = _GradCarry(plan, incoming, params)
        with sink:
            if plan.mode == "step":
                for t in reversed(range(plan.steps)):
                    carry.backprop(t, states[t])
            else:
                revolve.reverse(plan, states, carry)
        del states
        buffers = sink.take() if capture is None else capture.parameter_grads()
        return (None, carry.grad if plan.psi0_needs_grad else None, *buffers)


class _GradCarry:
    """The gradient flowing back along the episode, one step at a time (steps in reverse)."""

    def __init__(self, plan, incoming, params):
        self.plan = plan
        self.incoming = incoming
        self.params = params
        self.grad = None  # gradient w.r.t. psi after the step being reversed

    def backprop(self, t: int, state: torch.Tensor) -> None:
        """Reverse step t given its input state: grad now refers to psi before step t."""
        g = self.incoming.pop(t, None)
        if g is not None:
            self.grad = g if self.grad is None else self.grad + g
        if self.grad is None:
            return  # nothing of the loss depends on this step's output
        plan = self.plan
        need_input = t > 0 or plan.psi0_needs_grad
        if plan.unit.capture is not None:
            self._backprop_captured(t, state, need_input)
            return
        psi_in = state.detach().requires_grad_(need_input)
        with torch.enable_grad(), plan.autocast(), keep_block_intermediates(), plan.rng.replay(t):
            out = plan.unit(psi_in, t)
        inputs = ([psi_in] if need_input else []) + self.params
        if not out.requires_grad or not inputs:
            self.grad = None
            return
        grads = torch.autograd.grad(out, inputs, self.grad, allow_unused=True)
        self.grad = grads[0] if need_input else None

    def _backprop_captured(self, t: int, state: torch.Tensor, need_input: bool) -> None:
        """backprop through the capture's graphs; the noise after the step stays eager."""
        plan = self.plan
        unit = plan.unit
        out = unit.capture.output_for_backward(state)
        grad_out = self.grad
        if unit.noise is not None:
            out = out.requires_grad_(True)
            with torch.enable_grad(), plan.autocast(), plan.rng.replay(t):
                noisy = unit.add_noise(out, t)
            grad_out = torch.autograd.grad(noisy, out, grad_out, allow_unused=True)[0] if noisy.requires_grad else None
            if grad_out is None:
                self.grad = None
                return
        grad_in = unit.capture.backward(grad_out)
        self.grad = grad_in if need_input else None
