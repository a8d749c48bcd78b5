"""torch.compile'd code inside a recomputing episode's steps: kept from running, and refused.

Every policy but plain autograd runs its steps under dispatch modes and saved-tensors hooks of its
own, which torch.compile does not trace: seeing such a mode, torch.compile marks the code it was
about to compile to run eagerly from then on, so one episode left a user's compiled function
uncompiled for good, and the episode ran it as eager torch, rounding and drawing random numbers
otherwise than plain autograd's compiled graph. So the episode's forward and backward run with
torch.compile off (`uncompiled`: torch's "force_eager" stance, which touches no compiled code's
state), and the probed steps are watched for a call of compiled code (`CompiledCalls`), which is
refused by name: every torch.compile'd function and module runs one wrapper function of torch's.
"""

import contextlib
import sys

import torch

_COMPILED_WRAPPER = torch.compile(lambda: None).__code__  # the code every torch.compile'd callable runs first


@contextlib.contextmanager
def uncompiled():
    """torch.compile'd code run as the eager code it wraps, its compiled state untouched (about 60
    us to enter on a CPU: once for an episode's forward, once for its backward)."""
    if torch.compiler.is_compiling():
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


class CompiledCalls:
    """Whether code run inside `watching()` called a torch.compile'd function or module (a Python
    profile function, this thread's, set for a probed step and put back after it)."""

    def __init__(self):
        self.reached = False

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code is _COMPILED_WRAPPER:
            self.reached = True

    @contextlib.contextmanager
    def watching(self):
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(previous)
