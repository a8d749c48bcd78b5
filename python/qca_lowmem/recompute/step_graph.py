"""One QCA step as two captured CUDA graphs, for rollouts whose time goes to kernel launches.

At B=1 a step of the default U-Net is a few hundred small kernels: the GPU waits on Python and
the dispatcher, not on memory or arithmetic. `StepGraph(step_fn)` captures, once per
configuration, the step's forward (with grad, keeping what its backward needs in the graph's
private memory pool) and its backward (the gradients w.r.t. psi and every parameter, the latter
added to per-parameter accumulators inside the graph). A rollout given a StepGraph then runs
each step as one forward replay and each reverse step as one forward and one backward replay,
with the same kernels on the same data as the eager step.

A rollout with a carry (state besides psi, a ConvLSTM's memory) captures step_fn(psi, carry) with
static tensors for each carry entry; a step whose carry is not the captured one's shape (a first
step whose memory is still None) runs eagerly.

What a capture assumes, checked where it can be:
- psi keeps its shape, dtype and device, the autocast state stays the same, and the parameters
  keep their storage (an optimizer's in-place update is fine; `.to()` or reassignment makes a
  new capture: the key holds every parameter's address);
- step_fn draws no random numbers from torch's generators (a replay would repeat the captured
  draw): checked while warming up; such a step falls back as below;
- step_fn does nothing on the host that depends on the data (no `.item()`, no branches on
  values): such a step fails to capture;
- step_fn reaches the parameters and writes the tensors the episode's first steps did (the
  probe's): the first warm-up run is watched, and a step that, from the state captured, reaches
  or writes others (a step that changes with the calls made of it) falls back as below, its
  writes undone;
- step_fn keeps doing what it did when captured: a replay repeats the recorded kernels and runs
  no Python, so a step that changes later with the calls made of it (state kept on an object) or
  runs Python at each call (a module hook recording activations) is not one to capture (enable()
  captures only an engine step whose code it follows, not while the operator has a hook, and not
  where a call changes a plain value its layers hold: `settings`, checked at the watched run).
Noise between steps stays outside the graphs (its keys change every step).

A capture that fails does not stop the rollout: the StepGraph warns once per configuration with
the whole exception chain, first error first, and rolls that configuration out eagerly from then
on; so does running out of memory while capturing (the eager steps need less, while an OOM guard
lowering the policy would not change what the capture needs), and a step that draws random
numbers (its warm-up's draws undone, so the eager steps draw what they would have).

Memory: the graphs' pool holds one step's activations and one set of per-parameter gradients;
the accumulators one more set. The rollout's eager path needs the first and one gradient set
too, so a StepGraph costs about one extra copy of the parameters.

Overlap (`StepGraph(step_fn, overlap=True)`): at B=1 a step's kernels leave most of a large GPU
idle, and the recompute of step t-1 needs only the state the forward kept for it. So the step is
captured on two lanes, each with its graphs, static tensors, pool and stream; the reverse pass
replays step t on lane t % 2 and, while step t's backward replays on the caller's stream, queues
the forward of step t-1 on the other lane's stream (schedules that keep step t-1's input state
pass it on). The kernels and their order on each lane are those of one lane, and the gradients
are added to the shared accumulators in the same order, so the bits are the same. It costs a
second pool (one step's activations and gradients) and, once per configuration, a second
capture. Not run ahead: a step whose carry the capture does not take, and episodes whose steps
write buffers (their values are loaded before each recompute, on the caller's stream).
"""

import contextlib
import gc
import warnings
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _torch_private as torch_private
from .buffers import storage_key
from .cuda_graphs import (
    CaptureFailed,
    CaptureFallbackWarning,
    CudaGraphs,
    caching_allocator_off,
    capture_errors_explained,
)
from .intermediates import keep_block_intermediates
from .lanes import Lane
from .state import State, signature
from .weight_casts import StaticCasts


class StepGraph:
    """A step function whose rollouts on CUDA replay captured graphs (see the module notes).

    Called directly it is the plain step: step_fn(psi), or step_fn(psi, carry) in a rollout with
    carry=... . Keep one per model and configuration: each capture is reused by every later
    rollout with the same key, and a new key replaces the old capture (its memory is released).

    overlap=True captures the step twice (two lanes, see the module notes): in the reverse pass
    the recompute of the step reversed next runs on a second stream while this step's backward
    runs, for a second copy of the graphs' memory. `settings`: a function returning the plain
    values the step's objects hold (enable() gives its operator's layers'); a step whose call
    changes them is not captured."""

    def __init__(self, step_fn: Callable, overlap: bool = False, settings: Optional[Callable[[], object]] = None):
        if not callable(step_fn):
            raise TypeError(f"StepGraph: step_fn must be callable, got {type(step_fn).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"StepGraph: overlap must be True or False, got {overlap!r}")
        if settings is not None and not callable(settings):
            raise TypeError(f"StepGraph: settings must be callable or None, got {type(settings).__name__}")
        self.step_fn = step_fn
        self.overlap = overlap
        self.settings = settings
        self.capture: Optional[_Capture] = None
        self.captures_made = 0  # for tests and reports: how often a new capture was needed
        self.failed_keys = set()  # configurations whose capture failed: rolled out eagerly

    def __call__(self, *args):
        return self.step_fn(*args)

    @staticmethod
    def captures_on(device: torch.device) -> bool:
        """Whether rollouts on this device run on captured graphs (elsewhere, steps run eagerly)."""
        return _captures_on(torch.device(device))

    @staticmethod
    def why_not_captured(device: torch.device) -> Optional[str]:
        """Why rollouts on this device run eagerly, or None where they run on captured graphs."""
        device = torch.device(device)
        if _captures_on(device):
            return None
        if not on_cuda(device):
            return f"the operator is on {device}"
        return ("PYTORCH_NO_CUDA_MEMORY_CACHING is set, and a capture allocates from torch's caching allocator "
                "(cudaMalloc is not allowed while capturing)")

    @staticmethod
    def resolve(cuda_graph: Optional[bool], policy, device: torch.device) -> Tuple[bool, Optional[str]]:
        """(whether a rollout under `policy` on `device` runs captured steps, why not where it does
        not) for a cuda_graph setting: None means on wherever it can run, False off. Plain autograd
        (checkpoint "none") has no recomputed step to capture."""
        if cuda_graph is False:
            return False, "cuda_graph is off"
        why_not = StepGraph.why_not_captured(device)
        if why_not is None and not policy.recomputes:
            why_not = f"{policy.describe()} runs plain autograd, with no recomputed step to capture"
        return why_not is None, why_not

    def for_rollout(self, state: State, step: Callable, params: List[torch.Tensor], autocast_state,
                    writes: Sequence[torch.Tensor] = ()) -> Optional["_Capture"]:
        """The capture of `step(psi, carry) -> (psi, carry)` (the rollout's call of step_fn, the
        carry () in a rollout without one) for a state like `state`, this parameter set and
        autocast state, made when missing; None where the rollout runs eagerly (psi not on CUDA,
        or this configuration failed to capture). `params` and `writes`: the leaves the episode's
        steps reach and the tensors they write, as far as its first steps showed; a step that,
        from `state`, reaches or writes others is not captured (lanes.py)."""
        if not _captures(state.psi):
            return None
        key = _capture_key(state, params, autocast_state, writes)
        if key in self.failed_keys:
            return None
        if self.capture is None or self.capture.key != key:
            self.capture = None  # release the old graphs and pool before capturing anew
            try:
                self.capture = _Capture(step, state, params, autocast_state, key, writes, self.settings,
                                        lanes=2 if self.overlap else 1)
            except CaptureFailed as failure:
                self.failed_keys.add(key)
                gc.collect()  # the half-made graphs and their pool
                if failure.out_of_memory:
                    torch.cuda.empty_cache()  # the pool's memory, for the eager steps
                warnings.warn(str(failure), CaptureFallbackWarning, stacklevel=3)
                return None
            self.captures_made += 1
        else:
            self.capture.casts.refresh()  # the weights this episode trains with
        return self.capture


def _captures(psi: torch.Tensor) -> bool:
    """Whether a rollout of psi runs on captured graphs (tests simulate CUDA by replacing it)."""
    return _captures_on(psi.device)


def _captures_on(device: torch.device) -> bool:
    return on_cuda(device) and not caching_allocator_off()


def on_cuda(device: torch.device) -> bool:
    """The device query every capture decision reads (tests replace it to decide as on CUDA)."""
    return torch.device(device).type == "cuda"


def _capture_key(state: State, params, autocast_state, writes):
    """What a capture holds fixed: the state's shapes, autocast's state, and the tensors the step
    reaches and writes, by identity and memory (a buffer replaced between episodes, not only one
    written in place, is captured anew)."""
    return (state.signature(), tuple(autocast_state.states),
            tuple((id(p), p.data_ptr(), tuple(p.shape), p.dtype) for p in params),
            tuple((*storage_key(w), w.nbytes) for w in writes))  # a new view of one storage each episode: its memory


@contextlib.contextmanager
def _hooks_set_aside(params):
    """Parameter tensor hooks (a user's, DDP's) must not run, let alone be captured, while the
    graphs compute per-step gradients: the rollout hands the totals to autograd at the end."""
    saved = []
    for p in params:
        if torch_private.has_hooks(p):
            hooks = torch_private.backward_hooks(p)
            saved.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, original in saved:
            hooks.update(original)


def _graphs(device: torch.device):
    """The graph machinery a capture records into (tests replace it with an eager stand-in)."""
    return CudaGraphs(device)


class _Capture:
    """The lanes of one configuration (one, or two with StepGraph's overlap) and what they share:
    the half-precision weight copies and per-parameter gradient accumulators. Steps taken without
    grad replay lane 0; the reverse pass replays step t on lane t % len(lanes), and with two lanes
    the forward of the step it reverses next runs ahead on its own lane while this step's backward
    runs (`run_ahead`)."""

    def __init__(self, step, state: State, params, autocast_state, key, writes, settings, lanes: int = 1):
        self.key = key
        self.params = params
        self.carry_signature = tuple(map(signature, state.carry))
        autocast = autocast_state.without_cache
        # Half-precision weight copies outside the graphs, cast once an episode (refresh_casts),
        # not at every replay.
        self.casts = StaticCasts()

        def forward(lane: Lane):
            with torch.enable_grad(), autocast(), keep_block_intermediates(), self.casts.active():
                return step(lane.static_in, lane.static_carry_in)

        # Autocast's cache holds the weights' casts from the eager steps so far, and through them
        # the weights' gradient accumulators, made on the caller's stream: a backward capture that
        # reaches one syncs that stream with the capture, which CUDA refuses (every bf16 and fp16
        # capture failed so on an H200). Dropped, the accumulators are made anew on the side stream.
        torch.clear_autocast_cache()
        self.lanes = [Lane(state, _graphs(state.psi.device)) for _ in range(lanes)]
        self.reached: List[bool] = []
        with _hooks_set_aside(params):
            for i, lane in enumerate(self.lanes):
                lane.warm_up(forward, params, writes if i == 0 else None, settings)
            with capture_errors_explained():
                self.accumulators = [torch.zeros_like(p) for p in params]
            for lane in self.lanes:
                lane.capture(forward, self)
        self.reversing: Optional[Lane] = None  # the lane of the step being reversed
        self.ahead: Optional[_Ahead] = None  # a forward run ahead, until the reverse joins it

    def takes(self, carry: tuple) -> bool:
        """Whether a step with this carry runs on the graphs (a first step whose memory is not made
        yet, None, does not)."""
        return tuple(map(signature, carry)) == self.carry_signature

    def forward(self, psi: torch.Tensor, carry: tuple):
        """The step's (psi, carry) for (psi, carry), as tensors of their own (the next replay
        overwrites the graph's)."""
        self._join_ahead()
        lane = self.lanes[0]
        lane.load(psi, carry)
        return lane.static_out.detach().clone(), tuple(_own(c) for c in lane.static_carry_out)

    def output_for_backward(self, t: int, psi: torch.Tensor, carry: tuple):
        """Step t's forward replayed for (psi, carry) (or joined, if it ran ahead on these very
        tensors); returns the lane's own outputs (valid until the lane's next replay), ready for
        backward()."""
        ran_ahead = self.ahead is not None and self.ahead.holds(t, psi, carry)
        self._join_ahead()
        lane = self.reversing = self.lanes[t % len(self.lanes)]
        if not ran_ahead:
            lane.load(psi, carry)
        return lane.static_out.detach(), tuple(None if c is None else c.detach() for c in lane.static_carry_out)

    def run_ahead(self, t: int, psi: torch.Tensor, carry: tuple) -> None:
        """With two lanes: step t's forward for (psi, carry) queued on its lane's stream, after
        what the caller's stream holds and alongside what it queues next (the backward of step
        t + 1, on the other lane). With one, nothing."""
        if len(self.lanes) < 2:
            return
        self._join_ahead()
        lane = self.lanes[t % len(self.lanes)]
        done = lane.graphs.run_ahead(lambda: lane.load(psi, carry), [psi, *(c for c in carry if c is not None)])
        self.ahead = _Ahead(t, psi, carry, lane, done)

    def _join_ahead(self) -> None:
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            ahead.lane.graphs.join(ahead.done)

    def backward(self, grad_out: Optional[torch.Tensor], grad_carry_out: tuple):
        """After output_for_backward: adds the parameters' gradients to the accumulators and
        returns the gradients w.r.t. psi and each carry entry (tensors of their own; None where
        the step's inputs do not reach its differentiable outputs)."""
        lane = self.reversing
        with torch.no_grad():
            _load_or_zero(lane.static_grad_out, grad_out)
            for static, g in zip(lane.static_grad_carry_out, grad_carry_out):
                if static is not None:
                    _load_or_zero(static, g)
        lane.replay_backward()
        return _own(lane.static_grad_in), tuple(_own(g) for g in lane.static_grad_carry_in)

    def zero_accumulators(self) -> None:
        torch._foreach_zero_(self.accumulators)

    def parameter_grads(self) -> List[Optional[torch.Tensor]]:
        """The accumulated gradients (the accumulators themselves: valid until they are zeroed)."""
        return [a if used else None for a, used in zip(self.accumulators, self.reached)]


class _Ahead(NamedTuple):
    """A forward queued by run_ahead: step t's for (psi, carry), on `lane`, ending at `done`."""

    t: int
    psi: torch.Tensor
    carry: tuple
    lane: Lane
    done: object

    def holds(self, t: int, psi: torch.Tensor, carry: tuple) -> bool:
        """Whether it is step t's for these very tensors."""
        return t == self.t and psi is self.psi and len(carry) == len(self.carry) and \
            all(a is b for a, b in zip(carry, self.carry))


def _own(tensor):
    return None if tensor is None else tensor.detach().clone()


def _load_or_zero(static: torch.Tensor, value: Optional[torch.Tensor]) -> None:
    if value is None:
        static.zero_()
    else:
        static.copy_(value)
