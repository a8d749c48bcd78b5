"""State that code qca_lowmem does not follow keeps outside its tensors, checked across the backward.

A recomputing episode runs each step again in its backward, where stock's episode runs it once:
the operator (and its hooks), the engine's own step and the trainer's noise injector. Where their
code is followed (code_identity.py: torch's, qca_lowmem's, the users' recorded versions) a call
keeps nothing outside its tensors; any other code may (a call counter on the engine, a list a
noise injector logs to, a generator of its own, a global). The recompute check sees a step that
computes otherwise; it cannot see state the extra calls move for later episodes (a counter stock
leaves at T calls an episode stands at 2T, and a threshold on it is crossed an episode early). So
the episode reads that state after its forward and again after its backward, and refuses the
episode on a change, naming it; checkpoint="none" calls everything as stock does.
"""

import collections
import functools
import itertools
import pickle
import random
import sys
import types
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .code_identity import functions_of
from .code_reads import library_function, reads, users_module

_MODULE_OWN = frozenset(vars(nn.Module()))  # what torch keeps on every module (its dicts of parameters, hooks...)
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
_REBOUND_IN = (list, dict, collections.deque)  # the containers whose entries a call may bind anew (`log["last"] = psi`)
_NUMPY_BYTES = 1 << 20  # a numpy array up to this size is read by its bytes; a larger one by its shape alone


def _generator_state(value):
    """A random generator's state as bytes, or None for anything else."""
    if isinstance(value, torch.Generator):
        return bytes(value.get_state().numpy())
    if isinstance(value, random.Random):
        return pickle.dumps(value.getstate())
    if type(value).__module__.startswith("numpy.random"):  # a RandomState or Generator (numpy not imported here)
        if hasattr(value, "bit_generator"):
            return pickle.dumps(value.bit_generator.state)
        if hasattr(value, "get_state"):
            return pickle.dumps(value.get_state())
    return None


def _position(value):
    """Where an iterator stands (a schedule `next()` reads), or None for anything else: a Python
    generator by its frame (the instruction it stopped at, its simple locals); a builtin iterator
    by its reduction (a list iterator's index, a dict iterator's keys left)."""
    if isinstance(value, types.GeneratorType):
        frame = value.gi_frame
        return "done" if frame is None else (frame.f_lasti, tuple(
            (name, held) for name, held in frame.f_locals.items() if isinstance(held, _SIMPLE)))
    if not hasattr(type(value), "__next__"):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # itertools' pickling, deprecated in 3.12
            reduced = value.__reduce__()
    except Exception:  # an iterator that does not reduce: its position is not read
        return None
    return tuple(tuple(map(_fingerprint, part)) if isinstance(part, tuple) else _fingerprint(part)
                 for part in reduced[1:])


def _numpy_value(value):
    """A numpy array's or scalar's (`np.int64` counter) shape, type and, up to _NUMPY_BYTES, bytes;
    None for anything else (numpy is not imported here)."""
    if type(value).__module__ != "numpy" or not hasattr(value, "tobytes"):
        return None
    small = value.nbytes <= _NUMPY_BYTES
    return type(value).__name__, value.shape, str(value.dtype), value.tobytes() if small else "larger than 1 MiB"


def _rebound(value) -> bool:
    """Whether a call binding another in a value's place is put back rather than read: a tensor, or
    a tuple holding one (`self.last = (psi, out)`), which no op writes to."""
    return isinstance(value, torch.Tensor) or isinstance(value, tuple) and any(
        isinstance(held, torch.Tensor) for held in value)


class _Bound:
    """A tensor as the attribute holding it: the same only while it holds the same tensor (its
    writes in place are ops the rollout sees; a new tensor bound there is not)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __eq__(self, other):
        return isinstance(other, _Bound) and other.tensor is self.tensor

    def __hash__(self):
        return id(self.tensor)

    def __repr__(self):
        return f"a tensor of shape {tuple(self.tensor.shape)}"


def _fingerprint(value, depth: int = 3, bound: Optional[list] = None, held: bool = False):
    """What of a value a call could change, in simple values (compared with !=), or None where
    nothing is read: a simple value itself; a tensor by identity (another bound in its place); a
    random generator's state; a numpy array or scalar by its bytes (up to 1 MiB); an iterator's
    position; a container's (a deque's too) type, length and entries read alike but tensors,
    `depth` levels down (`self.log["norms"].append(...)`), which `bound` collects as (the container,
    the key, the tensor) where a call may bind another in their place; a counter's repr. An object
    is read attribute by attribute (_entries), or so here where a container holds it (`held`: a
    callback in a list)."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.Tensor):
        return _Bound(value)
    generator = _generator_state(value)
    if generator is not None:
        return "generator", generator
    numpy_value = _numpy_value(value)
    if numpy_value is not None:
        return numpy_value
    if isinstance(value, itertools.count):  # its repr, on every Python (its reduction is going in 3.14)
        return repr(value)
    position = _position(value)
    if position is not None:
        return "iterator", position
    if isinstance(value, _CONTAINERS):
        pairs = list(value.items() if isinstance(value, dict) else enumerate(value)) if depth > 0 else []
        if bound is not None and isinstance(value, _REBOUND_IN):
            bound += [(value, k, v) for k, v in pairs if _rebound(v)]
        read = [(k, _fingerprint(v, depth - 1, bound, held=True)) for k, v in pairs
                if isinstance(k, _SIMPLE) and not isinstance(v, torch.Tensor)]
        return _Container(type(value).__name__, len(value), tuple((k, v) for k, v in read if v is not None))
    if held and depth > 0 and not isinstance(value, type) and _by_attribute(value):
        attributes = _own_attributes(value)
        if bound is not None:
            bound += [(value, name, v) for name, v in attributes.items() if _rebound(v)]
        return _Object(type(value).__name__, tuple((name, _fingerprint(v, depth - 1, bound, held=True))
                                                   for name, v in attributes.items() if not isinstance(v, torch.Tensor)))
    return None


class _Container(NamedTuple):
    """A container's fingerprint: its type's name, length and (key or index, fingerprint) of the entries read."""

    kind: str
    length: int
    entries: tuple


class _Object(NamedTuple):
    """The fingerprint of an object a container holds: its class's name, (attribute, fingerprint) of those read."""

    kind: str
    attributes: tuple


def _difference(before, after, path: str = "") -> Tuple[str, object, object]:
    """Where two fingerprints first differ, inside containers and the objects they hold: (the path
    from the value read, `[key]` and `.attribute`, the fingerprints there)."""
    if isinstance(before, _Container) and isinstance(after, _Container) and before[:2] == after[:2]:
        pairs, nested, suffix = before.entries, after.entries, "[{!r}]"
    elif isinstance(before, _Object) and isinstance(after, _Object) and before.kind == after.kind:
        pairs, nested, suffix = before.attributes, after.attributes, ".{}"
    else:
        return path, before, after
    was, now = dict(pairs), dict(nested)
    key = next((k for k in [*was, *(k for k in now if k not in was)] if was.get(k) != now.get(k)), None)
    return _difference(was.get(key), now.get(key), path + suffix.format(key)) if key is not None else (path, before, after)


_BY_ATTRIBUTE = object()  # _whole's answer for a value read attribute by attribute
_GONE = object()  # _held's answer for an attribute or entry no longer there


def _own_attributes(value) -> dict:
    """An object's attributes: those in its __dict__ and the slots set (`@dataclass(slots=True)`)."""
    found = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for owner in type(value).__mro__:
        slots = vars(owner).get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            name = f"_{owner.__name__.lstrip('_')}{slot}" if slot.startswith("__") and not slot.endswith("__") else slot
            if name not in ("__dict__", "__weakref__") and name not in found and hasattr(value, name):
                found[name] = getattr(value, name)
    return found


def _held(owner, key):
    """What an object's attribute (a closure's cell's contents), or a container's entry, holds now, or _GONE."""
    if isinstance(owner, dict):
        return owner.get(key, _GONE)
    if isinstance(owner, _REBOUND_IN):
        return owner[key] if key < len(owner) else _GONE
    try:
        return getattr(owner, key)
    except (AttributeError, ValueError):  # gone, or a cell emptied
        return _GONE


def _by_attribute(value) -> bool:
    """Whether a value is read attribute by attribute: a plain object (slots too), or a function of
    theirs holding attributes (`step.calls += 1`)."""
    if isinstance(value, types.FunctionType):
        return bool(vars(value)) and not library_function(value)
    if isinstance(value, (nn.Module, types.ModuleType, types.MethodType)):
        return False
    return hasattr(value, "__dict__") or any("__slots__" in vars(owner) for owner in type(value).__mro__[:-1])


def _whole(value, bound: Optional[list] = None):
    """A value's fingerprint (_fingerprint, collecting `bound`) where it is read whole, else
    _BY_ATTRIBUTE: a value _by_attribute, or a class of the users' own (`class Counters: calls =
    0`, read as a global)."""
    if isinstance(value, type):
        return _BY_ATTRIBUTE if users_module(sys.modules.get(value.__module__)) else None
    fingerprint = _fingerprint(value, bound=bound)
    return _BY_ATTRIBUTE if fingerprint is None and _by_attribute(value) else fingerprint


def _entries(name: str, value, seen: set, bound: Optional[list], depth: int = 2):
    """(name, fingerprint) of what of a value a call could change: the value's own; for a plain
    object or a class of theirs, one per attribute read whole (_fingerprint: a simple value, a
    container, a generator, a numpy array, an iterator; not a tensor), and those of a plain
    object it holds (`holder.stats["calls"]`, two levels down) not read already (`seen`: ids, the
    holders' own included), so each is named once, by its first path. `bound` collects (the object
    or container, the attribute or key, the value) of each tensor held on the way (_rebound)."""
    whole = _whole(value, bound)
    if whole is not _BY_ATTRIBUTE:
        yield name, whole
        return
    seen.add(id(value))
    if isinstance(value, functools.partial):  # what it passes its function (`partial(f, calls=[0])`)
        for key, held in [*enumerate(value.args), *value.keywords.items()]:
            yield from _entries(f"{name}'s argument {key}", held, seen, bound, depth)
        return
    for attr, held in _own_attributes(value).items():
        if bound is not None and _rebound(held):  # bound anew: put back by check()
            bound.append((value, attr, held))
        if isinstance(held, torch.Tensor):  # written in place: the rollout sees it
            continue
        whole = _whole(held, bound)
        if whole is not _BY_ATTRIBUTE:
            yield f"{name}.{attr}", whole
        elif depth > 1 and id(held) not in seen:
            yield from _entries(f"{name}.{attr}", held, seen, bound, depth - 1)


def _shown(fingerprint) -> str:
    """A fingerprint in a few words: a container as its type, length and simple entries."""
    if isinstance(fingerprint, tuple) and len(fingerprint) == 2 and fingerprint[0] == "generator":
        return "a random generator's state"
    if isinstance(fingerprint, _Object):
        return f"a {fingerprint.kind}"
    if isinstance(fingerprint, _Container):
        simple = [(k, v) if fingerprint.kind == "dict" else v for k, v in fingerprint.entries if isinstance(v, _SIMPLE)]
        text = f"a {fingerprint.kind} of {fingerprint.length}" + (f": {simple!r}" if simple else "")
    else:
        text = repr(fingerprint)
    return text if len(text) <= 60 else text[:57] + "..."


def held_callables(holder) -> list:
    """(name, value) of each callable an object holds on the instance (on a module: not a
    submodule), which its followed code may call in place of what it was followed with."""
    own = _MODULE_OWN if isinstance(holder, nn.Module) else ()
    return [(name, value) for name, value in vars(holder).items()
            if name not in own and callable(value) and not isinstance(value, (nn.Module, torch.Tensor, type))]


def hooks_code(hooks) -> Tuple[List[Tuple[str, object]], list]:
    """(holders, functions) of `hooks`: a plain function; a bound method's function, and its object
    as a holder; a callable object as a holder, with its class's functions."""
    holders, functions = [], []
    for hook in hooks:
        if isinstance(hook, types.FunctionType):
            functions.append(hook)
        elif isinstance(hook, types.MethodType):
            functions.append(hook.__func__)
            holders.append((f"the hook {hook.__qualname__}'s {type(hook.__self__).__name__}", hook.__self__))
        elif hasattr(hook, "__dict__"):
            holders.append((f"the hook {type(hook).__name__}", hook))
            functions += code_of([], own_classes(hook))
    return holders, [f for f in functions if isinstance(f, types.FunctionType)]


def own_classes(value) -> list:
    """The classes of `value`'s MRO that can define what a call runs (all but `object`)."""
    return [owner for owner in type(value).__mro__ if owner is not object]


def _unbound(value):
    """The callable a functools.partial calls, or `value`."""
    while isinstance(value, functools.partial):
        value = value.func
    return value


def code_of(holders, classes) -> list:
    """The plain functions a call on `holders` may run: those `classes` define (their methods,
    static and class methods, properties' accessors) and the functions the holders hold on the instance."""
    functions = [f for owner in classes for value in vars(owner).values() for f in functions_of(value) or ()]
    held = [getattr(_unbound(value), "__func__", _unbound(value)) for holder in holders
            for _, value in held_callables(holder)]
    return functions + [f for f in held if isinstance(f, types.FunctionType)]


class StateDrift:
    """The Python state the steps' unfollowed code may keep: the attributes of what holds it (an
    operator's every module; the engine; the noise injector), and what that code reads besides its
    arguments (closure cells, module globals, their modules' attributes: code_identity.reads),
    fingerprinted when made (after the episode's forward) and compared by check() (after its
    backward). A tensor the recomputes bound anew (snntorch's `reset`, a running total
    `self.x = self.x + ...`, `self.plot["last"] = (psi, out)`) is bound again to the forward's, as
    stock's episode leaves it; any other change refuses the episode."""

    def __init__(self, holders: List[Tuple[str, object]], functions: list, runs: str, backward_hooks: list = ()):
        """`holders`: (the name to say, the object); `runs`: what the recomputes run again, in words;
        `backward_hooks`: the objects and functions the backward runs as hooks, as stock's does."""
        self.holders, self.functions, self.runs = holders, functions, runs
        self.backward_hooks = {id(hook) for hook in backward_hooks}
        self.source: Dict[str, object] = {}  # a fingerprint's name -> the holder or function it was read from
        self.bound: list = []  # where the forward left a tensor: read()'s `bound`
        self.after_forward = self.read(self.bound)

    def _attributes(self):
        """(the holder, the name to say, the owner, its attribute, the value) of every holder's
        attribute, and (the holder, the class's name, its class, None, the class) of each class of
        theirs in the MRO of its owners (`type(self).calls += 1`), once each."""
        classes = set()
        for label, holder in self.holders:
            owners = holder.named_modules() if isinstance(holder, nn.Module) else [("", holder)]
            for name, owner in owners:
                for attr, value in vars(owner).items():
                    if attr not in _MODULE_OWN:
                        yield holder, f"{label}{'.' + name if name else ''}.{attr}", owner, attr, value
                for cls in type(owner).__mro__:
                    if id(cls) not in classes and _whole(cls) is _BY_ATTRIBUTE:
                        classes.add(id(cls))
                        yield holder, f"{cls.__module__}.{cls.__qualname__}", cls, None, cls

    def read(self, bound: Optional[list] = None) -> Dict[str, object]:
        """The fingerprints; `bound` collects (the object or container, the attribute or key, the
        value, the holder or function it was read from, the name to say) of every tensor read (_rebound)."""
        found, attributes = {}, list(self._attributes())
        seen = {id(owner) for _, _, owner, _, _ in attributes}  # each holder read as itself, not through another
        def held(owner, key, value, put_back: bool) -> Optional[list]:  # what _entries collects into, from this
            return None if bound is None else [(owner, key, value)] if put_back and owner is not None else []

        read_from = [(name, value, holder, held(owner, attr, value, attr is not None and _rebound(value)))
                     for holder, name, owner, attr, value in attributes]
        read_from += [(read.name, read.value, function,
                       held(*(read.place or (None, None)), read.value, read.written_only or _rebound(read.value)))
                      for function in self.functions for read in reads(function)]
        for name, value, source, found_bound in read_from:
            self._add(found, _entries(name, value, seen, found_bound), source)
            if bound is not None:
                bound += [(owner, key, tensor, source, name) for owner, key, tensor in found_bound]
        return {name: value for name, value in found.items() if value is not None}

    def _add(self, found: dict, entries, source) -> None:
        for name, fingerprint in entries:
            found[name] = fingerprint
            self.source[name] = source

    def _bind_again(self) -> Optional[str]:
        """Binds each tensor (_rebound) read after the forward again where the recomputes bound another (as
        stock's episode leaves it); the name of one a backward hook may have bound, left as it is."""
        for owner, key, tensor, source, name in self.bound:
            now = _held(owner, key)
            if now is _GONE or now is tensor:  # gone: the read shows it
                continue
            if id(source) in self.backward_hooks:  # stock's backward binds it too
                return name
            if isinstance(owner, _REBOUND_IN):
                owner[key] = tensor
            else:
                setattr(owner, key, tensor)
        return None

    def check(self) -> None:
        by_backward_hook = self._bind_again()
        if by_backward_hook is not None:
            self._refuse(f"qca_lowmem: {by_backward_hook} (or a tensor it holds) was bound anew during the backward",
                         both=True)
        after = self.read()
        names = [*self.after_forward, *(name for name in after if name not in self.after_forward)]  # in read order
        changed = next((name for name in names if self.after_forward.get(name) != after.get(name)), None)
        if changed is not None:
            inside, was, now = _difference(self.after_forward.get(changed), after.get(changed))
            self._refuse(f"qca_lowmem: {changed}{inside} changed during the backward ({_shown(was)} -> {_shown(now)})",
                         both=id(self.source.get(changed)) in self.backward_hooks)

    def _refuse(self, moved: str, both: bool) -> None:
        if both:
            raise RuntimeError(
                f"{moved}: what holds it is both a forward hook, which the rollout's recomputes run again where "
                "stock's episode does not, and a backward hook, which stock's backward runs too but which here "
                "writes before the recomputes read, so qca_lowmem cannot tell which wrote it, nor that the "
                "recomputes compute the forward's values. Keep the backward hook's state on another object than "
                "the forward hook's (a forward hook that records can then skip the recomputes: "
                "qca_lowmem.recomputing()), or enable(trainer, checkpoint='none'), which runs each step once as "
                "stock does")
        raise RuntimeError(
            f"{moved}: the rollout's recomputes run {self.runs} again, where stock's "
            "episode does not, so later episodes would start from another state than stock's. Keep that "
            "state in tensors, skip what records it while qca_lowmem.recomputing() (a hook that records what "
            "the steps saw), or enable(trainer, checkpoint='none'), which runs each step once as stock does")


def episode_drift(parts: List[Tuple[str, List[Tuple[str, object]], Optional[list]]],
                  backward_hooks: list = ()) -> Optional[StateDrift]:
    """A StateDrift read now over `parts`, (what runs, in words; the holders of its state, with the
    names to say; the unfollowed functions it runs, None where its code is followed), or None
    where every part's is; `backward_hooks` as StateDrift's."""
    unfollowed = [(runs, holders, functions) for runs, holders, functions in parts if functions is not None]
    if not unfollowed:
        return None
    return StateDrift([holder for _, holders, _ in unfollowed for holder in holders],
                      [f for *_, functions in unfollowed for f in functions],
                      " and ".join(runs for runs, *_ in unfollowed), backward_hooks)
