"""Tensors that leave a step other than through its state (psi, the carry).

A recomputing episode runs each step in its forward keeping nothing of the step's graph, and
again in backward. A tensor the step hands out some other way (an activity penalty a forward
hook appends to a list, a tensor kept on a module) comes from the forward's run; plain autograd
would differentiate the loss through it into the step, where the episode keeps no graph. So each
step the forward runs eagerly (the probe's included) runs inside a `StepFrame`: its inputs fresh
leaves requiring grad, as plain autograd's steps see them, under saved-tensor hooks that hold
what the step's graph saves only while the step runs (an operator calling torch.autograd.grad
inside its forward has them). A backward that later reaches the step's graph through a tensor it
handed out needs a saved tensor or the gradient of the step's inputs, and either raises
`EscapedTensorError`, naming the rollout, the step and the fix; one whose graph needs neither (a
function of the parameters alone) gets its gradient, as under plain autograd.

The probed steps run with grad, so what they hand out carries their graph. The forward's other
steps run without grad (a graph costs a third of a small step's time), so what they hand out
would be a constant: when anything a probed step made outlives it (`Leftovers`) besides its state
and the episode's weight copies, the forward runs every step with grad instead; otherwise what a
later step made and hands out (the watch's `made`) is refused at the forward.
"""

import sys
import weakref
from typing import Dict, Iterable, List, Optional

import torch

from .memory import counted_storages
from .state import State


class EscapedTensorError(RuntimeError):
    pass


class InputTrap:
    """Refuses the gradient of a step's input leaves (`set_on`), except while `allowed`: reached
    otherwise, the gradient would stop there instead of flowing on into the earlier steps."""

    def __init__(self, policy, t: int, allowed: bool):
        self.policy, self.t, self.allowed = policy, t, allowed

    def set_on(self, state: State) -> State:
        for x in state.tensors():
            if x is not None and x.requires_grad:
                x.register_hook(self._reached)
        return state

    def _reached(self, grad):
        if not self.allowed:
            self.refuse()
        return grad

    def refuse(self):
        raise EscapedTensorError(
            f"rollout(checkpoint={self.policy.checkpoint!r}): the backward reached the graph of step {self.t} through a tensor "
            "that left the step other than through psi (or the carry): an activity penalty a forward hook appends "
            "to a list, a tensor kept on a module, ... The episode keeps no graph of its steps, so that gradient "
            "cannot be computed: hand the tensor out through the carry (rollout(..., carry=...)), or use "
            "checkpoint='none' (plain autograd)")


class StepFrame:
    """Step `t`'s forward run, for a rollout under `policy` (a Policy). With `keep` the graph's saved
    tensors are kept (a graph the episode goes on using), and nothing is refused; with `sizes`
    the bytes of the storages saved (parameters excluded, each counted once) are appended to it
    on exit, as memory.saved_bytes counts them."""

    def __init__(self, policy, t: int, sizes: Optional[List[int]] = None, keep: bool = False, grad: bool = True):
        self.t, self.sizes, self.keep = t, sizes, keep
        self.saved: Optional[list] = []  # None once the step has ended
        self.trap = InputTrap(policy, t, allowed=True)
        self.storages = {}
        self.kept = {}  # with `keep`: id of each tensor the graph saved -> how many times (its references)
        self._grad = torch.enable_grad() if grad else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "StepFrame":
        if self._grad is not None:
            self._grad.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        if self._grad is not None:
            self._grad.__exit__(*exc)
        self.saved = None
        self.trap.allowed = False
        if self.sizes is not None:
            self.sizes.append(sum(storage.nbytes() for storage in self.storages.values()))
        self.storages = None
        return False

    def inputs(self, state: State) -> State:
        """The step's inputs: leaves requiring grad, whose gradient, asked after the step, is refused."""
        inputs = state.as_inputs(True)
        return inputs if self.keep else self.trap.set_on(inputs)

    def _pack(self, tensor):
        if self.sizes is not None:
            self.storages.update(counted_storages(tensor))
        if self.keep:
            self.kept[id(tensor)] = self.kept.get(id(tensor), 0) + 1
            return tensor
        self.saved.append(tensor)
        return self, len(self.saved) - 1

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        frame, index = packed
        if frame.saved is None:
            frame.trap.refuse()
        return frame.saved[index]


class Leftovers:
    """The tensors the probed steps' ops made (weak references), to tell after them whether any
    outlives its step other than as (a view of) the step's state."""

    def __init__(self):
        self.made: List[weakref.ref] = []
        self.state_storages = set()
        self.saved: Dict[int, int] = {}  # id -> references a kept graph holds to that tensor

    def add(self, made: Iterable[weakref.ref], outputs: State, existing: Iterable[int],
            saved: Optional[Dict[int, int]] = None) -> None:
        """`made`: what a step's ops returned; not counted, those whose ids are in `existing`:
        tensors that were there before and that an in-place op returned (a BatchNorm's
        statistics); `saved`: the references a graph the episode keeps holds (StepFrame.kept)."""
        existing = set(existing)
        self.made += [ref for ref in made if id(ref()) not in existing]
        self.state_storages |= {x.untyped_storage().data_ptr() for x in outputs.tensors() if x is not None}
        self.saved.update(saved or {})

    def any(self, kept: Iterable[torch.Tensor]) -> bool:
        """Whether one is alive, other than the tensors in `kept` (the episode's weight copies)."""
        kept = {id(x) for x in kept}
        for ref in self.made:
            tensor = ref()
            if tensor is not None and id(tensor) not in kept and tensor.device.type != "meta" \
                    and tensor.untyped_storage().data_ptr() not in self.state_storages \
                    and sys.getrefcount(tensor) - 2 > self.saved.get(id(tensor), 0):  # 2: the call's, `tensor`
                return True
        return False
