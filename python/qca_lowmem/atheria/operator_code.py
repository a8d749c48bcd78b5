"""Whether a call of the operator runs only code qca_lowmem follows: every class in the MRO of each
of its modules is torch's own (a `torch.nn` class whose functions all come from torch's files),
qca_lowmem's (likewise from its own), or one of the users' classes whose code is recorded
(`code_identity.followed_class`, per Python version); or the module's call is stock's ConvBlock's
(`ops.stock_block_call`, by its code: its forward is `return self.conv_block(x)`).

Only such an operator is called outside the calls stock makes (enable()'s probe of its ops), gets
the fused step and is captured: code it does not follow may keep state outside its tensors (a call
counter in a closure, a global, an attribute), which an extra call would move and a captured
graph's replays would not, both silently. Anything else keeps the engine's own step, and its steps
run eagerly, each recompute checked against its forward (`state_drift` then checks that the
recomputes left the state it reads as the forward left it). Checked at enable() and at every
episode: a class edited or a module swapped since then is seen.
"""

import os
import types
import weakref
from operator import is_
from typing import List, Optional, Tuple

import torch
from torch import nn

from .. import _torch_private as torch_private
from ..blocks import FusedConvBlock, fused_in_place
from ..ops import stock_block_call
from .code_identity import NOT_CALLED, followed_class, functions_of, not_recorded
from .code_reads import reads
from .episode_refusals import EpisodeRefused
from .state_drift import code_of, held_callables, hooks_code
from .user_modules import compiled_module

_TORCH_FILES = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_FILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the qca_lowmem package


def _outside(owner: type, files: str) -> Optional[str]:
    """The first thing `owner` defines that a call may run and that was not compiled from a file
    under `files`, or None."""
    for name, value in vars(owner).items():
        if name in NOT_CALLED:
            continue
        functions = functions_of(value)
        if functions is None or any(type(f) is not types.FunctionType or not f.__code__.co_filename.startswith(files)
                                    for f in functions):
            return name
    return None


# owner -> (what its namespace held when `_outside` read it, held so that the ids stay theirs;
# the verdict): read again when a value changed.
_READ: "weakref.WeakKeyDictionary[type, Tuple[tuple, Optional[str]]]" = weakref.WeakKeyDictionary()


def _outside_cached(owner: type, files: str) -> Optional[str]:
    read = tuple(vars(owner).values())
    known = _READ.get(owner)
    if known is not None and len(known[0]) == len(read) and all(map(is_, known[0], read)):
        return known[1]
    verdict = _outside(owner, files)
    _READ[owner] = (read, verdict)
    return verdict


def _owner_verdict(owner: type) -> Optional[str]:
    module = getattr(owner, "__module__", "") or ""
    if owner is nn.Module or module.startswith("torch.nn."):
        name = _outside_cached(owner, _TORCH_FILES)
        return None if name is None else f"{owner.__qualname__}.{name} is not torch's own code"
    if module == "qca_lowmem" or module.startswith("qca_lowmem."):
        name = _outside_cached(owner, _OWN_FILES)
        return None if name is None else f"{owner.__qualname__}.{name} is not qca_lowmem's own code"
    if module == "typing":  # Generic and Protocol: class machinery, nothing a call runs
        return None
    if all(name in NOT_CALLED for name in vars(owner)) or followed_class(owner) is not None:
        return None  # a class of theirs defining nothing a call runs, or one recorded
    why = not_recorded()
    return f"{module}.{owner.__qualname__} is not code qca_lowmem follows" + (f" ({why})" if why else "")


def _runs_as(cls: type) -> type:
    """The class whose code a call of an instance of `cls` runs: for a users' block fused in place,
    FusedConvBlock's while their class's call is stock's (its forward checks that at each call),
    else theirs."""
    own = fused_in_place(cls)
    if own is None:
        return cls
    return FusedConvBlock if stock_block_call(own) is None else own


def class_unfollowed(cls: type, judged: Optional[dict] = None) -> Optional[str]:
    """None when a call of an instance of `cls` runs only code qca_lowmem follows, else what it does
    not follow. `judged`: the verdicts of the classes of its MRO already judged in this walk."""
    cls = _runs_as(cls)
    if stock_block_call(cls) is None:
        return None
    judged = {} if judged is None else judged
    for owner in cls.__mro__:
        if owner is object:
            continue
        if owner not in judged:
            judged[owner] = _owner_verdict(owner)
        if judged[owner] is not None:
            return judged[owner]
    return None


def _modules(operator: nn.Module) -> list:
    """The operator's modules, a shared one as often as it is reached (Module.modules() costs
    several times more)."""
    pending = [operator]
    for module in pending:  # grows while walked
        pending.extend(child for child in module.__dict__["_modules"].values() if child is not None)
    return pending


def operator_unfollowed(operator: nn.Module) -> Optional[str]:
    """None when calling `operator` runs only code qca_lowmem follows, else the first module that
    does not, named by its path, with why: about 60 us a walk of the default U-Net on a CPU."""
    modules = _modules(operator)
    judged: dict = {}
    verdicts = {cls: class_unfollowed(cls, judged) for cls in {type(module) for module in modules}}
    if not any(verdicts.values()):
        held = next((f"{type(module).__name__}.{name} ({type(value).__name__})" for module in modules
                     for name, value in held_callables(module)), None)
        return None if held is None else f"{type(operator).__name__} ({held} is set on the instance)"
    name, module = next((name, module) for name, module in operator.named_modules() if verdicts[type(module)])
    return f"{type(operator).__name__}{'.' + name if name else ''} ({verdicts[type(module)]})"


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _draws_now(module: nn.Module) -> bool:
    """Whether one of torch's layers draws random numbers when called now (in training mode)."""
    if not module.training:
        return False
    if isinstance(module, nn.RReLU):
        return True
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout > 0
    return isinstance(module, _DROPOUTS) and module.p > 0


def random_draw(operator: nn.Module) -> Optional[str]:
    """The first of the operator's layers that draws random numbers when called now (torch's dropout
    layers with p above 0, RReLU, an attention's dropout; in training mode), named by its path, or None."""
    return next((f"{type(operator).__name__}{'.' + name if name else ''} ({type(module).__name__})"
                 for name, module in operator.named_modules() if _draws_now(module)), None)


def compiled_draws(operator) -> Optional[str]:
    """Why the fused step, which runs a torch.compile'd operator's module eagerly, would not give
    the compiled operator's answer: a layer of it draws random numbers, which the compiled code
    draws otherwise than eager torch; else None."""
    module = compiled_module(operator)
    draw = None if module is operator else random_draw(module)
    return None if draw is None else (
        f"{draw} draws random numbers, which {_compiled_named(type(operator).__name__, operator)} draws otherwise "
        "than its module run eagerly, as the fused step runs it")


def _compiled_named(path: str, compiled: nn.Module) -> str:
    return f"{path} (torch.compile of {type(compiled_module(compiled)).__name__})"


# Why an episode that recomputes cannot roll out a torch.compile'd operator on the engine's own
# step (seen: no compiled frame ran in such a checkpoint='step' episode, one a step in stock's).
RECOMPUTED_COMPILED = ("the episode runs each step without grad and again in the backward, under checks torch.compile "
                       "does not trace, so what it wraps runs eagerly or as another graph: not stock's compiled "
                       "graph, once a step with grad, which draws and rounds otherwise")


def compiled_in(operator: nn.Module) -> Optional[Tuple[str, str]]:
    """(the first torch.compile'd module or function a call of the operator runs, named; what to
    change for the engine's own step to run it uncompiled), or None: the operator itself or one of
    its layers compiled, or a compiled function its code not followed holds or reads (a method,
    a global: code_identity.reads)."""
    for name, module in operator.named_modules():
        if compiled_module(module) is not module:
            suffix = f".{name}" if name else ""
            where = f"motor.operator{suffix}"
            return (_compiled_named(f"{type(operator).__name__}{suffix}", module),
                    f"set {where} to the module it wraps ({where}._orig_mod)")
    for function in unfollowed_code(operator)[1] or ():
        for label, value, *_ in [(function.__qualname__, function), *reads(function)]:
            if hasattr(value, "_torchdynamo_orig_callable"):  # what torch.compile returns for a function
                return (f"{label} (a torch.compile'd function {type(operator).__name__}'s code calls)",
                        f"call {label} uncompiled (its _torchdynamo_orig_callable)")
    return None


def refuse_compiled_own_step(operator, recomputes: bool) -> None:
    """The engine's own step (kept by enable(), or a fallback said above) on an operator that is or
    holds a torch.compile'd module, in an episode that recomputes: enable() refuses that, and so
    does the episode."""
    compiled = compiled_in(operator) if recomputes else None
    if compiled is not None:
        raise EpisodeRefused(
            f"qca_lowmem: the episode runs the engine's own step now, on {compiled[0]}: {RECOMPUTED_COMPILED}; "
            f"disable(trainer) and enable(trainer, checkpoint='none'), which recomputes nothing, or {compiled[1]}")


def first_hook(operator: nn.Module) -> Optional[str]:
    """The first module hook that calling the operator runs (global, or on one of its layers), or None."""
    if torch_private.global_module_hooks():
        return "a global module hook"
    return next((f"a hook on {type(operator).__name__}{'.' + name if name else ''}"
                 for name, module in operator.named_modules() if torch_private.module_has_hooks(module)), None)


def unfollowed_code(operator: nn.Module) -> Tuple[List[Tuple[str, object]], Optional[list]]:
    """(the holders of the state a call of `operator` may keep, with the names to say; the functions
    it runs that qca_lowmem does not follow: its unfollowed classes', callables held on its modules,
    its forward hooks (theirs and the global ones), or None where it runs only followed code and no
    hook)."""
    modules = _modules(operator)
    owners = {owner for cls in {_runs_as(type(m)) for m in modules} if stock_block_call(cls) is not None
              for owner in cls.__mro__ if owner is not object and _owner_verdict(owner) is not None}
    hook_holders, hook_functions = hooks_code(torch_private.forward_hooks(modules))
    holders = [(type(operator).__name__, operator)] + hook_holders
    if owners or hook_holders or hook_functions or any(held_callables(module) for module in modules):
        return holders, code_of(modules, owners) + hook_functions
    return holders, None


def backward_hook_code(operator: nn.Module) -> list:
    """The objects and functions a backward through calls of `operator` runs as hooks (module,
    global and parameter hooks): stock's backward runs them too."""
    holders, functions = hooks_code(torch_private.backward_run_hooks(_modules(operator)))
    return [holder for _, holder in holders] + functions
