"""What differs between the users' trainer versions around the one lowmem episode that
enable() runs (switch.py): where psi0 comes from, the noise, the loss, which model trains,
the clipping norm, whether the loss is scaled, what happens to the engine's memory afterwards and
what train_episode returns.

`QC_Trainer_v4`: psi0 from the engine's state reset or the stock draw, the noise curriculum, the
history loss `loss_fn(history, psi0)`, `model_operator` clipped at 1.0, the loss scaled by
`scaler` where `use_amp`, the ConvLSTM memory kept on the engine, returns (loss, metrics, psi_T).
`QC_Trainer_v3`: psi0 = `motor.get_initial_state(batch_size)`, no noise, the reward
`compute_reward(psi0, psi_T)` (loss = -reward), clipping at its `gradient_clip` when positive, no
loss scaling, the memory reset to None after the episode, returns (loss, reward, quietness
reward, complexity reward). A trainer is told apart by its attributes.
"""

from typing import Callable, Optional, Protocol, Tuple, runtime_checkable

import torch

from .. import stock
from ..ops.noise import NoiseSchedule
from .engine_state import store_memory
from .mask_free_noise import without_host_waits


def _missing(trainer, paths) -> list:
    missing = []
    for path in paths:
        owner = trainer
        for part in path.split("."):
            if not hasattr(owner, part):
                missing.append(path)
                break
            owner = getattr(owner, part)
    return missing


def _psi_dtype(trainer) -> torch.dtype:
    """The complex dtype of a psi0 the stock draw makes: the trainer's cfg.DTYPE where it names one
    (as the stand-in draws), else the one the operator's parameters compute in."""
    dtype = getattr(getattr(trainer, "cfg", None), "DTYPE", None)
    if isinstance(dtype, torch.dtype) and dtype.is_complex:
        return dtype
    parameter = next(trainer.motor.operator.parameters())
    return torch.complex128 if parameter.dtype == torch.float64 else torch.complex64


@runtime_checkable
class TrainerVersion(Protocol):
    """What the episode (switch.py) and enable() read of a trainer version: its adapter, a class of
    static methods, is the value that satisfies this."""

    name: str  # the users' class name of that version
    draws_own_psi0: bool  # psi0 from the trainer's own draw: enable()'s grid_size / batch_size refused
    # the device types whose autocast the stock episode sets itself; on others it runs under the caller's
    own_autocast: Tuple[str, ...]
    has_noise: bool  # its episodes inject noise (enable()'s `noise` is read)
    named_on_enable: bool  # enable()'s line names this version's episode
    required: Tuple[str, ...]  # the attribute paths a trainer of this version has

    def check(self, trainer) -> None:
        """Refuse a trainer of this version that has nothing to train."""

    def model(self, trainer) -> Optional[torch.nn.Module]:
        """The module their episode puts in train mode and whose parameters it clips (None: neither)."""

    def initial_state(self, trainer, opts, device) -> torch.Tensor:
        """The episode's psi0."""

    def noise(self, trainer, episode, source: str) -> Optional[Callable]:
        """The episode's noise(psi, t), or None."""

    def record_every(self, trainer) -> Optional[int]:
        """The rollout's history spacing (None: the stock rule)."""

    def loss(self, trainer, psi0, psi_T, history):
        """(loss, what result() reports besides)."""

    def max_grad_norm(self, trainer) -> Optional[float]:
        """The clipping norm where enable() was given none, None for no clipping."""

    def scales(self, trainer) -> bool:
        """Whether its episode scales the loss with `trainer.scaler`, read at each episode."""

    def leave_memory(self, trainer, memory_T) -> None:
        """The engine's memory as the version's episode leaves it once its steps are done, before
        the loss reads the engine (and again after the backward, whose recomputes may rewrite it)."""

    def result(self, trainer, episode, loss, details, psi_T):
        """What train_episode returns."""


class TrainerV4:
    name = "QC_Trainer_v4"
    draws_own_psi0 = False  # enable()'s grid_size / batch_size / the engine's state reset size psi0
    own_autocast = ("cuda",)  # torch.cuda.amp.autocast(enabled=use_amp) around its forward
    has_noise = True  # its noise_injector, or enable(noise="fused")
    named_on_enable = False  # the default: enable()'s line names only another version's episode
    required = ("motor", "motor.operator", "motor.evolve_step", "optimizer", "qca_steps", "max_noise", "loss_fn",
                "train_episode", "scaler")

    @staticmethod
    def check(trainer) -> None:
        pass

    @staticmethod
    def model(trainer) -> Optional[torch.nn.Module]:
        # `if self.model_operator:`, the operator their constructor read: one set on motor since is
        # neither put in train mode nor clipped by their episode
        model = getattr(trainer, "model_operator", trainer.motor.operator)
        return model if model else None

    @staticmethod
    def initial_state(trainer, opts, device):
        if opts.initial_state is not None:
            return opts.initial_state(trainer)
        return stock.initial_state(opts.batch_size, opts.grid, opts.d_state, device, dtype=_psi_dtype(trainer))

    @staticmethod
    def noise(trainer, episode, source: str) -> Optional[Callable]:
        """The episode's noise(psi, t), None when the curriculum leaves it off. "trainer": the
        trainer's injector as stock applies it, the same draws in the same order (the rollout
        replays the generators' states in its recomputes), without host waits on CUDA
        (mask_free_noise.py); "fused": a NoiseSchedule keyed by one
        draw from torch's generator, replayed by construction."""
        rate = stock.noise_rate(episode, trainer.max_noise)
        if rate <= stock.NOISE_RATE_THRESHOLD:
            return None
        if source == "fused":
            return NoiseSchedule(trainer.max_noise, episode, int(torch.randint(0, 2**62, (1,)).item()))
        injector = without_host_waits(trainer.noise_injector)
        return lambda psi, t: stock.noise_step(injector, psi, rate)

    @staticmethod
    def record_every(trainer) -> None:
        return None  # the stock history: t == 0, T-1 and every max(1, T // 10) steps

    @staticmethod
    def loss(trainer, psi0, psi_T, history):
        return trainer.loss_fn(history, psi0)

    @staticmethod
    def max_grad_norm(trainer) -> float:
        return 1.0

    @staticmethod
    def scales(trainer) -> bool:
        return bool(getattr(trainer, "use_amp", False) and trainer.scaler)  # `if self.use_amp and self.scaler:`

    @staticmethod
    def leave_memory(trainer, memory_T) -> None:
        if memory_T is not None:  # the memory the last step left, as the engine's own step keeps it
            store_memory(trainer.motor, memory_T)

    @staticmethod
    def result(trainer, episode, loss, metrics, psi_T):
        loss_value = loss.item()
        stock.episode_bookkeeping(getattr(trainer, "writer", None), episode, loss_value, metrics,
                                  stock.noise_rate(episode, trainer.max_noise))
        return loss_value, metrics, psi_T.detach().cpu()


class TrainerV3:
    name = "QC_Trainer_v3"
    draws_own_psi0 = True  # motor.get_initial_state(batch_size)
    own_autocast = ()
    has_noise = False
    named_on_enable = True
    required = ("motor", "motor.operator", "motor.evolve_step", "motor.get_initial_state",
                "motor.get_model_for_params", "optimizer", "qca_steps", "batch_size", "gradient_clip",
                "compute_reward", "train_episode")

    @staticmethod
    def check(trainer) -> None:
        if trainer.optimizer is None:
            raise ValueError(f"enable(): {type(trainer).__name__}.optimizer is None (its engine gave no model to "
                             "train): there is no episode to run with less memory")
        if TrainerV3.model(trainer) is None:
            raise ValueError(f"enable(): {type(trainer).__name__}.motor.get_model_for_params() returned None: "
                             "no model to train")

    @staticmethod
    def model(trainer) -> torch.nn.Module:
        return trainer.motor.get_model_for_params()

    @staticmethod
    def initial_state(trainer, opts, device):
        psi0 = opts.initial_state(trainer) if opts.initial_state is not None else \
            trainer.motor.get_initial_state(trainer.batch_size)
        # As their episode: a reward may differentiate with respect to psi_initial.
        return psi0.requires_grad_(True)

    @staticmethod
    def noise(trainer, episode, source: str) -> None:
        return None

    @staticmethod
    def record_every(trainer) -> int:
        return trainer.qca_steps  # the reward reads psi_T alone: keep no history besides

    @staticmethod
    def loss(trainer, psi0, psi_T, history):
        rewards = trainer.compute_reward(psi0, psi_T)
        if not isinstance(rewards, (tuple, list)) or len(rewards) != 3:
            raise TypeError(f"{type(trainer).__name__}.compute_reward(psi_initial, psi_final) must return (total, "
                            f"quietness, complexity) as QC_Trainer_v3's does, it returned {type(rewards).__name__}")
        return -rewards[0], rewards  # V3 maximises the reward

    @staticmethod
    def max_grad_norm(trainer) -> Optional[float]:
        return trainer.gradient_clip if trainer.gradient_clip > 0 else None

    @staticmethod
    def scales(trainer) -> bool:
        return False  # a scaler set on it is never read

    @staticmethod
    def leave_memory(trainer, memory_T) -> None:
        # V3 drops the memory after its steps, before compute_reward: the next episode starts from none.
        state = getattr(trainer.motor, "state", None)
        for name in ("h_state", "c_state"):
            if getattr(state, name, None) is not None:
                setattr(state, name, None)

    @staticmethod
    def result(trainer, episode, loss, rewards, psi_T):
        values = (loss.item(), *(r.item() for r in rewards))
        if torch.cuda.is_available():  # as V3 releases the cache after each episode
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        return values


ADAPTERS: Tuple[TrainerVersion, ...] = (TrainerV4, TrainerV3)


def adapter_for(trainer) -> TrainerVersion:
    """The adapter of the first trainer version whose attributes `trainer` has; else a TypeError
    naming what it lacks (one line first: the environment switch's warning shows that line)."""
    lacks = {adapter.name: _missing(trainer, adapter.required) for adapter in ADAPTERS}
    for adapter in ADAPTERS:
        if not lacks[adapter.name]:
            adapter.check(trainer)
            return adapter
    name = type(trainer).__name__
    # A trainer named as a version it is (their QC_Trainer_v4 on an engine without our step): what
    # that version lacks; else what each version lacks.
    versions = [adapter.name for adapter in ADAPTERS if adapter.name == name] or list(lacks)
    said = " and ".join(", ".join(lacks[version]) + ("" if version == name else f" (as {version})")
                        for version in versions)
    motor = getattr(trainer, "motor", None)
    engine = f" (its motor: {type(motor).__name__})" if motor is not None and "motor." in said else ""
    raise TypeError(f"enable(): {name} lacks {said}{engine}, which the switch replaces or reads; no setting changes "
                    "that: train it on stock, without enable()\n(docs/design.md lists what the switch relies on)")
