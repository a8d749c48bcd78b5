"""The steps enable() puts on the users' engine, with and without memory, over the fused
pack/update (`ops.qca_step.fused_step_once`).

An engine with memory (the users' `motor.has_memory`, a ConvLSTM operator) calls
`operator(x, h, c) -> (delta, h, c)` with `h`, `c` read from `motor.state.h_state` /
`c_state` (None before the first step ever) and detached, and stores the new ones there, detached:
no gradient flows through the memory, but each step's output depends on it. The rollout carries
the memory as `carry=(h, c)`, so a recompute sees the memory its forward step saw; the episode
writes the final memory back to `motor.state`, where the engine's other code reads it.

The fused step is only installed where it is exact: enable() refuses an engine whose state is not a
complex tensor, and keeps the engine's own step where its `evolve_step` (and the `_evolve_logic` it
calls) is not, by its code's identity (code_identity.py), a Cartesian engine step qca_lowmem follows
(checked again at every episode), and for an operator whose output jumps with its input (a spiking
model: discontinuity.py), which would turn the fused step's other rounding into other jumps. The
probe (engine_probe.py) runs the recognised step once more. The fused step reads what the engine
reads, at every step: the operator, its class (the multiplicative rule), GAMMA_DECAY; an episode
that recomputes refuses a GAMMA_DECAY changed during it. On their CartesianEngine it writes
`last_psi_input`, `last_delta_psi` and `last_delta_psi_decay` as that engine's step does; the
episode writes the forward's last step's before the loss (which may read them:
engine_state.SideStateRead) and leaves them so.
"""

import inspect
import logging
from typing import Callable, Optional

import torch

from .. import _torch_private as torch_private
from .. import stock
from ..ops import stands_for_stock, step_function_replaced
from ..ops.qca_step import fused_step_once, qca_pack, qca_update
from ..unet import input_dtype
from .code_identity import followed, not_recorded, resolved
from .discontinuity import discontinuity
from .engine_probe import check_engine_state, check_engine_step, probe_shape
from .engine_state import SideStateRead, tensor_of, values_of
from .episode_refusals import ProofStale
from .operator_code import RECOMPUTED_COMPILED, compiled_draws, compiled_in, first_hook, operator_unfollowed
from .say import say
from .state_drift import code_of, own_classes
from .user_modules import compiled_module

# The fused packs lay the operator's input out as the engine's own (torch.cat of the permuted parts:
# NHWC at every shape), so a Dropout's mask, drawn in memory order, lands where stock's lands.
PACKS_NHWC = True


def has_memory(motor) -> bool:
    """Whether the engine runs its operator with memory; refuses what cannot be read."""
    value = getattr(motor, "has_memory", False)
    if not isinstance(value, bool):
        raise ValueError(f"enable(): motor.has_memory must be True or False, got {value!r}")
    if value:
        state = getattr(motor, "state", None)
        missing = [name for name in ("h_state", "c_state") if not hasattr(state, name)]
        if missing:
            raise ValueError(
                f"enable(): {type(motor).__name__}.has_memory is True but motor.state has no {' / '.join(missing)}: "
                "an engine with memory keeps the operator's h and c on motor.state.h_state / c_state"
            )
    return value


def check_operator_call(operator, memory: bool) -> None:
    """Refuse, naming the model class, an operator that cannot be called as the engine calls it."""
    call, args = ("operator(x, h, c)", (None, None, None)) if memory else ("operator(x)", (None,))
    operator = compiled_module(operator)
    try:
        signature = inspect.signature(operator.forward)
    except (TypeError, ValueError, AttributeError):
        return  # nothing to read: the call itself will tell
    try:
        signature.bind(*args)
    except TypeError as error:
        if memory:
            advice = "an engine with has_memory=True needs forward(x, h, c) returning (delta, h, c)"
        else:
            advice = ("a model with memory (forward(x, h, c) returning (delta, h, c)) needs an engine with "
                      "has_memory=True and motor.state.h_state / c_state")
        raise TypeError(f"enable(): {type(operator).__name__}.forward{signature} cannot be called as the engine calls "
                        f"it, {call} ({error}); {advice}") from None


class _LiveStep:
    """What the fused steps share: the engine they step, GAMMA_DECAY read at every call as the
    engine reads it (`fixed_gamma`, set by an episode that recomputes, refuses a change during
    it), and the side state their CartesianEngine writes (`side_state`)."""

    def __init__(self, motor, side_state: bool = False):
        self.motor, self.side_state, self.fixed_gamma = motor, side_state, None
        # In an episode the side state is written once, from the forward's last step (flush()):
        # each step then only keeps references, where a call outside one writes it.
        self.deferred, self.pending = False, None
        self.in_episode, self.identity = False, None  # identity: the EngineIdentity enable() recognised

    def engine_changed(self) -> Optional[Callable]:
        """Called outside the switch's episode (their own train_episode run as written; a wrapper
        their code set on the engine while an episode ran, holding this step), at every call: the
        engine's own step where its code is no longer the one recognised or the caller's context
        rules a fused path out (ops.stands_for_stock), else None."""
        if self.in_episode or self.identity is None:
            return None
        own = self.identity.own_step(self.motor, True)
        return own if own is not None or stands_for_stock() else type(self.motor).evolve_step.__get__(self.motor)

    def gamma(self) -> float:
        gamma = live_gamma(self.motor)
        if self.fixed_gamma is not None and gamma != self.fixed_gamma:
            raise RuntimeError(f"qca_lowmem: {type(self.motor).__name__}.cfg GAMMA_DECAY changed during the episode, from "
                               f"{self.fixed_gamma!r} to {gamma!r}: the steps recomputed in the backward would decay "
                               "by another rate than their forward. Change it between episodes, or enable(trainer, "
                               "checkpoint='none'), whose steps read it as the engine's do")
        return gamma

    def record(self, psi, delta, gamma: float, multiplicative: bool) -> None:
        """Write the engine's side state as their CartesianEngine._evolve_logic does, detached."""
        if not self.side_state:
            return
        if self.deferred:
            self.pending = (values_of(psi), values_of(delta), gamma, multiplicative)
            return
        with torch.no_grad():
            real = psi.real.dtype
            a_real, a_imag = (part.to(real).permute(0, 2, 3, 1) for part in torch.chunk(delta, 2, dim=1))
            if multiplicative:
                a_real, a_imag = (a_real * psi.real - a_imag * psi.imag, a_real * psi.imag + a_imag * psi.real)
            motor = self.motor
            motor.last_psi_input = psi.detach()  # theirs is psi itself, in its graph: the same values
            motor.last_delta_psi = torch.complex(a_real, a_imag)
            motor.last_delta_psi_decay = -gamma * psi.detach() if gamma > 0 else None

    def start_episode(self, fixed_gamma: Optional[float]) -> None:
        """`fixed_gamma`: the GAMMA_DECAY the episode's steps must keep (it recomputes), else None."""
        self.fixed_gamma, self.deferred, self.pending, self.in_episode = fixed_gamma, self.side_state, None, True

    def end_episode(self) -> None:
        self.fixed_gamma, self.deferred, self.pending, self.in_episode = None, False, None, False

    def flush(self) -> Optional[SideStateRead]:
        """Write the side state of the last step called (the forward's last, before any recompute)
        for the loss to read, as stock's loss finds it (SideStateRead); None where no step recorded."""
        return SideStateRead(self.motor) if self.write_pending() else None

    def write_pending(self) -> bool:
        """Write the side state of the last step called, as their engine's step left it (also where
        the forward raised); whether one had."""
        pending, self.pending, deferred = self.pending, None, self.deferred
        if pending is None:
            return False
        self.deferred = False
        self.record(tensor_of(pending[0]), tensor_of(pending[1]), *pending[2:])
        self.deferred = deferred
        return True

    def __getstate__(self):
        # A copy (one made inside an episode too) is in none: its calls check the engine, write the side state.
        return {**vars(self), "fixed_gamma": None, "deferred": False, "pending": None, "in_episode": False}


class FusedMemoryStep(_LiveStep):
    """step(psi, (h, c)) -> (psi, (h, c)): the engine's step with memory on the fused pack/update,
    calling the engine's operator of the moment (current_operator). A value holding the engine,
    not a closure, so that a copy of the trainer steps its own engine and pickles."""

    def __call__(self, psi, memory):
        operator, multiplicative = current_operator(self.motor)
        gamma = self.gamma()
        h, c = (m.detach() if m is not None else None for m in memory)
        out = operator(qca_pack(psi, channels_last=PACKS_NHWC), h, c)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise TypeError(f"{type(operator).__name__} on an engine with has_memory=True must return (delta, h, c), "
                            f"it returned {type(out).__name__}")
        delta, h, c = out
        self.record(psi, delta, gamma, multiplicative)
        return (qca_update(psi, delta, gamma, multiplicative),
                tuple(m.detach() if m is not None else None for m in (h, c)))


def current_operator(motor):
    """(the module to run, whether it acts multiplicatively), read from motor.operator at each
    step as the engine's own step reads it, so a compile_model() before or after enable() is seen
    alike. A compiled operator's module runs uncompiled: the same function, where the compiled one
    runs one graph in the forward (no grad) and another in the recompute (grad), which can round
    differently; the stock rule on the class name reads the compiled module, as the engine does."""
    operator = motor.operator
    return compiled_module(operator), stock.is_multiplicative(operator)


class FusedEngineStep(_LiveStep):
    """motor.evolve_step on the fused pack/update, calling the engine's operator of the moment; a
    value holding the engine (a copy of the trainer or of the engine steps its own)."""

    def __call__(self, psi):
        own = self.engine_changed()
        if own is not None:
            return own(psi)
        operator, multiplicative = current_operator(self.motor)
        gamma = self.gamma()
        recorded = (lambda delta: self.record(psi, delta, gamma, multiplicative)) if self.side_state else None
        return fused_step_once(operator, psi, gamma, multiplicative, PACKS_NHWC, recorded,
                               pack_dtype=input_dtype(operator, psi))


class EngineMemoryStep:
    """step(psi, (h, c)) -> (psi, (h, c)) around the engine's own evolve_step(psi) (`own`, by
    default motor.evolve_step), which reads and writes the memory on motor.state: the memory it
    reads is the one handed in."""

    def __init__(self, motor, own: Optional[Callable] = None):
        self.motor, self.own = motor, own

    def __call__(self, psi, memory):
        state = self.motor.state
        state.h_state, state.c_state = memory
        psi = (self.own or self.motor.evolve_step)(psi)
        return psi, (state.h_state, state.c_state)


class MemoryStep:
    """motor.evolve_step(psi) for an engine with memory: the carried step with the memory read
    from and written to motor.state, as the engine's own step does."""

    def __init__(self, motor, carried: Callable):
        self.motor = motor
        self.carried = carried

    def __call__(self, psi):
        own = self.carried.engine_changed() if isinstance(self.carried, _LiveStep) else None
        if own is not None:
            return own(psi)
        state = self.motor.state
        psi, (state.h_state, state.c_state) = self.carried(psi, (state.h_state, state.c_state))
        return psi


def live_gamma(motor) -> float:
    """GAMMA_DECAY as their engine reads it at each step: cfg.GAMMA_DECAY, else cfg['GAMMA_DECAY'],
    else none; no decay unless it is above 0."""
    cfg = getattr(motor, "cfg", None)
    gamma = 0.0
    if cfg is not None:
        if hasattr(cfg, "GAMMA_DECAY"):
            gamma = cfg.GAMMA_DECAY
        elif isinstance(cfg, dict) and "GAMMA_DECAY" in cfg:
            gamma = cfg["GAMMA_DECAY"]
    return float(gamma) if gamma > 0 else 0.0


def engine_kind(motor, installed=None) -> Optional[str]:
    """Which Cartesian engine step qca_lowmem follows the engine runs, by the identity of its code:
    "CartesianEngine" (theirs, writing the side state), "Motor" (the stand-in's), else None.
    `installed`: the step enable() set on the engine, looked through."""
    evolve = resolved(motor, "evolve_step", installed)
    if step_function_replaced() is not None:  # their step's calls are not torch's: not the step followed
        return None
    if followed("CartesianEngine.evolve_step", evolve) is not None:
        logic = resolved(motor, "_evolve_logic")
        return "CartesianEngine" if followed("CartesianEngine._evolve_logic", logic) is not None else None
    return "Motor" if followed("Motor.evolve_step", evolve) is not None else None


def engine_code(motor, installed=None) -> Optional[list]:
    """The functions of the engine's step that qca_lowmem does not follow (those of its classes
    and held on it), or None where the step it runs is the fused one or a Cartesian step followed.
    `installed`: the step enable() set on the engine, looked through."""
    if engine_kind(motor, installed) is not None:
        return None
    return code_of([motor], own_classes(motor))


def unknown_engine(motor) -> str:
    why = not_recorded() or (f"{replaced} is not torch's since qca_lowmem was imported"
                             if (replaced := step_function_replaced()) else None)
    return (f"{type(motor).__name__}.evolve_step is not, by its code, a Cartesian engine step qca_lowmem follows"
            + (f" ({why})" if why else ""))


def own_step_verdict(motor, fused_step_ops: bool, grid=None, d_state: Optional[int] = None,
                     recomputes: bool = True) -> Optional[str]:
    """Why the engine's own step runs although fused_step_ops asks for the fused one, else None;
    refuses an engine or operator that neither step can roll out. `grid` and `d_state` size the
    probe when the engine holds no psi; `recomputes`: the episode runs steps again in the backward."""
    check_engine_state(motor)
    operator = motor.operator
    memory = has_memory(motor)
    check_operator_call(operator, memory)
    why, unfollowed = None, operator_unfollowed(compiled_module(operator)) if fused_step_ops else None
    if fused_step_ops and engine_kind(motor) is None:
        why = unknown_engine(motor)
    elif unfollowed is not None:
        why = f"{unfollowed}, so it is not called to check its ops (a call could move state it keeps outside its tensors)"
    elif fused_step_ops and (drawn := compiled_draws(operator)) is not None:
        why = drawn
    elif fused_step_ops:
        shape, dtype = probe_shape(motor, grid, d_state)
        with torch_private.module_hooks_set_aside(compiled_module(operator)):  # stock calls no hook here
            jumps = discontinuity(compiled_module(operator), _probe_input(operator, shape, dtype), memory)
        why = None if jumps is None else (
            f"{type(operator).__name__}'s output jumps with its input ({jumps}): the fused step, rounding "
            "differently from the engine's, would give other jumps")
    # Without a recompute the compiled step runs once, with grad, as in the engine's own episode.
    if (not fused_step_ops or why is not None) and recomputes and (compiled := compiled_in(operator)) is not None:
        (named, unwrap), own_step = compiled, (
            f"On the engine's own step {RECOMPUTED_COMPILED}; checkpoint='none' recomputes nothing")
        if why is None and compiled_module(operator) is not operator:
            raise TypeError(f"enable(): {named} with fused_step_ops=False; fused_step_ops=True runs the module it "
                            f"wraps\n{own_step}")
        raise TypeError(f"enable(): {named} keeps the engine's own step; {unwrap}\n{own_step}{f' ({why})' if why else ''}")
    return why


def lowmem_steps(motor, fused: bool, grid=None, d_state: Optional[int] = None):
    """(the engine's evolve_step for enable() to install, or None to keep the engine's own; the
    carried step(psi, (h, c)) the episode rolls out for an engine with memory, else None), on an
    engine own_step_verdict passed. `fused`: the fused step (proved by the probe here)."""
    memory = has_memory(motor)
    if not fused:
        return None, (EngineMemoryStep(motor) if memory else None)
    operator = motor.operator
    # The engine's rule reads the class of what it calls: a compiled UNetUnitary (OptimizedModule) is additive there.
    multiplicative = stock.is_multiplicative(operator)
    shape, dtype = probe_shape(motor, grid, d_state)
    side_state = engine_kind(motor) == "CartesianEngine"
    with torch_private.module_hooks_set_aside(compiled_module(operator)):
        if not memory:
            step = FusedEngineStep(motor, side_state)
            check_engine_step(motor, step, None, shape, dtype, multiplicative)
            return step, None
        carried = FusedMemoryStep(motor, side_state)
        check_engine_step(motor, None, carried, shape, dtype, multiplicative)
    return MemoryStep(motor, carried), carried


def fused_of(evolve_step, memory_step) -> Optional[_LiveStep]:
    """The fused step object among what lowmem_steps returned, or None (the engine's own step)."""
    for step in (memory_step, evolve_step):
        if isinstance(step, _LiveStep):
            return step
    return None


class EngineIdentity:
    """The engine step enable() recognised, and the step it installed in its place, checked again
    at each episode."""

    def __init__(self, motor, installed, memory: bool):
        self.installed, self.memory, self.said = installed, memory, False
        self.why_said = None  # why the operator's calls keep the engine's own step, as last said
        self.kind = engine_kind(motor, installed) if installed is not None else None
        self.operator = compiled_module(motor.operator)  # the module the fused step was proved on

    def own_step(self, motor, called: bool = False) -> Optional[Callable]:
        """None while the installed step still stands for the engine's; else the step the engine
        would run now, bound (said once). `called`: asked by the installed step, called by whatever
        holds it (a wrapper set on the engine after enable()), for which it stands for the class's
        step: the class's is then read, and run where it changed."""
        if self.kind is None:
            return None
        if has_memory(motor) != self.memory:
            changed = f"{type(motor).__name__}.has_memory is {not self.memory} now ({self.memory} at enable())"
            raise ProofStale(f"qca_lowmem: {changed}: the step carries the memory as enable() decided; disable() and "
                             "enable() again", changed)
        held = vars(motor).get("evolve_step")
        if engine_kind(motor, held if called else self.installed) != self.kind:
            if not self.said:
                self.said = True
                why = (f"motor.evolve_step set to {getattr(held, '__qualname__', None) or 'a ' + type(held).__name__}"
                       if held is not None and held is not self.installed and not called else unknown_engine(motor))
                say(logging.WARNING, f"{type(motor).__name__}'s step changed since enable() ({why}): "
                                     "the episodes run the engine's own step")
        else:
            why = self.operator_differs(motor.operator)
            if why is None:
                self.why_said = None
                return None
            if why != self.why_said:
                self.why_said = why
                say(logging.WARNING, f"{why}: the episodes run the engine's own step while it is there")
        if held is not None and held is not self.installed and not called:
            return held
        return getattr(type(motor), "evolve_step").__get__(motor, type(motor))

    def operator_differs(self, operator) -> Optional[str]:
        """Why calling `operator` (motor.operator) is not what the fused step was proved on (another
        module, a hook, code qca_lowmem does not follow, a compiled one's random draws), else None."""
        module = compiled_module(operator)
        if module is not self.operator:
            return f"motor.operator ({type(module).__name__}) is not the module enable() checked"
        return first_hook(module) or operator_unfollowed(module) or compiled_draws(operator)


def _probe_input(operator, shape, dtype):
    """The discontinuity probe's packed random psi (its own generator; the parameters' dtype, device)."""
    parameter = next(operator.parameters())
    draw = torch.Generator().manual_seed(0)
    psi = torch.randn(shape, dtype=dtype, generator=draw).to(parameter.device)
    return qca_pack(psi, parameter.dtype, channels_last=PACKS_NHWC)
