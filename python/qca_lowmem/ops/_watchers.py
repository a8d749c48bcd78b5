"""Known computations run hidden from the dispatch modes that only watch (an episode's StepWatch),
and the check that a module call is only its class's forward, on which every such shortcut rests.

A mode sees each op for 5-25 us on a CPU, more than a small fused block's kernels. A computation
whose reads and writes are known (a fused block: its input and parameters, writing only what it
makes) runs with dispatch off instead, and tells each watcher what it read and made.
"""

import functools
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _torch_private as torch_private

watching_modes = torch_private.watching_modes

# The torch methods and functions that a stock U-Net's layers run; a fused path computes what they
# compute, so it stands in for them only while each is still the one torch defined.
_STOCK_METHODS = tuple((owner, name, getattr(owner, name)) for owner, name in (
    (nn.Module, "__call__"), (nn.Module, "_call_impl"), (nn.Sequential, "forward"), (nn.Conv2d, "forward"),
    (nn.Conv2d, "_conv_forward"), (nn.ConvTranspose2d, "forward"), (nn.MaxPool2d, "forward"),
    (nn.GroupNorm, "forward"), (nn.ELU, "forward"), (F, "conv2d"), (F, "conv_transpose2d"), (F, "max_pool2d"),
    (F, "group_norm"), (F, "elu")))
# Replaced before this module was imported (a wrapper, a function of another module): never stood in for.
_STOCK_AT_IMPORT = all(getattr(fn, "__module__", "").startswith("torch") and not hasattr(fn, "__wrapped__")
                       for _, _, fn in _STOCK_METHODS)


def torch_layers_unchanged() -> bool:
    """Whether the torch methods a stock U-Net layer runs are still torch's own (none replaced on
    its class or in torch.nn.functional since import)."""
    return _STOCK_AT_IMPORT and all(getattr(owner, name) is fn for owner, name, fn in _STOCK_METHODS)


def calls_are_forwards(modules: Iterable[nn.Module], *, with_submodules: bool = False) -> bool:
    """Whether calling each of `modules` (and, `with_submodules`, each module inside them) runs
    just its class's forward, now: no hook registered for every module (forward, forward-pre,
    backward, backward-pre, full backward), none on the module itself, and no `forward` set on
    the instance. A shortcut past such calls (a fused block, a layer run hidden) holds only while
    this does, so it is asked at every call: about 0.3 us a module on a CPU."""
    if torch_private.global_module_hooks():
        return False
    stack = list(modules)
    while stack:
        module = stack.pop()
        if module is None:  # a submodule slot registered empty
            continue
        if torch_private.module_has_hooks(module) or "forward" in module.__dict__:
            return False
        if with_submodules:
            stack.extend(module._modules.values())
    return True


def eager_watchers():
    """watching_modes() in eager execution; None under torch.compile, whose graphs see the ops."""
    return None if torch.compiler.is_compiling() else watching_modes()


def run_hidden(run: Callable, read: Sequence[Tensor], watchers: list):
    """run() with dispatch off, then each watcher told `read` and the tensors run() returned. A
    tensor subclass among `read` keeps its own dispatch: then run() runs as it is, watched."""
    if not all(type(t) in (Tensor, nn.Parameter) for t in read):
        return run()
    with torch_private.dispatch_disabled():
        out = run()
    made = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, Tensor)]
    for watcher in watchers:
        watcher.ran_unseen(read, made)
    return out


def call_unwatched(op: Callable, tensors: Sequence[Tensor], *args):
    """op(*tensors, *args) for an op that reads `tensors` and writes only the tensor it returns
    (this package's QCA and noise ops, `cat`): hidden from watching modes, seen by any other."""
    watchers = eager_watchers()
    if watchers:
        return run_hidden(functools.partial(op, *tensors, *args), tensors, watchers)
    return op(*tensors, *args)
