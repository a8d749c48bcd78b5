"""What code qca_lowmem does not follow reads besides its arguments, where a call may keep state
that the recomputes would move (state_drift.py reads it after the forward and after the backward):
closure cells, defaults, module globals and their modules' attributes, function by function, not
into the code of torch, of Python or of qca_lowmem."""

import functools
import os
import sysconfig
import types
from typing import List, NamedTuple, Optional, Tuple

from .code_identity import static_of

# The interpreter's library folders (the standard library, site-packages: torch, numpy) and
# qca_lowmem's own (installed editable, it is elsewhere): a module from there is not the users'
# own, and its attributes are not state their code keeps.
_LIBRARY_FOLDERS = tuple(sorted({os.path.join(os.path.abspath(folder), "") for key, folder in sysconfig.get_paths().items()
                                 if key in ("stdlib", "platstdlib", "purelib", "platlib")}
                                | {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")}))


@functools.lru_cache(maxsize=None)  # a few files, asked at every episode
def _library_file(file) -> bool:
    return isinstance(file, str) and os.path.abspath(file).startswith(_LIBRARY_FOLDERS)


def library_function(fn: types.FunctionType) -> bool:
    """Whether a plain function's code is a library's (torch's, Python's, qca_lowmem's), not theirs."""
    return _library_file(fn.__code__.co_filename)


def users_module(value) -> bool:
    """Whether `value` is a module of the users' own, loaded from a file outside the library
    folders (their `config`, a helpers module), whose attributes their code may keep state in."""
    if not isinstance(value, types.ModuleType):
        return False
    file = getattr(value, "__file__", None)
    return isinstance(file, str) and not _library_file(file)


def _cells(fn) -> List[Tuple[str, object, object]]:
    """(name, value, the cell) of each filled closure cell of a plain function."""
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            cells.append((name, cell.cell_contents, cell))
        except ValueError:  # an empty cell
            pass
    return cells


class Read(NamedTuple):
    """A value a function reads (reads()): a name for it, the value, where a call binds another in
    its place (the owner and key to set, or None), and whether the code only binds it (`global
    LAST_NORM; LAST_NORM = norm`), never loading it."""

    name: str
    value: object
    place: Optional[Tuple[object, str]] = None
    written_only: bool = False


def reads(function) -> List[Read]:
    """What a plain function reads besides its arguments and attributes, where a call could keep
    state: each closure cell, default value and module global its code loads or binds, and each
    attribute it takes off a module of the users' own (`counters.calls`), of it and of every
    function among those, each function once; of a library's function (library_function), only the
    functions its closure holds (a wrapper's)."""
    found, pending, seen = [], [function], set()
    while pending:
        fn = pending.pop()
        if not isinstance(fn, types.FunctionType) or id(fn) in seen:
            continue
        seen.add(id(fn))
        if library_function(fn):  # not theirs (qca_lowmem.recomputing(), torch's), nor its state,
            pending += [value for _, value, _ in _cells(fn)]  # but a function of theirs it wraps (torch.no_grad's)
            continue
        read = [Read(f"{fn.__qualname__}'s {name}", value, (cell, "cell_contents")) for name, value, cell in _cells(fn)]
        positional = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        defaults = [*zip(positional[len(positional) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()),
                    *(fn.__kwdefaults__ or {}).items()]
        read += [Read(f"{fn.__qualname__}'s default {name}", value) for name, value in defaults]  # `calls=[0]`
        namespace, static = fn.__globals__, static_of(fn.__code__)
        read += [Read(f"{namespace.get('__name__', '?')}.{name}", namespace[name], (namespace, name), name in static.stored)
                 for name in static.globals + static.stored if name in namespace]
        read += [Read(f"{module.__name__}.{attribute}", getattr(module, attribute), (module, attribute))
                 for name, attribute in static.global_attributes
                 if users_module(module := namespace.get(name)) and hasattr(module, attribute)]
        found += read
        pending += [value for _, value, *_ in read if isinstance(value, types.FunctionType)]
    return found
