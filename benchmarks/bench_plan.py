"""Checks `qca-lowmem plan` against the GPU: predicted vs measured peak for every policy.

    python benchmarks/bench_plan.py [--config configs/default.yaml] [--qca-steps N]

For each policy plan lists, runs one training episode (forward, backward, AdamW step) of the
reference trainer on CUDA, measures torch.cuda.max_memory_reserved (what must fit the GPU, what
plan predicts; target: within 10%) and max_memory_allocated, and writes
benchmarks/results/plan_<device>.json with predicted and measured bytes and both ratios. plan is
told whether the allocator runs with expandable_segments (PYTORCH_CUDA_ALLOC_CONF), as here.
The stock row runs the users' forward with full autograd when it fits.
"""

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

from qca_lowmem import stock
from qca_lowmem.trainer.allocator import expandable_in_environment
from qca_lowmem.trainer.bench import EpisodeRunner, environment
from qca_lowmem.trainer.config import load_config
from qca_lowmem.trainer.plan import plan
from qca_lowmem.trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def measure_policy(config, estimate):
    """(peak allocated, peak reserved) bytes of one training episode under the estimate's policy."""
    torch.cuda.empty_cache()
    if estimate.policy is None:  # the users' stock trainer
        runner = EpisodeRunner(config, torch.device("cuda"))
        optimizer = torch.optim.AdamW(runner.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        # Optimizer state exists from the second step on; measure a step once it does.
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats()
            loss = runner.episode_loss("stock", config.qca_steps, _psi0(config))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    policy_config = dataclasses.replace(config, **estimate.policy.options(), amp_dtype=estimate.amp_dtype, episodes=2,
                                        save_every=0)
    trainer = Trainer(policy_config, progress=False)
    peaks = []
    for episode in range(2):
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(episode, 1)
        peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    return peaks[-1]


def _psi0(config):
    generator = torch.Generator().manual_seed(0)
    return stock.initial_state(config.batch, config.grid, config.d_state, torch.device("cuda"), generator)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--qca-steps", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_plan.py needs a CUDA GPU")
    out_dir = Path(args.out)
    config = load_config(args.config, device="cuda", qca_steps=args.qca_steps, out_dir=str(out_dir / "plan_run"))
    total = torch.cuda.get_device_properties(0).total_memory
    expandable = expandable_in_environment()
    predicted = plan(config, gpu_mem=total, reserve=0, expandable=expandable)
    rows = []
    for estimate in predicted["estimates"]:
        row = {"policy": estimate.name, "predicted_bytes": estimate.peak_bytes,
               **{k: v for k, v in estimate.as_dict().items() if k.endswith("_bytes") and k != "peak_bytes"}}
        if estimate.peak_bytes > 0.9 * total:
            row["measured_bytes"] = None
            row["skipped"] = "predicted peak exceeds this GPU"
        else:
            try:
                row["measured_bytes"], row["measured_reserved_bytes"] = measure_policy(config, estimate)
                row["predicted_over_measured"] = estimate.peak_bytes / row["measured_bytes"]
                row["predicted_over_reserved"] = estimate.peak_bytes / row["measured_reserved_bytes"]
                row["within_10_percent_of_reserved"] = abs(row["predicted_over_reserved"] - 1.0) <= 0.10
            except torch.OutOfMemoryError:
                row["measured_bytes"] = None
                row["skipped"] = "out of memory"
        rows.append(row)
        print(f"{row['policy']:<26} predicted reserved {row['predicted_bytes'] / 2**20:10.1f} MiB  "
              + (f"measured reserved {row['measured_reserved_bytes'] / 2**20:10.1f} MiB (ratio "
                 f"{row['predicted_over_reserved']:.3f}), allocated {row['measured_bytes'] / 2**20:10.1f} MiB "
                 f"(ratio {row['predicted_over_measured']:.3f})"
                 if row.get("measured_bytes") else row["skipped"]), flush=True)
    env = environment(torch.device("cuda"), repo=ROOT)
    result = {"kind": "plan", **env, "expandable_segments": expandable,
              "config": {k: getattr(config, k) for k in ("grid", "d_state", "hidden", "qca_steps", "batch")},
              "parameters": predicted["parameters"], "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "_", env["device"]).strip("_").lower()
    path = out_dir / f"plan_{name}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
