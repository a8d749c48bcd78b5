"""What one episode of a bench_episode run does on the device, from torch's profiler. Per step: the
episode's count over its steps, so what an episode does once (the loss's reads, the optimizer) is
spread over them. Measured under the profiler, which slows the host: an eager episode's busy
fraction is a floor.

- host_wait_ops_per_step: the ops after which the host may wait for a GPU (HOST_WAIT_OPS; counted
  on any device, on the CPU they wait for nothing; a read of a CPU tensor, such as AdamW's step
  counts, counts too).

The rest are None off CUDA. The device's events are its kernels and its memory operations
(Memcpy, Memset); torch's GPU user annotations (ranges such as `Optimizer.step#AdamW.step` laid
over the kernels they hold) are not events here.

- device_syncs_per_step: the CUDA runtime's calls that block the host until the GPU is done
  (SYNC_CALLS), the benchmark's own three around the profiled episode included: the host waits
  there were.
- kernels_per_step: kernels, the memory operations left out.
- layout_conversions_per_step: cuDNN's layout conversion kernels (LAYOUT_CONVERSION).
- gpu_busy_fraction: the union of the device's events over the episode's span (host events
  included).
- kernel_ms_per_step_by_family, kernels_per_step_by_family: every family of FAMILIES, in its
  order, and the device's milliseconds and launches of its events. Memset counts under fills and
  Memcpy under copies, so the milliseconds add up to all the device's time in kernels and memory
  operations, and the launches to kernels_per_step plus the memory operations a step.
- top_kernels_per_step_by_family: each family's TOP_KERNELS names that took the most time, as
  [name cut to NAME_CHARS, launches a step, ms a step]: what a family such as "other" holds, read
  from a lent GPU's file rather than guessed.
"""

import re

import torch
from torch.autograd import DeviceType

import common

# A boolean index or mask (nonzero, masked_select) and a scalar read (.item()).
HOST_WAIT_OPS = ("aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAYOUT_CONVERSION = re.compile(r"nchwToNhwc|nhwcToNchw", re.IGNORECASE)
MEMORY_OPS = ("Memcpy", "Memset")
# A kernel's family by its name as the profiler gives it (demangled, with its parameter types):
# the first that matches, else "other".
FAMILIES = tuple((family, re.compile(pattern, re.IGNORECASE)) for family, pattern in (
    ("layout", LAYOUT_CONVERSION.pattern),
    # Ours by their parameter types (csrc/kernels/groupnorm_elu*; qca_gn_elu_* in older builds);
    # torch's GroupNorm and ELU kernels in stock's rows.
    ("groupnorm_elu", r"qca_(groupnorm|gn)_elu|GroupNorm|RowwiseMoments|ComputeInternalGradients"
                      r"|Compute\w*FusedParams|GammaBeta\w*Backward|::elu(_backward)?_kernel"),
    # Ours: pack and update (qca_step.cu), noise (noise.cu; a name cut short keeps its cells).
    ("qca", r"qca_(pack|update|noise)_\w*params|(phase|bit)_flip_cells"),
    # cuDNN, CUTLASS and cuBLAS: the U-Net's only matrix products are its convolutions.
    ("convolution", r"cudnn|cutlass|cublas|nvjet|xmma|gemm|fprop|dgrad|wgrad|winograd|im2col|col2im"
                    r"|conv(olution|_depthwise|2d)"),
    ("cats", r"CatArray"),
    ("fills", r"^Memset|FillFunctor|ZeroFunctor"),
    ("copies", r"^Memcpy|copy_kernel|CopyFunctor"),
    # The library's gradient accumulators: its accumulate_ (scaler.cu), or torch's add and foreach
    # add of two lists (older builds; AdamW adds scalars only).
    ("adds", r"accumulate_chunks_kernel|CUDAFunctor_add|BinaryOpListAlphaFunctor<[^>]*>, std::plus"),
    # AdamW's and the gradient clipping's foreach kernels, torch's and our gradient scalers.
    ("optimizer", r"multi_tensor_apply_kernel|lpnorm_cleanup|amp_update_scale|unscale_chunks_kernel"
                  r"|sum_partials_kernel|scale_update_kernel"),
    # The recompute check's measure of each step (step_difference.cu).
    ("checks", r"qca_step_difference_params"),
    ("pooling", r"max_pool|avg_pool"),
    ("reductions", r"reduce_kernel"),
))
FAMILY_NAMES = tuple(family for family, _ in FAMILIES) + ("other",)
TOP_KERNELS = 6
NAME_CHARS = 200


def family_of(kernel_name: str) -> str:
    return next((family for family, pattern in FAMILIES if pattern.search(kernel_name)), "other")


def busy_seconds(intervals) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    return busy / 1e6


def device_counts(events, steps) -> dict:
    """The fields that are None off CUDA, from a profile's events (host ones included); {} where
    the device has none."""
    device_events = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    if not device_events:
        return {}
    milliseconds, launches = dict.fromkeys(FAMILY_NAMES, 0.0), dict.fromkeys(FAMILY_NAMES, 0)
    by_name = {}  # name -> [family, launches, milliseconds]
    for event in device_events:
        family = family_of(event.name)
        duration = (event.time_range.end - event.time_range.start) / 1e3
        milliseconds[family] += duration
        launches[family] += 1
        named = by_name.setdefault(event.name, [family, 0, 0.0])
        named[1] += 1
        named[2] += duration
    top = {family: [] for family in FAMILY_NAMES}
    for name, (family, n, ms) in sorted(by_name.items(), key=lambda item: (-item[1][2], item[0])):
        if len(top[family]) < TOP_KERNELS:
            top[family].append([name[:NAME_CHARS], n / steps, ms / steps])
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e6
    return {"device_syncs_per_step": sum(e.name in SYNC_CALLS for e in events) / steps,
            "kernels_per_step": sum(not e.name.startswith(MEMORY_OPS) for e in device_events) / steps,
            "gpu_busy_fraction": busy_seconds((e.time_range.start, e.time_range.end) for e in device_events) / span,
            "layout_conversions_per_step": launches["layout"] / steps,
            "kernel_ms_per_step_by_family": {family: ms / steps for family, ms in milliseconds.items()},
            "kernels_per_step_by_family": {family: n / steps for family, n in launches.items()},
            "top_kernels_per_step_by_family": {family: names for family, names in top.items() if names}}


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
              **dict.fromkeys(("device_syncs_per_step", "kernels_per_step", "gpu_busy_fraction",
                               "layout_conversions_per_step",
                               "kernel_ms_per_step_by_family", "kernels_per_step_by_family",
                               "top_kernels_per_step_by_family"))}
    if on_cuda:
        counts.update(device_counts(events, steps))
    return counts


def summary(result) -> str:
    """A bench_episode result's profiled fields for the end of its line ('' unprofiled)."""
    if "host_wait_ops_per_step" not in result:
        return ""
    text = f"   waits/step {result['host_wait_ops_per_step']:.2f}"
    if result["kernels_per_step"] is not None:
        text += (f" (device syncs {result['device_syncs_per_step']:.2f})"
                 f"   kernels/step {result['kernels_per_step']:.0f} (layout {result['layout_conversions_per_step']:.0f})"
                 f"   GPU busy {result['gpu_busy_fraction']:.0%}")
    return text


def family_table(result) -> str:
    """Its kernel time a step by family, a line of its own: ms (launches) of each family that ran,
    the most time first; '' where there is none."""
    milliseconds = result.get("kernel_ms_per_step_by_family")
    if not milliseconds:
        return ""
    launches = result["kernels_per_step_by_family"]
    parts = [f"{family} {ms:.3f} ({launches[family]:g})"
             for family, ms in sorted(milliseconds.items(), key=lambda item: -item[1]) if launches[family]]
    return (f"{'':26s} ms/step by family (launches): {', '.join(parts)}; "
            f"all {sum(milliseconds.values()):.3f} ({sum(launches.values()):g})")
