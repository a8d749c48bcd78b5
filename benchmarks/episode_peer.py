"""bench_episode's strongest peer: what a user would try instead of qca_lowmem, torch's own tools
on the stock U-Net.

stock_compiled_checkpoint: the stock U-Net (qca_lowmem.stock, the users' model) with its weights
channels_last and run through `torch.compile`, one `torch.utils.checkpoint` per step
(use_reentrant=False) and bf16 autocast, in the stock episode. The complex pack and update around
the U-Net run eagerly, as the users' engine runs them. The compile mode is a parameter: on CUDA
the benchmark measures each of `CUDA_MODES` and keeps the fastest as the row, reporting every
mode's time (or error), and where none of them ran, `FALLBACK_MODE`; off CUDA it runs the
default mode alone (the other modes' CUDA graphs and autotuned GPU kernels have nothing to do
there).
"""

import copy
import time

import torch

from qca_lowmem import stock as reference

PEER_RUNS = ["stock_compiled_checkpoint"]
# reduce-overhead: CUDA graphs (cudagraph trees); default: inductor's kernels alone, the mode a user
# tries first, compiled without autotuning (a compiled row even where cudagraph trees refuse the
# checkpoint); max-autotune: CUDA graphs and autotuned kernels, whose autotuning took over 200 s
# on an H200 (d7c48a1): measured last, so a bounded run has the others.
CUDA_MODES = ["reduce-overhead", "default", "max-autotune"]
# The autotuned kernels alone, should the checkpoint's recompute inside the backward not suit
# cudagraph trees.
FALLBACK_MODE = "max-autotune-no-cudagraphs"
MODES = ["default", *CUDA_MODES, FALLBACK_MODE]
# The first episode compiles; with CUDA graphs the second records them: both are warm-up.
WARMUP_EPISODES = 2


def compile_modes(requested, device):
    """The modes to measure on `device`: `requested`, or every CUDA mode on CUDA and the default
    mode elsewhere. Raises ValueError naming a CUDA-only mode asked for off CUDA."""
    on_cuda = device.type == "cuda"
    if requested is None:
        return list(CUDA_MODES) if on_cuda else ["default"]
    cuda_only = [mode for mode in requested if mode != "default"]
    if cuda_only and not on_cuda:
        raise ValueError(f"--compile-modes {' '.join(cuda_only)} need a CUDA device (CUDA graphs, autotuned GPU "
                         f"kernels), got --device {device}; off CUDA use 'default'")
    return list(requested)


def peer_step_fn(model, gamma, mode):
    """One stock step through `torch.compile(model, mode=mode)`, its input channels_last as the
    model's weights (the model itself is left uncompiled: the optimizer holds its Parameters)."""
    compiled = torch.compile(model, mode=None if mode == "default" else mode)

    def step(psi):
        x = reference.pack(psi).contiguous(memory_format=torch.channels_last)
        return reference.update(psi, compiled(x), gamma, multiplicative=True)  # compiled's type is no UNetUnitary

    return step


def begin_episode(mode):
    """Each episode is one iteration for cudagraph trees: the last episode's outputs are dead."""
    if mode != "default":
        torch.compiler.cudagraph_mark_step_begin()


def fastest_mode(measure, name, args, modes, mode_done=None):
    """The row of `name` in the fastest of `modes` (and FALLBACK_MODE where none of them ran):
    the result of measure(name, args with compile_modes=[mode]) for the fastest mode that ran
    (else the first mode's error), with its "compile_mode" and every mode's time, peak or error,
    and the seconds its setup (the compile included) and episodes took, under "compile_modes".
    mode_done(mode, per_mode) is called as each mode ends, so that a run stopped before the last
    keeps what the others gave."""
    results, per_mode = {}, {}

    def measured(mode):
        results[mode], per_mode[mode] = _measured(measure, name, args, mode)
        if mode_done is not None:
            mode_done(mode, dict(per_mode))

    for mode in modes:
        measured(mode)
    if FALLBACK_MODE not in per_mode and all(m["error"] is not None for m in per_mode.values()):
        measured(FALLBACK_MODE)
    ran = [mode for mode in per_mode if per_mode[mode]["error"] is None]
    best = min(ran, key=lambda mode: per_mode[mode]["episode_s"]) if ran else modes[0]
    return {**results[best], "compile_mode": best, "compile_modes": per_mode}


def _measured(measure, name, args, mode):
    """(measure's result in `mode`, its time, peak, error and the seconds it took)."""
    mode_args = copy.copy(args)
    mode_args.compile_modes = [mode]
    started = time.perf_counter()
    result = measure(name, mode_args)
    summary = {key: result.get(key) for key in ("episode_s", "peak_bytes", "error")}
    return result, {**summary, "wall_s": time.perf_counter() - started}
