"""What the users' engine keeps across steps and episodes, read and put back as their code leaves
it: the memory of an engine with memory (motor.state.h_state / c_state) and the side state their
CartesianEngine writes for their plots."""

from typing import Optional

import torch

SIDE_STATE = ("last_psi_input", "last_delta_psi", "last_delta_psi_decay")  # their CartesianEngine's, for their plots


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
