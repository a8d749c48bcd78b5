"""What one QCA step keeps for backward, stock vs fused: `saved_bytes` (exact, on the CPU) of the
U-Net alone and of the whole step (pack, U-Net, update), for each of the fused U-Net's recompute
modes.

    python benchmarks/bench_step_memory.py                       # grid 32, d 14, hidden 16
    python benchmarks/bench_step_memory.py --grid 64 --hidden 128

Writes benchmarks/results/step_memory_cpu.json.
"""

import argparse

import torch

import common
import qca_lowmem
from qca_lowmem import stock as reference


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", type=int, default=32)
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--out", default=str(common.RESULTS / "step_memory_cpu.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    stock = reference.UNetUnitary(args.d_state, args.hidden)
    psi = reference.initial_state(1, args.grid, args.d_state).requires_grad_(True)
    x = reference.pack(psi.detach()).requires_grad_(True)
    rows = [{"variant": "stock", "unet_bytes": qca_lowmem.saved_bytes(stock, x),
             "step_bytes": qca_lowmem.saved_bytes(reference.step, psi, stock)}]
    for mode in ("unet", "blocks", "none"):
        fused = qca_lowmem.UNetUnitary(args.d_state, args.hidden, recompute=mode)
        fused.load_state_dict(stock.state_dict())
        step = qca_lowmem.ops.qca_step.fused_step(fused, 0.0, multiplicative=True)
        rows.append({"variant": f"fused recompute={mode}", "unet_bytes": qca_lowmem.saved_bytes(fused, x),
                     "step_bytes": qca_lowmem.saved_bytes(step, psi)})
    print(f"saved bytes of one QCA step, grid {args.grid}, d {args.d_state}, hidden {args.hidden}, B=1, fp32")
    print(f"{'variant':>24} {'U-Net':>12} {'less':>7} {'whole step':>12} {'less':>7}")
    for r in rows:
        r["unet_less"] = rows[0]["unet_bytes"] / r["unet_bytes"]
        r["step_less"] = rows[0]["step_bytes"] / r["step_bytes"]
        print(f"{r['variant']:>24} {r['unet_bytes']:>12,} {r['unet_less']:>6.1f}x {r['step_bytes']:>12,} {r['step_less']:>6.1f}x")
    config = {"grid": args.grid, "d_state": args.d_state, "hidden": args.hidden, "batch": 1, "dtype": "float32"}
    print(f"wrote {common.write_result('step_memory', torch.device('cpu'), {'config': config, 'rows': rows}, args.out)}")


if __name__ == "__main__":
    main()
