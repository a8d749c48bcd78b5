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

import functools
import types
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .code_identity import functions_of
from .code_reads import reads
from .fingerprints import (
    BY_ATTRIBUTE,
    GONE,
    REBOUND_IN,
    difference,
    is_tensor,
    named_fingerprints,
    read_whole,
    rebound,
    shown,
    value_at,
)

_MODULE_OWN = frozenset(vars(nn.Module()))  # what torch keeps on every module (its dicts of parameters, hooks...)


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
        self._before_recompute: list = []  # what each of `bound` held before the step recomputed now
        self.recompute_bound: Dict[int, object] = {}  # i -> what the last recompute that bound bound[i] bound

    def note_recompute(self, done: bool) -> None:
        """Before (`done` False) and after each step the backward recomputes (replay.around_each_recompute):
        what it bound, told apart from what the backward binds (a custom Function's backward, a
        tensor's hook: `probe.last_grad = grad`), which stock's backward binds as well."""
        now = [value_at(owner, key) for owner, key, *_ in self.bound]
        if not done:
            self._before_recompute = now
            return
        for i, (was, value) in enumerate(zip(self._before_recompute, now)):
            if value is not was:
                self.recompute_bound[i] = value

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
                    if id(cls) not in classes and read_whole(cls) is BY_ATTRIBUTE:
                        classes.add(id(cls))
                        yield holder, f"{cls.__module__}.{cls.__qualname__}", cls, None, cls

    def read(self, bound: Optional[list] = None) -> Dict[str, object]:
        """The fingerprints; `bound` collects (the object or container, the attribute or key, the
        value, the holder or function it was read from, the name to say) of every tensor read (rebound)."""
        found, attributes = {}, list(self._attributes())
        seen = {id(owner) for _, _, owner, _, _ in attributes}  # each holder read as itself, not through another
        def held(owner, key, value, put_back: bool) -> Optional[list]:  # what named_fingerprints collects into, from this
            return None if bound is None else [(owner, key, value)] if put_back and owner is not None else []

        read_from = [(name, value, holder, held(owner, attr, value, attr is not None and rebound(value)))
                     for holder, name, owner, attr, value in attributes]
        read_from += [(read.name, read.value, function,
                       held(*(read.place or (None, None)), read.value, read.written_only or rebound(read.value)))
                      for function in self.functions for read in reads(function)]
        for name, value, source, found_bound in read_from:
            self._add(found, named_fingerprints(name, value, seen, found_bound), source)
            if bound is not None:
                bound += [(owner, key, tensor, source, name) for owner, key, tensor in found_bound]
        return {name: value for name, value in found.items() if value is not None}

    def _add(self, found: dict, entries, source) -> None:
        for name, fingerprint in entries:
            found[name] = fingerprint
            self.source[name] = source

    def _bind_again(self) -> Tuple[Optional[str], set]:
        """Binds each tensor (rebound) read after the forward again where a recompute bound the one
        there now (as stock's episode leaves it: the forward's); one the backward bound is left, as
        stock's backward leaves it. (The name of one a backward hook on a holder may have bound, left
        as it is, or None; the names of those the backward bound.)"""
        left = set()
        for i, (owner, key, tensor, source, name) in enumerate(self.bound):
            now = value_at(owner, key)
            if now is GONE or now is tensor:  # gone: the read shows it
                continue
            if id(source) in self.backward_hooks:  # stock's backward binds it too
                return name, left
            if now is not self.recompute_bound.get(i, GONE):
                left.add(name)
                continue
            if any(isinstance(t, torch.Tensor) and t.retains_grad for t in (now if isinstance(now, tuple) else (now,))):
                raise RuntimeError(
                    f"qca_lowmem: {name} holds a tensor the step called retain_grad() on, bound by the rollout's "
                    "recompute of step 0: its .grad is that step's, and the forward's tensor, which stock's episode "
                    "leaves there, has none (stock's has the last step's). Keep the gradient with a hook on the "
                    "tensor (out.register_hook(...), if out.requires_grad), which the backward runs once a step as "
                    "stock's does, or enable(trainer, checkpoint='none'), which runs each step once as stock does")
            if isinstance(owner, REBOUND_IN):
                owner[key] = tensor
            else:
                setattr(owner, key, tensor)
        return None, left

    def check(self) -> None:
        by_backward_hook, left = self._bind_again()
        if by_backward_hook is not None:
            self._refuse(f"qca_lowmem: {by_backward_hook} (or a tensor it holds) was bound anew during the backward",
                         both=True)
        after = self.read()
        names = [*self.after_forward, *(name for name in after if name not in self.after_forward)]  # in read order
        changed = next((name for name in names if self.after_forward.get(name) != after.get(name)
                        and not (name in left and is_tensor(self.after_forward.get(name)))), None)
        if changed is not None:
            inside, was, now = difference(self.after_forward.get(changed), after.get(changed))
            self._refuse(f"qca_lowmem: {changed}{inside} changed during the backward ({shown(was)} -> {shown(now)})",
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
