"""Parameter gradients of a recomputing backward, summed over its steps into one buffer each."""

import contextlib
import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from .. import _torch_private as torch_private
from ..ops.scaler import accumulate_

# id(parameter) -> (the sink collecting its gradient, its index there). Global, not per thread:
# autograd runs a CUDA backward on its own device threads.
_collecting: Dict[int, Tuple["ParamGradSink", int]] = {}


def deposit(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Hand grad (of any floating dtype) to the sink collecting param's gradient, which adds it
    to its buffer in param's dtype, and return True; False when no sink collects it. Spares a
    half-precision gradient its cast to param's dtype before the add: one pass instead of two."""
    entry = _collecting.get(id(param))
    if entry is None or entry[0].params[entry[1]] is not param:
        return False
    entry[0].add(entry[1], grad)
    return True


@contextlib.contextmanager
def deposited_into(sink, params):
    """Inside, deposit() adds params' gradients to `sink` (`sink.add(i, grad)`, `sink.params`)."""
    outer = [_collecting.get(id(p)) for p in params]
    for i, p in enumerate(params):
        _collecting[id(p)] = (sink, i)
    try:
        yield sink
    finally:
        for p, entry in zip(params, outer):
            if entry is None:
                del _collecting[id(p)]
            else:
                _collecting[id(p)] = entry


class _PendingAdds:
    """Gradients taken during a backward, added to their buffers together by flush(): one
    accumulate_ for all of them (one launch on CUDA), not one add a parameter. A parameter's
    second gradient before the flush flushes first, so each buffer gets its adds in order."""

    def __init__(self):
        self._pending: Dict[int, torch.Tensor] = {}  # parameter index -> its gradient, in arrival order

    def _buffer(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def _add_later(self, i: int, grad: torch.Tensor) -> None:
        if i in self._pending:
            self.flush()
        self._pending[i] = grad

    def flush(self) -> None:
        """Add the gradients taken since the last flush to their buffers; call it after each
        backward that reaches the parameters."""
        if self._pending:
            indices = list(self._pending)
            accumulate_([self._buffer(i) for i in indices], [self._pending[i] for i in indices])
            self._pending.clear()


class Accumulators(_PendingAdds):
    """deposit()'s target while a StepGraph's backward is captured (step_graph.py): its per-parameter
    accumulators, noting which it reached. The backward's other parameter gradients are added with
    its deposits, in the graph's one accumulate_ (`add`, then `flush`)."""

    def __init__(self, params, accumulators):
        super().__init__()
        self.params, self.accumulators = params, accumulators
        self.reached = [False] * len(params)

    def _buffer(self, i: int) -> torch.Tensor:
        return self.accumulators[i]

    def add(self, i: int, grad: torch.Tensor) -> None:
        self._add_later(i, grad)
        self.reached[i] = True


class ParamGradSink(_PendingAdds):
    """Collects the per-step gradients of the parameters into buffers during the backward.

    While active, each parameter's tensor hooks are set aside and replaced by one that adds the
    gradient to the parameter's buffer and hands autograd a broadcast zero, so no full-size
    per-step copy outlives its hook and the user's hooks do not see partial gradients. The
    buffers are returned as the Function's gradients: autograd then accumulates each into
    `.grad` once, running the parameter's hooks once.
    """

    def __init__(self, params):
        super().__init__()
        self.params = list(params)
        self.buffers: List[Optional[torch.Tensor]] = [None] * len(params)
        self._set_aside = []
        self._zeros: List[Optional[torch.Tensor]] = [None] * len(self.params)  # a scalar zero broadcast to each

    def __enter__(self):
        try:
            for i, p in enumerate(self.params):
                self._collect(i, p)
        except BaseException:  # a Ctrl-C midway: the parameters set aside so far get their hooks back
            self.__exit__()
            raise
        return self

    def _collect(self, i: int, p: torch.Tensor) -> None:
        hooks = torch_private.backward_hooks(p)
        # Noted before anything changes, so that __exit__ puts back whatever an interrupt left.
        self._set_aside.append((hooks, list(hooks.items()), _collecting.get(id(p))))
        _collecting[id(p)] = (self, i)
        hooks.clear()
        handle = RemovableHandle(hooks)
        hooks[handle.id] = functools.partial(self._accumulate, i)

    def __exit__(self, *exc):
        for p, (hooks, original, outer) in zip(self.params, self._set_aside):
            hooks.clear()
            hooks.update(original)
            if outer is None:
                del _collecting[id(p)]
            else:
                _collecting[id(p)] = outer
        self._set_aside = []
        return False

    def _buffer(self, i: int) -> torch.Tensor:
        return self.buffers[i]

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Add grad, of any floating dtype, to parameter i's buffer: the first one becomes the
        buffer (cast to the parameter's dtype), later ones are added at the next flush()."""
        if self.buffers[i] is not None:
            self._add_later(i, grad)
            return
        buffer = torch.empty_like(self.params[i])
        buffer.copy_(grad)
        self.buffers[i] = buffer

    def _accumulate(self, i: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if grad is None:  # all of this step's gradient went in through deposit()
            return None
        self.add(i, grad)
        # Per parameter: autograd hands a leaf's hook a gradient of the leaf's dtype and shape.
        zero = self._zeros[i]
        if zero is None:
            zero = self._zeros[i] = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
        return zero

    def take(self):
        self.flush()
        buffers, self.buffers = self.buffers, None
        return buffers
