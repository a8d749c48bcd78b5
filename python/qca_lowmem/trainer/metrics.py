"""What the reference trainer reports: one record per episode to metrics.csv, TensorBoard (when
installed) and a progress bar, and messages on stderr. Only rank 0 reports."""

import csv
import sys
from pathlib import Path
from typing import List, Optional

from ..memory import format_bytes

METRICS_NAME = "metrics.csv"
METRIC_KEYS = ("survival", "symmetry", "complexity")


def memory_column(device) -> str:
    """The memory figure of a record: the CUDA peak on a GPU, the graph's saved bytes elsewhere."""
    return "peak_bytes" if device.type == "cuda" else "saved_bytes"


def record_of(row: List[float], device, policy: str) -> dict:
    """A record from an episode row [episode, loss, *METRIC_KEYS, memory, seconds]."""
    record = dict(zip(["episode", "loss", *METRIC_KEYS, memory_column(device), "seconds"], row))
    record["episode"] = int(record["episode"])
    record[memory_column(device)] = int(record[memory_column(device)])
    record["policy"] = policy
    return record


def message(text: str, rank: int = 0):
    if rank == 0:
        print(f"qca-lowmem: {text}", file=sys.stderr, flush=True)


class EpisodeLog:
    """metrics.csv (rows of episodes before `next_episode` kept, later ones dropped: a resumed run
    rewrites them), TensorBoard scalars and a tqdm bar; a no-op on ranks other than 0."""

    def __init__(self, out_dir: Path, device, next_episode: int, episodes: int, rank: int, progress: bool):
        self.column = memory_column(device)
        self.csv_file = self.writer = self.board = self.bar = None
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.csv_file, self.writer = self._open_csv(out_dir / METRICS_NAME, next_episode)
        self.board = _tensorboard_writer(out_dir / "tensorboard")
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=episodes, initial=next_episode, desc="qca-lowmem train", unit="episode",
                            dynamic_ncols=True)

    def _open_csv(self, path: Path, next_episode: int):
        header = ["episode", "loss", *METRIC_KEYS, self.column, "seconds", "policy"]
        kept = []
        if path.exists() and next_episode > 0:
            with open(path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["episode"]) < next_episode]
        f = open(path, "w", newline="")
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        for row in kept:
            writer.writerow({k: row.get(k, "") for k in header})
        return f, writer

    def write(self, record: dict):
        if self.writer is not None:
            self.writer.writerow(record)
            self.csv_file.flush()
        if self.board is not None:
            for key in ("loss", *METRIC_KEYS, self.column, "seconds"):
                self.board.add_scalar(key, record[key], record["episode"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(episode=record["episode"], loss=f"{record['loss']:.4f}",
                                 surv=f"{record['survival']:.3f}", sym=f"{record['symmetry']:.3f}",
                                 cplx=f"{record['complexity']:.3f}", mem=format_bytes(record[self.column]))

    def close(self):
        for resource in (self.bar, self.csv_file, self.board):
            if resource is not None:
                resource.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tensorboard_writer(path: Path) -> Optional[object]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))
