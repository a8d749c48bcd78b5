"""Known computations run hidden from the dispatch modes that only watch (an episode's StepWatch).

A mode sees each op for 5-25 us on a CPU, more than a small fused block's kernels. A computation
whose reads and writes are known (a fused block: its input and parameters, writing only what it
makes) runs with dispatch off instead, and tells each watcher what it read and made.
"""

import functools
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .. import _torch_private as torch_private

watching_modes = torch_private.watching_modes


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
