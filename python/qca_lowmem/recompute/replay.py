"""What a recomputed step replays from its forward: the autocast state and the random
generators' states; whether the calling thread runs a backward that recomputes; and who is told
when a backward has run a step again."""

import contextlib
import threading
from typing import Callable, List, Optional

import torch

from . import generators


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
        self.cuda = generators.cuda_of(device)
        self.states = []

    def record(self) -> None:
        if self.enabled:
            self.states.append(generators.save(self.cuda))

    @contextlib.contextmanager
    def untouched(self):
        """Around a backward's replays: NumPy's and Python's generators as it found them. Once per
        backward, not per replay: reading and setting NumPy's state costs about 30 us each."""
        if not self.enabled:
            yield
            return
        with generators.left_as_found(torch_cpu=False):
            yield

    @contextlib.contextmanager
    def replay(self, t: int):
        """Step t's draws again (inside untouched(), which puts NumPy's and Python's back)."""
        if not self.enabled:
            yield
            return
        with generators.left_as_found(self.cuda, host=False):
            self.states[t].restore()
            yield


_IN_BACKWARD = threading.local()  # autograd runs a CUDA backward on a thread of its own
_RECOMPUTE_LISTENERS: List[Callable[[bool], None]] = []  # not per thread: for the same reason


@contextlib.contextmanager
def around_each_recompute(listener: Callable[[bool], None]):
    """Inside: listener(False) before and listener(True) after each step's forward that a
    recomputing backward runs again, on whichever thread runs the backward; the switch tells from
    it what the recomputes bound from what the backward did (atheria/state_drift.py)."""
    _RECOMPUTE_LISTENERS.append(listener)
    try:
        yield
    finally:
        _RECOMPUTE_LISTENERS.remove(listener)


@contextlib.contextmanager
def step_recomputed():
    """Around a step's forward run again by a recomputing backward: each listener told."""
    for listener in _RECOMPUTE_LISTENERS:
        listener(False)
    yield
    for listener in _RECOMPUTE_LISTENERS:
        listener(True)


def recomputing() -> bool:
    """True while the calling thread runs the backward of a `rollout` that recomputes
    (checkpoint "step", "revolve" or "auto"), whose recomputes call the step again where plain
    autograd's backward calls nothing: a forward hook that records what the steps saw skips those
    calls (`if qca_lowmem.recomputing(): return`), and keeps stock's record."""
    return getattr(_IN_BACKWARD, "depth", 0) > 0


@contextlib.contextmanager
def backward_recomputes():
    """Around a recomputing rollout's backward: recomputing() is True inside."""
    _IN_BACKWARD.depth = getattr(_IN_BACKWARD, "depth", 0) + 1
    try:
        yield
    finally:
        _IN_BACKWARD.depth -= 1
