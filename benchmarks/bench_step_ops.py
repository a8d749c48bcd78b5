"""Ops per step of the step recompute on the CPU, by kind (adds, fills, copies, cats), from torch's
profiler.

The episode is bench_episode's lowmem_fp32_step (qca_lowmem.UNetUnitary with fused blocks, fused
pack and update, rollout with checkpoint="step", the evolutionary loss, backward) without noise
(its bit flip comes at one step in five: a step's count would depend on the step) and with a
history of psi_0 and psi_T only. Episodes of N, 2N and 3N steps are profiled after a warm-up; a
step's count is the difference of two episodes' over N (its forward, its recompute and its
backward; what an episode does once cancels), and `linear_in_steps` says the two differences
agree, so the counts are exact. The profiler counts deterministically on the CPU.

Per kind, two counts: `ops`, every event of each op's name (the ones inside another op
included, such as the zero_ and fill_ of torch's CPU convolutions or the zero_ inside a zeros),
and `issued`, the kind's ops that no other op runs (but composites that only dispatch one, such
as `to` and `contiguous`): those issued by Python, autograd and the library's Functions, as a GPU
step launches them (the ops inside torch's CPU kernels differ by backend). Both layouts: NCHW and
channels_last (the weights and the pack NHWC); each in float32 and under bfloat16 autocast
(`_bf16`: the weights' half-precision copies, whose gradients go to their float32 accumulators).

    python benchmarks/bench_step_ops.py     # the embedded `qca-lowmem train` config, ~10 s

Writes benchmarks/results/step_ops_cpu.json.
"""

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import common
import qca_lowmem
from bench_episode import lowmem_step_fn
from qca_lowmem import stock as reference

KINDS = {
    "adds": ("aten::add", "aten::add_", "aten::_foreach_add", "aten::_foreach_add_", "qca_lowmem::accumulate_"),
    "fills": ("aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::zero_", "aten::fill_", "aten::full",
              "aten::full_like", "aten::_foreach_zero_"),
    "copies": ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::_foreach_copy_"),
    "cats": ("aten::cat", "aten::stack"),
}
OP_NAMESPACES = ("aten::", "qca_lowmem::")
# Composite ops that only dispatch another (a copy or nothing): an op under them is still issued.
DISPATCHING = ("aten::to", "aten::contiguous", "aten::reshape", "aten::type_as")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--grid", type=int, default=32)
    p.add_argument("--d-state", type=int, default=4)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="N: episodes of N, 2N and 3N steps are profiled")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(common.RESULTS / "step_ops_cpu.json"))
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


def is_op(event) -> bool:
    return event.name.startswith(OP_NAMESPACES)


def issued(event) -> bool:
    """No op runs this one (but those that only dispatch it): Python, autograd or a Function
    issued it."""
    if event.name in DISPATCHING:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if is_op(parent) and parent.name not in DISPATCHING:
            return False
        parent = parent.cpu_parent
    return True


def episode_counts(episode) -> collections.Counter:
    """Counts of one profiled episode(): ("ops", name) for every op event, ("issued", name) for
    those no other op runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        episode()
    counts = collections.Counter()
    for event in prof.events():
        if is_op(event):
            counts["ops", event.name] += 1
            counts["issued", event.name] += issued(event)
    return counts


def by_kind(per_step: dict, which: str) -> dict:
    kinds = {kind: sum(per_step.get((which, name), 0) for name in names) for kind, names in KINDS.items()}
    kinds["total"] = sum(count for (key, _), count in per_step.items() if key == which)
    return kinds


def step_counts(grid, d_state, hidden, steps, channels_last=False, wrap_step=None, autocast_dtype=None) -> dict:
    """A step's op counts of the step recompute (module docstring): {"ops": {kind: n}, "issued":
    {kind: n}, "ops_by_name" and "issued_by_name": {name: n} (the kinds' names), "linear_in_steps": bool}.
    `wrap_step(step) -> step`, where given, changes the step (the tests add an op); `autocast_dtype`,
    where given, runs the rollout under autocast (the weights' half-precision copies and their
    gradients' accumulation)."""
    torch.manual_seed(0)
    model = qca_lowmem.UNetUnitary(d_state, hidden)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    step = lowmem_step_fn(model, 0.0, autocast_dtype, channels_last=channels_last)
    step = wrap_step(step) if wrap_step else step

    def episode(n):
        psi0 = reference.initial_state(1, grid, d_state, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            _, history = qca_lowmem.rollout(step, psi0, n, checkpoint="step", record_every=n)
        loss, _ = reference.evolutionary_loss(history, psi0)
        loss.backward()
        model.zero_grad(set_to_none=True)

    episode(steps)  # warm-up: first calls set things up once
    counts = [episode_counts(lambda n=n: episode(n)) for n in (steps, 2 * steps, 3 * steps)]
    keys = set().union(*counts)
    first = {key: counts[1][key] - counts[0][key] for key in keys}
    second = {key: counts[2][key] - counts[1][key] for key in keys}
    per_step = {key: n // steps if n % steps == 0 else n / steps for key, n in first.items() if n}
    kind_names = {name for names in KINDS.values() for name in names}
    return {"ops": by_kind(per_step, "ops"), "issued": by_kind(per_step, "issued"),
            **{f"{which}_by_name": {name: per_step[key, name] for key, name in sorted(per_step)
                                    if key == which and name in kind_names} for which in ("ops", "issued")},
            "linear_in_steps": first == second}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    layouts = {}
    for precision, autocast_dtype in (("", None), ("_bf16", torch.bfloat16)):
        for layout, channels_last in (("nchw", False), ("channels_last", True)):
            counts = layouts[layout + precision] = step_counts(args.grid, args.d_state, args.hidden, args.steps,
                                                               channels_last, autocast_dtype=autocast_dtype)
            print(f"{layout + precision}: a step's ops, issued {counts['issued']} ({counts['issued_by_name']}); "
                  f"all {counts['ops']} ({counts['ops_by_name']}); linear in steps: {counts['linear_in_steps']}")
    payload = {"config": {"grid": args.grid, "d_state": args.d_state, "hidden": args.hidden, "batch": 1,
                          "checkpoint": "step", "episodes_steps": [args.steps, 2 * args.steps, 3 * args.steps]},
               "threads": torch.get_num_threads(), "kinds": {kind: list(names) for kind, names in KINDS.items()},
               "per_step": layouts}
    print(f"wrote {common.write_result('step_ops', device, payload, args.out)}")
    return 0 if all(counts["linear_in_steps"] for counts in layouts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
