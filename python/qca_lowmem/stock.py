"""The stock computation qca_lowmem must match, in plain torch: the oracle of the tests, the
baseline of the benchmarks, `bench` and `plan`, and the trainer's loss and initial state.

It is the users' QC_Trainer_v4 episode (docs/design.md, "The stock computation"): a U-Net of
ConvBlocks applied `qca_steps` times to a complex state, with per-cell normalisation, the stock
noise curriculum and the evolutionary loss. Nothing here uses qca_lowmem's kernels; keep it
boring, so that it is obviously what the users' code does.
"""

from typing import Tuple, Union

import numpy
import torch
from torch import nn

# The noise curriculum: rate = min(max_noise, max_noise * episode / NOISE_RAMP_EPISODES); noise
# is on when the rate exceeds NOISE_RATE_THRESHOLD; each step bit-flips with probability
# BIT_FLIP_PROBABILITY, at BIT_FLIP_SCALE times the rate.
NOISE_RAMP_EPISODES = 2000
NOISE_RATE_THRESHOLD = 0.001
BIT_FLIP_PROBABILITY = 0.2
BIT_FLIP_SCALE = 0.1


def group_count(channels: int) -> int:
    """The stock GroupNorm group rule: channels // 8 groups above 8 channels, 1 if that does not divide."""
    groups = max(1, channels // 8 if channels > 8 else 1)
    return 1 if channels % groups != 0 else groups


class ConvBlock(nn.Module):
    def __init__(self, in_channels, out_channels, mid_channels=None):
        super().__init__()
        mid = out_channels if mid_channels is None else mid_channels
        self.conv_block = nn.Sequential(
            nn.Conv2d(in_channels, mid, kernel_size=3, padding=1, bias=False),
            nn.GroupNorm(group_count(mid), mid),
            nn.ELU(),
            nn.Conv2d(mid, out_channels, kernel_size=3, padding=1, bias=False),
            nn.GroupNorm(group_count(out_channels), out_channels),
            nn.ELU(inplace=True),
        )

    def forward(self, x):
        return self.conv_block(x)


class UNetUnitary(nn.Module):
    def __init__(self, d_state, hidden_channels):
        super().__init__()
        h, c = hidden_channels, 2 * d_state
        self.inc = ConvBlock(c, h)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), ConvBlock(h, 2 * h))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), ConvBlock(2 * h, 4 * h))
        self.bot = ConvBlock(4 * h, 8 * h)
        self.up1 = nn.ConvTranspose2d(8 * h, 4 * h, 2, stride=2)
        self.conv_up1 = ConvBlock(6 * h, 4 * h)
        self.up2 = nn.ConvTranspose2d(4 * h, 2 * h, 2, stride=2)
        self.conv_up2 = ConvBlock(3 * h, h)
        self.outc = nn.Conv2d(h, c, 1)
        nn.init.normal_(self.outc.weight, 0.0, 1e-5)

    def forward(self, x):
        # Statement for statement as the users' UNetUnitary.forward, so that the bytecode of theirs
        # equals this one's (unet.input_dtype proves their forward by it).
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        b = self.bot(x3)
        u1 = self.up1(b)
        s1 = torch.cat([u1, x2], dim=1)
        c1 = self.conv_up1(s1)
        u2 = self.up2(c1)
        s2 = torch.cat([u2, x1], dim=1)
        c2 = self.conv_up2(s2)
        delta = self.outc(c2)
        return delta


class StockForward(nn.Module):
    """The stock U-Net forward over a qca_lowmem.UNetUnitary's own layers: every block runs its
    plain `conv_block` Sequential (Conv2d, GroupNorm, ELU) and every pool torch's max_pool2d,
    keeping what stock autograd keeps.
    Same Parameters; the baseline of `bench` and `plan`. Not a "UNetUnitary" by type name, so
    pass `multiplicative=True` to `step`."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, x):
        return self.unet.forward_with(x, lambda block, h: block.conv_block(h), fused_pools=False)


def is_multiplicative(operator) -> bool:
    """Stock rule: UNetUnitary operators act multiplicatively, any other additively."""
    return type(operator).__name__ == "UNetUnitary"


def pack(psi):
    """Stock step 1: complex (B, H, W, d) -> real (B, 2d, H, W), real parts first."""
    return torch.cat([psi.real.permute(0, 3, 1, 2), psi.imag.permute(0, 3, 1, 2)], dim=1)


def update(psi, delta, gamma=0.0, multiplicative=True, eps=1e-9):
    """Stock steps 2-5 given delta = U(x). Narrow deltas are upcast to the state's real type."""
    d = psi.shape[-1]
    real = psi.real.dtype
    a = torch.complex(delta[:, :d].to(real), delta[:, d:].to(real)).permute(0, 2, 3, 1)
    u = a * psi if multiplicative else a
    n = psi + u
    if gamma > 0:
        n = n - gamma * psi
    norm = torch.sqrt(torch.sum(torch.abs(n) ** 2, dim=-1, keepdim=True))
    return n / (norm + eps)


def step(psi, operator, gamma=0.0, multiplicative=None):
    """One stock engine step (`motor.evolve_step`); `multiplicative` None follows the operator's type."""
    if multiplicative is None:
        multiplicative = is_multiplicative(operator)
    return update(psi, operator(pack(psi)), gamma, multiplicative)


def initial_state(batch, grid: Union[int, Tuple[int, int]], d_state, device="cpu", generator=None,
                  dtype=torch.complex64):
    """psi0 on a `grid` (side, or (height, width)): complex(randn, randn) per component,
    normalised per cell. The draws are made on the CPU, so a generator gives the same psi0 on
    any device."""
    height, width = (grid, grid) if isinstance(grid, int) else grid
    real = torch.float64 if dtype == torch.complex128 else torch.float32
    shape = (batch, height, width, d_state)
    psi = torch.complex(
        torch.randn(shape, generator=generator, dtype=real),
        torch.randn(shape, generator=generator, dtype=real),
    ).to(device)
    return psi / torch.sqrt(torch.sum(torch.abs(psi) ** 2, dim=-1, keepdim=True))


def noise_rate(episode, max_noise):
    """The curriculum: the rate ramps linearly to max_noise over NOISE_RAMP_EPISODES episodes
    (rounded as the users' trainer computes it, so `rand < rate` decides the same hits)."""
    return min(max_noise, max_noise * (episode / NOISE_RAMP_EPISODES))


def noise_step(injector, psi, rate):
    """The noise after one step of a noisy episode, as the users' train_episode applies it: a
    phase flip, then, when NumPy's global coin falls below BIT_FLIP_PROBABILITY, a bit flip at
    BIT_FLIP_SCALE times the rate."""
    psi = injector.apply_phase_flip(psi, rate=rate)
    if numpy.random.random() < BIT_FLIP_PROBABILITY:
        psi = injector.apply_bit_flip(psi, rate=rate * BIT_FLIP_SCALE)
    return psi


def episode_bookkeeping(writer, episode_num: int, loss: float, metrics: dict, noise_level: float) -> None:
    """What the stock train_episode does besides the episode, every 10 episodes: release the
    CUDA cache and, given a TensorBoard writer, log the loss, symmetry, survival and noise level."""
    if episode_num % 10:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if writer is not None:
        writer.add_scalar("Loss/Total", loss, episode_num)
        writer.add_scalar("Metrics/Symmetry", metrics["symmetry"], episode_num)
        writer.add_scalar("Metrics/Survival", metrics["survival"], episode_num)
        writer.add_scalar("Environment/NoiseLevel", noise_level, episode_num)


class NoiseInjector:
    """The users' QuantumNoiseInjector (Jonakss/Atheria, module src.physics.noise), its phase and bit
    flips as they are written there: the masks and angles drawn on the injector's device, the
    state indexed by boolean masks (on CUDA each such index waits for the GPU; enable() replays
    them without, atheria/mask_free_noise.py)."""

    def __init__(self, device="cpu"):
        self.device = device

    def apply_phase_flip(self, psi, rate=0.01):
        mask = torch.rand(psi.shape[:3], device=self.device) < rate
        mask = mask.unsqueeze(-1).expand_as(psi)
        random_angle = torch.rand(psi.shape, device=self.device) * 2 * torch.pi
        phase_noise = torch.complex(torch.cos(random_angle), torch.sin(random_angle))
        psi_out = psi.clone()
        psi_out[mask] = psi[mask] * phase_noise[mask]
        return psi_out

    def apply_bit_flip(self, psi, rate=0.005):
        mask = torch.rand(psi.shape[:3], device=self.device) < rate
        mask = mask.unsqueeze(-1).expand_as(psi)
        psi_out = psi.clone()
        psi_out[mask] = -psi[mask]
        return psi_out


def evolutionary_loss(psi_history, psi_initial):
    """The default ("evolutionary") loss, 10*survival + 5*symmetry + complexity: uses only the
    final and the initial state. Returns (loss, metrics as floats)."""
    psi_final = psi_history[-1]
    energy_final = torch.sum(torch.abs(psi_final) ** 2)
    energy_initial = torch.sum(torch.abs(psi_initial) ** 2)
    survival = torch.abs(energy_final - 0.8 * energy_initial) / (energy_initial + 1e-6)
    magnitude = torch.abs(psi_final)
    symmetry = torch.mean((magnitude - torch.rot90(magnitude, 1, dims=(1, 2))) ** 2)
    density = torch.sum(magnitude, dim=-1)
    complexity = -torch.log(torch.std(density) + 1e-6)
    loss = 10 * survival + 5 * symmetry + 1 * complexity
    metrics = {"survival": survival.item(), "symmetry": symmetry.item(), "complexity": complexity.item()}
    return loss, metrics


def rollout(psi0, operator, steps, gamma=0.0, noise=None, rate=0.0):
    """Stock episode forward with full autograd: returns (psi_T, history) like train_episode."""
    psi = psi0
    history = []
    record_every = max(1, steps // 10)
    for t in range(steps):
        psi = step(psi, operator, gamma)
        if noise is not None and rate > NOISE_RATE_THRESHOLD:
            psi = noise_step(noise, psi, rate)
        if t == 0 or t == steps - 1 or t % record_every == 0:
            history.append(psi)
    return psi, history
