"""The one-time probe behind the fused step: enable() installs the fused pack/update on an
engine only where the engine's own `evolve_step` computes the same step.

Both steps run once under no_grad on a random psi with the operator's `forward` replaced by a
fixed random delta (so weights, buffers and membranes play no part); the operator's calls and the
new psi must agree within 64 units of rounding. The engine, its state and every RNG are put back
as found, and nothing is drawn from the trainer's generators.
"""

import contextlib
import inspect
import math
from typing import Callable, Optional

import torch

from ..recompute import generators
from .user_modules import compiled_module

SUPPORTED_ENGINES = (
    "qca_lowmem supports engines whose state psi is a complex (B, H, W, d) tensor, stepped by the Cartesian "
    "engine step (delta = operator(pack(psi)); psi + delta*psi for UNetUnitary, else psi + delta; minus "
    "GAMMA_DECAY*psi; normalised per cell), with or without has_memory"
)


def _engine_state(motor):
    """motor.state, or None where the engine has none (a property that cannot make one counts as none)."""
    return getattr(motor, "state", None)


def check_engine_state(motor) -> None:
    """Refuse, naming the engine class, an engine whose state the rollout cannot carry: psi must
    be a complex (B, H, W, d) tensor (or None before the first reset), the memory tensors."""
    if not hasattr(motor, "__dict__"):
        raise TypeError(f"enable(): {type(motor).__name__} keeps its attributes in __slots__, not an instance "
                        "__dict__: the switch cannot put its step on it for an episode nor put back what a probe "
                        "of its step changes; qca_lowmem.rollout(motor.evolve_step, ...) rolls its episodes out")
    state = _engine_state(motor)
    wanted = {"psi": "a complex (B, H, W, d) tensor", "h_state": "a tensor", "c_state": "a tensor"}
    for name, kind in wanted.items():
        value = getattr(state, name, None)
        if value is None:
            continue
        if not (_is_psi(value) if name == "psi" else isinstance(value, torch.Tensor)):
            raise _state_refusal(motor, f"state.{name} is {_found(value)}, not {kind}")
    if not isinstance(getattr(state, "psi", None), torch.Tensor) and callable(getattr(motor, "get_initial_state", None)):
        _check_drawn_state(motor)


def _is_psi(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex() and value.dim() == 4


def _found(value) -> str:
    """What a refusal says was found instead."""
    return (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
            else f"a {type(value).__name__}")


def _state_refusal(motor, why: str) -> TypeError:
    return TypeError(f"enable(): {type(motor).__name__}.{why}; no setting changes that: train this engine on "
                    f"stock, without enable()\n{SUPPORTED_ENGINES}")


def _check_drawn_state(motor) -> None:
    """An engine that keeps no state.psi starts its episodes from motor.get_initial_state(batch)
    (QC_Trainer_v3's always, their QC_Trainer_v4's then): one call under no_grad, the engine and
    every RNG left as found, must give a complex (B, H, W, d) tensor (their HARMONIC engine gives
    a real (B, d, H, W) one, which its step hands back untouched: no gradient reaches the operator)."""
    device = next(motor.operator.parameters()).device
    try:
        with torch.no_grad(), _engine_left_as_found(motor, device):
            psi = motor.get_initial_state(1)
    except Exception as error:  # any failure is the refusal's reason
        raise _state_refusal(motor, f"get_initial_state(1) raised {type(error).__name__}: "
                             f"{(str(error).splitlines() or [''])[0][:100]} (it keeps no state.psi)") from None
    if not _is_psi(psi):
        raise _state_refusal(motor, f"get_initial_state(1), where it keeps no state.psi, gives {_found(psi)}, not a "
                             "complex (B, H, W, d) tensor")


# The probe's update moves each cell by up to this fraction of its norm: large, so a missing or
# different term shows far above rounding, and bounded, so no cell's norm nears zero.
PROBE_UPDATE_SIZE = 0.5
PROBE_GRID = (8, 8)  # where neither the engine's psi nor the trainer tells the grid
_MISSING = object()


def probe_shape(motor, grid, d_state):
    """(shape, dtype) of the probe psi: the engine's own psi's where it holds one."""
    psi = getattr(_engine_state(motor), "psi", None)
    if isinstance(psi, torch.Tensor):
        return tuple(psi.shape), psi.dtype
    parameter = next(motor.operator.parameters())
    dtype = torch.complex128 if parameter.dtype == torch.float64 else torch.complex64
    height, width = grid if grid is not None else PROBE_GRID
    return (1, height, width, d_state), dtype


class _OperatorProbe:
    """Stands in for operator.forward while both steps run: records each call's arguments and
    returns a fixed delta (and memory), so the steps are compared whatever the weights, and the
    operator itself (its buffers, a membrane) is never run."""

    def __init__(self, forward, output):
        self.signature = _signature(forward)
        self.output = output
        self.calls = []

    def __call__(self, *args, **kwargs):
        values = list(args) + list(kwargs.values())
        if self.signature is not None:
            try:
                bound = self.signature.bind(*args, **kwargs)
                bound.apply_defaults()  # operator(x) and operator(x, None, None) are the same call
                values = _flat_arguments(self.signature, bound.arguments)
            except TypeError:
                pass
        self.calls.append([v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values])
        return self.output


def _flat_arguments(signature, arguments) -> list:
    """The bound arguments' values with *args and **kwargs spread (a compiled module's forward
    takes both), so that calls compare value by value."""
    values = []
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            values += list(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            values += list(value.values())
        else:
            values.append(value)
    return values


def _signature(forward):
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _forward_replaced(operator, probe):
    """operator.forward, and that of the module a compiled operator wraps, replaced by `probe`."""
    modules = [operator] + ([compiled_module(operator)] if compiled_module(operator) is not operator else [])
    owns = [vars(module).get("forward", _MISSING) for module in modules]
    for module in modules:
        module.forward = probe
    try:
        yield
    finally:
        for module, own in zip(modules, owns):
            if own is _MISSING:
                del module.forward
            else:
                module.forward = own


@contextlib.contextmanager
def _engine_left_as_found(motor, device):
    """Puts back what one call of the engine's step may change: the attributes of the engine and
    of its state (rebound, added, or tensors changed in place) and every random generator."""
    owners = [motor] + [s for s in (_engine_state(motor),) if hasattr(s, "__dict__")]
    attributes = [(vars(owner), dict(vars(owner))) for owner in owners]
    tensors = [(t, t._version, t.detach().clone()) for _, saved in attributes for t in saved.values()
               if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]
    with generators.left_as_found(generators.every_cuda(device)):
        try:
            yield
        finally:
            for live, saved in attributes:
                live.clear()
                live.update(saved)
            with torch.no_grad():
                for tensor, version, copy in tensors:
                    if tensor._version != version:
                        tensor.copy_(copy)


def _gap(actual, expected) -> float:
    """max |actual - expected| / max(1, max |expected|); inf where they cannot be compared."""
    if actual is None or expected is None:
        return 0.0 if actual is expected else math.inf
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return math.inf
    wide = torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    actual, expected = actual.detach().to(expected.device, wide), expected.detach().to(dtype=wide)
    if expected.numel() == 0:
        return 0.0
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def _calls_differ(actual_calls, expected_calls, tolerance) -> bool:
    (actual,), (expected,) = actual_calls, expected_calls
    return len(actual) != len(expected) or any(
        _gap(a, e) > tolerance if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor) else a != e
        for a, e in zip(actual, expected))


def check_engine_step(motor, fused: Optional[Callable], carried: Optional[Callable], shape, dtype,
                      multiplicative: bool) -> None:
    """Refuse, naming the engine class, an engine whose own evolve_step is not the step enable()
    installs (`fused`, or `carried` for an engine with memory): both run once, under no_grad, on
    the same random psi (and memory) with the operator's forward replaced by a fixed delta. The
    trainer is left as found: engine and state attributes, RNGs, the operator untouched."""
    operator, engine = motor.operator, type(motor).__name__
    device = next(operator.parameters()).device
    real = torch.float64 if dtype == torch.complex128 else torch.float32
    tolerance = 64 * torch.finfo(real).eps  # the fused and the plain step differ by ~2 eps on the CPU
    draw = torch.Generator().manual_seed(0)  # enable() draws nothing from the trainer's RNG

    def randn(*size):
        return torch.randn(size, generator=draw, dtype=real).to(device)

    batch, height, width, d_state = shape
    psi = torch.complex(randn(*shape), randn(*shape))
    psi = psi / torch.sqrt(torch.sum(torch.abs(psi) ** 2, dim=-1, keepdim=True))
    # |delta_k| <= bound per component: a multiplicative update scales each component by at most
    # that, an additive one adds at most that times sqrt(d) to a cell of norm 1.
    bound = PROBE_UPDATE_SIZE / math.sqrt(2) / (1.0 if multiplicative else math.sqrt(d_state))
    uniform = torch.rand((batch, 2 * d_state, height, width), generator=draw, dtype=real).to(device)
    delta = (2 * uniform - 1) * bound
    memory_in = (randn(batch, 2, height, width), randn(batch, 2, height, width))
    memory_out = (randn(batch, 2, height, width), randn(batch, 2, height, width))
    probe = _OperatorProbe(compiled_module(operator).forward, (delta, *memory_out) if carried else delta)
    with torch.no_grad(), _forward_replaced(operator, probe):
        if carried:
            expected, expected_memory = carried(psi, memory_in)
        else:
            expected, expected_memory = fused(psi), None
        expected_calls, probe.calls = probe.calls, []
        with _engine_left_as_found(motor, device):
            if carried:
                motor.state.h_state, motor.state.c_state = memory_in
            try:
                actual = motor.evolve_step(psi)
            except Exception as error:  # an engine that cannot step a plain complex psi is not the Cartesian step
                first_line = (str(error).splitlines() or [""])[0][:100]
                reason, never_calls = f"on a random psi it raised {type(error).__name__}: {first_line}", False
            else:
                never_calls = not probe.calls
                kept = (motor.state.h_state, motor.state.c_state) if carried else None
                reason = _step_difference(probe.calls, expected_calls, actual, expected, kept, expected_memory,
                                          tolerance, carried is not None)
    if reason is not None:
        # A step that never calls the operator gives its parameters no gradient, whoever rolls it out.
        advice = ("no setting changes that: train this engine on stock, without enable()" if never_calls
                  else "fused_step_ops=False rolls out the engine's own step instead")
        raise TypeError(f"enable(): {engine}.evolve_step is not the Cartesian step ({reason}); {advice}\n"
                        f"{SUPPORTED_ENGINES}")


def _step_difference(calls, expected_calls, actual, expected, kept, expected_memory, tolerance, memory):
    """Why the engine's probed step is not the fused one, or None."""
    if len(calls) != 1:
        return f"it called the operator {len(calls)} times, the Cartesian step once"
    if _calls_differ(calls, expected_calls, tolerance):
        return "it called the operator on another input than " + ("(pack(psi), h, c)" if memory else "pack(psi)")
    if not isinstance(actual, torch.Tensor):
        return f"it returned a {type(actual).__name__}"
    if actual.shape != expected.shape:
        return f"it returned shape {tuple(actual.shape)} for psi of shape {tuple(expected.shape)}"
    gap = _gap(actual, expected)
    if gap > tolerance:
        return f"its new psi differs by {gap:.1e}, tolerance {tolerance:.0e}"
    if memory and any(_gap(k, e) > tolerance for k, e in zip(kept, expected_memory)):
        return "it keeps other memory on motor.state than the operator returned"
    return None
