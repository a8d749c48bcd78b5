"""Whether an operator's output jumps where its input moves by a rounding: a spiking model
(SNNUNet's Leaky neurons: `(membrane - threshold > 0).float()`), a sign, a rounding.

The fused pack/update rounds differently from the engine's own plain-torch step (by about one
unit of the last place); a continuous operator carries that on as a rounding, a discontinuous one
turns it into other spikes, and the episode into another. So enable() keeps the engine's own step
for such an operator (engine_step.lowmem_steps), and says so.

Read off the ops, not off values: a random input seldom puts a neuron within a rounding of its
threshold, and a model at its initialisation may not spike at all. The operator runs once, under
no_grad, on the probe's psi, in a dispatch mode that follows what depends on its input: it is
discontinuous where such a value goes through a rounding op (sign, round, floor, ...) or a
comparison whose result is used as a number (cast, multiplied). A comparison that only selects
between values (`where`, `masked_fill`: ReLU-like, continuous) does not count. The operator's
buffers and the random generators are left as found.
"""

import contextlib
from typing import Optional

import torch

from .. import _torch_private as torch_private
from .engine_probe import buffer_bindings, rebind

_aten = torch.ops.aten
_ROUNDING = {_aten.sign, _aten.sgn, _aten.round, _aten.floor, _aten.ceil, _aten.trunc, _aten.frac, _aten.heaviside,
             _aten.hardshrink}
_COMPARISONS = {_aten.gt, _aten.ge, _aten.lt, _aten.le, _aten.eq, _aten.ne}
_SELECTIONS = {_aten.where, _aten.masked_fill, _aten.masked_fill_, _aten.masked_select, _aten.masked_scatter,
               _aten.index, _aten.index_put, _aten.index_put_, _aten.nonzero}


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


class _Follow(torch_private.TorchDispatchMode):
    def __init__(self, source: torch.Tensor):
        super().__init__()
        self.derived = {id(source)}  # ids of the tensors computed from the input
        self.masks = set()  # ids of comparisons of such tensors
        self.found: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(_tensors((*args, *kwargs.values())))
        out = func(*args, **kwargs)
        if not any(id(x) in self.derived for x in inputs):
            return out
        packet = func.overloadpacket
        outputs = list(_tensors(out if isinstance(out, (tuple, list)) else (out,)))
        if self.found is None:
            if packet in _ROUNDING or packet is _aten.threshold and args[1] != args[2]:
                self.found = f"{packet.__name__} of a value computed from its input"
            elif packet not in _SELECTIONS and any(id(x) in self.masks for x in inputs) \
                    and any(x.is_floating_point() for x in outputs):
                self.found = f"a comparison of a value computed from its input, used as a number ({packet.__name__})"
        for x in outputs:
            self.derived.add(id(x))
            if packet in _COMPARISONS or (id(x) not in self.masks and x.dtype == torch.bool
                                          and any(id(i) in self.masks for i in inputs)):
                self.masks.add(id(x))
        return out


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module):
    bound = buffer_bindings(module)
    saved = [(b, b.detach().clone()) for _, _, b in bound]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            rebind(bound)
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)


def discontinuity(operator: torch.nn.Module, x: torch.Tensor, memory: bool) -> Optional[str]:
    """Where the operator's output jumps with its input `x` (the packed probe psi), or None."""
    follow = _Follow(x)
    with torch.no_grad(), _buffers_kept(operator), follow:
        operator(x, None, None) if memory else operator(x)
    return follow.found
