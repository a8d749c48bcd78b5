"""The reference trainer's checkpoint: what it holds (model, optimizer, scheduler, scaler, RNG
states, policy, config, episode), written atomically, and read back with the checks that a
resumed run continues the same run."""

import dataclasses
import io
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import archive
from .errors import UsageError, error_text
from .metrics import METRICS_NAME
from .oom import RunPolicy

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT = "qca_lowmem.train/1"
# How a run is computed, not what it computes: a resume may change these. Every other setting
# (the model, the episodes, the optimiser, amp_dtype, batch) must be the checkpoint's.
RESUME_MAY_CHANGE = ("checkpoint", "slots", "budget", "fused_blocks", "channels_last", "cuda_graph", "device", "threads",
                     "out_dir", "save_every", "episodes", "max_skipped_steps")


def previous_path(path) -> Path:
    """Where atomic_save keeps the checkpoint it replaced: a fallback when the newest is damaged."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def _temporary_path(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.tmp-{pid}")


def atomic_save(obj, path, keep_previous: bool = False):
    """torch.save (with a digest, archive.py) to a temporary file in the same folder, fsync, then
    os.replace: a crash mid-save leaves the previous file intact. `keep_previous`: the file
    replaced stays as previous_path."""
    path = Path(path)
    data = archive.with_digest(obj)
    tmp = _temporary_path(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.is_file():
            # A hard link, renamed into place: both names are valid files at every moment.
            link = _temporary_path(previous_path(path), os.getpid())
            link.unlink(missing_ok=True)
            try:
                os.link(path, link)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(path, link)
            os.replace(link, previous_path(path))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def all_finite(tensors) -> bool:
    tensors = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def tensor_problem(state: dict) -> Optional[str]:
    """What makes a checkpoint's weights or optimizer state unusable: a non-finite value, or a
    tensor without data (meta device). None when there is nothing."""
    named = [(f"model tensor {name!r}", t) for name, t in state["model_state_dict"].items()]
    named += [(f"optimizer state {index}/{key}", t) for index, values in state["optimizer_state_dict"]["state"].items()
              for key, t in values.items()]
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.is_meta:
            return f"{name} has no data (meta device)"
        if not all_finite([tensor]):
            return f"{name} holds non-finite values"
    return None


def remove_stale_temporaries(folder: Path):
    """Temporary files of checkpoint and metrics.csv writes killed mid-way (their process is gone)."""
    checkpoint = folder / CHECKPOINT_NAME
    for name in (checkpoint, previous_path(checkpoint), folder / METRICS_NAME):
        for tmp in folder.glob(_temporary_path(name, 0).name[:-1] + "*"):
            pid = tmp.name.rsplit("-", 1)[1]
            if pid.isdigit() and not _process_alive(int(pid)):
                tmp.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (OverflowError: no pid is that large)
        return False
    except PermissionError:
        return True  # another user's process
    return True


def check_out_dir(out_dir, create: bool = True):
    """Refuse, before the first episode, an output folder the run could not write its files to;
    `create`: make it (else check that it could be made)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: a file is in the way (the run needs a folder there)")
    for name in (CHECKPOINT_NAME, METRICS_NAME):
        if (out / name).is_dir():
            raise UsageError(f"--out {out}: {out / name} is a folder; the run writes a file there")
    if not create:
        existing = next(p for p in (out, *out.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"--out {out}: cannot be created ({existing} is not a writable folder)")
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise UsageError(f"--out {out}: not writable ({error.strerror or error})") from None


def rng_state():
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # (is_available() is not asked: it may touch the driver)
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def state_of(trainer) -> dict:
    """What a checkpoint of `trainer` holds."""
    return {
        "format": FORMAT,
        "episode": trainer.next_episode,
        "model_state_dict": trainer.model.state_dict(),
        "optimizer_state_dict": trainer.optimizer.state_dict(),
        "scheduler_state_dict": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "scaler_state_dict": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "rng_state": rng_state(),
        "policy": trainer.policy.state_dict(),
        "config": dataclasses.asdict(trainer.config),
        "world_size": trainer.dist.world_size,
    }


def read_checkpoint(path) -> dict:
    """The checkpoint at `path`; a UsageError saying what is wrong with it, and whether the
    previous one can be used instead."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--resume {path}: is a folder, not a checkpoint file")
    if not path.exists():
        raise UsageError(f"--resume {path}: no checkpoint there")
    try:
        return _usable(path)
    except _Unusable as reason:
        raise UsageError(f"{reason}; {_fallback(path)}") from None


class _Unusable(Exception):
    """A checkpoint of this trainer that cannot be resumed; the previous one may be."""


REQUIRED_KEYS = ("episode", "model_state_dict", "optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict",
                 "rng_state", "policy", "config", "world_size")


def _usable(path: Path) -> dict:
    try:
        # On the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the device.
        state = torch.load(io.BytesIO(archive.verified(path.read_bytes())), map_location="cpu", weights_only=False)
    except archive.DamagedCheckpoint as error:
        raise _Unusable(f"checkpoint {path} is damaged: {error}") from None
    except Exception as error:  # torch.load raises whatever the damaged bytes lead its unpickler to
        raise _Unusable(f"checkpoint {path} is unreadable (truncated?): {error_text(error)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise UsageError(f"--resume {path}: not a qca-lowmem train checkpoint (format {found!r})")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise _Unusable(f"checkpoint {path} is damaged: it lacks {', '.join(missing)}")
    problem = tensor_problem(state)
    if problem is not None:
        raise _Unusable(f"checkpoint {path} cannot be resumed: its {problem} (the run had diverged)")
    return state


def _fallback(path: Path) -> str:
    previous = previous_path(path)
    if previous == path or not previous.is_file():
        return "no older checkpoint exists"
    try:
        episode = _usable(previous)["episode"]
    except (_Unusable, UsageError):
        return f"the older {previous} is unusable too"
    return f"the older {previous} (episode {episode}) is readable: --resume {previous}"


def check_resumable(state: dict, path, config, episodes_per_step: int):
    """Refuse (UsageError) a resume under settings that change what the run computes."""
    saved = state["config"]
    fixed = [f.name for f in dataclasses.fields(config) if f.name not in RESUME_MAY_CHANGE + ("accumulate",)]
    changed = [f"{name} (checkpoint {saved.get(name)!r}, now {getattr(config, name)!r})"
               for name in fixed if saved.get(name) != getattr(config, name)]
    saved_per_step = state["world_size"] * saved["accumulate"]
    if saved_per_step != episodes_per_step:
        changed.append(f"episodes per optimizer step, accumulate x processes (checkpoint {saved_per_step}, "
                       f"now {episodes_per_step})")
    if saved["scheduler"] == "cosine" and saved["episodes"] != config.episodes:
        changed.append(f"episodes, which sets the cosine schedule (checkpoint {saved['episodes']}, "
                       f"now {config.episodes})")
    if changed:
        raise UsageError(f"--resume {path}: a resume cannot change {'; '.join(changed)}: they change what the "
                         f"run computes (start a new run in another --out); it can change "
                         f"{', '.join(RESUME_MAY_CHANGE)}")


def restore(trainer, path, state: Optional[dict] = None) -> int:
    """Load the checkpoint at `path` into `trainer` after checking it is of the same run. A
    policy set anew (checkpoint, slots) replaces the checkpoint's (which the OOM guard may have
    lowered); the batch stays the checkpoint's. `state`: the checkpoint already read. Returns the
    next episode."""
    state = state if state is not None else read_checkpoint(path)
    saved, config = state["config"], trainer.config
    check_resumable(state, path, config, trainer.episodes_per_step())
    trainer.model.load_state_dict(state["model_state_dict"])
    trainer.optimizer.load_state_dict(state["optimizer_state_dict"])
    if trainer.scheduler is not None and state["scheduler_state_dict"] is not None:
        trainer.scheduler.load_state_dict(state["scheduler_state_dict"])
    if trainer.scaler is not None and state["scaler_state_dict"] is not None:
        trainer.scaler.load_state_dict(state["scaler_state_dict"])
    set_rng_state(state["rng_state"])
    policy = RunPolicy.from_state_dict(state["policy"])
    if (config.checkpoint, config.slots, config.budget) != (saved["checkpoint"], saved["slots"], saved.get("budget")):
        policy = RunPolicy(config.policy(), policy.batch)
    trainer.policy = policy
    trainer.next_episode = trainer.saved_episode = state["episode"]
    return trainer.next_episode
