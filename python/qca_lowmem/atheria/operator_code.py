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

import itertools
import os
import types
import weakref
from operator import is_
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .. import _torch_private as torch_private
from ..ops import stock_block_call
from .code_identity import NOT_CALLED, followed_class, functions_of, not_recorded, reads

_TORCH_FILES = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_MODULE_OWN = frozenset(vars(nn.Module()))  # what torch keeps on every module (its dicts of parameters, hooks...)
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


def class_unfollowed(cls: type, judged: Optional[dict] = None) -> Optional[str]:
    """None when a call of an instance of `cls` runs only code qca_lowmem follows, else what it does
    not follow. `judged`: the verdicts of the classes of its MRO already judged in this walk."""
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


def _held_callables(module: nn.Module) -> list:
    """(name, value) of each callable the module holds on the instance (not a submodule: a function
    set on it), which followed code may call in place of what it was followed with."""
    return [(name, value) for name, value in vars(module).items()
            if name not in _MODULE_OWN and callable(value) and not isinstance(value, (nn.Module, torch.Tensor, type))]


def operator_unfollowed(operator: nn.Module) -> Optional[str]:
    """None when calling `operator` runs only code qca_lowmem follows, else the first module that
    does not, named by its path, with why: about 60 us a walk of the default U-Net on a CPU."""
    modules = _modules(operator)
    judged: dict = {}
    verdicts = {cls: class_unfollowed(cls, judged) for cls in {type(module) for module in modules}}
    if not any(verdicts.values()):
        held = next((f"{type(module).__name__}.{name} ({type(value).__name__})" for module in modules
                     for name, value in _held_callables(module)), None)
        return None if held is None else f"{type(operator).__name__} ({held} is set on the instance)"
    name, module = next((name, module) for name, module in operator.named_modules() if verdicts[type(module)])
    return f"{type(operator).__name__}{'.' + name if name else ''} ({verdicts[type(module)]})"


def first_hook(operator: nn.Module) -> Optional[str]:
    """The first module hook that calling the operator runs (global, or on one of its layers), or None."""
    if torch_private.global_module_hooks():
        return "a global module hook"
    return next((f"a hook on {type(operator).__name__}{'.' + name if name else ''}"
                 for name, module in operator.named_modules() if torch_private.module_has_hooks(module)), None)


_SIMPLE = (type(None), bool, int, float, complex, str, bytes)


def _fingerprint(value):
    """What of a value a call could change, in simple values (compared with !=), or None where
    nothing is read: a simple value itself; a container's type, length and simple entries; a
    counter's repr; an object's simple attributes. Tensors (their writes are ops the rollout sees),
    modules, functions and classes not."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, dict):
        return "dict", len(value), tuple((k, v) for k, v in value.items() if isinstance(k, _SIMPLE) and isinstance(v, _SIMPLE))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value).__name__, len(value), tuple(v for v in value if isinstance(v, _SIMPLE))
    if isinstance(value, itertools.count):
        return repr(value)
    if isinstance(value, (torch.Tensor, nn.Module, type, types.FunctionType, types.ModuleType, types.MethodType)) \
            or not hasattr(value, "__dict__"):
        return None
    return tuple(sorted((k, v) for k, v in vars(value).items() if isinstance(v, _SIMPLE))) or None


def _shown(fingerprint) -> str:
    """A fingerprint in a few words: a container as its type, length and simple entries."""
    if isinstance(fingerprint, tuple) and len(fingerprint) == 3 and isinstance(fingerprint[1], int) \
            and fingerprint[0] in ("dict", "list", "tuple", "set", "frozenset"):
        text = f"a {fingerprint[0]} of {fingerprint[1]}" + (f": {fingerprint[2]!r}" if fingerprint[2] else "")
    else:
        text = repr(fingerprint)
    return text if len(text) <= 60 else text[:57] + "..."


class StateDrift:
    """The Python state that a call of an operator running code qca_lowmem does not follow may keep
    (operator_unfollowed): its modules' attributes, and what that code reads besides its arguments
    (closure cells, module globals: code_identity.reads), fingerprinted. Read after the episode's
    forward and again after its backward, whose recomputes call the operator (and its hooks) again
    where stock's episode does not: a change in between would start later episodes from another
    state than stock's, so the episode is refused, naming it."""

    def __init__(self, operator: nn.Module, functions: list):
        self.operator, self.functions = operator, functions
        self.after_forward = self.read()

    def read(self) -> Dict[str, object]:
        found = {}
        for name, module in self.operator.named_modules():
            for attr, value in vars(module).items():
                if attr not in _MODULE_OWN:
                    found[f"{type(self.operator).__name__}{'.' + name if name else ''}.{attr}"] = _fingerprint(value)
        for function in self.functions:
            found.update((name, _fingerprint(value)) for name, value in reads(function))
        return {name: value for name, value in found.items() if value is not None}

    def check(self) -> None:
        after = self.read()
        changed = next((name for name in self.after_forward.keys() | after.keys()
                        if self.after_forward.get(name) != after.get(name)), None)
        if changed is not None:
            raise RuntimeError(
                f"qca_lowmem: {changed} changed during the backward ({_shown(self.after_forward.get(changed))} -> "
                f"{_shown(after.get(changed))}): the rollout's recomputes call the operator (and its hooks) again, where "
                "stock's episode does not, so later episodes would start from another state than stock's. Keep "
                "that state in the operator's tensors, or enable(trainer, checkpoint='none'), which calls it as "
                "stock does")


def state_drift(operator: nn.Module) -> Optional[StateDrift]:
    """A StateDrift of `operator` read now, where it runs code qca_lowmem does not follow, else None."""
    modules = _modules(operator)
    owners = {owner for cls in {type(m) for m in modules} if stock_block_call(cls) is not None
              for owner in cls.__mro__ if owner is not object and _owner_verdict(owner) is not None}
    held = [getattr(value, "__func__", value) for module in modules for _, value in _held_callables(module)]
    if not owners and not held:
        return None
    functions = [f for owner in owners for value in vars(owner).values() for f in functions_of(value) or ()]
    return StateDrift(operator, functions + [f for f in held if isinstance(f, types.FunctionType)])
