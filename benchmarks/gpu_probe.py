"""The GPU run's first phase: the questions a GPU answers in about two minutes, each on its own.

1. capture: the default-config step (grid 64, d_state 14, hidden 128) as a StepGraph in fp32,
   bf16 and fp16 autocast, NCHW and channels_last: captured or fell back (the first error first),
   the rollout's gradients against the same rollout run eagerly, the current stream afterwards.
2. fallback: a step that reads a value on the host (`.item()`) cannot be captured: one warning,
   the eager rollout's answer, the default stream current again, `empty_cache()` and random
   draws still working, and a good step capturing afterwards.
3. determinism: the step's forward run twice on the same input (the recompute check assumes a
   recompute gives the forward's bits up to rounding) with cudnn.benchmark off and on, and from a
   second host thread; the recompute check's margin (its measured difference over its tolerance)
   with the output head at a trained size.
4. groupnorm: the fused GroupNorm+ELU forward and backward at the U-Net's own GroupNorm shapes
   (read off the model with hooks), NCHW and channels_last (two kernel families: per group, and
   tiles of a slab of groups), against torch's group_norm + elu and a `copy_` of the input,
   each call timed inside a captured graph of GRAPH_CALLS calls (one call between two events
   mostly times its launch; the backwards' graphs are made on the capture's stream), or where a
   candidate cannot be captured, its kernels' times summed by torch's profiler.
5. budget: budget="free" under a 3.68 GiB per-process cap (the small-GPU emulation): what
   `free_bytes` reads against the cap, and that an "auto" rollout of a captured step (a StepGraph)
   runs under it, with its private pool's free bytes, which free_bytes leaves out.
6. noise: the users' boolean-mask noise injector (stock.NoiseInjector) against its replay without
   host waits (atheria/mask_free_noise.py): bitwise equal flips, the CUDA generator left alike, and
   the ops that wait for the GPU in each.
7. step_kernels: the QCA step's ops (pack, update and their backwards, in fp16 channels_last as
   enable() runs them and in fp32 NCHW), the noise's phase flip, and the recompute check's
   measure (`step_difference`, against the same measure in torch's ops, as the check had it
   before) on the default state, each call timed inside a captured graph of GRAPH_CALLS calls,
   beside a `copy_` of psi.
8. pools: the U-Net's two 2x2 max pools (hidden channels at the grid, twice that at half of it)
   in fp16 and bf16, channels_last and NCHW: max_pool2x2 and its backward against torch's
   max_pool2d and its backward (given its indices), each call timed inside a captured graph; and
   their values and gradients compared bit for bit with torch's autograd, on random inputs and on
   ties, NaN and windows of -infinities.
9. convolutions: each convolution shape of the U-Net's forward (read off the model with hooks,
   with how many times a forward runs it), in fp16 channels_last as enable() runs them: the
   forward, the input's gradient and the weight's at batch 1, and the weight's at batch 8 and 32
   (what one launch would cost for the weight gradients of 8 or 32 steps' recomputes, were they
   deferred and batched), each with cuDNN's heuristics and with its benchmark's search
   (cudnn.benchmark, as the users' engine sets it), timed inside captured graphs; summed to a
   step's convolutions (the forward twice: the episode's and the recompute's) both ways.

Each section is written to benchmarks/results/probe_<device>.json as soon as it ends (a killed
run keeps what it had); a section that fails records its error and the next one runs. Without a
GPU it prints what it would measure and exits 0.
    python benchmarks/gpu_probe.py [--sections capture fallback ...]
"""

import argparse
import copy
import functools
import itertools
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import common
import qca_lowmem
from qca_lowmem import stock
from qca_lowmem.ops.max_pool import max_pool2x2
from qca_lowmem.ops.qca_step import fused_step
from qca_lowmem.recompute import memory
from qca_lowmem.recompute.check import ROUNDING_UNITS, _relative_difference
from qca_lowmem.recompute.cuda_graphs import CaptureFallbackWarning

SECTIONS = ["capture", "fallback", "determinism", "groupnorm", "budget", "noise", "step_kernels", "pools",
            "convolutions"]
GRAPH_CALLS = 20  # calls per captured graph when timing a kernel
AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CAP_BYTES = int(3.68 * 2**30)
DEFERRED_STEPS = (8, 32)  # steps whose weight gradients one batched launch would take


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS)
    p.add_argument("--grid", type=int, default=64)
    p.add_argument("--d-state", type=int, default=14)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="rollout steps per capture check")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the code paths at tiny shapes (no budget section)")
    p.add_argument("--out", default=None, help="output JSON (default benchmarks/results/probe_<device>.json)")
    return p.parse_args(argv)


def model(args, device, channels_last=False, head_scale=0.05):
    """The lowmem U-Net with an output head of a trained size (stock initialises it near zero,
    where every step changes psi by rounding alone)."""
    torch.manual_seed(0)
    unet = qca_lowmem.UNetUnitary(args.d_state, args.hidden)
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, head_scale)
    unet = unet.to(device)
    return unet.to(memory_format=torch.channels_last) if channels_last else unet


def psi0(args, device, seed=1):
    return stock.initial_state(1, args.grid, args.d_state, device, torch.Generator().manual_seed(seed))


def episode_grads(unet, step, args, device, amp):
    """One rollout with the stock loss and backward: (loss, [param grads], warnings raised)."""
    for p in unet.parameters():
        p.grad = None
    start = psi0(args, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            _, history = qca_lowmem.rollout(step, start, args.steps, checkpoint="step",
                                            noise=qca_lowmem.NoiseSchedule(0.1, 1000, seed=3))
        loss, _ = stock.evolutionary_loss(history, start)
        loss.backward()
    common.synchronize(device)
    return loss.item(), [p.grad.detach().clone() for p in unet.parameters()], caught


def max_rel(grads, reference):
    return max(((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(grads, reference))


def stream_state(device):
    if device.type != "cuda":
        return {}
    return {"current_is_default": torch.cuda.current_stream(device) == torch.cuda.default_stream(device)}


def empty_cache_works(device):
    if device.type != "cuda":
        return None
    try:
        torch.cuda.empty_cache()
        return True
    except Exception as e:  # the allocator left mid-capture asserts here
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def random_draw_works(device):
    """A failed capture can leave the default generator in capture mode: every draw then raises."""
    try:
        torch.randn(4, device=device)
        return True
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def section_capture(args, device):
    rows = []
    for name, amp in AMP.items():
        for channels_last in (False, True):
            row = {"amp": name, "channels_last": channels_last}
            try:
                unet = model(args, device, channels_last)
                eager = fused_step(unet, 0.0, True, channels_last=channels_last)
                loss_e, grads_e, _ = episode_grads(unet, eager, args, device, amp)
                graph = qca_lowmem.StepGraph(eager)
                t0 = time.perf_counter()
                loss_g, grads_g, caught = episode_grads(unet, graph, args, device, amp)
                row["first_episode_s"] = time.perf_counter() - t0
                fallbacks = [str(w.message) for w in caught if issubclass(w.category, CaptureFallbackWarning)]
                row.update(captures_made=graph.captures_made, fell_back=bool(graph.failed_keys),
                           fallback_warnings=len(fallbacks), first_error=fallbacks[0] if fallbacks else None,
                           loss_eager=loss_e, loss_graph=loss_g, grad_rel_err_vs_eager=max_rel(grads_g, grads_e),
                           **stream_state(device))
                _, grads_g2, _ = episode_grads(unet, graph, args, device, amp)
                row["captures_after_second_episode"] = graph.captures_made
                row["replays_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(grads_g, grads_g2))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc(limit=6)
            row["empty_cache"] = empty_cache_works(device)
            row["random_draw_after"] = random_draw_works(device)
            print(f"capture {name} channels_last={channels_last}: {short(row)}")
            rows.append(row)
    return rows


def section_fallback(args, device):
    unet = model(args, device)
    good = fused_step(unet, 0.0, True)

    def syncing_step(psi):
        if psi.abs().amax().item() > 1e9:  # a host read: cannot be captured
            raise AssertionError("unreachable")
        return good(psi)

    row = {}
    _, grads_e, _ = episode_grads(unet, good, args, device, None)
    graph = qca_lowmem.StepGraph(syncing_step)
    _, grads_f, caught = episode_grads(unet, graph, args, device, None)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, CaptureFallbackWarning)]
    row.update(fallback_warnings=len(fallbacks), first_error=fallbacks[0] if fallbacks else None,
               fell_back=bool(graph.failed_keys), grad_rel_err_vs_eager=max_rel(grads_f, grads_e), **stream_state(device))
    row["empty_cache"] = empty_cache_works(device)
    row["random_draw_after"] = random_draw_works(device)
    _, _, caught = episode_grads(unet, graph, args, device, None)
    row["warnings_second_episode"] = sum(issubclass(w.category, CaptureFallbackWarning) for w in caught)
    after = qca_lowmem.StepGraph(good)
    _, grads_after, _ = episode_grads(unet, after, args, device, None)
    row.update(good_step_captures_after=after.captures_made, good_step_grad_rel_err=max_rel(grads_after, grads_e))
    print(f"fallback: {short(row)}")
    return row


def forward_twice(step, x):
    with torch.no_grad():
        return step(x), step(x)


def section_determinism(args, device):
    rows = []
    benchmark = torch.backends.cudnn.benchmark
    try:
        for cudnn_benchmark in (False, True):
            torch.backends.cudnn.benchmark = cudnn_benchmark
            for name, amp in AMP.items():
                unet = model(args, device)
                step = fused_step(unet, 0.0, True)
                x = psi0(args, device)
                autocast = lambda: torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None)  # noqa: E731
                with autocast():
                    a, b = forward_twice(step, x)
                other = {}

                def in_other_thread():  # autocast is per thread
                    with autocast():
                        other["out"] = forward_twice(step, x)[0]

                thread = threading.Thread(target=in_other_thread)
                thread.start()
                thread.join()
                common.synchronize(device)
                tolerance = ROUNDING_UNITS * max(torch.finfo(amp or torch.float32).eps, torch.finfo(torch.float32).eps)
                real = lambda z: torch.view_as_real(z)  # noqa: E731
                diff_same = _relative_difference(real(b), real(a), real(x)).item()
                diff_thread = _relative_difference(real(other["out"]), real(a), real(x)).item()
                row = {"cudnn_benchmark": cudnn_benchmark, "amp": name, "bitwise_same_thread": torch.equal(a, b),
                       "bitwise_other_thread": torch.equal(a, other["out"]), "check_difference_same_thread": diff_same,
                       "check_difference_other_thread": diff_thread, "check_tolerance": tolerance,
                       "margin": max(diff_same, diff_thread) / tolerance}
                print(f"determinism {name} cudnn.benchmark={cudnn_benchmark}: {short(row)}")
                rows.append(row)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    return rows


def unet_layer_calls(args, device, layer_types):
    """[(layer, shape of its input)] of each call the stock U-Net's forward makes of its layers of
    `layer_types`, in order."""
    net = stock.UNetUnitary(args.d_state, args.hidden).to(device)
    calls = []
    handles = [m.register_forward_hook(lambda module, inputs, output: calls.append((module, tuple(inputs[0].shape))))
               for m in net.modules() if isinstance(m, layer_types)]
    with torch.no_grad():
        net(torch.randn(1, 2 * args.d_state, args.grid, args.grid, device=device))
    for h in handles:
        h.remove()
    return calls


def unet_groupnorm_shapes(args, device):
    """(shape of x, groups) of every GroupNorm in the stock U-Net's forward, in order, deduplicated."""
    return list(dict.fromkeys((shape, norm.num_groups) for norm, shape in unet_layer_calls(args, device, torch.nn.GroupNorm)))


def fused_groupnorm_elu(x, w, b, groups):
    return qca_lowmem.groupnorm_elu(x, w, b, groups)


def torch_groupnorm_elu(x, w, b, groups):
    return F.elu(F.group_norm(x, groups, w, b, 1e-5))


def section_groupnorm(args, device):
    rows = []
    layouts = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
    # channels_last takes the tiled kernels (groupnorm_elu_nhwc.cuh), NCHW the per-group ones
    for (shape, groups), dtype, layout in itertools.product(unet_groupnorm_shapes(args, device),
                                                            (torch.float32, torch.bfloat16), layouts):
        x = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=layouts[layout])
        x.requires_grad_(True)
        w = torch.randn(shape[1], device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(shape[1], device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=layouts[layout])
        fused = functools.partial(fused_groupnorm_elu, groups=groups)
        reference = functools.partial(torch_groupnorm_elu, groups=groups)
        fused_y, torch_y = fused(x, w, b), reference(x, w, b)
        _, mean, rstd = torch.ops.qca_lowmem.groupnorm_elu(x.detach(), w.detach(), b.detach(), groups, 1e-5)
        candidates = {
            "fused_forward": lambda: fused(x.detach(), w.detach(), b.detach()),
            "torch_forward": lambda: reference(x.detach(), w.detach(), b.detach()),
            "fused_backward": common.backward_of(fused, (x, w, b), g),
            # the backward op alone, without autograd's call above it
            "fused_backward_op": lambda: torch.ops.qca_lowmem.groupnorm_elu_backward(
                g, x.detach(), w.detach(), b.detach(), mean, rstd),
            "torch_backward": common.backward_of(reference, (x, w, b), g),
            "copy_of_x": common.copy_of(x.numel() * x.element_size() * 2, device),
        }
        calls = {}
        times = common.interleaved_medians(candidates, device, warmup=5, reps=30, calls=GRAPH_CALLS, timed_in=calls)
        row = {"shape": list(shape), "groups": groups, "dtype": str(dtype).replace("torch.", ""), "layout": layout,
               "calls_per_timed_graph": calls,
               **{f"{k}_us": v * 1e6 for k, v in times.items()},
               "max_abs_diff_vs_torch": (fused_y.float() - torch_y.float()).abs().max().item()}
        print(f"groupnorm {shape} g={groups} {row['dtype']} {layout}: {short(row)}")
        rows.append(row)
    return rows


def section_budget(args, device):
    total = torch.cuda.get_device_properties(device).total_memory
    before = torch.cuda.get_per_process_memory_fraction(device)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total), device)
    try:
        row = {"cap_bytes": CAP_BYTES, "free_bytes_under_cap": memory.free_bytes(device),
               "allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
        unet = model(args, device)
        step = fused_step(unet, 0.0, True)
        long_args = copy.copy(args)
        long_args.steps = 60
        torch.cuda.reset_peak_memory_stats(device)
        try:
            episode_grads(unet, step, long_args, device, None)  # checkpoint="step", the baseline
            row["step_peak_allocated"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            for p in unet.parameters():
                p.grad = None
            start = psi0(args, device)
            captured = qca_lowmem.StepGraph(step)
            _, history = qca_lowmem.rollout(captured, start, long_args.steps, checkpoint="auto", budget="free")
            stock.evolutionary_loss(history, start)[0].backward()
            torch.cuda.synchronize(device)
            row.update(auto_free_ran=True, auto_peak_allocated=torch.cuda.max_memory_allocated(device),
                       auto_peak_reserved=torch.cuda.max_memory_reserved(device),
                       captures_made=captured.captures_made, fell_back=bool(captured.failed_keys),
                       private_pool_free_bytes=memory.private_pool_free_bytes(device),
                       free_bytes_after=memory.free_bytes(device))
        except torch.OutOfMemoryError as e:
            row.update(auto_free_ran=False, error=f"out of memory: {str(e).splitlines()[0]}")
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(before, device)
    print(f"budget: {short(row)}")
    return row


def section_noise(args, device):
    from qca_lowmem.atheria.mask_free_noise import MaskFreeInjector

    def flipped(injector, method, psi):
        torch.manual_seed(5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = getattr(injector, method)(psi, 0.3)
        waits = sum(e.name in ("aten::nonzero", "aten::_local_scalar_dense") for e in profile.events())
        generator = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
        return out, generator, waits

    rows = []
    for shape in ((1, args.grid, args.grid, args.d_state), (2, 17, 33, 3)):
        for dtype in (torch.complex64, torch.complex128):
            psi = torch.randn(shape, dtype=dtype, device=device)
            for method in ("apply_phase_flip", "apply_bit_flip"):
                theirs, rng_theirs, waits_theirs = flipped(stock.NoiseInjector(device), method, psi)
                ours, rng_ours, waits_ours = flipped(MaskFreeInjector(device), method, psi)
                rows.append({"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "method": method,
                             "bitwise": torch.equal(torch.view_as_real(ours), torch.view_as_real(theirs)),
                             "same_generator": torch.equal(rng_ours, rng_theirs),
                             "cells_flipped": (theirs != psi).any(-1).float().mean().item(),
                             "waits_theirs": waits_theirs, "waits_replay": waits_ours})
    result = {"all_bitwise": all(r["bitwise"] and r["same_generator"] for r in rows), "rows": rows}
    print(f"noise: all bitwise {result['all_bitwise']}; waits theirs/replay "
          f"{[(r['waits_theirs'], r['waits_replay']) for r in rows[:2]]}")
    return result


def torch_step_difference(actual, expected, before):
    """The recompute check's measure in torch's ops (its formulation before step_difference)."""
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    difference = torch.where(same, 0.0, (actual - expected).abs()).amax()
    scale = (expected - before).abs().nan_to_num(0.0, 0.0, 0.0).amax().clamp_min(torch.finfo(torch.float32).tiny)
    return (difference / scale).to(torch.float32)


def section_step_kernels(args, device):
    ops = torch.ops.qca_lowmem
    psi = psi0(args, device)
    before = psi0(args, device, seed=2)
    grad = torch.randn_like(psi)
    rows = []
    for dtype, channels_last in ((torch.float16, True), (torch.float32, False)):
        x = ops.qca_pack(psi, dtype, channels_last)
        delta = 0.01 * torch.randn_like(x)
        grad_x = torch.randn_like(x)
        recomputed = psi + 1e-6 * torch.randn_like(psi)
        candidates = {
            "pack": lambda: ops.qca_pack(psi, dtype, channels_last),
            "update": lambda: ops.qca_update(psi, delta, 0.0, True, 1e-9),
            "update_backward": lambda: ops.qca_update_backward(grad, psi, delta, 0.0, True, 1e-9),
            "pack_backward": lambda: ops.qca_pack_backward(grad_x, psi.dtype),
            "phase_flip": lambda: ops.phase_flip(psi, 0.05, 7, 3, False),
            "step_difference": lambda: ops.step_difference(recomputed, psi, before),
            "torch_step_difference": lambda: torch_step_difference(recomputed, psi, before),
            "copy_of_psi": common.copy_of(psi.numel() * psi.element_size() * 2, device),
        }
        calls = {}
        times = common.interleaved_medians(candidates, device, warmup=5, reps=30, calls=GRAPH_CALLS, timed_in=calls)
        row = {"psi": list(psi.shape), "planes_dtype": str(dtype).replace("torch.", ""),
               "layout": "channels_last" if channels_last else "nchw", "calls_per_timed_graph": calls,
               **{f"{k}_us": v * 1e6 for k, v in times.items()},
               "step_difference_vs_torch": ops.step_difference(recomputed, psi, before).item()
               / torch_step_difference(recomputed, psi, before).item()}
        print(f"step kernels {row['planes_dtype']} {row['layout']}: {short(row)}")
        rows.append(row)
    return rows


def pool_bits_equal(x):
    """max_pool2x2 against F.max_pool2d through autograd on x: values (NaN where NaN) and the
    gradient's bits (the sign of zero included) equal."""
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, expected = max_pool2x2(ours), F.max_pool2d(theirs, 2)
    grad = torch.randn(expected.shape, device=x.device).to(x.dtype)
    grad[..., 0] = -0.0
    y.backward(grad)
    expected.backward(grad)
    return (torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.nan_to_num(0.0), expected.nan_to_num(0.0))
            and y.stride() == expected.stride() and torch.equal(ours.grad, theirs.grad)
            and torch.equal(ours.grad.signbit(), theirs.grad.signbit()))


def section_pools(args, device):
    ops = torch.ops.qca_lowmem
    rows = []
    shapes = [(1, args.hidden, args.grid, args.grid), (1, 2 * args.hidden, args.grid // 2, args.grid // 2)]
    for shape, dtype, channels_last in itertools.product(shapes, (torch.float16, torch.bfloat16), (True, False)):
        layout = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=layout)
        _, indices = F.max_pool2d(x, 2, return_indices=True)
        grad_y = torch.randn_like(F.max_pool2d(x, 2))
        candidates = {
            "max_pool2x2": lambda: ops.max_pool2x2(x),
            "torch_max_pool2d": lambda: F.max_pool2d(x, 2),
            "max_pool2x2_backward": lambda: ops.max_pool2x2_backward(grad_y, x),
            "torch_backward": lambda: torch.ops.aten.max_pool2d_with_indices_backward(
                grad_y, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices),
            "copy_of_x": common.copy_of(x.numel() * x.element_size(), device),
        }
        calls = {}
        times = common.interleaved_medians(candidates, device, warmup=5, reps=30, calls=GRAPH_CALLS, timed_in=calls)
        special = torch.randint(-3, 3, shape, device=device).to(torch.float32)
        special[special == 2] = float("nan")
        special[special <= -2] = float("-inf")
        row = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
               "layout": "channels_last" if channels_last else "nchw", "calls_per_timed_graph": calls,
               **{f"{k}_us": v * 1e6 for k, v in times.items()},
               "bitwise_random": pool_bits_equal(x),
               "bitwise_ties_nan_infinities": pool_bits_equal(special.to(dtype).contiguous(memory_format=layout))}
        print(f"pools {row['shape']} {row['dtype']} {row['layout']}: {short(row)}")
        rows.append(row)
    return {"all_bitwise": all(r["bitwise_random"] and r["bitwise_ties_nan_infinities"] for r in rows), "rows": rows}


def unet_convolution_shapes(args, device):
    """[(layer, input shape, count)] of the stock U-Net's convolutions, in forward order,
    deduplicated by their settings and input shape; count: the calls a forward makes of them."""
    seen = {}
    for layer, shape in unet_layer_calls(args, device, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
        first, _, count = seen.get((repr(layer), shape), (layer, shape, 0))
        seen[repr(layer), shape] = (first, shape, count + 1)
    return list(seen.values())


def convolution_candidates(layer, shape, dtype, device):
    """{name: fn} of the layer's forward and gradients at batch 1 and its weight's gradient at
    the batches of DEFERRED_STEPS, on random channels_last operands of `dtype`."""
    cl = torch.channels_last
    weight = layer.weight.detach().to(dtype).contiguous(memory_format=cl)
    settings = dict(stride=list(layer.stride), padding=list(layer.padding), dilation=list(layer.dilation),
                    transposed=isinstance(layer, torch.nn.ConvTranspose2d), output_padding=list(layer.output_padding),
                    groups=layer.groups)
    ops = torch.ops.aten

    def operands(batch):
        x = torch.randn((batch, *shape[1:]), device=device).to(dtype).contiguous(memory_format=cl)
        y = ops.convolution(x, weight, None, **settings)
        return x, torch.randn_like(y)

    def gradient(x, grad_y, mask):
        return lambda: ops.convolution_backward(grad_y, x, weight, None, **settings, output_mask=mask)

    x, grad_y = operands(1)
    candidates = {
        "forward": lambda: ops.convolution(x, weight, None, **settings),
        "input_grad": gradient(x, grad_y, [True, False, False]),
        "weight_grad": gradient(x, grad_y, [False, True, False]),
    }
    for steps in DEFERRED_STEPS:
        candidates[f"weight_grad_batch{steps}"] = gradient(*operands(steps), [False, True, False])
    return candidates


def with_cudnn_benchmark(fn, on):
    """fn with cudnn.benchmark set to `on` for its calls (its search runs in in_graph's warm-up;
    a replay runs the algorithm captured)."""
    def run():
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = on
        try:
            return fn()
        finally:
            torch.backends.cudnn.benchmark = before
    return run


def section_convolutions(args, device):
    rows, dtype = [], torch.float16
    step_ms = {"heuristics": {}, "benchmark": {}}
    for layer, shape, count in unet_convolution_shapes(args, device):
        candidates = {}
        for name, fn in convolution_candidates(layer, shape, dtype, device).items():
            candidates[name] = with_cudnn_benchmark(fn, False)
            candidates[f"{name}_benchmark"] = with_cudnn_benchmark(fn, True)
        calls = {}
        times = common.interleaved_medians(candidates, device, warmup=5, reps=30, calls=GRAPH_CALLS, timed_in=calls)
        row = {"layer": repr(layer), "input": list(shape), "calls_per_forward": count, "dtype": "float16",
               "layout": "channels_last", "calls_per_timed_graph": calls, **{f"{k}_us": v * 1e6 for k, v in times.items()}}
        print(f"convolution {row['layer']} {row['input']} x{count}: {short(row)}")
        rows.append(row)
        for search, suffix in (("heuristics", ""), ("benchmark", "_benchmark")):
            # a step: the episode's forward, the recompute's, then both gradients
            parts = {"now": 2 * times["forward" + suffix] + times["input_grad" + suffix] + times["weight_grad" + suffix],
                     **{f"weight_grads_deferred_over_{k}": 2 * times["forward" + suffix] + times["input_grad" + suffix]
                        + times[f"weight_grad_batch{k}" + suffix] / k for k in DEFERRED_STEPS}}
            for part, seconds in parts.items():
                step_ms[search][part] = step_ms[search].get(part, 0.0) + count * seconds * 1e3
    print(f"convolutions a step (ms): {step_ms}")
    return {"step_ms": step_ms, "rows": rows}


def short(row):
    return {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items() if k != "traceback"}


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_probe: no CUDA GPU; it would measure, each into benchmarks/results/probe_<device>.json:")
        for line in __doc__.split("\n\n")[1].splitlines():
            print("  " + line.strip())
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # set_per_process_memory_fraction needs one
        device = torch.device("cuda", torch.cuda.current_device())
    payload = {"config": {"grid": args.grid, "d_state": args.d_state, "hidden": args.hidden, "steps": args.steps},
               "cudnn": torch.backends.cudnn.version(), "sections": {}}
    if device.type == "cuda":
        payload["multiprocessors"] = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"device {common.device_name(device)}, torch {torch.__version__}")
    failed = []
    for name in args.sections:
        start = time.perf_counter()
        try:
            payload["sections"][name] = globals()[f"section_{name}"](args, device)
        except Exception as e:
            failed.append(name)
            payload["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
            print(f"{name} FAILED: {type(e).__name__}: {e}")
        payload["sections"][name + "_seconds"] = time.perf_counter() - start
        path = common.write_result("probe", device, payload, args.out)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
