"""The memory policy of an episode: what the rollout keeps for backward and what it recomputes.

A `Policy` is a frozen value, checked and normalised once (`Policy.of`): the budget is bytes or
"free". The mode names are defined here, and what each means for an episode by its `Schedule`
subclass (schedule.py, which `schedule.choose` picks by the policy's mode); everything else
(rollout, enable(), the trainer, plan, the OOM guard) asks the policy: how it is described, how it
is lowered when memory runs out, what it keeps. The rollout passes it whole, down to the errors
that name it.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from ..units import parse_bytes, size_text

NONE, STEP, REVOLVE, AUTO = "none", "step", "revolve", "auto"
MODES = (NONE, STEP, REVOLVE, AUTO)
FREE = "free"  # an "auto" budget read from the GPU's free memory


@dataclass(frozen=True)
class Policy:
    """checkpoint: "none" (plain autograd), "step" (one state per step, each step recomputed
    once), "revolve" (at most `slots` states, binomial schedule) or "auto" (the full graphs of as
    many last steps as `budget` bytes hold, the others "step", or revolve below that)."""

    checkpoint: str = STEP
    slots: Optional[int] = None
    budget: Union[int, str, None] = None

    @classmethod
    def of(cls, checkpoint=STEP, slots=None, budget=None, caller: str = "rollout") -> "Policy":
        """The policy of these options; ValueError, prefixed by `caller`, unless they make one."""
        if checkpoint not in MODES:
            raise ValueError(f"{caller}: checkpoint must be one of {MODES}, got {checkpoint!r}")
        if checkpoint == REVOLVE:
            if slots is None:
                raise ValueError(f"{caller}: checkpoint='revolve' needs slots >= 1 (the number of states to keep)")
            if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
                raise ValueError(f"{caller}: slots must be an int >= 1 (states kept, psi0 included), got {slots!r}")
        elif slots is not None:
            raise ValueError(f"{caller}: slots applies only to checkpoint='revolve', got slots={slots!r} with "
                             f"checkpoint={checkpoint!r}")
        if checkpoint != AUTO:
            if budget is not None:
                raise ValueError(f"{caller}: budget applies only to checkpoint='auto', got budget={budget!r} "
                                 f"with checkpoint={checkpoint!r}")
            return cls(checkpoint, slots)
        return cls(checkpoint, None, _normalised_budget(budget, caller))

    @classmethod
    def plain(cls) -> "Policy":
        return cls(NONE)

    @classmethod
    def every_step(cls) -> "Policy":
        return cls(STEP)

    @classmethod
    def revolve(cls, slots: int) -> "Policy":
        return cls.of(REVOLVE, slots)

    @classmethod
    def auto(cls, budget) -> "Policy":
        return cls.of(AUTO, budget=budget)

    @property
    def recomputes(self) -> bool:
        """Whether the episode recomputes steps (every policy but plain autograd)."""
        return self.checkpoint != NONE

    @property
    def reads_free_memory(self) -> bool:
        return self.budget == FREE

    @property
    def keeps_one_state_per_step(self) -> bool:
        """"step": the policy the OOM guard lowers from and plan offers "auto" beside."""
        return self.checkpoint == STEP

    def options(self) -> dict:
        """rollout()'s and enable()'s keyword arguments for this policy."""
        return dict(checkpoint=self.checkpoint, slots=self.slots, budget=self.budget)

    def check_device(self, device: torch.device, caller: str = "rollout") -> None:
        """Refuse a budget of "free" off CUDA: it reads a GPU's free memory."""
        if self.reads_free_memory and torch.device(device).type != "cuda":
            raise ValueError(f"{caller}: budget='free' reads the free memory of a CUDA device, but the device is "
                             f"{device}: give the budget in bytes (e.g. 2GiB)")

    def describe(self) -> str:
        """As the trainer logs it: checkpoint=revolve slots=8, checkpoint=auto budget=2.00 GiB."""
        return f"checkpoint={self.checkpoint}{self._detail(' slots=', ' budget=')}"

    def label(self) -> str:
        """As plan names it: step, revolve 32, auto."""
        return f"{self.checkpoint}{self._detail(' ', '') if self.checkpoint == REVOLVE else ''}"

    def cli_arguments(self) -> List[str]:
        """The `qca-lowmem train` flags that select this policy."""
        flags = ["--checkpoint", self.checkpoint]
        if self.checkpoint == REVOLVE:
            flags += ["--slots", str(self.slots)]
        if self.checkpoint == AUTO:
            flags += ["--budget", _budget_text(self.budget)]
        return flags

    def _detail(self, slots_prefix: str, budget_prefix: str) -> str:
        if self.checkpoint == REVOLVE:
            return f"{slots_prefix}{self.slots}"
        if self.checkpoint == AUTO:
            return f"{budget_prefix}{_budget_text(self.budget)}"
        return ""

    def lowered(self, steps: int) -> Optional["Policy"]:
        """The next lower-memory policy for an episode of `steps` steps: revolve (from any other),
        then fewer slots; None below two slots."""
        if self.checkpoint != REVOLVE:
            return Policy.revolve(max(1, min(32, steps // 4)))
        if self.slots > 2:
            return Policy.revolve(max(2, self.slots // 4))
        return None

    def kept_states(self, steps: int) -> int:
        """States (psi and carry) a recomputing episode of `steps` steps keeps across it: `slots`
        with revolve, else one per step ("auto" keeps at least that, or is revolve)."""
        return self.slots if self.checkpoint == REVOLVE else steps

    @property
    def byte_budget(self) -> Optional[int]:
        """The budget in bytes of an "auto" policy that has one (not "free")."""
        return self.budget if self.checkpoint == AUTO and not self.reads_free_memory else None


def _normalised_budget(budget, caller: str):
    if budget is None:
        raise ValueError(f"{caller}: checkpoint='auto' needs budget: the bytes the episode may keep for backward "
                         "(an int, a size such as '2GiB', or 'free' on CUDA)")
    if budget == FREE:
        return FREE
    if isinstance(budget, str):
        try:
            return parse_bytes(budget, allow_zero=True)
        except ValueError:
            raise ValueError(f"{caller}: budget must be a number of bytes, a size such as '2GiB' or 'free', "
                             f"got {budget!r}") from None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"{caller}: budget must be an int >= 0 (bytes), a size such as '2GiB' or 'free', "
                         f"got {budget!r}")
    return budget


def _budget_text(budget) -> str:
    return budget if budget == FREE else size_text(budget)
