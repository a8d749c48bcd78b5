"""Whether fused blocks recompute their intermediates in backward or keep them.

A step-level recompute (the rollout) already re-runs each step's forward in backward; a fused
block that recomputed again inside it would run its convolutions a third time. The rollout
enters `keep_block_intermediates()` around that recompute, and fused blocks then save their
intermediates like stock autograd does.
"""

import contextlib
import threading

_state = threading.local()


def block_keeps_intermediates() -> bool:
    return getattr(_state, "keep", False)


@contextlib.contextmanager
def keep_block_intermediates(enabled: bool = True):
    """Inside this context, fused blocks keep their intermediates instead of recomputing them."""
    previous = block_keeps_intermediates()
    _state.keep = enabled
    try:
        yield
    finally:
        _state.keep = previous
