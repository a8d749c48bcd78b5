import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import cuda_only, single_thread, write_config  # noqa: E402  (tests/ on the path first)


def pytest_collection_modifyitems(items):
    """Mark every test that runs on a GPU `cuda` (`pytest -m cuda`, the GPU run's test phase): the
    ones skipped without a GPU and the cuda cases of device-parametrised ones."""
    for item in items:
        skipped_without_gpu = any(mark.kwargs.get("reason") == cuda_only.kwargs["reason"]
                                  for mark in item.iter_markers("skipif"))
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_cuda = any(str(value) == "cuda" or (isinstance(value, torch.device) and value.type == "cuda")
                      for value in params.values())
        if skipped_without_gpu or on_cuda:
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 episodes: checkpoint.pt at episode 2, checkpoint.prev.pt at episode 1."""
    from qca_lowmem.trainer import cli  # only the trainer's tests need it

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
