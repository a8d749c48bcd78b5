"""One QCA step as two captured CUDA graphs, for rollouts whose time goes to kernel launches.

At B=1 a step of the default U-Net is a few hundred small kernels: the GPU waits on Python and
the dispatcher, not on memory or arithmetic. `StepGraph(step_fn)` captures, once per
configuration, the step's forward (with grad, keeping what its backward needs in the graph's
private memory pool) and its backward (the gradients w.r.t. psi and every parameter, the latter
added to per-parameter accumulators inside the graph). A rollout given a StepGraph then runs
each step as one forward replay and each reverse step as one forward and one backward replay,
with the same kernels on the same data as the eager step.

What a capture assumes, checked where it can be:
- psi keeps its shape, dtype and device, the autocast state stays the same, and the parameters
  keep their storage (an optimizer's in-place update is fine; `.to()` or reassignment makes a
  new capture: the key holds every parameter's address);
- step_fn draws no random numbers from torch's generators (a replay would repeat the captured
  draw): checked while warming up, with an error that says what to do;
- step_fn does nothing on the host that depends on the data (no `.item()`, no branches on
  values): such a step fails to capture.
Noise between steps stays outside the graphs (its keys change every step).

A capture that fails does not stop the rollout: the StepGraph warns once per configuration with
the whole exception chain, first error first (torch.cuda.graph's exit ends the capture even when
the body raised, so the cause survives only as the context of a later error), and rolls that
configuration out eagerly from then on. Running out of memory while capturing is raised as
torch.OutOfMemoryError, so that an OOM guard lowers its policy instead of losing the speed-up.

Memory: the graphs' pool holds one step's activations and one set of per-parameter gradients;
the accumulators one more set. The rollout's eager path needs the first and one gradient set
too, so a StepGraph costs about one extra copy of the parameters.
"""

import contextlib
import gc
import warnings
from typing import Callable, List, Optional

import torch

from .recompute import keep_block_intermediates

WARMUP_STEPS = 3  # eager runs on a side stream before capture: lazy inits, cuDNN/cuBLAS handles


class CaptureFallbackWarning(RuntimeWarning):
    """A StepGraph could not capture a configuration and rolls it out eagerly."""


class _CaptureFailed(RuntimeError):
    """A capture failed for a reason other than memory; the message holds the whole chain."""


class StepGraph:
    """A step function whose rollouts on CUDA replay captured graphs (see the module notes).

    Called directly it is the plain step. Keep one per model and configuration: each capture is
    reused by every later rollout with the same key, and a new key replaces the old capture (its
    memory is released)."""

    def __init__(self, step_fn: Callable[[torch.Tensor], torch.Tensor]):
        if not callable(step_fn):
            raise TypeError(f"StepGraph: step_fn must be callable, got {type(step_fn).__name__}")
        self.step_fn = step_fn
        self.capture: Optional[_Capture] = None
        self.captures_made = 0  # for tests and reports: how often a new capture was needed
        self.failed_keys = set()  # configurations whose capture failed: rolled out eagerly

    def __call__(self, psi: torch.Tensor) -> torch.Tensor:
        return self.step_fn(psi)

    def for_rollout(self, psi: torch.Tensor, params: List[torch.Tensor], autocast_state) -> Optional["_Capture"]:
        """The capture for this psi, parameter set and autocast state, made when missing; None
        where the rollout runs eagerly (psi not on CUDA, or this configuration failed to capture)."""
        if not _captures(psi):
            return None
        key = _capture_key(psi, params, autocast_state)
        if key in self.failed_keys:
            return None
        if self.capture is None or self.capture.key != key:
            self.capture = None  # release the old graphs and pool before capturing anew
            try:
                self.capture = _Capture(self.step_fn, psi, params, autocast_state, key)
            except _CaptureFailed as failure:
                self.failed_keys.add(key)
                gc.collect()  # the half-made graphs and their pool
                warnings.warn(str(failure), CaptureFallbackWarning, stacklevel=3)
                return None
            self.captures_made += 1
        return self.capture


def _captures(psi: torch.Tensor) -> bool:
    """Whether a rollout of psi runs on captured graphs (tests simulate CUDA by replacing it)."""
    return psi.is_cuda


def _capture_key(psi, params, autocast_state):
    return (tuple(psi.shape), psi.dtype, psi.device, tuple(autocast_state.states),
            tuple((id(p), p.data_ptr(), tuple(p.shape), p.dtype) for p in params))


@contextlib.contextmanager
def _hooks_set_aside(params):
    """Parameter tensor hooks (a user's, DDP's) must not run, let alone be captured, while the
    graphs compute per-step gradients: the rollout hands the totals to autograd at the end."""
    saved = []
    for p in params:
        hooks = p._backward_hooks
        if hooks:
            saved.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, original in saved:
            hooks.update(original)


class _Capture:
    """The two graphs of one configuration and the static tensors they read and write."""

    def __init__(self, step_fn, psi, params, autocast_state, key):
        self.key = key
        self.params = params
        device = psi.device
        self.static_in = psi.detach().clone().requires_grad_(True)
        autocast = autocast_state.without_cache

        def forward():
            with torch.enable_grad(), autocast(), keep_block_intermediates():
                return step_fn(self.static_in)

        # Warm-up and capture on one side stream. Garbage from earlier work is collected first:
        # freeing it during the capture would make the allocator touch other streams' events.
        gc.collect()
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), _hooks_set_aside(params), _random_draws_refused(device):
            for _ in range(WARMUP_STEPS):
                out = forward()
                _check_output(out, psi)
                torch.autograd.grad(out, [self.static_in, *params], torch.zeros_like(out), allow_unused=True)
                del out
        torch.cuda.current_stream(device).wait_stream(side)

        self.pool = torch.cuda.graph_pool_handle()
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = torch.cuda.CUDAGraph()
        with _hooks_set_aside(params), _capture_errors_explained():
            with torch.cuda.graph(self.forward_graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                self.static_out = forward()
            self.static_grad_out = torch.zeros_like(self.static_out)
            self.accumulators = [torch.zeros_like(p) for p in params]
            with torch.cuda.graph(self.backward_graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(self.static_out, [self.static_in, *params], self.static_grad_out,
                                            allow_unused=True)
                self.static_grad_in = grads[0]
                reached = [(a, g) for a, g in zip(self.accumulators, grads[1:]) if g is not None]
                self.reached = [g is not None for g in grads[1:]]
                if reached:
                    torch._foreach_add_([a for a, _ in reached], [g for _, g in reached])

    def forward(self, psi: torch.Tensor) -> torch.Tensor:
        """The step's output for psi, as a tensor of its own (the next replay overwrites the
        graph's)."""
        with torch.no_grad():
            self.static_in.copy_(psi)
        self.forward_graph.replay()
        return self.static_out.detach().clone()

    def output_for_backward(self, psi: torch.Tensor) -> torch.Tensor:
        """Replays the forward for psi and returns the graph's own output (valid until the next
        replay), ready for backward()."""
        with torch.no_grad():
            self.static_in.copy_(psi)
        self.forward_graph.replay()
        return self.static_out.detach()

    def backward(self, grad_out: torch.Tensor) -> Optional[torch.Tensor]:
        """After output_for_backward: adds the parameters' gradients to the accumulators and
        returns the gradient w.r.t. psi (a tensor of its own)."""
        with torch.no_grad():
            self.static_grad_out.copy_(grad_out)
        self.backward_graph.replay()
        return None if self.static_grad_in is None else self.static_grad_in.clone()

    def zero_accumulators(self) -> None:
        torch._foreach_zero_(self.accumulators)

    def parameter_grads(self) -> List[Optional[torch.Tensor]]:
        """The accumulated gradients, as tensors of their own (autograd may keep them as .grad)."""
        return [a.clone() if used else None for a, used in zip(self.accumulators, self.reached)]


def _check_output(out, psi):
    if not isinstance(out, torch.Tensor) or out.shape != psi.shape or out.dtype != psi.dtype or out.device != psi.device:
        got = (f"shape={tuple(out.shape)} dtype={out.dtype} device={out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ValueError(f"StepGraph: step_fn must keep psi's shape, dtype and device "
                         f"(shape={tuple(psi.shape)} dtype={psi.dtype} device={psi.device}), it returned {got}")
    if not out.requires_grad:
        raise ValueError("StepGraph: step_fn's output does not require grad: nothing to capture a backward for")


@contextlib.contextmanager
def _random_draws_refused(device):
    cpu_before = torch.get_rng_state()
    cuda_before = torch.cuda.get_rng_state(device)
    yield
    if not (torch.equal(cpu_before, torch.get_rng_state()) and torch.equal(cuda_before, torch.cuda.get_rng_state(device))):
        raise RuntimeError(
            "StepGraph: step_fn draws random numbers from torch's generators; a captured graph would "
            "replay the same draw at every step. Keep random draws out of step_fn (a rollout's noise= "
            "with a qca_lowmem.NoiseSchedule is keyed by step), or roll out without a StepGraph."
        )


@contextlib.contextmanager
def _capture_errors_explained():
    """A failed capture raised as torch.OutOfMemoryError when memory ran out anywhere in the
    chain, else as _CaptureFailed; either way with every error of the chain, first first."""
    try:
        yield
    except Exception as error:
        chain = _exception_chain(error)
        story = " <- then: ".join(f"{type(e).__name__}: {str(e).strip()}" for e in chain)
        if any(isinstance(e, torch.OutOfMemoryError) for e in chain):
            raise torch.OutOfMemoryError(
                f"StepGraph: out of memory while capturing the step as a CUDA graph ({story})") from error
        raise _CaptureFailed(
            f"StepGraph: capturing the step as a CUDA graph failed; rolling this configuration out eagerly. "
            f"Errors, first first: {story}. A captured step must not synchronise with the host (.item(), "
            "printing tensors, data-dependent branches or shapes).") from error


def _exception_chain(error: BaseException) -> List[BaseException]:
    """error and the errors it was raised from or during, the first one first."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ if error.__cause__ is not None else error.__context__
    return chain[::-1]
