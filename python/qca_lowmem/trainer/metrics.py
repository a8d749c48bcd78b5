"""What the reference trainer reports: one record per episode to metrics.csv, TensorBoard (when
installed) and a progress bar, and notes that the bar stays below. Only rank 0 reports."""

import codecs
import csv
import io
import os
import sys
from pathlib import Path
from typing import List, Optional

from .errors import TrainingStopped, UsageError
from .say import PREFIX, message

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


def duration_text(seconds: float) -> str:
    """3 ms, 2.5 s, 4 min 10 s, 2 h 05 min."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60)} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


class EpisodeLog:
    """metrics.csv (rows of episodes before `next_episode` kept, later ones dropped: a resumed run
    rewrites them), TensorBoard scalars and a tqdm bar; a no-op on ranks other than 0."""

    def __init__(self, out_dir: Path, device, next_episode: int, episodes: int, rank: int, progress: bool):
        self.column = memory_column(device)
        self.csv_file = self.writer = self.board = self.bar = None
        self.board_tried = False
        self.rows_written = 0
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / METRICS_NAME
        self.created = not self.path.exists()  # a new run's file: removed again if no episode finishes
        self.csv_file, self.writer = self._open_csv(self.path, next_episode)
        self.board_dir = out_dir / "tensorboard"
        if progress:
            from tqdm import tqdm

            # Redrawn at every episode, however fast: an episode is the unit a user waits for.
            self.bar = tqdm(total=episodes, initial=next_episode, desc="qca-lowmem train", unit="episode",
                            dynamic_ncols=True, mininterval=0, miniters=1)

    def _open_csv(self, path: Path, next_episode: int):
        """The file rewritten atomically with the rows to keep (a kill mid-way leaves the old file
        whole), then opened to append. A file edited by hand keeps its comment lines, byte order
        mark, delimiter and extra columns."""
        ours = ["episode", "loss", *METRIC_KEYS, self.column, "seconds", "policy"]
        table = _MetricsFile.read(path, next_episode) if path.exists() else _MetricsFile(ours)
        fields = table.fields + [name for name in ours if name not in table.fields]
        try:
            _replace_atomically(path, table.text(fields), table.encoding)
            f = open(path, "a", newline="", encoding=table.encoding.replace("-sig", ""))
        except OSError as error:
            raise _write_failed(path, error) from None
        return f, csv.DictWriter(f, fieldnames=fields, delimiter=table.delimiter, lineterminator=table.newline,
                                 restval="")

    def write(self, record: dict):
        """One finished episode: a row of metrics.csv, its TensorBoard scalars, a step of the bar."""
        if self.writer is None:
            return
        try:
            self.writer.writerow(record)
            self.csv_file.flush()
        except OSError as error:
            raise _write_failed(self.path, error) from None
        self.rows_written += 1
        if not self.board_tried:  # made at the first episode, so that a run stopped before it leaves no file
            self.board_tried = True
            self.board = _tensorboard_writer(self.board_dir)
            if self.board is None:
                self.note(f"no TensorBoard logs in {self.board_dir}: {TENSORBOARD_MISSING}")
        if self.board is not None:
            for key in ("loss", *METRIC_KEYS, self.column, "seconds"):
                self.board.add_scalar(f"episode/{key}", record[key], record["episode"])
            self.board.flush()
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {record['loss']:.4f}", refresh=False)
            self.bar.update(1)

    def note(self, text: str):
        """A message on stderr that the bar, when there is one, stays below."""
        if self.bar is not None:
            self.bar.write(f"{PREFIX}{text}", file=sys.stderr)
        elif self.writer is not None:
            message(text)

    def close(self):
        for resource in (self.bar, self.csv_file, self.board):
            if resource is not None:
                resource.close()
        if self.writer is not None and self.created and self.rows_written == 0:
            self.path.unlink(missing_ok=True)  # a new run stopped before its first episode: nothing to resume

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


TENSORBOARD_MISSING = "tensorboard is not installed (pip install tensorboard)"


def _tensorboard_writer(path: Path) -> Optional[object]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


def check_metrics_file(out_dir: Path, next_episode: int) -> None:
    """Refuse, before a resumed run's first episode, a metrics.csv it could not keep rows of (its
    reasons are _MetricsFile.read's)."""
    path = Path(out_dir) / METRICS_NAME
    if path.exists():
        _MetricsFile.read(path, next_episode)


class _MetricsFile:
    """The lines of a metrics.csv to keep: its header, comment lines and rows of episodes before
    the resumed one, verbatim."""

    def __init__(self, fields: List[str], delimiter: str = ",", encoding: str = "utf-8", lines=(), newline="\r\n"):
        self.fields, self.delimiter, self.encoding, self.lines = fields, delimiter, encoding, list(lines)
        self.newline = newline

    @classmethod
    def read(cls, path: Path, next_episode: int) -> "_MetricsFile":
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8-sig")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"{path}: cannot be read ({error}); move it away to start it anew") from None
        encoding = "utf-8-sig" if raw.startswith(codecs.BOM_UTF8) else "utf-8"
        lines = text.splitlines(keepends=True)
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip() and not line.startswith("#")]
        if not numbered:
            return cls([], encoding=encoding, lines=[line for line in lines if line.startswith("#")])
        header_number, header = numbered[0]
        try:
            delimiter = csv.Sniffer().sniff(header, delimiters=",;\t").delimiter
        except csv.Error:
            delimiter = ","
        fields = next(csv.reader([header], delimiter=delimiter))
        if "episode" not in fields:
            raise UsageError(f"{path}: its header (line {header_number}) has no 'episode' column, which says "
                             f"which rows a resume keeps; restore it, or move the file away")
        column = fields.index("episode")
        kept = []
        for number, line in enumerate(lines, 1):
            if number <= header_number or not line.strip() or line.startswith("#"):
                kept.append(line)
                continue
            values = next(csv.reader([line], delimiter=delimiter))
            try:
                episode = int(values[column])
            except (IndexError, ValueError):
                raise UsageError(f"{path}: line {number} has no integer episode ({line.strip()[:60]!r}); "
                                 f"fix or delete that line, or move the file away") from None
            if episode < next_episode:
                kept.append(line)
        newline = header[len(header.rstrip("\r\n")):] or "\r\n"
        kept = [line if line.endswith(("\n", "\r")) else line + newline for line in kept]
        return cls(fields, delimiter, encoding, kept, newline)

    def text(self, fields: List[str]) -> str:
        """The kept lines, the header line replaced by one with `fields`."""
        buffer = io.StringIO()
        csv.writer(buffer, delimiter=self.delimiter, lineterminator=self.newline).writerow(fields)
        header = buffer.getvalue()
        lines, replaced = [], False
        for line in self.lines:
            if not replaced and line.strip() and not line.startswith("#"):
                line, replaced = header, True
            lines.append(line)
        return "".join(lines if replaced else lines + [header])


def _replace_atomically(path: Path, text: str, encoding: str):
    """`text` into `path` through a temporary file in the same folder, fsync, then os.replace."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", newline="", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_failed(path: Path, error: OSError) -> TrainingStopped:
    return TrainingStopped(f"cannot write {path}: {error.strerror or error}; the last checkpoint is untouched: "
                           f"free space there (or use another --out), then --resume")
