"""`qca-lowmem bench`: stock vs lowmem episodes on the same model, in one process.

stock: the users' computation (plain ConvBlock layers, plain-torch step, full autograd graph);
lowmem: fused blocks and step ops under the configured rollout policy.

On the CPU the measure is `saved_bytes` of the episode's forward (what autograd keeps for
backward); on CUDA it is peak allocated memory and the episode's time.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import List, Optional

import torch

from .. import stock
from ..precision import autocast, parse_amp_dtype
from ..recompute import Policy, StepGraph, rollout
from ..recompute.memory import saved_bytes
from ..units import format_bytes
from .config import TrainConfig, build_model, channels_last_for, model_step
from .distributed import resolve_device


def library_commit(repo=None) -> Optional[str]:
    """$QCA_LOWMEM_COMMIT when set (a copied tree whose .git, if any, may be stale, as on a lent
    GPU machine), else the git commit of `repo` (default: the checkout qca_lowmem runs from),
    with "-dirty" when tracked files differ from it (then the commit is not what ran)."""
    if os.environ.get("QCA_LOWMEM_COMMIT"):
        return os.environ["QCA_LOWMEM_COMMIT"]
    cwd = repo or Path(__file__).resolve().parent
    head, changes = _git(cwd, "rev-parse", "HEAD"), _git(cwd, "status", "--porcelain", "--untracked-files=no")
    if not head:
        return None
    return head + ("-dirty" if changes else "")


def _git(cwd, *args) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device, repo=None) -> dict:
    """The facts every result file records: device, torch and CUDA versions, commit, date."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": library_commit(repo),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class EpisodeRunner:
    """One forward+backward of an episode of either kind on a shared model."""

    def __init__(self, config: TrainConfig, device: torch.device, model=None):
        self.config = config
        self.device = device
        self.amp_dtype = parse_amp_dtype(config.amp_dtype)
        channels_last = channels_last_for(config, device, self.amp_dtype)
        self.model = model if model is not None else build_model(config, device, channels_last)
        self.stock_model = stock.StockForward(self.model)
        # lowmem's step, as the trainer runs it: captured (once, reused) where cuda_graph resolves on
        self.lowmem_step = model_step(self.model, config, channels_last)
        if StepGraph.resolve(config.cuda_graph, config.policy(), device)[0]:
            self.lowmem_step = StepGraph(self.lowmem_step)

    def episode_loss(self, variant: str, steps: int, psi0):
        """The evolutionary loss of one episode from psi0, "stock" or "lowmem", with its graph."""
        gamma = self.config.gamma
        if variant == "stock":
            def step(psi):
                return stock.step(psi, self.stock_model, gamma, multiplicative=True)
            policy = Policy.plain()
        else:
            step = self.lowmem_step
            policy = self.config.policy()
        with autocast(self.device.type, self.amp_dtype):
            psi, history = rollout(step, psi0, steps, checkpoint=policy)  # history as stock records it (the default)
            loss, _ = stock.evolutionary_loss(history, psi0)
        return loss

    def run(self, variant: str, steps: int) -> dict:
        """Returns {'bytes': saved bytes (CPU) or peak allocated bytes (CUDA), 'seconds': ...}."""
        generator = torch.Generator().manual_seed(0)
        psi0 = stock.initial_state(self.config.batch, self.config.grid, self.config.d_state, self.device, generator)
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        if self.device.type == "cpu":
            out = {}
            memory = saved_bytes(lambda: out.update(loss=self.episode_loss(variant, steps, psi0)))
            out["loss"].backward()
        else:
            self.episode_loss(variant, steps, psi0).backward()
            torch.cuda.synchronize(self.device)
            memory = torch.cuda.max_memory_allocated(self.device)
        seconds = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)
        return {"bytes": int(memory), "seconds": seconds}


def bench(config: TrainConfig, steps_list: List[int], out_dir: str, repeats: int = 1, plot: bool = True) -> dict:
    device = resolve_device(config.device)
    runner = EpisodeRunner(config, device)
    measure = "peak_bytes" if device.type == "cuda" else "saved_bytes"
    rows = []
    warm = set()
    for steps in steps_list:
        row = {"qca_steps": steps}
        for variant in ("stock", "lowmem"):
            try:
                if variant not in warm or device.type == "cuda":
                    # Untimed: first calls (dispatch caches, allocator; cuDNN autotuning per shape on CUDA)
                    runner.run(variant, steps)
                    warm.add(variant)
                runs = [runner.run(variant, steps) for _ in range(max(1, repeats))]
                row[f"{variant}_bytes"] = max(r["bytes"] for r in runs)
                row[f"{variant}_bytes_per_step"] = _per_step(rows, variant, steps, row[f"{variant}_bytes"])
                row[f"{variant}_s"] = statistics.median(r["seconds"] for r in runs)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                row[f"{variant}_bytes"] = row[f"{variant}_bytes_per_step"] = row[f"{variant}_s"] = None
                row[f"{variant}_oom"] = True
        rows.append(row)
    result = {
        "kind": "bench",
        **environment(device),
        "measure": measure,
        "config": {"grid": config.grid, "d_state": config.d_state, "hidden": config.hidden, "batch": config.batch,
                   "gamma": config.gamma},
        "policy": {"checkpoint": config.checkpoint, "slots": config.slots, "amp_dtype": config.amp_dtype,
                   "fused_blocks": config.fused_blocks, "cuda_graph": config.cuda_graph},
        # lowmem's captures: how many were made, and whether one failed and ran eagerly
        "captures": ({"made": runner.lowmem_step.captures_made, "fell_back": bool(runner.lowmem_step.failed_keys)}
                     if isinstance(runner.lowmem_step, StepGraph) else None),
        "rows": rows,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if device.type == "cuda" else "cpu"
    json_path = out / f"bench_{tag}.json"
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    result["json_path"] = str(json_path)
    result["png_path"] = write_plot(result, out / f"bench_{tag}.png") if plot else None
    return result


def _per_step(rows: List[dict], variant: str, steps: int, total: int) -> float:
    """What one more step adds: the slope from the previous measured row (a first row: the
    average, which includes what does not grow with the steps)."""
    previous = next((r for r in reversed(rows) if r.get(f"{variant}_bytes") is not None), None)
    if previous is None:
        return total / steps
    return (total - previous[f"{variant}_bytes"]) / (steps - previous["qca_steps"])


def write_plot(result: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("qca-lowmem bench: matplotlib is not installed, so no plot was written "
              "(pip install matplotlib, or pip install 'qca-lowmem[plot]')")
        return None
    fig = plot_figure(result)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def plot_figure(result: dict):
    """Memory (log scale: lowmem's is a hundred times below stock's) and time per episode against
    qca_steps, stock and lowmem side by side; ticks at the step counts measured."""
    import matplotlib.pyplot as plt

    fig, (memory, time) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in ("stock", "lowmem"):
        rows = [r for r in result["rows"] if r.get(f"{variant}_bytes")]
        if rows:
            steps = [r["qca_steps"] for r in rows]
            memory.plot(steps, [r[f"{variant}_bytes"] / 2**20 for r in rows], marker="o", label=variant)
            time.plot(steps, [r[f"{variant}_s"] for r in rows], marker="o", label=variant)
    memory.set_yscale("log")
    memory.set_ylabel(("peak allocated" if result["measure"] == "peak_bytes" else "bytes saved for backward")
                      + " (MiB, log scale)")
    time.set_ylabel("episode time (s)")
    for ax in (memory, time):
        ax.set_xticks([r["qca_steps"] for r in result["rows"]])
        ax.set_xlabel("qca_steps")
        ax.legend()
        ax.grid(True, alpha=0.3)
    cfg = result["config"]
    fig.suptitle(f"grid {cfg['grid']}, d {cfg['d_state']}, hidden {cfg['hidden']} on {result['device']}")
    fig.tight_layout()
    return fig


def format_table(result: dict) -> str:
    what = "peak memory" if result["measure"] == "peak_bytes" else "saved bytes"
    # per step: what one more step adds (the slope from the row above; the first row's average)
    lines = [f"{'qca_steps':>9}  {'stock ' + what:>20}  {'lowmem ' + what:>20}  {'stock +step':>11}  "
             f"{'lowmem +step':>12}  {'ratio':>7}  {'stock s':>8}  {'lowmem s':>8}"]

    def fmt(value, f):
        return "OOM" if value is None else f(value)

    for r in result["rows"]:
        ratio = (r["stock_bytes"] / r["lowmem_bytes"]) if r.get("stock_bytes") and r.get("lowmem_bytes") else None
        lines.append(
            f"{r['qca_steps']:>9}  {fmt(r['stock_bytes'], format_bytes):>20}  {fmt(r['lowmem_bytes'], format_bytes):>20}  "
            f"{fmt(r['stock_bytes_per_step'], format_bytes):>11}  {fmt(r['lowmem_bytes_per_step'], format_bytes):>12}  "
            f"{fmt(ratio, lambda x: f'{x:.1f}x'):>7}  {fmt(r['stock_s'], lambda x: f'{x:.3f}'):>8}  "
            f"{fmt(r['lowmem_s'], lambda x: f'{x:.3f}'):>8}"
        )
    return "\n".join(lines)


def default_steps(config: TrainConfig) -> List[int]:
    top = config.qca_steps
    steps = sorted({max(1, top // 8), max(1, top // 4), max(1, top // 2), top})
    return steps


def main_bench(config: TrainConfig, steps: Optional[List[int]], out_dir: str, repeats: int) -> int:
    result = bench(config, steps or default_steps(config), out_dir, repeats)
    print(f"qca-lowmem bench on {result['device']} (torch {result['torch']}), grid {config.grid}, d {config.d_state}, "
          f"hidden {config.hidden}, batch {config.batch}; lowmem = {config.policy().describe()} "
          f"amp={config.amp_dtype or 'fp32'}")
    print(format_table(result))
    print(f"wrote {result['json_path']}" + (f" and {result['png_path']}" if result["png_path"] else ""))
    return 0

