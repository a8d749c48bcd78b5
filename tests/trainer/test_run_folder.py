"""A run is never overwritten silently: `train` on a folder that holds one needs --resume or
--overwrite (which keeps the old files aside), on every DDP rank; scripts/run.sh a second time
trains into a new folder (train picks it)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from qca_lowmem.trainer import cli
from qca_lowmem.trainer.config import load_config
from qca_lowmem.trainer.errors import UsageError
from qca_lowmem.trainer.run_checks import check_run

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"model": {"d_state": 2, "hidden": 8}, "training": {"grid": 8, "qca_steps": 3, "episodes": 2, "seed": 1},
        "output": {"save_every": 1}, "device": "cpu"}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def train(config, out, *flags):
    return cli.main(["train", "--config", str(config), "--out", str(out), "--no-progress", *map(str, flags)])


def snapshot(folder: Path):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_a_folder_that_holds_a_run_is_refused_without_resume_or_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(tiny, out) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert train(tiny, out, "--episodes", 1) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"--out {out} holds a run (checkpoint.pt, metrics.csv)" in err and "--resume" in err and "--overwrite" in err
    assert snapshot(out) == before  # nothing written
    assert cli.main(["train", "--config", str(tiny), "--out", str(out), "--check"]) == 2
    (out / "checkpoint.pt").unlink()
    assert train(tiny, out) == 2  # metrics.csv alone is a run too (one killed before its first save)


def test_a_checkpoint_resumed_without_out_continues_in_its_own_folder(tmp_path, capsys):
    """The config's folder holds another, finished run: a resume of a checkpoint kept elsewhere
    continues that run where it is and leaves the config's run as it was."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "output": {"save_every": 1, "out_dir": str(tmp_path / "qca")}}))
    assert cli.main(["train", "--config", str(config), "--no-progress"]) == 0
    finished = snapshot(tmp_path / "qca")
    other = tmp_path / "x"
    assert train(config, other, "--stop-after", 1) == 0
    capsys.readouterr()
    assert cli.main(["train", "--config", str(config), "--no-progress", "--resume", str(other / "checkpoint.pt"),
                     "--episodes", "3"]) == 0
    err, out = capsys.readouterr()[::-1]
    assert f"continuing the run in {other}" in err and f"metrics in {other / 'metrics.csv'}" in out
    assert snapshot(tmp_path / "qca") == finished
    assert len((other / "metrics.csv").read_text().splitlines()) == 1 + 3


def test_a_resume_into_a_folder_holding_another_run_is_refused(tiny, tmp_path, capsys):
    held, other = tmp_path / "held", tmp_path / "x"
    assert train(tiny, held) == 0 and train(tiny, other, "--stop-after", 1) == 0
    before = snapshot(held)
    capsys.readouterr()
    assert train(tiny, held, "--resume", other / "checkpoint.pt") == 2
    err = capsys.readouterr().err
    assert f"--out {held} holds a run of its own" in err and f"--out {other} to continue it where it is" in err
    assert snapshot(held) == before
    assert train(tiny, held, "--resume") == 0  # its own checkpoint: continued


def test_overwrite_keeps_the_old_files_aside(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(tiny, out) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert train(tiny, out, "--overwrite", "--episodes", 1) == 0
    err = capsys.readouterr().err
    (aside,) = out.glob("replaced-*")
    assert f"--overwrite: the previous run's files are now in {aside}" in err
    assert snapshot(aside) == before
    assert (aside / "checkpoint.prev.pt").exists() and (aside / "tensorboard").is_dir() == (out / "tensorboard").is_dir()
    assert len((out / "metrics.csv").read_text().splitlines()) == 2  # the header and the new run's one episode
    assert train(tiny, out, "--overwrite") == 0
    assert len(list(out.glob("replaced-*"))) == 2  # a second overwrite keeps both
    assert train(tiny, out, "--overwrite", "--resume") == 2
    assert "give one of them" in capsys.readouterr().err


def test_every_ddp_rank_checks_the_output_folder(tiny, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    config = load_config(str(tiny), out_dir=str(blocked))
    with pytest.raises(UsageError, match="a file is in the way"):
        check_run(config, rank=1, world_size=2)
    held = tmp_path / "held"
    held.mkdir()
    (held / "metrics.csv").write_text("episode\n")
    with pytest.raises(UsageError, match="holds a run"):
        check_run(load_config(str(tiny), out_dir=str(held)), rank=1, world_size=2)


def test_train_without_out_takes_the_next_free_folder(tiny, tmp_path, monkeypatch, capsys):
    """runs/qca, runs/qca-2, ... as run.sh's users meet them; an --out names its folder; a run that
    holds its folder is left as it was."""
    monkeypatch.chdir(tmp_path)
    for _ in range(3):
        assert cli.main(["train", "--config", str(tiny), "--no-progress", "--episodes", "1"]) == 0
    before = snapshot(tmp_path / "runs" / "qca")
    capsys.readouterr()
    assert cli.main(["train", "--config", str(tiny), "--no-progress", "--episodes", "1"]) == 0
    assert "runs/qca holds a run (--resume continues it): training into runs/qca-4" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["qca", "qca-2", "qca-3", "qca-4"]
    assert snapshot(tmp_path / "runs" / "qca") == before
    assert all((tmp_path / "runs" / name / "checkpoint.pt").exists() for name in ("qca-2", "qca-3", "qca-4"))
    assert train(tiny, "mine", "--episodes", 1) == 0 and (tmp_path / "mine" / "checkpoint.pt").exists()
    # --resume continues the run in runs/qca, not a new folder's
    assert cli.main(["train", "--config", str(tiny), "--no-progress", "--resume"]) == 0
    assert len((tmp_path / "runs" / "qca" / "metrics.csv").read_text().splitlines()) == 3
    assert not (tmp_path / "runs" / "qca-5").exists()


def test_a_refusal_names_a_free_folder(tiny, tmp_path):
    """Under torchrun (where every rank would pick a folder of its own) or with a config's folder:
    the refusal says which --out holds no run."""
    for name in ("held", "held-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text("episode\n")
    with pytest.raises(UsageError, match=rf"--out {tmp_path / 'held'} holds a run .*\(--out {tmp_path / 'held'}-3 holds none\)"):
        check_run(load_config(str(tiny), out_dir=str(tmp_path / "held")), rank=1, world_size=2)


@pytest.mark.slow
def test_run_sh_installs_what_the_readme_promises_and_lets_train_pick_the_folder(tmp_path):
    """run.sh with a stand-in python that records what it is asked to run: setup installs
    TensorBoard (the run's logs) and matplotlib (bench's plot), and `train` gets the user's
    arguments as they are (it picks runs/qca, runs/qca-2, ... itself)."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    log = tmp_path / "calls.log"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$@" >> {log}
""")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake))
    subprocess.run(["bash", str(tmp_path / "scripts" / "run.sh")], check=True, env=env, capture_output=True)
    subprocess.run(["bash", str(tmp_path / "scripts" / "run.sh"), "--out", "mine"], check=True, env=env,
                   capture_output=True)
    calls = log.read_text().splitlines()
    assert "-m pip install -q tensorboard matplotlib" in calls
    assert [c for c in calls if "qca_lowmem" in c] == ["-m qca_lowmem train", "-m qca_lowmem train --out mine"]
