"""Fused pack + update (forward and backward) against the stock step's ops.

The operator is the identity (delta = x), so one iteration runs pack, update and both backwards
and nothing else. Achieved bandwidth counts the bytes that must move: each input read once and
each output written once (96 bytes per complex component for fp32 delta), against a measured
device-to-device copy. Target on a GPU: >= 60% of copy bandwidth at B=64.

    python benchmarks/bench_qca_step.py                 # CUDA when available, else CPU
    python benchmarks/bench_qca_step.py --device cpu --batches 1 8
"""

import argparse

import torch

import common
import qca_lowmem
from qca_lowmem import stock as reference

BYTES_PER_COMPONENT = {
    "pack": 8 + 8,  # psi in, x out
    "update": 8 + 8 + 8,  # psi and delta in, psi' out
    "update_backward": 8 + 8 + 8 + 8 + 8,  # grad_out, psi, delta in; grad_psi, grad_delta out
    "pack_backward": 8 + 8,  # grad_x in, grad_psi out
}


def fused_iteration(psi, upstream, gamma):
    x = qca_lowmem.qca_pack(psi)
    out = qca_lowmem.qca_update(psi, x, gamma, True)
    out.backward(upstream)


def stock_iteration(psi, upstream, gamma):
    x = reference.pack(psi)
    out = reference.update(psi, x, gamma, True)
    out.backward(upstream)


def run(device, batches, grid, d_state, gamma, reps):
    copy_bw = common.copy_bandwidth(device)
    rows = []
    for batch in batches:
        psi = reference.initial_state(batch, grid, d_state, device=device).requires_grad_()
        upstream = torch.randn_like(psi)
        components = psi.numel()
        moved = components * sum(BYTES_PER_COMPONENT.values())
        row = {"batch": batch, "bytes_moved": moved}
        for name, fn in (("stock", stock_iteration), ("fused", fused_iteration)):
            seconds = common.median_seconds(lambda: fn(psi, upstream, gamma), device, reps=reps)
            row[f"{name}_s"] = seconds
            row[f"{name}_bandwidth_Bps"] = moved / seconds
            psi.grad = None
        row["speedup"] = row["stock_s"] / row["fused_s"]
        row["fused_fraction_of_copy"] = row["fused_bandwidth_Bps"] / copy_bw
        rows.append(row)
    return copy_bw, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--gamma", type=float, default=0.01)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="result file (default benchmarks/results/qca_step_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    copy_bw, rows = run(device, args.batches, args.grid, args.d_state, args.gamma, args.reps)
    print(f"device: {common.device_name(device)}   copy bandwidth: {copy_bw / 1e9:.1f} GB/s")
    print(f"{'batch':>5} {'stock ms':>9} {'fused ms':>9} {'speedup':>8} {'fused GB/s':>11} {'of copy':>8}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['stock_s'] * 1e3:>9.3f} {r['fused_s'] * 1e3:>9.3f} {r['speedup']:>7.2f}x "
            f"{r['fused_bandwidth_Bps'] / 1e9:>11.1f} {r['fused_fraction_of_copy']:>7.0%}"
        )
    config = {"grid": args.grid, "d_state": args.d_state, "gamma": args.gamma}
    path = common.write_result("qca_step", device, {"config": config, "copy_bandwidth_Bps": copy_bw, "runs": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
