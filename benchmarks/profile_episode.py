"""Where an episode's time goes: torch.profiler over one short episode, top ops and kernels.

    python benchmarks/profile_episode.py                          # default config on CUDA, else CPU
    python benchmarks/profile_episode.py --device cpu --grid 32 --hidden 16 --d-state 4 --steps 48
    python benchmarks/profile_episode.py --variant stock --amp-dtype bf16

One warm-up episode, then one profiled episode (forward, backward) of the chosen variant. Prints
the top entries by self time on the device (kernels on CUDA, ops on the CPU), the share of the
wall time they cover, and the host time per step outside them (Python and dispatch), and writes
the table to benchmarks/results/profile_<variant>_<device>.json.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import common
import qca_lowmem
from qca_lowmem import stock as reference

AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grid", type=int, default=64)
    p.add_argument("--d-state", type=int, default=14)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variant", choices=["stock", "lowmem", "lowmem_graph"], default="lowmem")
    p.add_argument("--amp-dtype", choices=sorted(AMP), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    stock = reference.UNetUnitary(args.d_state, args.hidden).to(device)
    dtype = AMP[args.amp_dtype]
    if args.variant == "stock":
        model = stock

        def step(psi):
            return reference.step(psi, model)

        policy = "none"
    else:
        model = qca_lowmem.UNetUnitary(args.d_state, args.hidden).to(device)
        model.load_state_dict(stock.state_dict())

        def step(psi):
            return qca_lowmem.qca_update(psi, model(qca_lowmem.qca_pack(psi, dtype)), 0.0)

        if args.variant == "lowmem_graph":
            step = qca_lowmem.StepGraph(step)
        policy = "step"
    schedule = qca_lowmem.NoiseSchedule(0.05, 1000, seed=0)

    def episode():
        psi0 = reference.initial_state(args.batch, args.grid, args.d_state, device, torch.Generator().manual_seed(1))
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=False):
            _, history = qca_lowmem.rollout(step, psi0, args.steps, checkpoint=policy, noise=schedule)
            loss, _ = reference.evolutionary_loss(history, psi0)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    episode()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        episode()
    wall = time.perf_counter() - start  # with the profiler's own overhead
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    # On CUDA a kernel's time is reported twice: on the kernel's own event and as the device time
    # of the CPU op that launched it. Only the kernels (device-side events) are counted.
    events = [e for e in prof.key_averages() if getattr(e, key) > 0
              and (device.type != "cuda" or e.device_type == torch.autograd.DeviceType.CUDA)]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) / 1e6
    rows = [{"name": e.key, "calls": e.count, "self_s": getattr(e, key) / 1e6} for e in events[: args.top]]
    print(f"{args.variant} {args.amp_dtype} on {common.device_name(device)}: {args.steps} steps, grid {args.grid}, "
          f"B={args.batch}; wall {wall:.3f} s (profiled), device-busy {total:.3f} s")
    for r in rows:
        print(f"{r['self_s'] * 1e3:9.2f} ms {r['calls']:7d}  {r['name'][:100]}")
    common.write_result(f"profile_{args.variant}_{args.amp_dtype}", device, {
        "config": vars(args), "wall_s": wall, "busy_s": total, "top": rows, "threads": torch.get_num_threads(),
    }, args.out)


if __name__ == "__main__":
    main()
