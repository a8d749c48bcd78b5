"""What the users' engine keeps across steps and episodes, read and put back as their code leaves
it: the memory of an engine with memory (motor.state.h_state / c_state) and the side state their
CartesianEngine writes for their plots."""

import functools
from typing import Optional

import torch

from .. import _torch_private as torch_private

SIDE_STATE = ("last_psi_input", "last_delta_psi", "last_delta_psi_decay")  # their CartesianEngine's, for their plots


def values_of(tensor: torch.Tensor) -> tuple:
    """A step's tensor held by its memory, not as a tensor: the rollout refuses a tensor a step made
    that outlives it (a graph it may hold would be lost, escapes.py); these values carry none."""
    return tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def tensor_of(values: tuple) -> torch.Tensor:
    storage, offset, shape, stride, dtype, device = values
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def memory_of(motor) -> Optional[tuple]:
    return motor.state.h_state, motor.state.c_state


def store_memory(motor, memory) -> None:
    motor.state.h_state, motor.state.c_state = (m.detach() if m is not None else None for m in memory)


def side_state_of(motor, copy: bool = False) -> dict:
    """The side state their engine's step leaves on the engine (SIDE_STATE), as it stands; `copy`:
    its tensors cloned (a captured step rewrites its buffers in each replay)."""
    held = vars(motor) if hasattr(motor, "__dict__") else {}
    return {name: held[name].clone() if copy and isinstance(held[name], torch.Tensor) else held[name]
            for name in SIDE_STATE if name in held}


def put_side_state(motor, saved: dict) -> None:
    for name, value in saved.items():
        setattr(motor, name, value)


class SideStateRead:
    """The side state the fused step wrote for the forward's last step, put on the engine for the
    loss as stock's loss finds it: the same values, requiring grad (stock's are in the last step's
    graph). A loss differentiating through one would, under plain autograd, send that gradient into
    the last step, of which the fused step keeps no graph: `check()` refuses it, naming it, after
    the backward and before the optimizer steps."""

    def __init__(self, motor):
        self.engine, self.reached = type(motor).__name__, None
        with torch.enable_grad():
            for name in SIDE_STATE:
                value = getattr(motor, name, None)
                if isinstance(value, torch.Tensor):
                    read = value.detach().requires_grad_().clone()  # not a leaf: written in place as stock's may be
                    read.register_hook(functools.partial(self._reach, name))
                    setattr(motor, name, read)

    def release(self, motor) -> None:
        """The side state put back without this check's hooks, once it is done (a torch.save of the
        engine warns of hooks it cannot save)."""
        with torch.enable_grad():
            for name in SIDE_STATE:
                value = getattr(motor, name, None)
                if isinstance(value, torch.Tensor) and torch_private.has_hooks(value):
                    setattr(motor, name, value.detach().requires_grad_().clone())

    def _reach(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        self.reached = self.reached or name
        return grad

    def check(self) -> None:
        if self.reached is not None:
            raise RuntimeError(
                f"qca_lowmem: the loss differentiates through {self.engine}.{self.reached}, the side state the "
                "engine's last step leaves for plots: under plain autograd that gradient flows into the last step, "
                "whose graph the fused step does not keep, so the episode is refused before the optimizer steps. "
                f"Read it detached in the loss ({self.reached}.detach()), or compute the term from the history the "
                "loss is given; else qca_lowmem.disable(trainer) to train on stock")
