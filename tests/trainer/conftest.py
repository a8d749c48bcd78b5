"""The trainer's tests: a finished tiny run to resume, damage or refuse."""

import shutil

import pytest

from helpers import single_thread, write_config
from qca_lowmem.trainer import cli


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 episodes: checkpoint.pt at episode 2, checkpoint.prev.pt at episode 1."""
    folder = tmp_path_factory.mktemp("finished")
    config = write_config(folder / "tiny.yaml")
    with single_thread():  # made before a test's one_thread
        assert cli.main(["train", "--config", config, "--out", str(folder / "run"), "--no-progress"]) == 0
    return folder / "run"


@pytest.fixture
def run_dir(finished_run, tmp_path):
    """A copy of the finished run, its config next to it."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    write_config(tmp_path / "tiny.yaml")
    return out
