"""What a user sees while `qca-lowmem train` runs: the device and the time per step up front, a
progress bar that moves, TensorBoard scalars, and a stop before the first episode that leaves
nothing behind."""

import csv
import fcntl
import os
import select
import struct
import subprocess
import sys
import termios

import pytest
import torch

from helpers import TINY, write_config
from qca_lowmem.trainer import cli
from qca_lowmem.trainer import train as train_mod
from qca_lowmem.trainer.checkpoint import CHECKPOINT_NAME
from qca_lowmem.trainer.metrics import METRICS_NAME
from qca_lowmem.trainer.say import message

pytestmark = pytest.mark.usefixtures("one_thread")

THREE = {**TINY, "training": {**TINY["training"], "episodes": 3, "qca_steps": 3}, "output": {"save_every": 0}}


def in_a_terminal(*args, columns=120, timeout=240) -> str:
    """The command's output as a terminal of `columns` columns receives it."""
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "qca_lowmem", *map(str, args)], stdin=secondary, stdout=secondary,
                            stderr=secondary, close_fds=True, env=env)
    os.close(secondary)
    out = b""
    while select.select([primary], [], [], timeout)[0]:
        try:
            data = os.read(primary, 4096)
        except OSError:  # the terminal closed: the process is gone
            break
        if not data:
            break
        out += data
    os.close(primary)
    assert proc.wait(timeout=timeout) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


@pytest.mark.slow
def test_the_bar_moves_with_rate_eta_and_loss_below_the_device_and_time_lines(tmp_path):
    config = write_config(tmp_path / "three.yaml", THREE)
    screen = in_a_terminal("train", "--config", config, "--out", tmp_path / "run")
    frames = screen.replace("\r\n", "\n").replace("\r", "\n").splitlines()
    assert frames[0] == "qca-lowmem: training episodes 0-2 of 3 steps on cpu"
    bars = [f for f in frames if f.startswith("qca-lowmem train:") and "|" in f]
    for done in (1, 2, 3):  # each episode advances it, with its rate, time left and loss
        frame = next(f for f in bars if f" {done}/3 [" in f)
        assert "episode" in frame and "<" in frame and "loss " in frame, frame
    timing = next(f for f in frames if f.startswith("qca-lowmem: first episode"))
    assert " a step, warm-up included); about " in timing and "for the 2 episodes left" in timing


def test_tensorboard_gets_every_episodes_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is installed by scripts/test.sh")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert cli.main(["train", "--config", write_config(tmp_path / "three.yaml", THREE), "--out", str(out),
                     "--no-progress"]) == 0
    with open(out / METRICS_NAME) as f:
        rows = list(csv.DictReader(f))
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in ("loss", "survival", "symmetry", "complexity", "saved_bytes", "seconds"):
        scalars = events.Scalars(f"episode/{key}")
        assert [s.step for s in scalars] == [0, 1, 2], key
        assert [s.value for s in scalars] == pytest.approx([float(r[key]) for r in rows], rel=1e-6), key


def test_a_stop_before_the_first_episode_leaves_nothing_and_the_command_runs_again(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path / "three.yaml", THREE)
    out = tmp_path / "run"
    command = ["train", "--config", config, "--out", str(out), "--no-progress"]
    original = train_mod.Trainer.forward_episode

    def interrupted(self, episode, policy):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod.Trainer, "forward_episode", interrupted)
    assert cli.main(command) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "qca-lowmem train: interrupted at episode 0; no episode finished, nothing saved"
    assert not (out / CHECKPOINT_NAME).exists() and not (out / METRICS_NAME).exists()
    assert not (out / "tensorboard").exists()
    monkeypatch.setattr(train_mod.Trainer, "forward_episode", original)
    assert cli.main(command) == 0
    assert torch.load(out / CHECKPOINT_NAME, weights_only=False)["episode"] == 3


def test_the_first_lines_say_where_and_how_long(tmp_path, capsys):
    config = write_config(tmp_path / "three.yaml", {**THREE, "device": "auto"})
    assert cli.main(["train", "--config", config, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    first, timing = capsys.readouterr().err.splitlines()[:2]
    device = "cuda" if torch.cuda.is_available() else "cpu (no CUDA GPU visible)"
    assert first.startswith(f"qca-lowmem: training episodes 0-2 of 3 steps on {device}")
    assert timing.startswith("qca-lowmem: first episode ") and timing.endswith("for the 2 episodes left")


def test_a_line_is_said_once_by_rank_0_and_by_no_other(capsys):
    message("training episodes 0-2", rank=0)
    message("training episodes 0-2", rank=1)
    assert capsys.readouterr() == ("", "qca-lowmem: training episodes 0-2\n")
