"""The random generators' states, saved and put back in one place: torch's CPU generator, CUDA
devices' generators, NumPy's global generator and Python's `random` (the users' noise tosses its
bit-flip coin with numpy.random).

Each user names the generators it covers, and no more: a probe that runs the users' code once
leaves every generator as found (atheria/engine_probe.py, atheria/discontinuity.py); a recompute
replays the draws of its forward step on torch's CPU generator, psi's CUDA device's and the host
ones (recompute/replay.py); a CUDA graph's warm-up undoes torch's draws it refuses
(recompute/cuda_graphs.py). Reading a CUDA generator initialises CUDA: only devices named are
read, and `every_cuda` names all of them only where CUDA is initialised already or the caller's
own device is a CUDA one.
"""

import contextlib
import random
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy
import torch


class GeneratorStates(NamedTuple):
    """The saved states of the generators covered (None, or no CUDA device, where not covered)."""

    cpu: Optional[torch.Tensor]
    cuda: Tuple[Tuple[object, torch.Tensor], ...]  # (device, its generator's state)
    numpy: Optional[tuple]
    python: Optional[tuple]

    def restore(self) -> None:
        """Sets every generator covered to its state here."""
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)
        if self.numpy is not None:
            numpy.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)

    def torch_drawn_from(self) -> bool:
        """Whether torch's generators covered here (CPU, CUDA) have moved since."""
        return (self.cpu is not None and not torch.equal(self.cpu, torch.get_rng_state())) or any(
            not torch.equal(state, torch.cuda.get_rng_state(device)) for device, state in self.cuda)


def save(cuda: Sequence = (), torch_cpu: bool = True, host: bool = True) -> GeneratorStates:
    """The states now of torch's CPU generator (`torch_cpu`), the generators of the CUDA devices
    in `cuda`, and NumPy's global and Python's `random` (`host`)."""
    return GeneratorStates(torch.get_rng_state() if torch_cpu else None,
                           tuple((device, torch.cuda.get_rng_state(device)) for device in cuda),
                           numpy.random.get_state() if host else None, random.getstate() if host else None)


@contextlib.contextmanager
def left_as_found(cuda: Sequence = (), torch_cpu: bool = True, host: bool = True):
    """The generators `save` covers with these arguments, put back on exit (an error included)."""
    saved = save(cuda, torch_cpu, host)
    try:
        yield
    finally:
        saved.restore()


def every_cuda(device=None) -> Tuple[int, ...]:
    """Every CUDA device, where CUDA is initialised or `device` is a CUDA one (whose draws would
    initialise it); else none, leaving CUDA uninitialised."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return tuple(range(torch.cuda.device_count())) if on_cuda or torch.cuda.is_initialized() else ()


def cuda_of(device) -> Tuple[torch.device, ...]:
    """`device` where it is a CUDA one, else none: the CUDA generator a computation on it draws from."""
    device = torch.device(device)
    return (device,) if device.type == "cuda" else ()
