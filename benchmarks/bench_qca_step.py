"""The fused pack and update kernels, forward and backward, against the torch expressions they
replace and against a `copy_` of the same bytes.

Each op is timed on its own (interleaved with its torch expression and the copy, medians): pack
vs `stock.pack` (torch.cat), pack backward vs the one-copy torch expression of the same
contiguous complex gradient, update vs `stock.update`, update backward vs autograd through
`stock.update` (its retained graph, backward only). Bandwidth counts the bytes an op must move,
each input read once and each output written once (fp32 x / delta): pack and pack backward 16
bytes per complex component, update 24, update backward 40. On the CPU every shape is measured
at one thread and at all threads in the same run. Target: >= 60% of the copy's bandwidth and
faster than torch.

    python benchmarks/bench_qca_step.py                 # CUDA when available, else CPU
    python benchmarks/bench_qca_step.py --device cpu --batches 1 8 --threads 1

Writes benchmarks/results/qca_step_<device>.json (qca_step_cpu.json on the CPU) and, with
matplotlib, a PNG of bandwidth against the copy line next to it.
"""

import argparse
import os
from pathlib import Path

import torch

import common
import qca_lowmem
from qca_lowmem import stock as reference

_lib = torch.ops.qca_lowmem
BYTES_PER_COMPONENT = {"pack": 16, "pack_backward": 16, "update": 24, "update_backward": 40}


def candidates(psi, gamma):
    """{op: (fused fn, torch fn)} on one state."""
    b, h, w, d = psi.shape
    x = qca_lowmem.qca_pack(psi)
    grad_x = torch.randn_like(x)
    grad_out = torch.randn_like(psi)
    leaf_psi, leaf_delta = psi.clone().requires_grad_(), x.clone().requires_grad_()
    stock_out = reference.update(leaf_psi, leaf_delta, gamma, True)
    return {
        "pack": (lambda: qca_lowmem.qca_pack(psi), lambda: reference.pack(psi)),
        "pack_backward": (
            lambda: _lib.qca_pack_backward(grad_x, psi.dtype),
            lambda: torch.view_as_complex(grad_x.view(b, 2, d, h, w).permute(0, 3, 4, 2, 1).contiguous()),
        ),
        "update": (lambda: qca_lowmem.qca_update(psi, x, gamma, True), lambda: reference.update(psi, x, gamma, True)),
        "update_backward": (
            lambda: _lib.qca_update_backward(grad_out, psi, x, gamma, True, 1e-9),
            lambda: torch.autograd.grad(stock_out, (leaf_psi, leaf_delta), grad_out, retain_graph=True),
        ),
    }


def run(device, batches, thread_counts, grid, d_state, gamma, reps):
    rows = []
    for threads in thread_counts:
        if threads:
            torch.set_num_threads(threads)
        for batch in batches:
            psi = reference.initial_state(batch, grid, d_state, device=device)
            for op, (fused, stock) in candidates(psi, gamma).items():
                moved = psi.numel() * BYTES_PER_COMPONENT[op]
                t = common.interleaved_medians({"fused": fused, "torch": stock, "copy": common.copy_of(moved, device)},
                                               device, reps=reps)
                rows.append({
                    "threads": torch.get_num_threads() if device.type == "cpu" else None,
                    "batch": batch, "op": op, "bytes_moved": moved,
                    **{f"{k}_s": v for k, v in t.items()},
                    **{f"{k}_bandwidth_Bps": moved / v for k, v in t.items()},
                    "fused_fraction_of_copy": t["copy"] / t["fused"],
                    "speedup_vs_torch": t["torch"] / t["fused"],
                })
    return rows


def write_plot(rows, device_label, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    panels = sorted({(r["threads"] or 0, r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (threads, batch) in zip(axes[0], panels):
        sub = [r for r in rows if (r["threads"] or 0) == threads and r["batch"] == batch]
        xs = range(len(sub))
        ax.bar([i - 0.2 for i in xs], [r["fused_bandwidth_Bps"] / 1e9 for r in sub], 0.4, label="fused")
        ax.bar([i + 0.2 for i in xs], [r["torch_bandwidth_Bps"] / 1e9 for r in sub], 0.4, label="torch")
        for i, r in zip(xs, sub):
            copy = r["copy_bandwidth_Bps"] / 1e9
            ax.hlines(copy, i - 0.45, i + 0.45, colors="k", label="copy_ (same bytes)" if i == 0 else None)
            ax.hlines(0.6 * copy, i - 0.45, i + 0.45, colors="k", linestyles=":", label="60% of copy_" if i == 0 else None)
        ax.set_xticks(list(xs), [r["op"].replace("_", "\n") for r in sub], fontsize=8)
        ax.set_title(f"B={batch}" + (f", {threads} thread(s)" if threads else ""), fontsize=9)
        ax.set_ylabel("GB/s (bytes moved / time)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"QCA pack / update kernels, {device_label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="CPU thread counts (default: 1 and all cores)")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--gamma", type=float, default=0.01)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="result file (default benchmarks/results/qca_step_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        thread_counts = args.threads or sorted({1, os.cpu_count()})
        out = args.out or str(common.RESULTS / "qca_step_cpu.json")
    else:
        thread_counts, out = [None], args.out

    rows = run(device, args.batches, thread_counts, args.grid, args.d_state, args.gamma, args.reps)
    label = common.device_name(device)
    print(f"device: {label}; medians of {args.reps} interleaved runs")
    print(f"{'threads':>7} {'batch':>5} {'op':>16} {'fused ms':>9} {'torch ms':>9} {'copy ms':>8} "
          f"{'vs torch':>8} {'fused GB/s':>10} {'of copy':>7}")
    for r in rows:
        print(f"{r['threads'] or '-':>7} {r['batch']:>5} {r['op']:>16} {r['fused_s'] * 1e3:>9.3f} {r['torch_s'] * 1e3:>9.3f} "
              f"{r['copy_s'] * 1e3:>8.3f} {r['speedup_vs_torch']:>7.2f}x {r['fused_bandwidth_Bps'] / 1e9:>10.1f} "
              f"{r['fused_fraction_of_copy']:>7.0%}")
    config = {"grid": args.grid, "d_state": args.d_state, "gamma": args.gamma, "reps": args.reps}
    path = common.write_result("qca_step", device, {"config": config, "runs": rows}, out)
    png = write_plot(rows, label, Path(path).with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
