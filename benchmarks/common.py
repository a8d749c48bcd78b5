"""Shared benchmark plumbing: timing with warm-up and medians, copy bandwidth, result files
(with the facts `qca_lowmem.trainer.bench.environment` records)."""

import json
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


def median_seconds(fn, device, warmup=5, reps=20, setup=None):
    """Median wall time of fn(): CUDA events on a GPU, perf_counter after a sync elsewhere.

    `setup()`, when given, runs before each call, outside the timing (to restore inputs that fn
    changes in place)."""
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


def interleaved_medians(candidates, device, warmup=3, reps=20):
    """{name: median seconds} of candidates {name: fn}, timed in turn within each repetition, so
    that load from other processes falls on all of them alike and their ratios stay fair. CUDA
    events on a GPU, perf_counter elsewhere."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
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
