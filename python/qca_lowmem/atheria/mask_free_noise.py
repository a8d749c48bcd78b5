"""The users' noise injector without host waits.

Their `QuantumNoiseInjector` (Jonakss/Atheria, module src.physics.noise; `stock.NoiseInjector` is the
same code) writes its flips as `psi_out[mask] = ...` with a boolean mask: on CUDA each such index
runs `nonzero`, which waits for the GPU to count the hits, three times in a noisy step. The
`MaskFreeInjector` makes the same draws, in the same order, on the same device (so the generators
end where theirs leave them), and writes the flips with `torch.where`, which keeps the work on the
GPU. On CUDA every element's product is the same device code either way, so the bits are theirs
(the probe checks it on a GPU); torch's CPU kernels round the product differently in the elements
a vectorised loop leaves to its scalar tail, which lie elsewhere in the compacted array than in
the whole one, so on the CPU, where a boolean index waits for nothing, their own code runs.

Only an injector whose flips are, by the identity of their code (code_identity.py), a version
this module follows is replayed, checked at each episode; any other runs as written.
"""

from typing import Optional

import torch

from .code_identity import followed, resolved
from .state_drift import code_of, own_classes

FLIPS = ("apply_phase_flip", "apply_bit_flip")


class MaskFreeInjector:
    """QuantumNoiseInjector's draws, its flips written without boolean indexing."""

    def __init__(self, device):
        self.device = device

    def apply_phase_flip(self, psi, rate=0.01):
        mask = (torch.rand(psi.shape[:3], device=self.device) < rate).unsqueeze(-1)
        random_angle = torch.rand(psi.shape, device=self.device) * 2 * torch.pi
        phase_noise = torch.complex(torch.cos(random_angle), torch.sin(random_angle))
        return torch.where(mask, psi * phase_noise, psi)

    def apply_bit_flip(self, psi, rate=0.005):
        mask = (torch.rand(psi.shape[:3], device=self.device) < rate).unsqueeze(-1)
        return torch.where(mask, -psi, psi)


def index_waits(device) -> bool:
    """Whether a boolean index on `device` waits for it (tests replace it to decide as on CUDA)."""
    return torch.device(device).type == "cuda"


def follows(injector) -> bool:
    """Whether the injector's flips are a version MaskFreeInjector replays: methods of its class
    (none set on the instance, no wrapper) whose code is followed, and a `device` to draw on."""
    return hasattr(injector, "device") and all(
        followed(f"QuantumNoiseInjector.{name}", resolved(injector, name)) is not None for name in FLIPS)


def injector_code(injector) -> Optional[list]:
    """The functions of the injector that qca_lowmem does not follow (those of its classes and
    held on it), or None where its flips are followed."""
    if follows(injector):
        return None
    return code_of([injector], own_classes(injector))


def without_host_waits(injector):
    """The injector to apply a noisy step with: a MaskFreeInjector where theirs would wait for
    the device and is one this module follows, else the injector itself."""
    if hasattr(injector, "device") and index_waits(injector.device) and follows(injector):
        return MaskFreeInjector(injector.device)
    return injector
