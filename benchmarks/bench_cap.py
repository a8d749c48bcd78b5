"""100 training episodes of configs/default.yaml under a 3.68 GiB cap (the users' GPU).

    python benchmarks/bench_cap.py [--config configs/default.yaml] [--cap 3.68GiB] [--episodes 100]

Caps this process with torch.cuda.set_per_process_memory_fraction, runs the reference trainer
(qca_lowmem.trainer.train) and writes benchmarks/results/cap_<device>.json:
{"kind": "cap", "cap_bytes", "episodes", "oom", "peak_bytes", "losses", "device", "commit", "date", ...}
plus the metrics of every episode, the stock quality bars (survival < 1.0, symmetry < 0.5) and
`qca-lowmem plan`'s prediction of the peak for the config's policy against the measured one.
"""

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from qca_lowmem.trainer.allocator import expandable_in_environment  # noqa: E402
from qca_lowmem.trainer.bench import environment  # noqa: E402
from qca_lowmem.trainer.config import load_config  # noqa: E402
from qca_lowmem.trainer.oom import OutOfMemoryStop  # noqa: E402
from qca_lowmem.trainer.plan import plan  # noqa: E402
from qca_lowmem.trainer.train import Trainer  # noqa: E402
from qca_lowmem.units import parse_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def plan_of(config, cap):
    """`qca-lowmem plan`'s estimate for the config's own policy on a GPU of `cap` bytes."""
    try:
        estimates = plan(config, gpu_mem=cap, reserve=0, expandable=expandable_in_environment())["estimates"]
        return next(e for e in estimates if e.from_config).as_dict()
    except Exception as error:  # the run goes on; the result says why there is no prediction
        return {"error": f"{type(error).__name__}: {error}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--cap", default="3.68GiB")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--amp-dtype", default=None, help="override the config's amp_dtype (fp32, bf16, fp16)")
    parser.add_argument("--grid", type=int, default=None, help="override the config's grid")
    parser.add_argument("--checkpoint", default=None, help="override the config's checkpoint policy (step, revolve)")
    parser.add_argument("--slots", type=int, default=None, help="revolve slots")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="override the config's cuda_graph (steps as captured CUDA graphs)")
    parser.add_argument("--name", default=None, help="result file stem (default cap_<device>)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cap.py needs a CUDA GPU")

    device = torch.device("cuda", torch.cuda.current_device())  # an index: set_per_process_memory_fraction needs one
    cap = parse_bytes(args.cap)
    total = torch.cuda.get_device_properties(device).total_memory
    if cap > total:
        sys.exit(f"cap {args.cap} is larger than this GPU ({total} bytes)")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)

    run_dir = tempfile.mkdtemp(prefix="qca_cap_")
    config = load_config(args.config, episodes=args.episodes, device="cuda", out_dir=run_dir, save_every=0,
                         amp_dtype=args.amp_dtype, grid=args.grid, checkpoint=args.checkpoint, slots=args.slots,
                         cuda_graph=args.cuda_graph)
    predicted = plan_of(config, cap)
    records, oom, message = [], False, None
    trainer = Trainer(config, progress=True)
    configured = trainer.policy_label()
    try:
        # A time limit (SIGTERM) still leaves a result file with the episodes done so far.
        signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
        trainer.fit(callback=records.append)
    except (OutOfMemoryStop, torch.OutOfMemoryError) as error:
        oom, message = True, str(error)
    except KeyboardInterrupt:
        message = f"interrupted after {len(records)} episodes"
    peak = max([r["peak_bytes"] for r in records], default=0)
    # The guard may have lowered the policy; an OOM that it absorbed still counts as one.
    lowered = any(r["policy"] != configured for r in records)

    last = records[-10:]
    survival = sum(r["survival"] for r in last) / max(1, len(last))
    symmetry = sum(r["symmetry"] for r in last) / max(1, len(last))
    env = environment(device, repo=ROOT)
    result = {
        "kind": "cap",
        "cap_bytes": cap,
        "episodes": len(records),
        "oom": oom or lowered,
        "peak_bytes": peak,
        "last_episode_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "plan": predicted,
        # plan predicts the reserved peak (target: within 10%); the allocated one is beside it.
        "plan_over_reserved": predicted["peak_bytes"] / torch.cuda.max_memory_reserved(device)
        if predicted.get("peak_bytes") else None,
        "plan_over_measured": predicted["peak_bytes"] / peak if predicted.get("peak_bytes") and peak else None,
        "losses": [r["loss"] for r in records],
        "device": env["device"],
        "commit": env["commit"],
        "date": env["date"],
        "torch": env["torch"],
        "cuda": env["cuda"],
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k not in ("out_dir", "device")},
        "policy_at_end": records[-1]["policy"] if records else None,
        "metrics": [{k: r[k] for k in ("survival", "symmetry", "complexity", "seconds")} for r in records],
        "quality": {"survival_last10_mean": survival, "symmetry_last10_mean": symmetry,
                    "survival_below_1": survival < 1.0, "symmetry_below_0_5": symmetry < 0.5},
        "error": message,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "_", env["device"]).strip("_").lower()
    path = out / f"{args.name or 'cap_' + name}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{len(records)} episodes, oom={result['oom']}, peak {peak / 2**30:.3f} GiB of a {cap / 2**30:.2f} GiB cap; "
          f"last-10 survival {survival:.3f}, symmetry {symmetry:.3f}; wrote {path}")
    return 1 if result["oom"] else 0


if __name__ == "__main__":
    sys.exit(main())
