"""torch.compile'd code a recomputing episode's step would reach, found before the episode runs it.

Every policy but plain autograd runs its steps under dispatch modes and saved-tensors hooks of its
own, which torch.compile does not trace: seeing such a mode it runs the code it wraps eagerly, and
marks that code to run eagerly from then on, so the episode would give eager torch's rounding and
random draws where plain autograd runs the compiled graph, and leave the user's compiled function
uncompiled for good. So `rollout` refuses, naming it, a step that is or holds such code where it
can be read without running the step: the step itself, a StepGraph's step, a partial's function
and arguments, a function's closure, defaults and the globals its code loads, a bound method's
object, a callable object's `__call__` and attributes, and the layers of any module among those (two
levels down: code reached only through further calls is not read); the noise likewise. A module
holding a compiled layer is refused whether or not the step calls that layer.
"""

import dis
import functools
import inspect
import types
from typing import Callable, Iterator, Optional, Tuple

import torch


def compiled_in_step(step_fn: Callable, name: str = "step_fn") -> Optional[str]:
    """What of step_fn (or the noise, `name`) is torch.compile'd, said; else None."""
    for held, value in _held(step_fn):
        what = name if held is None else f"{held} (held by {name})"
        if isinstance(value, torch.nn.Module):
            for layer, module in value.named_modules():
                if hasattr(module, "_orig_mod"):  # an OptimizedModule
                    compiled = f"a torch.compile'd {type(module._orig_mod).__name__}"
                    return f"{what} holds {compiled} ({layer})" if layer else f"{what} is {compiled}"
        elif _static(value, "_torchdynamo_orig_callable") is not None and not _static(value, "_torchdynamo_disable"):
            return f"{what} is a torch.compile'd function"  # (torch.compiler.disable marks its wrapper so too)
    return None


def _static(value, name: str):
    """An attribute read without running code of the value's (a Mock, a config whose __getattr__
    raises KeyError, a property), or None."""
    try:
        return inspect.getattr_static(value, name)
    except AttributeError:
        return None


def _held(step_fn: Callable, depth: int = 2) -> Iterator[Tuple[Optional[str], object]]:
    """(name, value): the callable itself (no name), then what it holds, `depth` levels down."""
    yield None, step_fn
    if depth == 0:
        return
    for name, value in _parts(step_fn):
        for inner, found in _held(value, depth - 1):
            yield (name if inner is None else f"{name}'s {inner}"), found


def _parts(value) -> Iterator[Tuple[str, object]]:
    if isinstance(value, functools.partial):
        yield "its function", value.func
        yield from ((f"argument {i}", arg) for i, arg in enumerate(value.args))
        yield from value.keywords.items()
        return
    inner = _static(value, "step_fn")  # a StepGraph's step
    if inner is not None and inner is not value:
        yield "its step", inner
    if isinstance(value, types.MethodType):  # the object and what it holds (self.operator)
        yield "its object", value.__self__
        yield from ((f"its object's {name}", held) for name, held in _attributes(value.__self__))
    function = value.__func__ if isinstance(value, types.MethodType) else value
    if isinstance(function, types.FunctionType):
        code = function.__code__
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                yield name, cell.cell_contents
            except ValueError:  # a cell not bound yet
                continue
        yield from zip(code.co_varnames[:code.co_argcount][::-1], (function.__defaults__ or ())[::-1])
        yield from (function.__kwdefaults__ or {}).items()
        loaded = {op.argval for op in dis.get_instructions(code) if op.opname == "LOAD_GLOBAL"}
        yield from ((name, function.__globals__[name]) for name in sorted(loaded) if name in function.__globals__)
    elif not isinstance(value, (types.BuiltinFunctionType, type, torch.nn.Module)) and callable(value):
        yield "its __call__", type(value).__call__
        yield from _attributes(value)


def _attributes(value) -> Iterator[Tuple[str, object]]:
    try:
        return iter(dict(vars(value)).items())
    except TypeError:  # no __dict__ (slots, a C object)
        return iter(())
