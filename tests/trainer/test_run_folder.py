"""A run is never overwritten silently: `train` on a folder that holds one needs --resume or
--overwrite (which keeps the old files aside), on every DDP rank; scripts/run.sh a second time
trains into a new folder."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from qca_lowmem.trainer import cli
from qca_lowmem.trainer.config import load_config
from qca_lowmem.trainer.errors import UsageError
from qca_lowmem.trainer.train import check_run

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


@pytest.mark.slow
def test_run_sh_a_second_time_trains_into_a_new_folder(tmp_path):
    """run.sh with a stand-in python that records what it is asked to run and writes a run's files."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    log = tmp_path / "calls.log"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "qca_lowmem" ]; then
  echo "$@" >> {log}
  mkdir -p "$5" && touch "$5/checkpoint.pt"
fi
""")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake))
    for _ in range(3):
        subprocess.run(["bash", str(tmp_path / "scripts" / "run.sh")], check=True, env=env, capture_output=True)
    subprocess.run(["bash", str(tmp_path / "scripts" / "run.sh"), "--out", "mine"], check=True, env=env,
                   capture_output=True)
    assert log.read_text().splitlines() == ["-m qca_lowmem train --out runs/qca", "-m qca_lowmem train --out runs/qca-2",
                                            "-m qca_lowmem train --out runs/qca-3", "-m qca_lowmem train --out mine"]
