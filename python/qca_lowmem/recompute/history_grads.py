"""Gradients a loss asks of a recomputing episode's history.

A recomputing episode is one autograd node for all its outputs (episode.py's EpisodeFunction):
psi_T, each history entry, carry_T. No graph runs between them, so the gradient of a history
entry before the last step (`torch.autograd.grad(..., history[k])`, `backward(inputs=...)`, a hook
on it, its `retain_grad()`) would hold only what reaches it directly from the loss, where plain
autograd adds what comes back through the steps after it. `HistoryGradGuard`, a torch function
mode around the loss (`history_grads_guarded`), refuses such a request, naming the entry: a
gradient asked with respect to an entry is refused only where the differentiated outputs reach a
later output of the episode (psi_T, a later entry, carry_T), so one that reaches the entry alone,
as exact as plain autograd's, is allowed; a hook or retain_grad is refused at once, the backward
it waits for reaching psi_T.
"""

import contextlib
import inspect
from typing import ContextManager, Dict, Iterable, List, NoReturn

import torch
from torch.overrides import TorchFunctionMode

_ASKS_INPUTS = {torch.autograd.grad: ("outputs", "torch.autograd.grad"),
                torch.autograd.backward: ("tensors", "torch.autograd.backward"),
                torch.Tensor.backward: ("self", "Tensor.backward")}
_WAITS = {torch.Tensor.register_hook: "a hook registered on it", torch.Tensor.retain_grad: "retain_grad()"}


def _tensors(value) -> List[torch.Tensor]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [x for x in value if isinstance(x, torch.Tensor)]


def reached_outputs(roots: Iterable[torch.Tensor], node) -> set:
    """The output indexes of autograd node `node` that the graphs of `roots` lead into."""
    found, seen, stack = set(), set(), []
    for root in roots:
        if root.grad_fn is node:
            found.add(root.output_nr)
        elif root.grad_fn is not None:
            stack.append(root.grad_fn)
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for next_fn, index in fn.next_functions:
            if next_fn is node:
                found.add(index)
            elif next_fn is not None:
                stack.append(next_fn)
    return found


def history_grads_guarded(history: List[torch.Tensor], caller: str, checkpoint: str) -> ContextManager:
    """Around a loss on a rollout's history (its last entry psi_T): a HistoryGradGuard where the
    entries before psi_T are outputs of psi_T's node (a recomputing episode), else nothing to guard
    (checkpoint='none', "auto" keeping every step's graph, a history of psi_T alone)."""
    node, earlier = history[-1].grad_fn, history[:-1]
    if node is None or not earlier or any(h.grad_fn is not node for h in earlier):
        return contextlib.nullcontext()
    return HistoryGradGuard(node, earlier, caller, checkpoint)


class HistoryGradGuard(TorchFunctionMode):
    """The torch function mode refusing a gradient of `earlier` (history[k] is output 1 + k of the
    episode's `node`, episode.Layout) that would take in a later output."""

    def __init__(self, node, earlier: List[torch.Tensor], caller: str, checkpoint: str):
        super().__init__()
        self.node, self.caller, self.checkpoint = node, caller, checkpoint
        self.entries: Dict[int, int] = {id(h): k for k, h in enumerate(earlier)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WAITS and args and id(args[0]) in self.entries:
            self._refuse(self.entries[id(args[0])], _WAITS[func])
        elif func in _ASKS_INPUTS:
            self._check_inputs(func, args, kwargs)
        return func(*args, **kwargs)

    def _check_inputs(self, func, args, kwargs) -> None:
        roots_name, name = _ASKS_INPUTS[func]
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        asked = [self.entries[id(x)] for x in _tensors(bound.get("inputs")) if id(x) in self.entries]
        if not asked:
            return
        reached = reached_outputs(_tensors(bound.get(roots_name)), self.node)
        for k in asked:
            if any(index == 0 or index > 1 + k for index in reached):  # psi_T, a later entry or carry_T
                self._refuse(k, f"{name}(..., inputs=history[{k}])")

    def _refuse(self, k: int, how: str) -> NoReturn:
        raise RuntimeError(
            f"{self.caller}: the loss asks the gradient of history[{k}] ({how}); a recomputing episode "
            f"(checkpoint={self.checkpoint!r}) keeps no graph between its outputs, so that gradient would miss what "
            "plain autograd adds through the steps after it: ask it of psi_T or of the parameters, or use "
            "checkpoint='none' (plain autograd)")
