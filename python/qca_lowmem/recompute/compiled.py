"""A torch.compile'd step, found before an episode that would run it uncompiled.

Every policy but plain autograd runs its steps under saved-tensors hooks and dispatch modes of its
own, which torch.compile does not trace: the compiled code does not run there (seen: no compiled
frame ran in a checkpoint='step' episode, two in plain autograd's), so the step runs as eager
torch, rounding and drawing random numbers otherwise than the compiled graph plain autograd runs.
"""

import types
from typing import Callable, Iterator, Optional, Tuple

import torch


def compiled_in_step(step_fn: Callable) -> Optional[str]:
    """What of step_fn is torch.compile'd, said: itself, or what it calls directly (a module's
    layers, a function's closure and the globals its code names); else None."""
    for name, value in _called_directly(step_fn):
        where = "step_fn is" if name is None else f"step_fn calls {name},"
        if isinstance(value, torch.nn.Module):
            for layer, module in value.named_modules():
                if hasattr(module, "_orig_mod"):  # an OptimizedModule
                    held = f" (its {layer})" if layer else ""
                    return f"{where} a torch.compile'd {type(module._orig_mod).__name__}{held}"
        elif hasattr(value, "_torchdynamo_orig_callable"):  # what torch.compile returns for a function
            return f"{where} a torch.compile'd function"
    return None


def _called_directly(step_fn: Callable) -> Iterator[Tuple[Optional[str], object]]:
    """(name, value): the step itself (no name), a StepGraph's step, what a function reads."""
    yield None, step_fn
    inner = getattr(step_fn, "step_fn", None)  # a StepGraph's step
    if inner is not None and inner is not step_fn:
        yield from _called_directly(inner)
    function = step_fn.__func__ if isinstance(step_fn, types.MethodType) else step_fn
    if not isinstance(function, types.FunctionType):
        return
    code = function.__code__
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # a cell not bound yet
            continue
    for name in code.co_names:
        if name in function.__globals__:
            yield name, function.__globals__[name]
