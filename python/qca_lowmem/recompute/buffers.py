"""Tensors a step writes that outlive it: BatchNorm's running statistics and step count, any
registered buffer, a counter kept in a tensor.

Plain autograd runs each step once, so such a buffer ends the episode having seen T updates. A
recomputing episode runs steps again: each recompute would update the buffer once more, and
read values the forward had already moved on from. So the probe (probe.py) finds the tensors a
step writes, the forward keeps their values before each step (they are small: statistics, not
activations), every recompute starts from the values its forward step saw, and the end of the
backward puts back the values the forward left.

Found by value: BatchNorm updates its statistics inside one kernel, without bumping their
versions or declaring the write in the op's schema, so the probe copies every tensor a step's ops
read that the step did not make, and compares after the step. Every later step of the forward
runs under a StepWatch (watch.py), which finds a tensor written first by a step the probe did not
run; `add` then keeps its values from then on, and before the steps recorded until then.
"""

import contextlib
import weakref
from typing import Dict, List, Optional

import torch

from .. import _torch_private as torch_private


def storage_key(tensor: torch.Tensor) -> tuple:
    """One key for every alias of a tensor's memory (`buffer.data` is a new tensor at each access)."""
    return tensor.untyped_storage().data_ptr(), tensor.device


def whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of the tensor's whole storage, one uint8 tensor: a step writing it through two
    aliases (the buffer, then a slice of its `.data`) is kept, loaded and put back at once, each
    alias's value before the step the one the step saw."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


def kept_by_value(tensor: torch.Tensor) -> bool:
    """Whether a tensor a step's op reads or writes may be a buffer the episode keeps: strided, with
    data, not requiring grad (parameters and the step's inputs cannot be written in place)."""
    return tensor.layout == torch.strided and not tensor.requires_grad and tensor.device.type != "meta"


class _WriteFinder(torch_private.TorchDispatchMode):
    """Copies each tensor an op reads that no op inside made, at its first read."""

    def __init__(self):
        super().__init__()
        self.made: Dict[int, weakref.ref] = {}
        self.before: Dict[tuple, tuple] = {}  # storage_key -> (whole_storage, its bytes before)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tensor in torch_private.argument_tensors(args, kwargs):
            if kept_by_value(tensor) and not self._made(tensor) and storage_key(tensor) not in self.before:
                whole = whole_storage(tensor)
                self.before[storage_key(tensor)] = (whole, whole.clone())
        out = func(*args, **kwargs)
        for tensor in torch_private.result_tensors(out):
            self.made[id(tensor)] = weakref.ref(tensor)
        return out

    def _made(self, tensor: torch.Tensor) -> bool:
        ref = self.made.get(id(tensor))
        return ref is not None and ref() is tensor

    def written(self):
        """(tensor, its value before the step) for each tensor the step changed."""
        return [(tensor, old) for tensor, old in self.before.values() if not _same(tensor, old)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() or a.is_complex()
                                        else (a == b)).all())


class StepBuffers:
    """The tensors the episode's steps write, with their values before each step."""

    def __init__(self, tensors: List[torch.Tensor]):
        self.tensors = tensors
        self.before: Dict[int, List[torch.Tensor]] = {}  # step -> values before it
        self.after: Optional[List[torch.Tensor]] = None  # the values the backward found

    @staticmethod
    def finder() -> _WriteFinder:
        """A dispatch mode to run a probed step under; its written() is what the step wrote."""
        return _WriteFinder()

    @classmethod
    def of_probes(cls, writes: List[list]) -> "StepBuffers":
        """From each probed step's written() (steps 0, 1, ...): the tensors any of them wrote, with
        their values before each probed step."""
        tensors = list({storage_key(x): x for step in writes for x, _ in step}.values())
        buffers = cls(tensors)
        later = buffers._values()  # after the last probed step: now
        for t in reversed(range(len(writes))):
            old = {storage_key(x): value for x, value in writes[t]}
            later = [old.get(storage_key(x), value) for x, value in zip(tensors, later)]  # unwritten: as after it
            buffers.record(t, later)
        return buffers

    def add(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """A tensor first written by the step being recorded last, with its value before that step:
        its value before every step recorded until then too, since none of them wrote it."""
        self.tensors.append(tensor)
        for values in self.before.values():
            values.append(value)

    def _values(self) -> List[torch.Tensor]:
        return [x.detach().clone() for x in self.tensors]

    def _set(self, values: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for tensor, value in zip(self.tensors, values):
                tensor.copy_(value)

    def record(self, t: int, values: Optional[List[torch.Tensor]] = None) -> None:
        """The values before step t (copies of the tensors now, unless given)."""
        self.before[t] = values if values is not None else self._values()

    def backward_starts(self) -> None:
        """Their values now, which the backward's recomputes change and `restore` puts back: plain
        autograd's backward writes none, so a change made since the forward stays too."""
        self.after = self._values()

    def load(self, t: int) -> None:
        """The values step t saw in the forward, before it runs again."""
        self._set(self.before[t])

    def restore(self) -> None:
        """The values the backward found, after its recomputes."""
        self._set(self.after)

    @contextlib.contextmanager
    def unchanged(self):
        """Whatever runs inside (a capture's warm-up and recording runs the step) leaves them as
        they were."""
        values = self._values()
        try:
            yield
        finally:
            self._set(values)
