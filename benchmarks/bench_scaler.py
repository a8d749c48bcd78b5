"""Loss-scaler unscale + gradient clipping on the default UNetUnitary's gradients.

ours:  qca_lowmem.amp.GradScaler.unscale_ (unscale, non-finite check and sums of squares in one
       pass) + GradScaler.clip_grad_norm_ (reuses those sums; the clip multiply is skipped when
       the clip factor is 1)
torch: torch.amp.GradScaler.unscale_ + torch.nn.utils.clip_grad_norm_

Both run on the same scaled gradients, restored before every repetition (outside the timed
region). Two clip regimes: "clipping" (max_norm below the gradient norm) and "no_clip". The
achieved bandwidth counts the bytes each method must move (ours: unscale read + write, plus
read + write when clipping; torch: unscale read + write, norm read, clip read + write) against
a measured device-to-device copy. Targets on a GPU: >= 1.5x faster than torch, >= 70% of copy
bandwidth.

    python benchmarks/bench_scaler.py                     # CUDA when available, else CPU
    python benchmarks/bench_scaler.py --grad-dtype bfloat16 --reps 50
"""

import argparse

import torch

import common
import qca_lowmem
from qca_lowmem.amp import GradScaler

SCALE = 2.0**16


def build_model(d_state, hidden, device):
    return qca_lowmem.UNetUnitary(d_state, hidden).to(device)


def scaled_gradients(model, grid, d_state, grad_dtype, device):
    """Real gradients of one forward/backward, multiplied by the loss scale; parameters and
    gradients are then cast to `grad_dtype`."""
    x = torch.randn(1, 2 * d_state, grid, grid, device=device)
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        p.grad.mul_(SCALE)
    model.to(grad_dtype)
    return [p.grad.clone() for p in model.parameters()]


def run(device, d_state, hidden, grid, grad_dtype, warmup, reps):
    torch.manual_seed(0)
    model = build_model(d_state, hidden, device)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    saved = scaled_gradients(model, grid, d_state, grad_dtype, device)
    grads = [p.grad for p in params]
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    opt = torch.optim.SGD(params, lr=0.0)
    ours, theirs = GradScaler(device.type, init_scale=SCALE), torch.amp.GradScaler(device.type, init_scale=SCALE)
    total_norm = None

    def restore(scaler):
        def fn():
            torch._foreach_copy_(grads, saved)
            scaler.scale(torch.ones((), device=device))
            scaler.update(SCALE)  # also forgets the previous unscale_
        return fn

    def ours_step(max_norm):
        def fn():
            nonlocal total_norm
            ours.unscale_(opt)
            total_norm = ours.clip_grad_norm_(params, max_norm, reuse_unscale_norm=True)
        return fn

    def torch_step(max_norm):
        def fn():
            nonlocal total_norm
            theirs.unscale_(opt)
            total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return fn

    # the gradient norm decides the regimes
    restore(theirs)()
    torch_step(float("inf"))()
    norm = float(total_norm)

    copy_bw = common.copy_bandwidth(device)
    rows = []
    for regime, max_norm in (("clipping", norm / 4), ("no_clip", norm * 4)):
        clip_passes = 2 if regime == "clipping" else 0
        ours_bytes = grad_bytes * (2 + clip_passes)
        torch_bytes = grad_bytes * 5
        ours_s = common.median_seconds(ours_step(max_norm), device, warmup, reps, setup=restore(ours))
        ours_norm = float(total_norm)
        torch_s = common.median_seconds(torch_step(max_norm), device, warmup, reps, setup=restore(theirs))
        torch_norm = float(total_norm)
        rows.append(
            {
                "regime": regime,
                "max_norm": max_norm,
                "ours_s": ours_s,
                "torch_s": torch_s,
                "speedup": torch_s / ours_s,
                "ours_bytes": ours_bytes,
                "torch_bytes": torch_bytes,
                "ours_bandwidth_Bps": ours_bytes / ours_s,
                "torch_bandwidth_Bps": torch_bytes / torch_s,
                "ours_fraction_of_copy": ours_bytes / ours_s / copy_bw,
                "torch_fraction_of_copy": torch_bytes / torch_s / copy_bw,
                "ours_total_norm": ours_norm,
                "torch_total_norm": torch_norm,
            }
        )
    # the kernel alone (unscale, check and sums of squares), without the scaler's Python
    found_inf = torch.zeros((), device=device)
    inv_scale = torch.full((), 1.0 / SCALE, device=device)
    kernel_s = common.median_seconds(
        lambda: torch.ops.qca_lowmem.amp_unscale_(grads, found_inf, inv_scale, True),
        device,
        warmup,
        reps,
        setup=lambda: torch._foreach_copy_(grads, saved),
    )
    rows.append(
        {
            "regime": "kernel_only",
            "ours_s": kernel_s,
            "ours_bytes": 2 * grad_bytes,
            "ours_bandwidth_Bps": 2 * grad_bytes / kernel_s,
            "ours_fraction_of_copy": 2 * grad_bytes / kernel_s / copy_bw,
        }
    )
    config = {
        "d_state": d_state,
        "hidden_channels": hidden,
        "grid": grid,
        "parameters": n_params,
        "tensors": len(params),
        "grad_dtype": str(grad_dtype).replace("torch.", ""),
        "grad_bytes": grad_bytes,
        "reps": reps,
    }
    return copy_bw, config, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=128, help="hidden channels (128: 27.9M parameters)")
    parser.add_argument("--grid", type=int, default=16, help="grid of the one forward that makes the gradients")
    parser.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="result file (default benchmarks/results/scaler_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    grad_dtype = getattr(torch, args.grad_dtype)

    copy_bw, config, rows = run(device, args.d_state, args.hidden, args.grid, grad_dtype, args.warmup, args.reps)
    print(
        f"device: {common.device_name(device)}   copy bandwidth: {copy_bw / 1e9:.1f} GB/s   "
        f"{config['parameters'] / 1e6:.2f}M parameters in {config['tensors']} tensors ({config['grad_dtype']})"
    )
    print(f"{'regime':>9} {'torch ms':>9} {'ours ms':>8} {'speedup':>8} {'ours GB/s':>10} {'of copy':>8} {'norm rel diff':>14}")
    for r in rows:
        if "torch_s" not in r:  # the kernel alone
            print(f"{'kernel':>9} {'':>9} {r['ours_s'] * 1e3:>8.3f} {'':>8} "
                  f"{r['ours_bandwidth_Bps'] / 1e9:>10.1f} {r['ours_fraction_of_copy']:>7.0%}")
            continue
        rel = abs(r["ours_total_norm"] - r["torch_total_norm"]) / r["torch_total_norm"]
        print(
            f"{r['regime']:>9} {r['torch_s'] * 1e3:>9.3f} {r['ours_s'] * 1e3:>8.3f} {r['speedup']:>7.2f}x "
            f"{r['ours_bandwidth_Bps'] / 1e9:>10.1f} {r['ours_fraction_of_copy']:>7.0%} {rel:>14.2e}"
        )
    path = common.write_result("scaler", device, {"config": config, "copy_bandwidth_Bps": copy_bw, "runs": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
