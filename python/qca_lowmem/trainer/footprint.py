"""What an episode keeps across its steps, in bytes: the figure both `plan` and the OOM guard's
pre-run check count, so they agree."""

from ..memory import parse_bytes

# psi-sized tensors the loss keeps besides the rollout's states (psi_T, |psi_T|, psi0 terms);
# measured with saved_bytes: 2.3 psi at grid 8, 2.0 psi at grid 64.
LOSS_STATES = 3


def psi_bytes(config) -> int:
    """One complex64 state of the config's batch and grid."""
    return config.batch * config.grid * config.grid * config.d_state * 8


def kept_bytes(config, checkpoint: str, slots, budget=None) -> int:
    """The states a recomputing episode keeps: one per step ("step") or `slots` ("revolve"), and
    the loss's; with "auto", what its budget allows (at least one state per step: an "auto"
    episode below that is a revolve one, but the plan does not guess its slots)."""
    kept_states = slots if checkpoint == "revolve" else config.qca_steps
    kept = (kept_states + LOSS_STATES) * psi_bytes(config)
    if checkpoint == "auto" and budget not in (None, "free"):
        kept = max(kept, parse_bytes(budget, allow_zero=True) if isinstance(budget, str) else budget)
    return kept
