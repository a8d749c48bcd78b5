"""Shared benchmark plumbing: timing with warm-up and medians, copy bandwidth, result files
(with the facts `qca_lowmem.trainer.bench.environment` records)."""

import json
import re
import statistics
import time
from pathlib import Path

import torch

from qca_lowmem.trainer.bench import device_name, environment

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def synchronize(device):
    """Wait for the device's queued work (CUDA); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, warmup=5, reps=20, setup=None, calls=1):
    """Median wall time of fn(): CUDA events on a GPU, perf_counter after a sync elsewhere.

    `setup()`, when given, runs before each call, outside the timing (to restore inputs that fn
    changes in place). `calls` > 1 (CUDA, without setup): the time of one call within a replay of
    a captured graph of that many calls (`in_graph`)."""
    if calls > 1 and setup is None:
        return interleaved_medians({"fn": fn}, device, warmup, reps, calls)["fn"]
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for _ in range(reps):
        if setup:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device, nbytes=1 << 28):
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup=3, reps=10)
    return 2 * nbytes / seconds


def slug(text):
    return "".join(c if c.isalnum() else "_" for c in text).strip("_").lower()


def write_result(kind, device, payload, out=None):
    """Write benchmarks/results/<kind>_<device>.json (or `out`) and return its path."""
    path = Path(out) if out else RESULTS / f"{kind}_{slug(device_name(device))}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": kind, **environment(device, repo=ROOT), **payload}, indent=2) + "\n")
    return path


def readme_patch(path: str) -> str:
    """The README's ```diff block that changes the users' file `path`, as a user saves it for
    `git apply` (tests/project/test_atheria_patch.py checks it against their file)."""
    blocks = re.findall(r"^```diff\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.M | re.S)
    [patch] = [b for b in blocks if b.startswith(f"--- a/{path}\n+++ b/{path}\n")]
    return patch


def in_graph(fn, device, calls):
    """(a function replaying one captured CUDA graph of `calls` calls of fn, calls), or (fn, 1)
    where fn cannot be captured (it syncs with the host, say) or off CUDA. At the U-Net's sizes a
    kernel takes about as long as its launch, so one call between two events mostly times the
    launch; a replay issues the calls back to back, as the captured step runs them."""
    if device.type != "cuda" or calls <= 1:
        return fn, 1
    from qca_lowmem.recompute import step_graph  # StepGraph's capture: it leaves the process as found on failure

    if device.index is None:  # the capture's clean-up after a failure names the device by index
        device = torch.device("cuda", torch.cuda.current_device())
    graphs = step_graph._graphs(device)
    try:
        with graphs.warming_up():
            for _ in range(3):
                fn()
        _, replay = graphs.capture(lambda: [fn() for _ in range(calls)])
    except RuntimeError as error:
        print(f"not captured: {str(error).splitlines()[0]}", flush=True)
        return fn, 1
    return replay, calls


def backward_of(forward, inputs, grad):
    """A timing candidate: the gradients of forward(*inputs) w.r.t. inputs for `grad`. Its graph is
    made at its first call, on the stream current then: autograd runs a node's backward on the
    stream its forward ran on, so a graph made beforehand on the default stream makes a capture
    on in_graph's side stream fail ("operation would make the legacy stream depend on a
    capturing blocking stream"); made while in_graph warms up, it is on the side stream."""
    made = []

    def run():
        if not made:
            made.append(forward(*inputs))
        return torch.autograd.grad(made[0], inputs, grad, retain_graph=True)

    return run


def kernel_seconds(fn, reps):
    """Seconds one call of fn keeps the GPU's kernels busy: the summed durations of the kernels
    torch's profiler records over `reps` calls, over reps (what a captured graph's replay takes,
    less the gaps between kernels), for a fn that cannot be captured."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return summed_device_seconds(profile.key_averages()) / reps


def summed_device_seconds(averages) -> float:
    """The device time of the profiler's key averages (microseconds each, self time: every
    kernel counted once)."""
    return sum(a.self_device_time_total for a in averages) / 1e6


def interleaved_medians(candidates, device, warmup=3, reps=20, calls=1, timed_in=None):
    """{name: median seconds of one call} of candidates {name: fn}, timed in turn within each
    repetition, so that load from other processes falls on all of them alike and their ratios
    stay fair. CUDA events on a GPU, perf_counter elsewhere; with `calls` > 1 on CUDA, each
    candidate's time within a captured graph of that many calls (`in_graph`), or, where it cannot
    be captured, its kernels' summed times (`kernel_seconds`: one call between two events would
    time its launches); `timed_in`, a dict, gets each candidate's calls per timed run (1: timed
    call by call) or "profiler"."""
    cuda = device.type == "cuda"
    timed = {name: in_graph(fn, device, calls) for name, fn in candidates.items()}
    profiled = {name for name, (_, per) in timed.items() if cuda and calls > 1 and per == 1}
    if timed_in is not None:
        timed_in.update({name: "profiler" if name in profiled else per for name, (_, per) in timed.items()})
    for _ in range(warmup):
        for fn, _ in timed.values():
            fn()
    times = {name: [kernel_seconds(candidates[name], reps)] for name in profiled}
    times.update({name: [] for name in candidates if name not in profiled})
    for _ in range(reps):
        for name, (fn, per) in timed.items():
            if name in profiled:
                continue
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / per)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_of(nbytes, device):
    """A `copy_` that moves `nbytes` bytes (half read, half written), as a timing candidate."""
    src = torch.empty(max(1, nbytes // 8), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)
