"""Benchmark of the fused U-Net blocks on a CUDA GPU.

1. Per-step forward + backward of UNetUnitary (default: grid 64, d_state 14, hidden 128) at each
   batch size, stock vs fused (each recompute mode), fp32 and bf16 autocast: peak memory
   (max_memory_allocated, also above what the model and input hold) and median time over CUDA
   events after warm-up, all in one process.
2. The GroupNorm+ELU kernels at the shapes of the U-Net's GroupNorms: achieved bandwidth (bytes
   a kernel must move / time) next to a measured device-to-device copy, and time next to
   nn.GroupNorm + nn.ELU.

Writes benchmarks/results/block_<device>.json with the device, torch and CUDA versions, commit
and date. Run after building, with qca_lowmem importable: `python benchmarks/bench_block.py`.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import common

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--modes", nargs="+", choices=["unet", "blocks", "none"], default=["unet", "blocks", "none"],
                        help="recompute modes of the fused UNetUnitary to measure")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-model", action="store_true", help="only the kernel benchmark")
    parser.add_argument("--skip-kernels", action="store_true", help="only the model benchmark")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/block_<device>.json)")
    return parser.parse_args(argv)


def median_ms(fn, args):
    return common.median_seconds(fn, torch.device("cuda"), warmup=args.warmup, reps=args.iters) * 1e3


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


def bench_kernels(args):
    ops = torch.ops.qca_lowmem
    device = torch.device("cuda")
    copy_gbs = common.copy_bandwidth(device) / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    rows = []
    for batch in args.batches:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for channels, height, width, groups in gn_shapes(args):
                for layout in ("nchw", "channels_last"):
                    x = torch.randn(batch, channels, height, width, device=device, dtype=dtype)
                    if layout == "channels_last":
                        x = x.contiguous(memory_format=torch.channels_last)
                    weight = torch.randn(channels, device=device) * 0.3 + 1
                    bias = torch.randn(channels, device=device) * 0.3
                    grad_y = torch.randn_like(x)
                    y, mean, rstd = ops.groupnorm_elu(x, weight, bias, groups, 1e-5)
                    fwd_ms = median_ms(lambda: ops.groupnorm_elu(x, weight, bias, groups, 1e-5), args)
                    bwd_ms = median_ms(lambda: ops.groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd), args)
                    # Stock: nn.GroupNorm then nn.ELU (fp32 affine, as autocast runs it).
                    xs = x.detach().requires_grad_(True)
                    ws, bs = weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)

                    def stock_forward():
                        return F.elu(F.group_norm(xs, groups, ws.to(dtype), bs.to(dtype), 1e-5))

                    stock_fwd_ms = median_ms(stock_forward, args)
                    ys = stock_forward()
                    stock_bwd_ms = median_ms(lambda: torch.autograd.grad(ys, (xs, ws, bs), grad_y, retain_graph=True), args)
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


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_block.py measures CUDA peak memory and CUDA-event times: it needs a CUDA GPU")
    import qca_lowmem
    from qca_lowmem import stock as reference

    if not qca_lowmem._loader.has_cuda_kernels():
        sys.exit("qca_lowmem was built without CUDA kernels; rebuild with QCA_LOWMEM_CUDA=1")
    device = torch.device("cuda")
    print(f"{common.device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    payload = {"config": {"grid": args.grid, "d_state": args.d_state, "hidden": args.hidden, "batches": args.batches,
                          "dtypes": args.dtypes, "modes": args.modes, "warmup": args.warmup, "iters": args.iters}}
    if not args.skip_model:
        payload["unet_step"] = bench_models(args, reference, qca_lowmem)
    if not args.skip_kernels:
        payload["kernels"] = bench_kernels(args)
    print(f"wrote {common.write_result('block', device, payload, args.out)}")


if __name__ == "__main__":
    main()
