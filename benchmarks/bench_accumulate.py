"""A step's parameter-gradient accumulation on the default UNetUnitary's parameters: the float32
accumulators of the 42 parameters get one step's gradients, the 3x3 convolution weights' in half
precision (their autocast copies' gradients, as the rollout deposits them) and the rest in float32.

ours:              qca_lowmem's accumulate_, one pass over the list (one launch on CUDA)
torch_per_tensor:  `add_` a parameter (the half ones read in the add's kernel): the capture's
                   backward before accumulate_
torch_foreach:     `torch._foreach_add_` over the list (mixed dtypes take its per-tensor path)

Candidates are timed in turn within each repetition (`common.interleaved_medians`; on CUDA each in a
captured graph of `--calls` calls); the accumulators are reset between candidates' results only for
the check that all three give the same bits, which runs first. Bandwidth counts the bytes each moves
(accumulators read and written, gradients read) against a `copy_` of the same bytes.

    python benchmarks/bench_accumulate.py                       # CUDA when available, else CPU
    python benchmarks/bench_accumulate.py --half-dtype float16 --reps 50
"""

import argparse

import torch

import common
import qca_lowmem
from qca_lowmem.ops.scaler import accumulate_


def pairs(d_state, hidden, half_dtype, device):
    """(accumulators, gradients) of the default model's parameters: float32 accumulators, the 3x3
    convolution weights' gradients in `half_dtype`, the others' in float32."""
    generator = torch.Generator().manual_seed(0)
    model = qca_lowmem.UNetUnitary(d_state, hidden)
    accumulators, grads = [], []
    for p in model.parameters():
        accumulators.append(torch.randn(p.shape, generator=generator).to(device))
        dtype = half_dtype if p.dim() == 4 and p.shape[2:] == (3, 3) else torch.float32
        grads.append(torch.randn(p.shape, generator=generator).mul_(1e-3).to(device, dtype))
    return accumulators, grads


def candidates(accumulators, grads):
    same_dtype = [(a, g) for a, g in zip(accumulators, grads) if a.dtype == g.dtype]
    mixed = [(a, g) for a, g in zip(accumulators, grads) if a.dtype != g.dtype]

    def per_tensor():
        for a, g in mixed:
            a.add_(g)
        torch._foreach_add_([a for a, _ in same_dtype], [g for _, g in same_dtype])

    return {"ours": lambda: accumulate_(accumulators, grads), "torch_per_tensor": per_tensor,
            "torch_foreach": lambda: torch._foreach_add_(accumulators, grads)}


def run(device, d_state, hidden, half_dtype, warmup, reps, calls):
    accumulators, grads = pairs(d_state, hidden, half_dtype, device)
    start = [a.clone() for a in accumulators]
    results = {}
    for name, fn in candidates(accumulators, grads).items():
        for a, s in zip(accumulators, start):
            a.copy_(s)
        fn()
        results[name] = [a.clone() for a in accumulators]
    same_bits = all(torch.equal(x, y) for name in results for x, y in zip(results[name], results["ours"]))
    nbytes = sum(2 * a.numel() * a.element_size() + g.numel() * g.element_size() for a, g in zip(accumulators, grads))
    timed = dict(candidates(accumulators, grads), copy=common.copy_of(nbytes, device))
    seconds = common.interleaved_medians(timed, device, warmup, reps, calls)
    rows = [{"candidate": name, "seconds": s, "vs_torch_per_tensor": s / seconds["torch_per_tensor"],
             "bandwidth_Bps": nbytes / s, "fraction_of_copy": seconds["copy"] / s} for name, s in seconds.items()]
    config = {"d_state": d_state, "hidden_channels": hidden, "tensors": len(accumulators),
              "reals": sum(a.numel() for a in accumulators), "half_dtype": str(half_dtype).replace("torch.", ""),
              "half_tensors": sum(g.dtype == half_dtype for g in grads), "bytes": nbytes, "reps": reps,
              "calls": calls}
    return config, same_bits, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--d-state", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=128, help="hidden channels (128: 27.9M parameters)")
    parser.add_argument("--half-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10, help="calls a timed CUDA graph replays (CUDA only)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--out", help="result file (default benchmarks/results/accumulate_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    calls = args.calls if device.type == "cuda" else 1
    config, same_bits, rows = run(device, args.d_state, args.hidden, getattr(torch, args.half_dtype), args.warmup,
                                  args.reps, calls)
    print(f"device: {common.device_name(device)}   {config['reals'] / 1e6:.2f}M reals in {config['tensors']} "
          f"tensors ({config['half_tensors']} {config['half_dtype']})   same bits: {same_bits}")
    print(f"{'candidate':>17} {'ms':>8} {'vs torch_per_tensor':>20} {'GB/s':>7} {'of copy':>8}")
    for r in rows:
        print(f"{r['candidate']:>17} {r['seconds'] * 1e3:>8.3f} {r['vs_torch_per_tensor']:>20.2f} "
              f"{r['bandwidth_Bps'] / 1e9:>7.1f} {r['fraction_of_copy']:>7.0%}")
    payload = {"config": config, "threads": torch.get_num_threads(), "same_bits": same_bits, "runs": rows}
    print(f"wrote {common.write_result('accumulate', device, payload, args.out)}")
    return 0 if same_bits else 1


if __name__ == "__main__":
    raise SystemExit(main())
