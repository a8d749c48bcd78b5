"""Benchmark of the fused U-Net blocks and their GroupNorm+ELU kernels.

On a CUDA GPU:
1. Per-step forward + backward of UNetUnitary (default: grid 64, d_state 14, hidden 128) at each
   batch size, stock vs fused (each recompute mode), fp32 and bf16 autocast: peak memory
   (max_memory_allocated, also above what the model and input hold) and median time over CUDA
   events after warm-up, all in one process.
2. The GroupNorm+ELU kernels at the shapes of the U-Net's GroupNorms: achieved bandwidth (bytes
   a kernel must move / time) next to a measured device-to-device copy, and time next to
   nn.GroupNorm + nn.ELU.

On the CPU (`--device cpu`), part 2 only, at one torch thread and at all of them in the same run:
the fused forward and backward, torch's unfused group_norm + elu (forward, and its autograd
backward) on the same tensors and a `copy_` of x, timed interleaved (one of each per round),
medians; forward + backward against torch's is the ratio of the two medians' sums. Two more per row
show where the time floor is: the fused forward's second pass alone
(groupnorm_elu_apply: normalise + ELU with the statistics given) and torch's `elu` alone on x.
Also writes a PNG of the kernels' bandwidth against the copy's.

Writes benchmarks/results/block_<device>.json (block_cpu.json on the CPU) with the device, torch
and CUDA versions, thread counts, commit and date. Run after building, with qca_lowmem
importable: `python benchmarks/bench_block.py [--device cpu]`.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import common

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--modes", nargs="+", choices=["unet", "blocks", "none"], default=["unet", "blocks", "none"],
                        help="recompute modes of the fused UNetUnitary to measure")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20,
                        help="CUDA kernels: time each call inside a captured graph of this many (1: one call "
                             "between two events, which mostly times its launch)")
    parser.add_argument("--skip-model", action="store_true", help="only the kernel benchmark")
    parser.add_argument("--skip-kernels", action="store_true", help="only the model benchmark")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="CPU: torch thread counts to measure (default: 1 and all)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/block_<device>.json)")
    return parser.parse_args(argv)


def median_ms(fn, args, calls=1):
    return common.median_seconds(fn, torch.device("cuda"), warmup=args.warmup, reps=args.iters, calls=calls) * 1e3


def bench_models(args, reference, qca_lowmem):
    results = []
    device = torch.device("cuda")
    torch.manual_seed(0)
    stock = reference.UNetUnitary(args.d_state, args.hidden).to(device)
    with torch.no_grad():  # a non-trivial affine and a visible output layer: the error check below sees every block
        for module in stock.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.normal_(1.0, 0.3)
                module.bias.normal_(0.0, 0.3)
        stock.outc.weight.normal_(0, 0.3)
    variants = [("stock", stock)]
    for mode in args.modes:
        fused = qca_lowmem.UNetUnitary(args.d_state, args.hidden, recompute=mode).to(device)
        fused.load_state_dict(stock.state_dict(), strict=True)
        variants.append((f"fused-{mode}", fused))
    for batch in args.batches:
        x = torch.randn(batch, 2 * args.d_state, args.grid, args.grid, device=device)
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                expected = stock(x).float()
            for name, model in variants:
                with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                    error = ((model(x).float() - expected).abs().max() / expected.abs().max()).item()

                def step():
                    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                        y = model(x)
                    y.float().square().mean().backward()

                model.zero_grad(set_to_none=False)
                step()  # grads allocated, so the peak below is the step's own
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                ms = median_ms(step, args)
                row = {"model": name, "batch": batch, "dtype": dtype_name, "median_ms": ms,
                       "peak_bytes": peak, "peak_above_held_bytes": peak - held, "output_rel_err_vs_stock": error}
                results.append(row)
                print(f"B={batch} {dtype_name} {name:13s} {ms:8.3f} ms  peak {peak / 2**20:8.1f} MiB "
                      f"(+{(peak - held) / 2**20:.1f} MiB over model and grads)  rel. err. {error:.1e}")
    return results


def gn_shapes(args):
    """(C, H, W, groups) of every GroupNorm in the U-Net, deduplicated."""
    h, g = args.hidden, args.grid
    blocks = [(h, g), (2 * h, g // 2), (4 * h, g // 4), (8 * h, g // 8), (4 * h, g // 4), (h, g)]
    shapes = []
    for channels, size in blocks:
        groups = max(1, channels // 8 if channels > 8 else 1)
        groups = 1 if channels % groups else groups
        if (channels, size, size, groups) not in shapes:
            shapes.append((channels, size, size, groups))
    return shapes


def gn_cases(args, device, affine_dtype=None):
    """(batch, dtype name, (C, H, W, groups), layout, x, weight, bias, grad_y) for every
    benchmarked GroupNorm; the affine parameters in `affine_dtype` (x's dtype when None)."""
    for batch in args.batches:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for channels, height, width, groups in gn_shapes(args):
                for layout in ("nchw", "channels_last"):
                    x = torch.randn(batch, channels, height, width, device=device, dtype=dtype)
                    if layout == "channels_last":
                        x = x.contiguous(memory_format=torch.channels_last)
                    params = dict(device=device, dtype=affine_dtype or dtype)
                    weight = torch.randn(channels, **params) * 0.3 + 1
                    bias = torch.randn(channels, **params) * 0.3
                    yield batch, dtype_name, (channels, height, width, groups), layout, x, weight, bias, torch.randn_like(x)


def bench_kernels(args):
    ops = torch.ops.qca_lowmem
    device = torch.device("cuda")
    copy_gbs = common.copy_bandwidth(device) / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    rows = []
    for batch, dtype_name, shape, layout, x, weight, bias, grad_y in gn_cases(args, device, torch.float32):
        dtype = DTYPES[dtype_name]
        channels, height, width, groups = shape
        y, mean, rstd = ops.groupnorm_elu(x, weight, bias, groups, 1e-5)
        fwd_ms = median_ms(lambda: ops.groupnorm_elu(x, weight, bias, groups, 1e-5), args, args.calls)
        bwd_ms = median_ms(lambda: ops.groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd), args, args.calls)
        # Stock: nn.GroupNorm then nn.ELU (fp32 affine, as autocast runs it).
        xs = x.detach().requires_grad_(True)
        ws, bs = weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)

        def stock_forward():
            return F.elu(F.group_norm(xs, groups, ws.to(dtype), bs.to(dtype), 1e-5))

        stock_fwd_ms = median_ms(stock_forward, args, args.calls)
        ys = stock_forward()
        stock_bwd_ms = median_ms(lambda: torch.autograd.grad(ys, (xs, ws, bs), grad_y, retain_graph=True), args,
                                 args.calls)
        element = x.element_size()
        fwd_bytes = 2 * x.numel() * element  # read x, write y
        bwd_bytes = 3 * x.numel() * element  # read x and grad_y, write grad_x
        fwd_gbs, bwd_gbs = fwd_bytes / fwd_ms / 1e6, bwd_bytes / bwd_ms / 1e6
        row = {
            "batch": batch, "dtype": dtype_name, "layout": layout,
            "shape": [batch, channels, height, width], "groups": groups,
            "forward_ms": fwd_ms, "backward_ms": bwd_ms,
            "forward_GBps": fwd_gbs, "backward_GBps": bwd_gbs,
            "forward_fraction_of_copy": fwd_gbs / copy_gbs, "backward_fraction_of_copy": bwd_gbs / copy_gbs,
            "stock_forward_ms": stock_fwd_ms, "stock_backward_ms": stock_bwd_ms,
            "forward_speedup_vs_stock": stock_fwd_ms / fwd_ms, "backward_speedup_vs_stock": stock_bwd_ms / bwd_ms,
        }
        rows.append(row)
        print(f"B={batch} {dtype_name} {layout:13s} C={channels:4d} {height}x{width} G={groups:3d}: "
              f"fwd {fwd_ms * 1e3:7.1f} us {fwd_gbs:6.0f} GB/s ({fwd_gbs / copy_gbs:4.0%} of copy, "
              f"{stock_fwd_ms / fwd_ms:4.2f}x stock)  bwd {bwd_ms * 1e3:7.1f} us {bwd_gbs:6.0f} GB/s "
              f"({bwd_gbs / copy_gbs:4.0%}, {stock_bwd_ms / bwd_ms:4.2f}x stock)")
    return {"copy_GBps": copy_gbs, "groupnorm_elu": rows}


def bench_kernels_cpu(args):
    """Fused vs torch's unfused ops vs copy_, per thread count (interleaved, medians)."""
    ops = torch.ops.qca_lowmem
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch, dtype_name, shape, layout, x, weight, bias, grad_y in gn_cases(args, torch.device("cpu")):
            channels, height, width, groups = shape
            _, mean, rstd = ops.groupnorm_elu(x, weight, bias, groups, 1e-5)
            xs = x.detach().requires_grad_(True)
            ws, bs = weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)
            ys = F.elu(F.group_norm(xs, groups, ws, bs, 1e-5))
            copy_out = torch.empty_like(x)
            seconds = common.interleaved_medians({
                "forward": lambda: ops.groupnorm_elu(x, weight, bias, groups, 1e-5),
                "backward": lambda: ops.groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd),
                "stock_forward": lambda: F.elu(F.group_norm(xs, groups, ws, bs, 1e-5)),
                "stock_backward": lambda: torch.autograd.grad(ys, (xs, ws, bs), grad_y, retain_graph=True),
                "copy": lambda: copy_out.copy_(x),
                "apply": lambda: ops.groupnorm_elu_apply(x, weight, bias, mean, rstd),
                "stock_elu": lambda: F.elu(x),
            }, torch.device("cpu"), args.warmup, args.iters)
            nbytes = x.numel() * x.element_size()
            copy_gbs = 2 * nbytes / seconds["copy"] / 1e9
            fwd_gbs = 2 * nbytes / seconds["forward"] / 1e9  # read x, write y
            bwd_gbs = 3 * nbytes / seconds["backward"] / 1e9  # read x and grad_y, write grad_x
            row = {
                "threads": threads, "batch": batch, "dtype": dtype_name, "layout": layout,
                "shape": [batch, channels, height, width], "groups": groups, "x_bytes": nbytes,
                "forward_ms": seconds["forward"] * 1e3, "backward_ms": seconds["backward"] * 1e3,
                "stock_forward_ms": seconds["stock_forward"] * 1e3,
                "stock_backward_ms": seconds["stock_backward"] * 1e3,
                "copy_ms": seconds["copy"] * 1e3, "copy_GBps": copy_gbs,
                "apply_ms": seconds["apply"] * 1e3, "stock_elu_ms": seconds["stock_elu"] * 1e3,
                "forward_GBps": fwd_gbs, "backward_GBps": bwd_gbs,
                # read x, write y, as the forward: the ELU pass alone, ours and torch's
                "apply_fraction_of_copy": seconds["copy"] / seconds["apply"],
                "stock_elu_fraction_of_copy": seconds["copy"] / seconds["stock_elu"],
                "forward_fraction_of_copy": fwd_gbs / copy_gbs, "backward_fraction_of_copy": bwd_gbs / copy_gbs,
                "forward_speedup_vs_stock": seconds["stock_forward"] / seconds["forward"],
                "backward_speedup_vs_stock": seconds["stock_backward"] / seconds["backward"],
                "forward_backward_speedup_vs_stock": (seconds["stock_forward"] + seconds["stock_backward"])
                / (seconds["forward"] + seconds["backward"]),
            }
            rows.append(row)
            print(f"{threads}t B={batch} {dtype_name} {layout:13s} C={channels:4d} {height}x{width} G={groups:3d}: "
                  f"fwd {row['forward_ms'] * 1e3:7.0f} us {row['forward_speedup_vs_stock']:4.2f}x stock "
                  f"{fwd_gbs / copy_gbs:4.0%} of copy | bwd {row['backward_ms'] * 1e3:7.0f} us "
                  f"{row['backward_speedup_vs_stock']:4.2f}x stock {bwd_gbs / copy_gbs:4.0%} of copy "
                  f"| fwd+bwd {row['forward_backward_speedup_vs_stock']:4.2f}x stock "
                  f"| ELU pass {row['apply_fraction_of_copy']:4.0%}, torch elu {row['stock_elu_fraction_of_copy']:4.0%} "
                  f"of copy | copy {copy_gbs:5.1f} GB/s", flush=True)
    return {"groupnorm_elu": rows}


def plot_cpu(rows, path):
    """Kernel bandwidth against the copy's, one panel per thread count, one point per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thread_counts = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(len(thread_counts), 1, figsize=(15, 4 * len(thread_counts)), squeeze=False)
    for ax, threads in zip(axes[:, 0], thread_counts):
        cases = [r for r in rows if r["threads"] == threads]
        labels = [f"B{r['batch']} {r['dtype']} {'CL' if r['layout'] == 'channels_last' else 'NCHW'} "
                  f"C{r['shape'][1]} {r['shape'][2]}x{r['shape'][3]}" for r in cases]
        positions = range(len(cases))
        ax.plot(positions, [r["copy_GBps"] for r in cases], "k-", label="copy_ of x")
        ax.plot(positions, [r["forward_GBps"] for r in cases], "o", label="fused forward")
        ax.plot(positions, [r["backward_GBps"] for r in cases], "s", label="fused backward")
        ax.plot(positions, [2 * r["x_bytes"] / r["stock_forward_ms"] / 1e6 for r in cases], "x",
                label="torch group_norm + elu forward (same bytes)")
        ax.plot(positions, [3 * r["x_bytes"] / r["stock_backward_ms"] / 1e6 for r in cases], "+",
                label="torch group_norm + elu backward (same bytes)")
        ax.plot(positions, [2 * r["x_bytes"] / r["stock_elu_ms"] / 1e6 for r in cases], "v",
                label="torch elu alone (read x, write y)")
        ax.set_xticks(list(positions), labels, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (bytes a kernel must move / time)")
        ax.set_title(f"GroupNorm+ELU on {common.device_name(torch.device('cpu'))}, {threads} thread(s)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    import qca_lowmem
    from qca_lowmem import stock as reference

    device = torch.device(args.device)
    payload = {"config": {"grid": args.grid, "d_state": args.d_state, "hidden": args.hidden, "batches": args.batches,
                          "dtypes": args.dtypes, "modes": args.modes, "warmup": args.warmup, "iters": args.iters}}
    if device.type == "cpu":
        args.threads = args.threads or sorted({1, torch.get_num_threads()})
        print(f"{common.device_name(device)}, torch {torch.__version__}, threads {args.threads}")
        payload["config"]["threads"] = args.threads
        payload["kernels"] = bench_kernels_cpu(args)
        out = args.out or str(common.RESULTS / "block_cpu.json")
        plot_cpu(payload["kernels"]["groupnorm_elu"], out.removesuffix(".json") + ".png")
        print(f"wrote {common.write_result('block', device, payload, out)} and its .png")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_block.py on CUDA measures peak memory and CUDA-event times: it needs a CUDA GPU (or --device cpu)")
    if not qca_lowmem.ops._loader.has_cuda_kernels():
        sys.exit("qca_lowmem was built without CUDA kernels; rebuild with QCA_LOWMEM_CUDA=1")
    print(f"{common.device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if not args.skip_model:
        payload["unet_step"] = bench_models(args, reference, qca_lowmem)
    if not args.skip_kernels:
        payload["kernels"] = bench_kernels(args)
    print(f"wrote {common.write_result('block', device, payload, args.out)}")


if __name__ == "__main__":
    main()
