"""What one episode of a bench_episode run does on the device, from torch's profiler: kernels per
step, the fraction of the episode the GPU is busy, cuDNN's layout conversions per step (None
off CUDA), and the ops per step after which the host waits for a GPU (counted on any device; on
the CPU they wait for nothing). Per step: the episode's count over its steps, so what an episode
does once (the loss's reads, the optimizer) is spread over them. Measured under the profiler,
which slows the host: an eager episode's busy fraction is a floor."""

import re

import torch
from torch.autograd import DeviceType

import common

# A boolean index or mask (nonzero, masked_select) and a scalar read (.item()).
HOST_WAIT_OPS = ("aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense")
LAYOUT_CONVERSION = re.compile(r"nchwToNhwc|nhwcToNchw", re.IGNORECASE)


def busy_seconds(intervals) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    return busy / 1e6


def episode_counts(run, steps=None) -> dict:
    """One more episode of `run` (Run or TrainerRun), profiled; of `steps` steps where given (the
    profiler holds every kernel's event: a 500-step eager episode makes about half a million)."""
    on_cuda = run.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    steps = steps or run.args.steps
    with run.steps_set(steps), torch.profiler.profile(activities=activities) as profile:
        run.episode(seed=99)
        common.synchronize(run.device)
    events = profile.events()
    counts = {"profiled_steps": steps, "host_wait_ops_per_step": sum(e.name in HOST_WAIT_OPS for e in events) / steps,
              "kernels_per_step": None, "gpu_busy_fraction": None, "layout_conversions_per_step": None}
    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    if on_cuda and device_events:
        kernels = [e for e in device_events if not e.name.startswith(("Memcpy", "Memset"))]
        span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e6
        counts.update(kernels_per_step=len(kernels) / steps,
                      gpu_busy_fraction=busy_seconds((e.time_range.start, e.time_range.end) for e in device_events) / span,
                      layout_conversions_per_step=sum(bool(LAYOUT_CONVERSION.search(e.name)) for e in kernels) / steps)
    return counts
