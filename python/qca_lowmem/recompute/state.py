"""The episode's state inside the rollout: psi and the carry (state the step keeps besides psi,
a ConvLSTM's h and c), one representation for every schedule, the reverse pass and the capture.

The carry is always a tuple, empty when the rollout carries nothing; the public rollout() turns
its `carry=None` into () on the way in and back into two return values on the way out.
"""

from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch


def differentiable(tensor) -> bool:
    """Whether a state entry can carry a gradient (None and integer tensors cannot)."""
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


def signature(tensor):
    """What a capture or a measure fixes of a state entry: its shape, dtype and device, or None."""
    return None if tensor is None else (tuple(tensor.shape), tensor.dtype, tensor.device)


def describe(tensor) -> str:
    return "None" if tensor is None else f"shape={tuple(tensor.shape)} dtype={tensor.dtype} device={tensor.device}"


class State(NamedTuple):
    psi: torch.Tensor
    carry: Tuple[Optional[torch.Tensor], ...] = ()

    def tensors(self) -> tuple:
        """psi and each carry entry (None entries included), flat."""
        return (self.psi, *self.carry)

    def entries(self):
        """(name, tensor or None) for psi and each carry entry."""
        yield "psi", self.psi
        for i, c in enumerate(self.carry):
            yield f"carry[{i}]", c

    def signature(self):
        return signature(self.psi), tuple(map(signature, self.carry))

    def nbytes(self) -> int:
        return self.psi.nbytes + sum(c.nbytes for c in self.carry if c is not None)

    def detached(self) -> "State":
        return State(self.psi.detach(), tuple(None if c is None else c.detach() for c in self.carry))

    def as_inputs(self, needs_grad: Union[bool, Sequence[bool]]) -> "State":
        """Detached leaves, requiring grad where `needs_grad` says (one flag, or one per entry, psi
        first) and the entry is differentiable: the inputs of a step run with grad."""
        flags = [needs_grad] * (1 + len(self.carry)) if isinstance(needs_grad, bool) else list(needs_grad)
        leaves = [None if x is None else x.detach().requires_grad_(needs and differentiable(x))
                  for x, needs in zip(self.tensors(), flags)]
        return State(leaves[0], tuple(leaves[1:]))

    def needs_grad(self):
        """Per entry, psi first: whether it requires grad."""
        return [x is not None and x.requires_grad for x in self.tensors()]


def checked_carry(carry, what: str, width: Optional[int] = None) -> tuple:
    """carry as a tuple of tensors or None, of `width` entries when given."""
    if not isinstance(carry, (tuple, list)) or not all(c is None or isinstance(c, torch.Tensor) for c in carry):
        got = type(carry).__name__ if not isinstance(carry, (tuple, list)) else [type(c).__name__ for c in carry]
        raise TypeError(f"rollout: {what} must be a tuple of tensors (None entries allowed), got {got}")
    if width is not None and len(carry) != width:
        raise ValueError(f"rollout: {what} must keep the carry's length {width}, got {len(carry)} entries")
    return tuple(carry)


def check_like_psi(out, psi: torch.Tensor, name: str, t: Optional[int]) -> None:
    """A step or noise output must be a tensor of psi's shape, dtype and device (`t`: the step,
    None while a capture warms up)."""
    when = "while warming up its capture" if t is None else f"at step {t}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"rollout: {name} must return a tensor like psi, {when} it returned {type(out).__name__}")
    if out.shape != psi.shape or out.dtype != psi.dtype or out.device != psi.device:
        raise ValueError(
            f"rollout: {name} must keep psi's shape, dtype and device; {when} it got psi "
            f"shape={tuple(psi.shape)} dtype={psi.dtype} device={psi.device} and returned "
            f"shape={tuple(out.shape)} dtype={out.dtype} device={out.device}"
        )
