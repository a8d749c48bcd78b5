import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from qca_lowmem.trainer import cli

sys.path.insert(0, os.path.dirname(__file__))

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


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
    """Tiny tensors gain nothing from threads, and on a shared machine the intra-op pool's
    spin-waits make them many times slower; one thread keeps the runtime predictable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomize_affine(module: nn.Module, generator=None) -> nn.Module:
    """Give every GroupNorm a non-trivial affine (stock init is 1 and 0), so tests see it."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=generator))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=generator))
    return module


def batchnorm_step():
    """(conv, norm, step): a float64 step through a conv and a BatchNorm in train mode, which
    updates its running statistics at every call; made afresh from seed 0."""
    import qca_lowmem

    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1).double()
    norm = nn.BatchNorm2d(4).double()

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(norm(conv(x))), 0.05)

    return conv, norm, step


# The tiny CLI run the trainer's error and safety tests share.
TINY = {
    "model": {"d_state": 2, "hidden": 8},
    "training": {"grid": 8, "qca_steps": 5, "episodes": 2, "seed": 3},
    "output": {"save_every": 1},
    "device": "cpu",
}


def report_lines(stderr: str):
    """A run's stderr less its own progress notes (where it trains, how long the first episode
    took): what it reports besides them."""
    notes = ("qca-lowmem: training episodes ", "qca-lowmem: first episode ")
    return [line for line in stderr.splitlines() if not line.startswith(notes)]


def write_config(path: Path, config=None, text=None) -> str:
    path.write_text(text if text is not None else yaml.safe_dump(config if config is not None else TINY))
    return str(path)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 episodes: checkpoint.pt at episode 2, checkpoint.prev.pt at episode 1."""
    folder = tmp_path_factory.mktemp("finished")
    config = write_config(folder / "tiny.yaml")
    assert cli.main(["train", "--config", config, "--out", str(folder / "run"), "--no-progress"]) == 0
    return folder / "run"


@pytest.fixture
def run_dir(finished_run, tmp_path):
    """A copy of the finished run, its config next to it."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    write_config(tmp_path / "tiny.yaml")
    return out
