"""A run's output folder is never overwritten silently: a folder that holds a run is continued
(`--resume`) or, with `--overwrite`, its files are set aside in a subfolder first; a run given no
--out trains into the next free folder (free_run_folder)."""

import datetime
from pathlib import Path
from typing import Optional

from .checkpoint import CHECKPOINT_NAME, previous_path
from .errors import UsageError
from .metrics import METRICS_NAME

# What a run writes into its folder; these move aside together.
RUN_FILES = (CHECKPOINT_NAME, previous_path(CHECKPOINT_NAME).name, METRICS_NAME, "tensorboard", "ddp_check.json")
# What marks a folder as holding a run.
RUN_MARKS = (CHECKPOINT_NAME, METRICS_NAME)


def check_run_folder(out_dir, resume: Optional[str], overwrite: bool):
    """Refuse to start a new run over one in `out_dir` unless told which of the two to keep."""
    if resume and overwrite:
        raise UsageError("--resume continues the run in the folder and --overwrite starts a new one: give one of them")
    if overwrite:
        return
    out = Path(out_dir)
    held = [name for name in RUN_MARKS if (out / name).exists()]
    if resume and held and Path(resume).resolve().parent != out.resolve():
        # a resume rewrites the folder's metrics from the checkpoint's episode on: not another run's
        raise UsageError(f"--out {out} holds a run of its own ({', '.join(held)}), not the one --resume {resume} "
                         f"continues: give --out {Path(resume).parent} to continue it where it is, or --out "
                         f"{free_run_folder(out)} (which holds none) to continue it there")
    if held and not resume:
        raise UsageError(f"--out {out} holds a run ({', '.join(held)}): continue it with --resume, or start over "
                         f"with --overwrite (its files are kept in {out / 'replaced-<date>'}), or give another --out "
                         f"(--out {free_run_folder(out)} holds none)")


def holds_run(out_dir) -> bool:
    return any((Path(out_dir) / name).exists() for name in RUN_MARKS)


def free_run_folder(out_dir) -> str:
    """`out_dir` if it holds no run, else the first of `<out_dir>-2`, `<out_dir>-3`, ... that holds
    none (runs/qca, runs/qca-2, ...)."""
    folder, n = str(out_dir), 1
    while holds_run(folder):
        n += 1
        folder = f"{out_dir}-{n}"
    return folder


def set_aside(out_dir) -> Optional[Path]:
    """Move the run files in `out_dir` into a new `replaced-<date>` subfolder; returns it (None when
    there was nothing to move)."""
    out = Path(out_dir)
    present = [out / name for name in RUN_FILES if (out / name).exists()]
    if not present:
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside, n = out / f"replaced-{stamp}", 1
    while aside.exists():
        n += 1
        aside = out / f"replaced-{stamp}-{n}"
    aside.mkdir()
    for path in present:
        path.rename(aside / path.name)
    return aside
