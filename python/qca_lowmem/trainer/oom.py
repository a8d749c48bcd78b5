"""The reference trainer's answer to running out of memory (CUDA, or the CPU allocator): retry
the episode with the next lower-memory policy (revolve, then fewer slots, then half the batch);
when none is left, save progress and stop with advice (exit status EXIT_OOM from the CLI). And
before a CPU run, the refusal of a config that cannot fit at all."""

import dataclasses
import gc
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..recompute import Policy
from ..units import format_bytes
from .errors import UsageError
from .footprint import kept_bytes, model_state_bytes, psi_bytes

EXIT_OOM = 3


@dataclass(frozen=True)
class RunPolicy:
    """How the trainer runs an episode: the rollout's policy and the batch. The OOM guard lowers
    it step by step."""

    policy: Policy
    batch: int = 1

    def describe(self) -> str:
        return f"{self.policy.describe()} batch={self.batch}"

    def lowered(self, qca_steps: int) -> Optional["RunPolicy"]:
        """The next lower-memory run: the policy's next (revolve, then fewer slots), then half the
        batch."""
        lower = self.policy.lowered(qca_steps)
        if lower is not None:
            return dataclasses.replace(self, policy=lower)
        if self.batch > 1:
            return dataclasses.replace(self, batch=self.batch // 2)
        return None

    def state_dict(self) -> dict:
        return {**self.policy.options(), "batch": self.batch}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RunPolicy":
        """Also reads checkpoints written before the budget was kept in bytes."""
        return cls(Policy.of(state["checkpoint"], state["slots"], state.get("budget"), "checkpoint"), state["batch"])


class OutOfMemoryStop(RuntimeError):
    """Raised after the OOM guard ran out of policies; progress is saved."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's torch.OutOfMemoryError, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


def available_cpu_memory() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cpu_memory(config, parameters: int, available: Optional[int] = None):
    """Refuse a CPU run whose lower bound (model state and the states its policy keeps: what
    `qca-lowmem plan` counts, without a step's working set) exceeds the memory available."""
    available = available_cpu_memory() if available is None else available
    if available is None:
        return
    policy = config.policy()
    psi = psi_bytes(config.batch, config.grid, config.d_state)
    state_bytes, kept = model_state_bytes(parameters), kept_bytes(policy, config.qca_steps, psi)
    if state_bytes + kept <= available:
        return
    lower = policy.lowered(config.qca_steps)
    # the lower policy only where it fits (at an absurd grid each would name the next)
    advice = [" ".join(lower.cli_arguments())] if lower is not None and \
        lower.kept_states(config.qca_steps) < policy.kept_states(config.qca_steps) and \
        state_bytes + kept_bytes(lower, config.qca_steps, psi) <= available else []
    advice += [f"a smaller --batch (now {config.batch})"] * (config.batch > 1)
    advice.append(f"a smaller --grid (now {config.grid}), --qca-steps (now {config.qca_steps}) or --hidden "
                  f"(now {config.hidden})")
    raise OutOfMemoryStop(
        f"qca-lowmem: this config needs at least {format_bytes(state_bytes + kept)} of CPU memory "
        f"(model state {format_bytes(state_bytes)}, kept states {format_bytes(kept)} with "
        f"{policy.describe()}) but {format_bytes(available)} is available: lower it with "
        + "; ".join(advice) + " (`qca-lowmem plan` shows the peak)")


def check_cpu_holds_model(config, parameters: int) -> None:
    """Refuse to measure a step of a model (`qca-lowmem plan`) whose weights and gradients alone
    exceed the CPU memory available."""
    needed, available = 8 * parameters, available_cpu_memory()
    if available is not None and needed > available:
        raise UsageError(f"plan measures a step of the model on the CPU: hidden {config.hidden}, d_state "
                         f"{config.d_state} needs at least {format_bytes(needed)} of CPU memory for its weights and "
                         f"gradients, {format_bytes(available)} is available")


def release_cached_memory():
    """What a retry needs first: the failed attempt's tensors collected and the CUDA cache freed."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def no_policy_left(episode: int, device, policy: RunPolicy, saved_through: int, checkpoint_path, advice: List[str]):
    """The stop after the lowest policy failed too; progress up to `saved_through` is in
    `checkpoint_path`."""
    saved = f"Episodes 0-{saved_through - 1} are saved in {checkpoint_path}" if saved_through else \
        f"No episode finished; the run's state is in {checkpoint_path}"
    return OutOfMemoryStop(
        f"qca-lowmem: out of memory at episode {episode} on {device} even with "
        f"{policy.describe()} (the lowest-memory policy). {saved}; --resume {checkpoint_path} continues at "
        f"episode {saved_through}. To fit, try: " + "; ".join(advice) + "."
    )


def fitting_advice(amp_dtype, policy: RunPolicy, grid: int, hidden: int, device) -> List[str]:
    """What to change when even the lowest policy does not fit, cheapest first."""
    advice = []
    if amp_dtype is None:
        advice.append("--amp-dtype bf16 (halves the U-Net activations)")
    advice.append(f"a smaller --batch (now {policy.batch})" if policy.batch > 1 else
                  f"a smaller grid (now {grid}) or hidden (now {hidden}); this changes the model")
    advice.append(_where_to_look(device))
    return advice


def _where_to_look(device) -> str:
    """plan predicts GPU memory; on the CPU what matters is the memory other processes leave."""
    if device.type == "cuda":
        return "`qca-lowmem plan --gpu-mem <your GPU memory>` to see what fits"
    available = available_cpu_memory()
    return "fewer other processes on this machine" + (
        f" ({format_bytes(available)} of memory available now)" if available is not None else "")


def optimizer_step_failed(last_episode: int, device, parameters: int, out_dir):
    """The stop when the optimizer step itself runs out of memory (no checkpoint is written: it
    may have updated some parameters already)."""
    return OutOfMemoryStop(
        f"qca-lowmem: out of memory in the optimizer step after episode {last_episode} on {device}: "
        f"the model state (weights, gradients, AdamW moments: {format_bytes(model_state_bytes(parameters))}) does not fit "
        f"next to the rest. The last checkpoint in {out_dir} holds the progress saved so far. "
        + ("Free the GPU of other processes, or see `qca-lowmem plan --gpu-mem <your GPU memory>`."
           if device.type == "cuda" else "Free memory held by other processes on this machine.")
    )
