"""What of a value a call could change, read as simple values compared with != (a fingerprint):
the values state_drift.py reads after an episode's forward and again after its backward, named
by their path, and where a tensor read there is bound (to be put back)."""

import collections
import functools
import itertools
import pickle
import random
import sys
import types
import warnings
from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from .code_reads import library_function, users_module

_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
REBOUND_IN = (list, dict, collections.deque)  # the containers whose entries a call may bind anew (`log["last"] = psi`)
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


def rebound(value) -> bool:
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


def is_tensor(fingerprint) -> bool:
    """Whether a fingerprint is a tensor's (its identity)."""
    return isinstance(fingerprint, _Bound)


def _fingerprint(value, depth: int = 3, bound: Optional[list] = None, held: bool = False):
    """What of a value a call could change, in simple values (compared with !=), or None where
    nothing is read: a simple value itself; a tensor by identity (another bound in its place); a
    random generator's state; a numpy array or scalar by its bytes (up to 1 MiB); an iterator's
    position; a container's (a deque's too) type, length and entries read alike but tensors,
    `depth` levels down (`self.log["norms"].append(...)`), which `bound` collects as (the container,
    the key, the tensor) where a call may bind another in their place; a counter's repr. An object
    is read attribute by attribute (named_fingerprints), or so here where a container holds it (`held`: a
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
        if bound is not None and isinstance(value, REBOUND_IN):
            bound += [(value, k, v) for k, v in pairs if rebound(v)]
        read = [(k, _fingerprint(v, depth - 1, bound, held=True)) for k, v in pairs
                if isinstance(k, _SIMPLE) and not isinstance(v, torch.Tensor)]
        return _Container(type(value).__name__, len(value), tuple((k, v) for k, v in read if v is not None))
    if held and depth > 0 and not isinstance(value, type) and _by_attribute(value):
        attributes = _own_attributes(value)
        if bound is not None:
            bound += [(value, name, v) for name, v in attributes.items() if rebound(v)]
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


def difference(before, after, path: str = "") -> Tuple[str, object, object]:
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
    return difference(was.get(key), now.get(key), path + suffix.format(key)) if key is not None else (path, before, after)


BY_ATTRIBUTE = object()  # read_whole's answer for a value read attribute by attribute
GONE = object()  # value_at's answer for an attribute or entry no longer there


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


def value_at(owner, key):
    """What an object's attribute (a closure's cell's contents), or a container's entry, holds now, or GONE."""
    if isinstance(owner, dict):
        return owner.get(key, GONE)
    if isinstance(owner, REBOUND_IN):
        return owner[key] if key < len(owner) else GONE
    try:
        return getattr(owner, key)
    except (AttributeError, ValueError):  # gone, or a cell emptied
        return GONE


def _by_attribute(value) -> bool:
    """Whether a value is read attribute by attribute: a plain object (slots too), or a function of
    theirs holding attributes (`step.calls += 1`)."""
    if isinstance(value, types.FunctionType):
        return bool(vars(value)) and not library_function(value)
    if isinstance(value, (nn.Module, types.ModuleType, types.MethodType)):
        return False
    return hasattr(value, "__dict__") or any("__slots__" in vars(owner) for owner in type(value).__mro__[:-1])


def read_whole(value, bound: Optional[list] = None):
    """A value's fingerprint (_fingerprint, collecting `bound`) where it is read whole, else
    BY_ATTRIBUTE: a value _by_attribute, or a class of the users' own (`class Counters: calls =
    0`, read as a global)."""
    if isinstance(value, type):
        return BY_ATTRIBUTE if users_module(sys.modules.get(value.__module__)) else None
    fingerprint = _fingerprint(value, bound=bound)
    return BY_ATTRIBUTE if fingerprint is None and _by_attribute(value) else fingerprint


def named_fingerprints(name: str, value, seen: set, bound: Optional[list], depth: int = 2):
    """(name, fingerprint) of what of a value a call could change: the value's own; for a plain
    object or a class of theirs, one per attribute read whole (_fingerprint: a simple value, a
    container, a generator, a numpy array, an iterator; not a tensor), and those of a plain
    object it holds (`holder.stats["calls"]`, two levels down) not read already (`seen`: ids, the
    holders' own included), so each is named once, by its first path. `bound` collects (the object
    or container, the attribute or key, the value) of each tensor held on the way (rebound)."""
    whole = read_whole(value, bound)
    if whole is not BY_ATTRIBUTE:
        yield name, whole
        return
    seen.add(id(value))
    if isinstance(value, functools.partial):  # what it passes its function (`partial(f, calls=[0])`)
        for key, held in [*enumerate(value.args), *value.keywords.items()]:
            yield from named_fingerprints(f"{name}'s argument {key}", held, seen, bound, depth)
        return
    for attr, held in _own_attributes(value).items():
        if bound is not None and rebound(held):  # bound anew: put back by check()
            bound.append((value, attr, held))
        if isinstance(held, torch.Tensor):  # written in place: the rollout sees it
            continue
        whole = read_whole(held, bound)
        if whole is not BY_ATTRIBUTE:
            yield f"{name}.{attr}", whole
        elif depth > 1 and id(held) not in seen:
            yield from named_fingerprints(f"{name}.{attr}", held, seen, bound, depth - 1)


def shown(fingerprint) -> str:
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
