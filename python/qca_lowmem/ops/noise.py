"""The noise ops (C family `noise`): typed wrappers, fake kernels and autograd of
torch.ops.qca_lowmem.phase_flip / bit_flip / noise_coin, and the stock noise schedule on them.

Every random number is a Philox4x32-10 word keyed by `(seed, step)` and indexed by the cell and
the component (include/qca_lowmem/noise.h), so the same `(seed, step)` gives the same hits and
phases on every call, on the CPU and on CUDA: a recompute replays the noise without stored masks.
"""

import math
from typing import Optional

import torch

from .. import stock
from ._checks import check_state, describe, refuse_func_transforms
from .watchers import call_unwatched

_lib = torch.ops.qca_lowmem

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _as_int64(value, name: str) -> int:
    """A seed or step as the signed int64 the ops take; values up to 2^64 - 1 wrap around."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not _INT64_MIN <= value < 2**64:
        raise ValueError(f"{name} must fit in 64 bits, got {value}")
    return value - 2**64 if value > _INT64_MAX else value


def _as_rate(rate, name: str = "rate") -> float:
    if torch.compiler.is_compiling() and not isinstance(rate, torch.Tensor):  # perhaps symbolic: the fake checks it
        return rate
    rate = float(rate)
    if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
        raise ValueError(f"{name} must be a probability in [0, 1], got {rate}")
    return rate


def phase_flip(psi: torch.Tensor, rate: float, seed: int, step: int, *, conjugate: bool = False) -> torch.Tensor:
    """Stock phase-flip noise, keyed by (seed, step).

    Each cell (b, h, w) of psi (complex (B, H, W, d)) is hit with probability `rate`; a hit
    multiplies every component psi_k by exp(i theta_k), theta_k ~ U[0, 2 pi) independently per
    component (exp(-i theta_k) with `conjugate`, which undoes the flip). Returns a new tensor.
    Differentiable: the gradient of a hit cell is multiplied by the conjugate phase.
    """
    refuse_func_transforms("qca_lowmem.phase_flip", psi)
    return call_unwatched(_lib.phase_flip, (psi,), _as_rate(rate), _as_int64(seed, "seed"), _as_int64(step, "step"),
                          bool(conjugate))


def bit_flip(psi: torch.Tensor, rate: float, seed: int, step: int) -> torch.Tensor:
    """Stock bit-flip noise, keyed by (seed, step): each cell is hit with probability `rate` and a
    hit negates all its components. Returns a new tensor. Differentiable (a hit negates the
    gradient). The hits are independent of phase_flip's for the same (seed, step)."""
    refuse_func_transforms("qca_lowmem.bit_flip", psi)
    return call_unwatched(_lib.bit_flip, (psi,), _as_rate(rate), _as_int64(seed, "seed"), _as_int64(step, "step"))


def noise_coin(seed: int, step: int) -> float:
    """The step's coin in [0, 1), from the same keyed generator (its own stream): the stock
    schedule bit-flips step `step` when it is below 0.2. Computed on the host, no device sync."""
    return call_unwatched(_lib.noise_coin, (), _as_int64(seed, "seed"), _as_int64(step, "step"))


class NoiseSchedule:
    """The stock training noise of one episode, replayable: `schedule(psi, step) -> psi`.

    rate r = min(max_noise, max_noise * episode / 2000). At each step, when r > 0.001: a phase
    flip with rate r, then, when the step's coin (`noise_coin(seed, step)`) is below 0.2, a bit
    flip with rate 0.1 * r; a rate above 1 flips every cell, as stock's `rand < r` does. All randoms
    come from (seed, step), so calling the schedule again on the same step (the rollout's recompute)
    applies exactly the same noise. Give each episode its own seed; `seed=None` draws one from torch's
    default generator (reproducible under torch.manual_seed).

    Pass it to `qca_lowmem.rollout(..., noise=schedule)`.
    """

    def __init__(self, max_noise: float, episode: int, seed: Optional[int] = None):
        try:
            max_noise = float(max_noise)
        except (TypeError, ValueError):
            raise ValueError(f"max_noise must be a finite number >= 0, got {max_noise!r}") from None
        if not (math.isfinite(max_noise) and max_noise >= 0.0):
            raise ValueError(f"max_noise must be a finite number >= 0, got {max_noise}")
        if isinstance(episode, bool) or not isinstance(episode, int) or episode < 0:
            raise ValueError(f"episode must be an int >= 0, got {episode!r}")
        if seed is None:
            seed = int(torch.randint(_INT64_MIN, _INT64_MAX, (), dtype=torch.int64).item())
        self.max_noise = max_noise
        self.episode = episode
        self.seed = _as_int64(seed, "seed")

    @property
    def rate(self) -> float:
        return stock.noise_rate(self.episode, self.max_noise)

    @property
    def active(self) -> bool:
        return self.rate > stock.NOISE_RATE_THRESHOLD

    def bit_flips_at(self, step: int) -> bool:
        """Whether the step's coin calls for a bit flip (when the schedule is active)."""
        return noise_coin(self.seed, step) < stock.BIT_FLIP_PROBABILITY

    def __call__(self, psi: torch.Tensor, step: int) -> torch.Tensor:
        if not self.active:
            return psi
        rate = self.rate
        psi = phase_flip(psi, min(1.0, rate), self.seed, step)
        if self.bit_flips_at(step):
            psi = bit_flip(psi, min(1.0, stock.BIT_FLIP_SCALE * rate), self.seed, step)
        return psi

    def __repr__(self) -> str:
        return f"NoiseSchedule(max_noise={self.max_noise}, episode={self.episode}, seed={self.seed}, rate={self.rate:g})"


def episode_noise(max_noise: float, episode: int, seed: int) -> Optional[NoiseSchedule]:
    """The replayable stock noise of `episode` (curriculum included), keyed by `seed`; None when
    the episode's rate leaves it off, as stock does."""
    schedule = NoiseSchedule(max_noise, episode, seed)
    return schedule if schedule.active else None


# QCA_NOISE_MAX_D and QCA_NOISE_MAX_CELLS (include/qca_lowmem/noise.h): the Philox counter's room
# for a cell's words and for the cell index.
_MAX_D = 16379
_MAX_CELLS = 2**48


def _check_noise_args(psi, rate, op):
    """noise.cpp's prepare_noise, with its messages."""
    check_state(psi, op)
    torch._check(psi.shape[3] <= _MAX_D, lambda: f"{op}: psi's last dimension d must be at most {_MAX_D}, got {describe(psi)}")
    torch._check(psi.shape[0] * psi.shape[1] * psi.shape[2] <= _MAX_CELLS,
                 lambda: f"{op}: psi has more than 2^48 cells: {describe(psi)}")
    torch._check(math.isfinite(rate) and 0.0 <= rate <= 1.0, lambda: f"{op}: rate must be a probability in [0, 1], got {rate:g}")


@torch.library.register_fake("qca_lowmem::phase_flip")
def _phase_flip_fake(psi, rate, seed, step, conjugate=False):
    _check_noise_args(psi, rate, "phase_flip")
    return torch.empty_like(psi, memory_format=torch.contiguous_format)


@torch.library.register_fake("qca_lowmem::bit_flip")
def _bit_flip_fake(psi, rate, seed, step):
    _check_noise_args(psi, rate, "bit_flip")
    return torch.empty_like(psi, memory_format=torch.contiguous_format)


def _noise_setup_context(ctx, inputs, output):
    ctx.rate, ctx.seed, ctx.step = inputs[1], inputs[2], inputs[3]
    ctx.conjugate = inputs[4] if len(inputs) > 4 else False


def _phase_flip_backward(ctx, grad):
    # exp(i theta) is holomorphic: the gradient picks up the conjugate phase, same hits.
    return _lib.phase_flip(grad, ctx.rate, ctx.seed, ctx.step, not ctx.conjugate), None, None, None, None


def _bit_flip_backward(ctx, grad):
    return _lib.bit_flip(grad, ctx.rate, ctx.seed, ctx.step), None, None, None


torch.library.register_autograd("qca_lowmem::phase_flip", _phase_flip_backward, setup_context=_noise_setup_context)
torch.library.register_autograd("qca_lowmem::bit_flip", _bit_flip_backward, setup_context=_noise_setup_context)
