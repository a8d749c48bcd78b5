"""What `qca-lowmem train` refuses before the first episode (the device, the output folder and
whether it holds another run, the checkpoint to resume from), and where the run will run."""

from pathlib import Path
from typing import Optional

import torch

from .. import precision
from ..precision import parse_amp_dtype
from . import checkpoint, oom
from .config import TrainConfig, parameter_count
from .distributed import resolve_device
from .errors import UsageError
from .metrics import check_metrics_file
from .run_folder import check_run_folder, set_aside
from .runlock import FolderLock
from .say import message


def check_run(config: TrainConfig, resume: Optional[str] = None, create: bool = True, rank: int = 0,
              world_size: int = 1, lock: Optional[FolderLock] = None, overwrite: bool = False):
    """Everything that can be refused before the first episode (UsageError, or OutOfMemoryStop for
    a config far over this machine's memory), on every rank: the device, the output folder (made,
    `lock` acquired and stale temporaries removed when `create`, by rank 0; else only whether
    another run holds it) and whether it holds a run that neither `resume` nor `overwrite` names,
    the checkpoint to resume from and whether it is of the same run. Then, with `overwrite` and
    `create`, rank 0 sets the old run's files aside. Returns the checkpoint's state, or None."""
    try:
        device = resolve_device(config.device)
    except RuntimeError as error:
        raise UsageError(f"--device {config.device}: {error}") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {config.device}: only {torch.cuda.device_count()} CUDA devices are visible")
    try:
        config.policy().check_device(device, "--budget")
        precision.refuse_fp16_on_cpu(parse_amp_dtype(config.amp_dtype), device, "amp_dtype fp16",
                                     "--amp-dtype bf16 (the CPU's half precision) or fp32")
    except ValueError as error:
        raise UsageError(str(error)) from None
    checkpoint.check_out_dir(config.out_dir, create and rank == 0)
    if rank == 0:
        if create:
            if lock is not None:
                lock.acquire()  # before touching any file there
            checkpoint.remove_stale_temporaries(Path(config.out_dir))
        elif Path(config.out_dir).is_dir():
            probe = FolderLock(config.out_dir)
            probe.acquire()
            probe.release()
    check_run_folder(config.out_dir, resume, overwrite)
    state = checkpoint.read_checkpoint(resume) if resume else None
    parameters = parameter_count(config)
    if state is not None:
        checkpoint.check_resumable(state, resume, config, config.accumulate * world_size)
        if rank == 0:
            check_metrics_file(Path(config.out_dir), state["episode"])
    elif device.type == "cpu":  # (a resumed run has fit already)
        oom.check_cpu_memory(config, parameters)
    aside = set_aside(config.out_dir) if overwrite and create and rank == 0 else None
    if aside is not None:
        message(f"--overwrite: the previous run's files are now in {aside}")
    return state



def device_note(config: TrainConfig) -> str:
    """Where the run will run, said when the config does not pin it."""
    device = resolve_device(config.device)
    return f"on {device}" + (" (no CUDA GPU visible)" if config.device == "auto" and device.type == "cpu" else "")
