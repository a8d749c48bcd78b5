"""The episode as one autograd Function, for every schedule that recomputes.

Its forward (Episode.run, before the Function is applied) runs the steps without a graph (a step
whose graph the schedule keeps runs with one) and keeps what the schedule says; its backward
hands the kept states to the schedule, which drives the reverse pass (reverse.py) one step at a
time.

Parameters are found, not listed: the probe (probe.py) runs the first steps with grad enabled and
walks their graphs to the leaf tensors they reach (the parameters of step_fn's closure). They
become inputs of the Function, so autograd accumulates each one's gradient once per backward
(DDP's hooks fire once) and `torch.autograd.grad(loss, params)` works too. Leaves that only later
steps reach are seen by the forward's watch (watch.py) and join them before the Function is
applied, so they are inputs too: `inputs=` and `torch.autograd.grad` leave the others' `.grad`
untouched, as plain autograd does.
"""

import contextlib
import copy
from typing import Callable, List, Optional

import torch

from .. import _torch_private as torch_private
from ..ops import recomputes_unhooked, refuse_foreign_mode_in_backward, second_order_requested
from . import weight_casts
from .buffers import storage_key
from .check import RecomputeCheck
from .escapes import EscapedTensorError, InputTrap, Leftovers, StepFrame
from .intermediates import keep_block_intermediates
from .leaves import next_sequence_nr
from .param_grads import ParamGradSink
from .policy import Policy
from .replay import backward_recomputes
from .reverse import Rerun, StepReverser
from .schedule import Recomputing
from .state import State, check_like_psi, checked_carry
from .watch import StepWatch

# torch's refusals of a gradient hook on a tensor that needs none: a step that registers one in its
# forward runs here without grad first (the recomputing episode's forward), where stock's had grad.
_NEEDS_GRAD = {"cannot register a hook on a tensor that doesn't require gradient":
               "registers a hook on a tensor (Tensor.register_hook); register it only where the tensor "
               "requires grad (`if out.requires_grad: out.register_hook(...)`): the recompute, with grad, then "
               "registers it, and it runs once in the backward, as in stock's",
               "can't retain_grad on Tensor that has requires_grad=False":
               "keeps a tensor's gradient (Tensor.retain_grad), on a tensor the recompute makes anew"}


@contextlib.contextmanager
def _without_grad_said(t: int):
    """torch's refusal of a gradient hook in a step run without grad, said as what the step does."""
    try:
        yield
    except RuntimeError as error:
        does = _NEEDS_GRAD.get(str(error)) if not torch.is_grad_enabled() else None
        if does is None:
            raise
        raise RuntimeError(f"rollout: step {t} runs without grad here (a recomputing episode's forward), and "
                           f"step_fn {does}; checkpoint='none' runs each step once, with grad") from error


class StepUnit:
    """One step of the episode: step_fn then noise, with the checks that keep the state's type.

    With a capture (a StepGraph's, step_graph.py), steps taken without grad replay its forward graph;
    the reverse pass asks the capture for the backward."""

    def __init__(self, step_fn: Callable, noise: Optional[Callable], carried: bool):
        self.step_fn = step_fn
        self.noise = noise
        self.carried = carried
        self.capture = None
        # While a recomputing episode runs its forward (the probe included): its policy, for the
        # refusal of a step that changes its input in place (the state the backward starts from).
        self.refuse_in_place: Optional[Policy] = None
        # While an episode that runs its steps on copies of their input state (every policy but plain
        # autograd) runs them with grad: its policy, for the refusal of a hook a step sets on its input.
        self.refuse_input_hooks: Optional[Policy] = None
        # The episode's half-precision weights, cast once (or once per shared_weight_casts() scope).
        self.weight_casts = weight_casts.for_episode()

    def step(self, psi: torch.Tensor, carry: tuple, t: Optional[int] = None):
        """step_fn on (psi, carry) -> (psi, carry), whether or not the rollout carries state; t
        names the step in errors."""
        at = "" if t is None else f" at step {t}"
        if not self.carried:
            return self.step_fn(psi), ()
        result = self.step_fn(psi, carry)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"rollout: with carry=..., step_fn(psi, carry) must return (psi, carry);{at} "
                            f"it returned {type(result).__name__}")
        return result[0], checked_carry(result[1], f"the carry step_fn returned{at}", len(carry))

    def replays(self, state: State) -> bool:
        """Whether a call on `state` now replays the capture's forward graph."""
        return self.capture is not None and not torch.is_grad_enabled() and self.capture.takes(state.carry)

    def __call__(self, state: State, t: int) -> State:
        if self.replays(state):
            out, carry = self.capture.forward(*state)
            return State(self.add_noise(out, t), carry)
        given = state
        if self.refuse_in_place is not None:
            # A leaf requiring grad cannot change in place (autograd would refuse, naming neither the
            # rollout nor the cause); a copy can, so that its change is seen and refused below.
            given = State(_modifiable(state.psi), tuple(map(_modifiable, state.carry)))
            versions = [None if x is None else x._version for x in given.tensors()]
        hooks = None
        if self.refuse_input_hooks is not None and torch.is_grad_enabled():
            hooks = [None if x is None else torch_private.gradient_hook_count(x) for x in given.tensors()]
        with self.weight_casts.active(), _without_grad_said(t):
            out, carry = self.step(*given, t)
        if self.refuse_in_place is not None:
            self._refuse_changed_input(given, versions, t)
        if hooks is not None:
            self._refuse_input_hooks(given, hooks, t)
        check_like_psi(out, state.psi, "step_fn", t)
        return State(self.add_noise(out, t), carry)

    def _refuse_changed_input(self, given: State, versions: list, t: int) -> None:
        for (name, x), version in zip(given.entries(), versions):
            if x is not None and x._version != version:
                raise RuntimeError(
                    f"rollout(checkpoint={self.refuse_in_place.checkpoint!r}): step_fn changed its input {name} in place at step "
                    f"{t} (an in-place op such as {name}.mul_()); the episode keeps that state to recompute the step in "
                    f"backward: compute out of place ({name} = {name} * 0.9), or use checkpoint='none'")

    def _refuse_input_hooks(self, given: State, hooks: list, t: int) -> None:
        for (name, x), count in zip(given.entries(), hooks):
            if x is not None and torch_private.gradient_hook_count(x) != count:
                raise RuntimeError(
                    f"rollout(checkpoint={self.refuse_input_hooks.checkpoint!r}): step_fn registered a hook on its input "
                    f"{name} at step {t} ({name}.register_hook): the episode runs each step on a copy of its input "
                    f"state, whose hook would see only that step's share of {name}'s gradient, not the history's: "
                    "register it on the step's output (the next step's input, the whole gradient), or use "
                    "checkpoint='none'")

    def add_noise(self, out: torch.Tensor, t: int) -> torch.Tensor:
        if self.noise is None:
            return out
        noisy = self.noise(out, t)
        check_like_psi(noisy, out, "noise", t)
        return noisy


def _modifiable(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # Without grad a leaf may change in place (its version counter tells): no copy needed there.
    return x.clone() if x is not None and x.is_leaf and x.requires_grad and torch.is_grad_enabled() else x


class KeptGraph:
    """Steps start .. start + len(outputs) - 1 run with their whole graph kept, as one chain (as
    plain autograd runs them, and reversed by one backward): the input leaves of the first, the
    output state of each."""

    def __init__(self, start: int, inputs: State, trap: InputTrap):
        self.start = start
        self.inputs = inputs
        # Their gradient is asked only by the reverse pass (StepReverser.backprop_graph), which
        # allows it: reached otherwise, through a tensor leaving a step, it would stop there.
        self.trap = trap
        self.outputs: List[State] = []
        self.marker = next_sequence_nr()  # the chain's nodes come after this

    def run(self, unit: StepUnit, t: int) -> State:
        """Step t (the next one) on the chain, blocks keeping their intermediates; its output
        state detached, for the steps and history that do not differentiate it."""
        state = self.outputs[-1] if self.outputs else self.inputs
        with torch.enable_grad(), keep_block_intermediates():
            self.outputs.append(unit(state, t))
        return self.outputs[-1].detached()


class Layout:
    """The episode Function's inputs and outputs as states. Inputs: psi0, the carry entries, the
    parameters; outputs: psi_T, the history (each recorded step but the last), the entries of
    carry_T that are not None."""

    def __init__(self, steps: int, recorded: List[int], state0: State):
        self.steps = steps
        self.history_steps = [t for t in recorded if t != steps - 1]
        self.input_needs_grad = state0.needs_grad()  # psi0 then each carry entry
        self.carry_T_present: List[bool] = []  # which carry_T entries are outputs, once the forward ran

    def outputs(self, final: State, history: list) -> list:
        """The Function's outputs of the forward's final state and history; notes which carry_T
        entries are among them."""
        self.carry_T_present = [c is not None for c in final.carry]
        return [final.psi, *history, *(c for c in final.carry if c is not None)]

    def final_state(self, outputs) -> State:
        """psi_T and carry_T (None entries put back) of the Function's outputs."""
        carry_T = iter(outputs[1 + len(self.history_steps):])
        return State(outputs[0], tuple(next(carry_T) if present else None for present in self.carry_T_present))

    def results(self, outputs) -> tuple:
        """rollout's (psi_T, history, carry_T) of the Function's outputs; history[-1] is psi_T."""
        final = self.final_state(outputs)
        return final.psi, [*outputs[1:1 + len(self.history_steps)], final.psi], final.carry

    def incoming(self, grad_psi_T, grads) -> dict:
        """The gradients flowing into each step's output (step -> State), of those of the outputs."""
        n_history = len(self.history_steps)
        no_carry_grads = (None,) * (len(self.input_needs_grad) - 1)
        incoming = {t: State(g, no_carry_grads) for t, g in zip(self.history_steps, grads[:n_history]) if g is not None}
        carry_grads = iter(grads[n_history:])
        grad_carry_T = tuple(next(carry_grads) if present else None for present in self.carry_T_present)
        if grad_psi_T is not None or any(g is not None for g in grad_carry_T):
            incoming[self.steps - 1] = State(grad_psi_T, grad_carry_T)
        return incoming


class Episode:
    """Everything the episode's Function needs besides tensors, made from its start (a
    probe.EpisodeStart, probed and prepared)."""

    def __init__(self, policy: Policy, schedule: Recomputing, start, recorded: List[int], check_recompute: bool):
        # What runs: the policy (which the errors name), its schedule, the step and what running it
        # again as the forward ran needs, whether the forward's steps run with grad (escapes.py).
        self.policy = policy
        self.schedule = schedule
        self.rerun = Rerun(start.unit, start.rng, start.autocast, start.probed.buffers, start.grad_forward)
        self.grad_forward = start.grad_forward
        self.layout = Layout(schedule.steps, recorded, start.state0)
        # The leaves: the probe's, then those the forward's other steps read (run); their versions
        # after it. They stay here, not in save_for_backward: saved-tensor hooks (save_on_cpu,
        # saved_bytes) would hand back copies, which the recomputed steps never use.
        self.params: List[torch.Tensor] = start.probed.params
        self.param_versions: List[int] = []
        # The recompute check: the precision it allows for, and the final state kept for the last step's.
        self.check_recompute = check_recompute
        self.check_dtype = start.autocast.dtype(start.state0.psi.device.type)
        self.keeps_final_state = check_recompute and schedule.recomputes(schedule.steps - 1)
        # The forward's work: the output states of the first steps (run before it), what run() kept
        # and made until the Function takes them, which steps' states are saved (in saved order), and
        # the chain of full graphs the schedule keeps.
        self.probed: Optional[List[State]] = start.probed.states
        self.stored = self.outputs = None
        self.kept_steps: List[int] = []
        self.graphs: Optional[KeptGraph] = None

    def run(self, state: State) -> None:
        """The episode's forward from its input state, without a graph (steps whose graph the
        schedule keeps run with one): what it keeps (`stored`) and its outputs (`outputs`), for
        EpisodeFunction. Each step the probe did not run is watched (watch.py): the leaves it reads
        join `params`, the tensors it writes the buffers."""
        stored, history = [], []
        schedule, unit, rng, buffers = self.schedule, self.rerun.unit, self.rerun.rng, self.rerun.buffers
        history_steps = set(self.layout.history_steps)
        probed, self.probed = self.probed, None
        known_leaves = {id(p): p for p in self.params}
        known_writes = {storage_key(x) for x in buffers.tensors}
        with torch.no_grad():
            for t in range(schedule.steps):
                if schedule.keeps_state(t):
                    stored.append((t, state))
                if t < len(probed):
                    state = probed[t]
                else:
                    rng.record()
                    if schedule.recomputes(t):
                        buffers.record(t)
                    if schedule.keeps_graph(t) and self.graphs is None:
                        trap = InputTrap(self.policy, t, allowed=False)
                        self.graphs = KeptGraph(t, trap.set_on(state.as_inputs(True)), trap)
                    # A replayed capture is one fixed graph, of the leaves it was captured for.
                    framed = not (schedule.keeps_graph(t) or unit.replays(state))
                    frame = StepFrame(self.policy, t, grad=self.grad_forward) if framed else None
                    given = frame.inputs(state) if frame else state
                    inputs = {id(x) for x in (*state.tensors(), *given.tensors(),
                                              *(self.graphs.inputs.tensors() if self.graphs else ()))}
                    watch = None if unit.replays(state) else StepWatch(known_leaves, known_writes, inputs)
                    with watch or contextlib.nullcontext():
                        if schedule.keeps_graph(t):
                            state = self.graphs.run(unit, t)
                        else:
                            with frame or contextlib.nullcontext():
                                state = unit(given, t)
                            state = state.detached()
                    if framed and not self.grad_forward:
                        self._refuse_leftovers(watch, state, t)
                    if watch is not None:
                        self.params += watch.leaves
                        for tensor, value in watch.writes:
                            buffers.add(tensor, value)
                if t in history_steps:
                    history.append(state.psi)
        unit.refuse_in_place = None  # every step ran once: its recomputes change nothing in place
        self.param_versions = [p._version for p in self.params]
        self.kept_steps = [t for t, _ in stored]
        self.stored = stored
        self.outputs = self.layout.outputs(state, history)

    def _refuse_leftovers(self, watch: Optional[StepWatch], state: State, t: int) -> None:
        """Step t ran without grad, the probed steps having handed nothing out: refuse what it
        made that outlives it besides its state (it would be a constant where plain autograd has
        a gradient)."""
        if watch is None:
            return
        leftovers = Leftovers()
        leftovers.add(watch.made, state, ())
        if leftovers.any(self.rerun.unit.weight_casts.copies()):
            raise EscapedTensorError(
                f"rollout(checkpoint={self.policy.checkpoint!r}): step {t} handed out a tensor other than through psi "
                "(or the carry), which the first steps did not, so the forward ran it without grad and that tensor "
                "carries no gradient: hand it out through the carry (rollout(..., carry=...)), the same way from the "
                "first step on, or use checkpoint='none' (plain autograd)")

    def check_params_unchanged(self) -> None:
        """Refuse parameters changed in place since the forward (an optimizer step)."""
        for p, version in zip(self.params, self.param_versions):
            if p._version != version:
                raise RuntimeError(
                    f"rollout: a parameter of shape {tuple(p.shape)} was modified by an inplace operation "
                    f"between the episode's forward and its backward (version {version} -> {p._version}), "
                    "e.g. an optimizer step; the recompute would not reproduce the forward"
                )

    def take_graphs(self) -> Optional["KeptGraph"]:
        """The chain of full graphs the forward kept, for one backward: reversing it frees its
        buffers unless that backward retains the graph (retain_graph=True), as plain autograd's."""
        graphs = self.graphs
        if graphs is None:
            return None
        if not graphs.outputs:
            raise RuntimeError(f"rollout(checkpoint={self.policy.checkpoint!r}): the full graphs kept for the "
                               "episode's last steps were freed by its first backward: pass retain_graph=True to "
                               "every backward through the episode but its last")
        if torch_private.backward_keeps_graph():
            kept = copy.copy(graphs)  # reversing empties its outputs; the episode's stay for the next backward
            kept.outputs = list(graphs.outputs)
            return kept
        self.graphs = KeptGraph(graphs.start, graphs.inputs, graphs.trap)
        return graphs


class EpisodeFunction(torch.autograd.Function):
    """The episode run by Episode.run before it is applied, so that its inputs hold every leaf the
    forward's steps read: forward hands back what that run made and saves the kept states."""

    @staticmethod
    def forward(ctx, plan: Episode, psi0: torch.Tensor, *inputs: Optional[torch.Tensor]):
        outputs, stored = plan.outputs, plan.stored
        plan.outputs = plan.stored = None
        # An output must not be an input or another output (an identity step would make it so).
        seen = {id(x) for x in (psi0, *inputs) if x is not None}
        for i, out in enumerate(outputs):
            if id(out) in seen:
                outputs[i] = out.clone()
            seen.add(id(outputs[i]))
        if plan.keeps_final_state:
            stored.append((plan.layout.steps, plan.layout.final_state(outputs)))
        ctx.plan = plan
        ctx.save_for_backward(*(x for _, kept in stored for x in kept.tensors()))
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_psi_T, *grads):
        plan: Episode = ctx.plan
        if second_order_requested():
            # Each step's graph lives only while its reverse step runs: no graph can span them.
            raise RuntimeError(f"rollout(checkpoint={plan.policy.checkpoint!r}): no second-order gradients "
                               "(create_graph=True): this mode keeps no graph across steps; use checkpoint='none' "
                               "(plain autograd)")
        plan.check_params_unchanged()
        refuse_foreign_mode_in_backward(f"rollout(checkpoint={plan.policy.checkpoint!r})", "the steps it recomputes")
        width = len(plan.layout.input_needs_grad)
        saved = ctx.saved_tensors
        states = [State(saved[i], tuple(saved[i + 1:i + width])) for i in range(0, len(saved), width)]
        kept = dict(zip(plan.kept_steps, states))
        graphs = plan.take_graphs()
        if graphs is not None:
            kept[graphs.start] = graphs
        final = (plan.layout.steps, states[-1]) if plan.keeps_final_state else None
        del states, saved, graphs

        capture = plan.rerun.unit.capture
        if capture is not None:
            capture.zero_accumulators()
        sink = ParamGradSink(plan.params)  # steps run eagerly (all, or a capture's first) add theirs here
        check = RecomputeCheck(plan.policy, plan.check_dtype) if plan.check_recompute else None
        reverser = StepReverser(plan.rerun, plan.policy, plan.layout.incoming(grad_psi_T, grads), sink,
                                plan.layout.input_needs_grad, check, final)
        plan.rerun.buffers.backward_starts()
        try:
            with recomputes_unhooked(), sink, plan.rerun.rng.untouched(), backward_recomputes():
                plan.schedule.reverse(kept, reverser)
        finally:
            plan.rerun.buffers.restore()
        del kept, final
        reverser.verify()
        if capture is not None:
            for i, grad in enumerate(capture.parameter_grads()):
                if grad is not None:
                    sink.add(i, grad)
        grad_psi0, *grad_carry0 = reverser.grads_of_inputs()
        return (None, grad_psi0, *grad_carry0, *sink.take())
