"""The reference trainer's answer to a run that diverges: a step with a non-finite loss or
gradient is skipped (the weights unchanged), `max_skipped_steps` of them in a row stop the run,
and so does a step that leaves the weights non-finite; the last checkpoint stays as it was."""

from typing import Optional

from .checkpoint import CHECKPOINT_NAME, all_finite
from .errors import TrainingStopped


def last_checkpoint_text(trainer) -> str:
    if trainer.saved_episode is None:
        return "no checkpoint was written yet"
    return f"the last checkpoint, {trainer.out_dir / CHECKPOINT_NAME} (episode {trainer.saved_episode}), is untouched"


def count_skipped(trainer, first: int, count: int, reason: Optional[str]):
    """Say that the step of episodes first..first+count-1 was skipped for `reason` (None: it was
    taken); TrainingStopped after max_skipped_steps in a row."""
    if reason is None:
        trainer.skipped_in_row = 0
        return
    trainer.skipped_in_row += 1
    episodes = f"episode {first}" if count == 1 else f"episodes {first}-{first + count - 1}"
    config, limit = trainer.config, trainer.config.max_skipped_steps
    if trainer.skipped_in_row < limit:
        trainer._log(f"{episodes}: {reason}; optimizer step skipped, weights unchanged "
                     f"({trainer.skipped_in_row} in a row; the run stops at {limit})")
        return
    raise TrainingStopped(
        f"stopped at {episodes}: {limit} optimizer steps in a row skipped (max_skipped_steps), the last "
        f"for {reason}: the run diverged; {last_checkpoint_text(trainer)}; lower lr (now {config.lr:g}) "
        f"or weight_decay (now {config.weight_decay:g}), or check the config")


def check_weights(trainer, last_episode: int):
    """TrainingStopped when the step just taken left a weight non-finite (the same on every rank)."""
    if not all_finite(trainer.model.parameters()):
        raise TrainingStopped(
            f"stopped at episode {last_episode}: the optimizer step made the weights non-finite (lr "
            f"{trainer.config.lr:g}, weight_decay {trainer.config.weight_decay:g}), not saved; "
            f"{last_checkpoint_text(trainer)}; lower lr or weight_decay")
