"""The U-Net's 2x2 max pooling on `max_pool2x2` (ops/max_pool.py): torch's values and gradient,
bit for bit, one launch each way on CUDA where torch's channels_last kernels took a few blocks
of a GPU and wrote int64 indices, and nothing saved for backward but the input.

The op runs on the devices of `OP_DEVICES`: CUDA. On the CPU torch's vectorised kernels are
faster than the op's C kernel (docs/benchmarks.md, "Expected: the U-Net's max pools in one launch
each way"), and torch's run; inside `as_on_cuda()` the CPU takes the op as CUDA does, for `plan`,
which measures on the CPU what a GPU's step keeps (no indices).

`MaxPool2d` stands in for a users' `nn.MaxPool2d` (the switch: `fuse_pools_in_place`): the very
object, its class swapped for this subclass of torch's, named as torch's, so that their
references, `isinstance`, hooks and repr keep working. At each call it takes the op where its
settings are 2x2 of stride 2 (no padding, dilation, ceil mode or indices), its call is just its
forward (no hook) and no mode, transform or trace of the caller's would see other ops; else
torch's forward runs, as it would. `unfuse_pools` gives the class back.
"""

import contextlib
import threading
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import fused_call_stands_for
from .ops.max_pool import POOLED_DTYPES, max_pool2x2

OP_DEVICES = frozenset({"cuda"})
_as_on = threading.local()


@contextlib.contextmanager
def as_on_cuda():
    """Pools take the op on any device, as on CUDA, in this thread while this is active."""
    previous = getattr(_as_on, "cuda", False)
    _as_on.cuda = True
    try:
        yield
    finally:
        _as_on.cuda = previous


def is_2x2(pool: nn.MaxPool2d) -> bool:
    """The pool's settings are max_pool2x2's: a 2x2 window, stride 2, no padding or dilation, floor
    rounding, no indices returned."""
    return (pool.kernel_size in (2, (2, 2)) and pool.stride in (2, (2, 2)) and pool.padding in (0, (0, 0))
            and pool.dilation in (1, (1, 1)) and pool.ceil_mode is False and pool.return_indices is False)


def takes_the_op(pool: nn.MaxPool2d, x: Tensor) -> bool:
    """max_pool2x2(x) is pool's forward on x, on a device of OP_DEVICES: a 2x2 pool, x a 4-D
    floating tensor of at least one window, dense in one layout (where the op's output layout is
    torch's)."""
    return (is_2x2(pool) and isinstance(x, Tensor) and (x.device.type in OP_DEVICES or getattr(_as_on, "cuda", False))
            and x.dim() == 4 and x.dtype in POOLED_DTYPES
            and x.shape[2] >= 2 and x.shape[3] >= 2
            and x.is_contiguous() != x.is_contiguous(memory_format=torch.channels_last))


class MaxPool2d(nn.MaxPool2d):
    """torch's nn.MaxPool2d whose 2x2 calls run max_pool2x2 (module docstring)."""

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles torch's forward, written out
            return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                ceil_mode=self.ceil_mode, return_indices=self.return_indices)
        return self._eager_forward(input)

    @torch.jit.unused
    def _eager_forward(self, input: Tensor) -> Tensor:
        # Compiled code gets torch's op, which its compiler knows. The caller's context first: under
        # a torch.func transform x's layout cannot be asked.
        if not torch.compiler.is_compiling() and fused_call_stands_for((self,)) and takes_the_op(self, input):
            return max_pool2x2(input)
        return nn.MaxPool2d.forward(self, input)


def fuse_pools_in_place(module: nn.Module) -> List[nn.Module]:
    """Every `nn.MaxPool2d` of `module` (the class exactly: a subclass of theirs is left alone)
    given the stand-in's class; those swapped, for unfuse_pools()."""
    pools = [m for m in module.modules() if type(m) is nn.MaxPool2d]
    fuse_pools(pools)
    return pools


def fuse_pools(pools: List[nn.Module]) -> None:
    """These pools given the stand-in's class (those of torch's class exactly: one given another
    class since is left alone)."""
    for pool in pools:
        if type(pool) is nn.MaxPool2d:
            pool.__class__ = MaxPool2d


def unfuse_pools(pools: List[nn.Module]) -> None:
    """The pools of fuse_pools_in_place given torch's class back (those still the stand-in's)."""
    for pool in pools:
        if type(pool) is MaxPool2d:
            pool.__class__ = nn.MaxPool2d
