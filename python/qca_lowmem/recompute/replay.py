"""What a recomputed step replays from its forward: the autocast state and the random
generators' states."""

import contextlib
import random
from typing import Optional

import numpy
import torch


class AutocastState:
    """The autocast state of the forward, re-entered around each recompute."""

    def __init__(self, device_types):
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.states = [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in device_types]

    def __call__(self):
        return self._entered(self.cache_enabled)

    def dtype(self, device_type: str) -> Optional[torch.dtype]:
        """The dtype autocast computes in on this device type, None where it is off."""
        return next((dtype for dt, enabled, dtype in self.states if dt == device_type and enabled), None)

    def without_cache(self):
        """The same state with autocast's cast cache off, as CUDA graph capture requires (the
        casts are the same, only not shared between calls)."""
        return self._entered(False)

    @contextlib.contextmanager
    def _entered(self, cache_enabled):
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.states:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled))
            yield


class RngStates:
    """The generators' states before each step of the forward, replayed around recomputes:
    torch's CPU generator and psi's CUDA device's, and NumPy's and Python's global generators
    (the users' noise tosses its bit-flip coin with numpy.random)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda_device = device if device.type == "cuda" else None
        self.states = []

    def record(self) -> None:
        if self.enabled:
            cuda = torch.cuda.get_rng_state(self.cuda_device) if self.cuda_device is not None else None
            self.states.append((torch.get_rng_state(), cuda, numpy.random.get_state(), random.getstate()))

    @contextlib.contextmanager
    def untouched(self):
        """Around a backward's replays: NumPy's and Python's generators as it found them. Once per
        backward, not per replay: reading and setting NumPy's state costs about 30 us each."""
        if not self.enabled:
            yield
            return
        numpy_state, python_state = numpy.random.get_state(), random.getstate()
        try:
            yield
        finally:
            numpy.random.set_state(numpy_state)
            random.setstate(python_state)

    @contextlib.contextmanager
    def replay(self, t: int):
        """Step t's draws again (inside untouched(), which puts NumPy's and Python's back)."""
        if not self.enabled:
            yield
            return
        cpu, cuda, numpy_state, python_state = self.states[t]
        with torch.random.fork_rng(devices=[self.cuda_device] if cuda is not None else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.cuda_device)
            numpy.random.set_state(numpy_state)
            random.setstate(python_state)
            yield
