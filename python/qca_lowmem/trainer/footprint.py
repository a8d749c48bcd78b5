"""What a training run of the reference trainer keeps, in bytes, for `qca-lowmem plan` and the
OOM guard: the model state no policy removes, one state's size, and what an episode keeps across
its steps under a policy besides the step's working set."""

from typing import Optional, Tuple, Union

from ..recompute import Policy

# fp32 weights (4 B), gradients (4 B) and AdamW's two moments (8 B) per parameter: a floor no
# policy removes.
MODEL_STATE_BYTES_PER_PARAMETER = 16
# psi-sized tensors the stock loss keeps besides the rollout's states (psi_T, |psi_T|, psi0
# terms); measured with saved_bytes: 2.3 psi at grid 8, 2.0 psi at grid 64.
LOSS_STATES = 3


def kept_bytes(policy: Policy, steps: int, state_bytes: int, step_bytes: Optional[int] = None) -> int:
    """What a recomputing episode of `steps` steps keeps across them, and the loss's states: the
    policy's states, or with a budget in bytes what it allows, never more than every step's full
    graph when `step_bytes` (one step's, with its output state) is known."""
    kept = policy.kept_states(steps) * state_bytes
    if policy.byte_budget is not None:
        kept = max(kept, policy.byte_budget)
        if step_bytes is not None:
            kept = min(kept, steps * max(step_bytes, state_bytes))
    return kept + LOSS_STATES * state_bytes


def model_state_bytes(parameters: int) -> int:
    return MODEL_STATE_BYTES_PER_PARAMETER * parameters


def psi_bytes(batch: int, grid: Union[int, Tuple[int, int]], d_state: int, itemsize: int = 8) -> int:
    """One state of this batch and grid (an int for a square one), complex64 unless `itemsize`
    says otherwise (16: complex128)."""
    height, width = (grid, grid) if isinstance(grid, int) else grid
    return batch * height * width * d_state * itemsize
