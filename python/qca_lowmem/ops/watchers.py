"""The watch's contract, its one channel, and what runs hidden from it.

A watcher is a dispatch mode that only watches the ops it sees and runs them as they are: the
episode's `StepWatch` (recompute/watch.py), over each forward step the probe did not run, noting
the leaves the step reads and the tensors it writes and makes. It is reached through torch's
dispatch-mode stack alone, where entering it puts it: `watching_modes()` reads the stack, and so
does `note_read`, by which a leaf read through a copy made before the step (weight_casts.py's
cached casts) reaches every watcher.

A watcher sees each op for 5-25 us on a CPU, more than a small fused block's kernels, and under
any mode some ops take a slower path (max_pool2d computes its indices too). So every op wrapper
and model layer of this package decides, in its code:
- it runs hidden (`run_hidden`, `call_unwatched`, `call_layer_unwatched`) when it reads only its
  arguments (its tensors, a layer's parameters) and writes only the tensors it returns: dispatch
  is off while it runs, then each watcher is told what it read and made (`ran_unseen`). So do the
  QCA and noise ops, the fused block, and the fused U-Net's `cat` and torch layers. A mode that is
  not a watcher (a FakeTensorMode, the user's) still sees each of them as its op;
- else it stays watched, listed with its reason in tests/project/test_layout.py (`WATCHED`): the
  scaler's ops (the gradient accumulation among them) write their arguments in place;
  `groupnorm_elu` runs inside the library only within a fused block, hidden with it.
"""

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .. import _torch_private as torch_private
from ._forwards import plain_torch_layer


class WatchingDispatchMode(torch_private.TorchDispatchMode):
    """A mode that only watches the ops it sees and runs them as they are (the episode's
    StepWatch). What it does not see it is told: `read`, `ran_unseen`."""

    def read(self, tensor: Tensor) -> None:
        """The step reads `tensor` through a copy made before it (weight_casts.py)."""
        raise NotImplementedError

    def ran_unseen(self, read: Sequence[Tensor], made: Sequence[Tensor]) -> None:
        """An op ran without this mode seeing it: the tensors it read, those it made; it wrote
        nothing else."""
        raise NotImplementedError


def watching_modes() -> Optional[list]:
    """The dispatch modes active when every one is a watcher ([] without any), None when another
    is. Asked per op, so a mode entered at any time is honoured."""
    modes = torch_private.dispatch_modes()
    for mode in modes:  # (a loop: per op, a generator costs more than the check)
        if not isinstance(mode, WatchingDispatchMode):
            return None
    return modes


def eager_watchers() -> Optional[list]:
    """watching_modes() in eager execution; None under torch.compile, whose graphs see the ops."""
    return None if torch.compiler.is_compiling() else watching_modes()


def note_read(tensor: Tensor) -> None:
    """Every active watcher told that the step reads `tensor` through a copy made before it."""
    for mode in torch_private.dispatch_modes():
        if isinstance(mode, WatchingDispatchMode):
            mode.read(tensor)


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
    (this package's QCA and noise ops, `cat`): hidden from watchers, seen by any other mode."""
    watchers = eager_watchers()
    if watchers:
        return run_hidden(functools.partial(op, *tensors, *args), tensors, watchers)
    return op(*tensors, *args)


def call_layer_unwatched(layer: nn.Module, x: Tensor, run: Optional[Callable] = None) -> Tensor:
    """run() (default layer(x)), layer applied to x; hidden from watchers while layer is a torch
    layer whose call is just torch's forward (`plain_torch_layer`), which reads x and its
    parameters: under a dispatch mode max_pool2d takes a slower path, computing its indices too."""
    if run is None:  # not `run or ...`: torch.compile cannot branch on a callable's truth
        run = functools.partial(layer, x)
    watchers = eager_watchers()
    if watchers and plain_torch_layer(layer):
        return run_hidden(run, (x, *layer.parameters(recurse=False)), watchers)
    return run()
