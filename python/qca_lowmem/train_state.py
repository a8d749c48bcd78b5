"""The reference trainer's checkpoint: what it holds (model, optimizer, scheduler, scaler, RNG
states, policy, config, episode), written atomically, and read back with the checks that a
resumed run continues the same run."""

import dataclasses
import os
import random
from pathlib import Path

import torch

from .oom import Policy

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT = "qca_lowmem.train/1"
# Settings that define the run: a checkpoint resumes only under the same ones.
SAME_RUN_SETTINGS = ("d_state", "hidden", "grid", "qca_steps", "seed", "gamma", "max_noise", "scheduler")


def atomic_save(obj, path):
    """torch.save to a temporary file in the same folder, then os.replace: a crash mid-save
    leaves the previous file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
        "policy": dataclasses.asdict(trainer.policy),
        "config": dataclasses.asdict(trainer.config),
        "world_size": trainer.dist.world_size,
    }


def restore(trainer, path, warn) -> int:
    """Load the checkpoint at `path` into `trainer` after checking it is of the same run; `warn`
    reports a continuation that will differ (another number of episodes per optimizer step).
    Returns the next episode."""
    # On the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the device.
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a qca-lowmem train checkpoint (format {state.get('format')!r})")
    saved, config = state["config"], trainer.config
    for name in SAME_RUN_SETTINGS:
        if saved[name] != getattr(config, name):
            raise ValueError(f"--resume {path}: the checkpoint has {name}={saved[name]!r} but this run has "
                             f"{name}={getattr(config, name)!r}; resuming would not continue the same run")
    if state["world_size"] * saved["accumulate"] != trainer.episodes_per_step():
        warn(f"warning: the checkpoint ran {state['world_size'] * saved['accumulate']} episodes per optimizer "
             f"step, this run {trainer.episodes_per_step()}; the continuation differs from the original run")
    trainer.model.load_state_dict(state["model_state_dict"])
    trainer.optimizer.load_state_dict(state["optimizer_state_dict"])
    if trainer.scheduler is not None and state["scheduler_state_dict"] is not None:
        trainer.scheduler.load_state_dict(state["scheduler_state_dict"])
    if trainer.scaler is not None and state["scaler_state_dict"] is not None:
        trainer.scaler.load_state_dict(state["scaler_state_dict"])
    set_rng_state(state["rng_state"])
    trainer.policy = Policy(**state["policy"])
    trainer.next_episode = state["episode"]
    return trainer.next_episode
