"""The reference trainer's answer to CUDA running out of memory: retry the episode with the next
lower-memory policy (revolve, then fewer slots, then half the batch); when none is left, save
progress and stop with advice (exit status EXIT_OOM from the CLI)."""

import gc
from dataclasses import dataclass
from typing import List, Optional

import torch

from .memory import format_bytes

EXIT_OOM = 3


@dataclass
class Policy:
    """How an episode is run; the OOM guard lowers it step by step."""

    checkpoint: str = "step"
    slots: Optional[int] = None
    batch: int = 1

    def describe(self):
        extra = f" slots={self.slots}" if self.checkpoint == "revolve" else ""
        return f"checkpoint={self.checkpoint}{extra} batch={self.batch}"

    def lowered(self, qca_steps: int) -> Optional["Policy"]:
        """The next lower-memory policy: revolve, then fewer slots, then half the batch."""
        if self.checkpoint != "revolve":
            return Policy("revolve", max(1, min(32, qca_steps // 4)), self.batch)
        if self.slots > 2:
            return Policy("revolve", max(2, self.slots // 4), self.batch)
        if self.batch > 1:
            return Policy("revolve", self.slots, self.batch // 2)
        return None


class OutOfMemoryStop(RuntimeError):
    """Raised after the OOM guard ran out of policies; progress is saved."""


def release_cached_memory():
    """What a retry needs first: the failed attempt's tensors collected and the CUDA cache freed."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def no_policy_left(episode: int, device, policy: Policy, saved_through: int, checkpoint_path, advice: List[str]):
    """The stop after the lowest policy failed too; progress up to `saved_through` is in
    `checkpoint_path`."""
    return OutOfMemoryStop(
        f"qca-lowmem: out of memory at episode {episode} on {device} even with "
        f"{policy.describe()} (the lowest-memory policy). Progress up to episode {saved_through} "
        f"is saved in {checkpoint_path}; continue with --resume {checkpoint_path}. To fit, try: "
        + "; ".join(advice) + "."
    )


def fitting_advice(amp_dtype, policy: Policy, grid: int, hidden: int) -> List[str]:
    """What to change when even the lowest policy does not fit, cheapest first."""
    advice = []
    if amp_dtype is None:
        advice.append("--amp-dtype bf16 (halves the U-Net activations)")
    advice.append(f"a smaller --batch (now {policy.batch})" if policy.batch > 1 else
                  f"a smaller grid (now {grid}) or hidden (now {hidden}); this changes the model")
    advice.append("`qca-lowmem plan --gpu-mem <your GPU memory>` to see what fits")
    return advice


def optimizer_step_failed(last_episode: int, device, parameters: int, out_dir):
    """The stop when the optimizer step itself runs out of memory (no checkpoint is written: it
    may have updated some parameters already)."""
    return OutOfMemoryStop(
        f"qca-lowmem: out of memory in the optimizer step after episode {last_episode} on {device}: "
        f"the model state (weights, gradients, AdamW moments: {format_bytes(16 * parameters)}) does not fit "
        f"next to the rest. The last checkpoint in {out_dir} holds the progress saved so far. "
        "Free the GPU of other processes, or see `qca-lowmem plan --gpu-mem <your GPU memory>`."
    )
