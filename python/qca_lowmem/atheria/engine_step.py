"""The steps enable() puts on the users' engine, with and without memory, over the fused
pack/update (`ops.qca_step.fused_step_once`).

An engine with memory (the users' `motor.has_memory`, a ConvLSTM operator) calls
`operator(x, h, c) -> (delta, h, c)` with `h`, `c` read from `motor.state.h_state` /
`c_state` (None before the first step ever) and detached, and stores the new ones there, detached:
no gradient flows through the memory, but each step's output depends on it. The rollout carries
the memory as `carry=(h, c)`, so a recompute sees the memory its forward step saw; the episode
writes the final memory back to `motor.state`, where the engine's other code reads it.

The fused step is only installed where it is exact: enable() refuses an engine whose state is
not a complex tensor, and one whose own evolve_step, probed once, is not the Cartesian step
(engine_probe.py); and it keeps the engine's own step, and the stock blocks, for an operator whose
output jumps with its input (a spiking model: discontinuity.py), which would turn the fused
step's other rounding into other jumps.
"""

import inspect
from typing import Callable, Optional

import torch

from .. import stock
from ..ops.qca_step import fused_step_once, qca_pack, qca_update
from .discontinuity import discontinuity
from .engine_probe import check_engine_state, check_engine_step, compiled_module, probe_shape


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


class FusedMemoryStep:
    """step(psi, (h, c)) -> (psi, (h, c)): the engine's step with memory on the fused pack/update,
    calling the engine's operator of the moment (current_operator). A value holding the engine,
    not a closure, so that a copy of the trainer steps its own engine and pickles."""

    def __init__(self, motor, gamma: float):
        self.motor, self.gamma = motor, gamma

    def __call__(self, psi, memory):
        operator, multiplicative = current_operator(self.motor)
        h, c = (m.detach() if m is not None else None for m in memory)
        out = operator(qca_pack(psi), h, c)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise TypeError(f"{type(operator).__name__} on an engine with has_memory=True must return (delta, h, c), "
                            f"it returned {type(out).__name__}")
        delta, h, c = out
        return (qca_update(psi, delta, self.gamma, multiplicative),
                tuple(m.detach() if m is not None else None for m in (h, c)))


def current_operator(motor):
    """(the module to run, whether it acts multiplicatively), read from motor.operator at each
    step as the engine's own step reads it, so a compile_model() before or after enable() is seen
    alike. A compiled operator's module runs uncompiled: the same function, where the compiled one
    runs one graph in the forward (no grad) and another in the recompute (grad), which can round
    differently; the stock rule on the class name reads the compiled module, as the engine does."""
    operator = motor.operator
    return compiled_module(operator), stock.is_multiplicative(operator)


class FusedEngineStep:
    """motor.evolve_step on the fused pack/update, calling the engine's operator of the moment; a
    value holding the engine (a copy of the trainer or of the engine steps its own). With
    `channels_last` the pack writes NHWC."""

    def __init__(self, motor, gamma: float, channels_last: bool = False):
        self.motor, self.gamma, self.channels_last = motor, gamma, channels_last

    def __call__(self, psi):
        operator, multiplicative = current_operator(self.motor)
        return fused_step_once(operator, psi, self.gamma, multiplicative, self.channels_last)


class EngineMemoryStep:
    """step(psi, (h, c)) -> (psi, (h, c)) around the engine's own evolve_step(psi), which reads
    and writes the memory on motor.state: the memory it reads is the one handed in."""

    def __init__(self, motor):
        self.motor = motor

    def __call__(self, psi, memory):
        state = self.motor.state
        state.h_state, state.c_state = memory
        psi = self.motor.evolve_step(psi)
        return psi, (state.h_state, state.c_state)


class MemoryStep:
    """motor.evolve_step(psi) for an engine with memory: the carried step with the memory read
    from and written to motor.state, as the engine's own step does."""

    def __init__(self, motor, carried: Callable):
        self.motor = motor
        self.carried = carried

    def __call__(self, psi):
        state = self.motor.state
        psi, (state.h_state, state.c_state) = self.carried(psi, (state.h_state, state.c_state))
        return psi


def engine_gamma(motor) -> float:
    cfg = getattr(motor, "cfg", None)
    if isinstance(cfg, dict):
        return float(cfg.get("GAMMA_DECAY", 0.0) or 0.0)
    return float(getattr(cfg, "GAMMA_DECAY", 0.0) or 0.0)


def lowmem_steps(motor, fused_step_ops: bool, grid=None, d_state: Optional[int] = None, channels_last: bool = False):
    """(the engine's evolve_step for enable() to install, or None to keep the engine's own; the
    carried step(psi, (h, c)) the episode rolls out for an engine with memory, else None; why the
    engine's own step is kept although fused_step_ops asked for the fused one, else None).
    `grid` and `d_state` size the probes when the engine holds no psi; `channels_last`: the fused
    pack writes NHWC (an engine without memory)."""
    check_engine_state(motor)
    operator = motor.operator
    memory = has_memory(motor)
    check_operator_call(operator, memory)
    # The engine's rule reads the class of what it calls: a compiled UNetUnitary (OptimizedModule) is additive there.
    gamma, multiplicative = engine_gamma(motor), stock.is_multiplicative(operator)
    shape, dtype = probe_shape(motor, grid, d_state)
    jumps = discontinuity(compiled_module(operator), _probe_input(operator, shape, dtype), memory) \
        if fused_step_ops else None
    if not fused_step_ops or jumps is not None:
        if compiled_module(operator) is not operator:
            named = f"{type(operator).__name__} (torch.compile of {type(operator._orig_mod).__name__})"
            own_step = ("The engine's own step would run one compiled graph in the forward (no grad) and another in "
                        "the recompute (grad), which can round differently")
            if jumps is None:
                raise TypeError(f"enable(): {named} with fused_step_ops=False; fused_step_ops=True runs the module it "
                                f"wraps\n{own_step}")
            raise TypeError(f"enable(): {named} keeps the engine's own step, its output jumping with its input; set "
                            f"motor.operator to the module it wraps (operator._orig_mod)\n{own_step}, into other "
                            f"jumps ({jumps})")
        why = None if jumps is None else (
            f"{type(operator).__name__}'s output jumps with its input ({jumps}): the fused step, rounding "
            "differently from the engine's, would give other jumps")
        return None, (EngineMemoryStep(motor) if memory else None), why
    if not memory:
        step = FusedEngineStep(motor, gamma, channels_last)
        check_engine_step(motor, step, None, shape, dtype, multiplicative)
        return step, None, None
    carried = FusedMemoryStep(motor, gamma)
    check_engine_step(motor, None, carried, shape, dtype, multiplicative)
    return MemoryStep(motor, carried), carried, None


def _probe_input(operator, shape, dtype):
    """The packed random psi the discontinuity probe runs the operator on, drawn from a generator
    of its own, in the operator's parameters' dtype and device."""
    parameter = next(operator.parameters())
    draw = torch.Generator().manual_seed(0)
    psi = torch.randn(shape, dtype=dtype, generator=draw).to(parameter.device)
    return qca_pack(psi, parameter.dtype)


def memory_of(motor) -> Optional[tuple]:
    return motor.state.h_state, motor.state.c_state


def store_memory(motor, memory) -> None:
    motor.state.h_state, motor.state.c_state = (m.detach() if m is not None else None for m in memory)
