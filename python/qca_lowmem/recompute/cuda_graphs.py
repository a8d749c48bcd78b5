"""CUDA graphs as the rollout captures them, and what a failed capture leaves behind undone and
explained: graphs sharing one pool, warmed up and captured on a side stream (`CudaGraphs`); a
capture's failure raised as `CaptureFailed` with its whole exception chain, first error first,
and the cause a user can act on; a step that draws random numbers refused before it is captured.
StepGraph (step_graph.py) turns a failure into one CaptureFallbackWarning and eager steps.
"""

import contextlib
import gc
import os
from typing import Callable, List

import torch

from .. import _torch_private as torch_private
from . import generators


class CaptureFallbackWarning(RuntimeWarning):
    """A StepGraph could not capture a configuration and rolls it out eagerly."""


class CaptureFailed(RuntimeError):
    """A capture failed; the message holds the whole chain. Out of memory too: the eager steps
    need less than a capture (no pool of its own), and an OOM guard lowering the policy would
    not change the capture's memory."""

    def __init__(self, message: str, out_of_memory: bool = False):
        super().__init__(message)
        self.out_of_memory = out_of_memory


def caching_allocator_off() -> bool:
    """PYTORCH_NO_CUDA_MEMORY_CACHING (set for compute-sanitizer's memcheck) makes every allocation
    a cudaMalloc, which a capture cannot make."""
    return os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "") not in ("", "0")


class CudaGraphs:
    """CUDA graphs sharing one memory pool, warmed up and captured on one side stream. A capture
    runs a body once while recording it; each replay reruns its kernels on the same memory."""

    def __init__(self, device: torch.device):
        self.device = device
        # Garbage from earlier work is collected first: freeing it during a capture would make
        # the allocator touch other streams' events.
        gc.collect()
        torch.cuda.synchronize(device)
        self.side = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def warming_up(self):
        """Eager runs before capturing (lazy inits, cuDNN/cuBLAS handles), on the side stream."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.side):
                yield
        finally:  # also when the warm-up refuses the step: its work is in flight on the side stream
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def capture(self, body: Callable):
        """(what body returned, a function replaying it). However the capture ends, the caller's
        stream is current again and the allocator no longer routes allocations to the pool
        (torch.cuda.graph leaves both behind when ending a failed capture raises)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.side):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                outputs = body()
            except BaseException:
                self._end_failed(graph)  # the body's error is the one to report
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._undo_capture_state()
                raise
        return outputs, graph.replay

    def _end_failed(self, graph) -> None:
        try:
            graph.capture_end()
        except Exception:
            self._undo_capture_state()

    def _undo_capture_state(self) -> None:
        """What capture_end undoes after it ends the stream's capture, done when ending raised
        before it got there: untold, the allocator sends this stream's allocations to the pool
        (empty_cache() then asserts), and the default generator stays in capture mode (every
        later random draw raises "Offset increment outside graph capture")."""
        try:
            torch_private.end_allocate_to_pool(self.device.index, self.pool)
        except RuntimeError:
            pass  # it had been told
        generator = torch.cuda.default_generators[self.device.index]
        generator.graphsafe_set_state(generator.clone_state())  # the same seed and offset, not capturing

    def run_ahead(self, body: Callable, reads: List[torch.Tensor]) -> torch.cuda.Event:
        """Queue body on the side stream after what the caller's stream holds so far, to run
        alongside what the caller queues next; join() the returned event before reading what it
        writes. `reads`: the caller's tensors it reads (their memory kept until it is done)."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            body()
        for tensor in reads:
            tensor.record_stream(self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def join(self, done: torch.cuda.Event) -> None:
        """The caller's stream waits for work queued by run_ahead."""
        torch.cuda.current_stream(self.device).wait_event(done)

    @staticmethod
    def live(outputs):
        """The tensors a later capture differentiates for `outputs` of a capture: themselves, whose
        memory every replay rewrites."""
        return outputs


@contextlib.contextmanager
def random_draws_refused(device):
    """A step that draws from torch's generators cannot be captured (every replay would repeat
    the captured draw): the warm-up's draws are undone, so the eager steps that follow draw what
    they would have drawn without a StepGraph."""
    before = generators.save(generators.cuda_of(device), host=False)
    try:
        yield
    except BaseException:  # a warm-up refused for another cause: its draws undone all the same
        before.restore()
        raise
    if before.torch_drawn_from():
        before.restore()
        raise CaptureFailed(
            "StepGraph: step_fn draws random numbers from torch's generators, which a captured graph would "
            "repeat at every replay; rolling this configuration out eagerly. Keep random draws out of step_fn "
            "(a rollout's noise= with a qca_lowmem.NoiseSchedule is keyed by step) to have it captured.")


@contextlib.contextmanager
def capture_errors_explained():
    """A failed capture raised as CaptureFailed with every error of the chain, first first."""
    try:
        yield
    except Exception as error:
        chain = exception_chain(error)
        story = " <- then: ".join(f"{type(e).__name__}: {str(e).strip()}" for e in chain)
        if any(isinstance(e, torch.OutOfMemoryError) for e in chain):
            raise CaptureFailed(
                f"StepGraph: out of memory while capturing the step as a CUDA graph; rolling this configuration out "
                f"eagerly, which needs less. Errors, first first: {story}.", out_of_memory=True) from error
        cause = ("A captured step must not synchronise with the host (.item(), printing tensors, data-dependent "
                 "branches or shapes).")
        if "cudaErrorStreamCaptureImplicit" in story or "legacy stream depend on a capturing" in story:
            cause = ("A graph made before the capture on another stream still holds the parameters' gradient "
                     "accumulators (an earlier episode's output kept with its graph: keep it .detach()ed).")
        raise CaptureFailed(
            f"StepGraph: capturing the step as a CUDA graph failed; rolling this configuration out eagerly. "
            f"Errors, first first: {story}. {cause}") from error


def exception_chain(error: BaseException) -> List[BaseException]:
    """error and the errors it was raised from or during, the first one first."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ if error.__cause__ is not None else error.__context__
    return chain[::-1]
