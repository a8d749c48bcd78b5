"""What every test gets: tests/ on the path (helpers, fixtures, cuda_emu), the `cuda` marks, the
seed, the model families' stand-ins recorded as followed code, and one_thread. A layer's own
fixtures live in its folder's conftest (tests/trainer's run)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from fixtures.model_families import RECORDED  # noqa: E402
from helpers import cuda_only, follow, single_thread  # noqa: E402  (tests/ on the path first)


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


@pytest.fixture(autouse=True)
def _families_recorded(monkeypatch):
    """The model families' stand-ins (fixtures/model_families.py) recorded as code qca_lowmem
    follows, as their real classes are (code_identity.FOLLOWED)."""
    follow(monkeypatch, *RECORDED, origin="the stand-in of a model family,")


@pytest.fixture
def one_thread():
    with single_thread():
        yield


@pytest.fixture
def fused_ops_counted(monkeypatch):
    """A list that grows by one at each fused block's call of its op (a FusedConvBlock running
    fused, in eager code: blocks.conv_block_forward)."""
    from qca_lowmem import blocks
    calls, original = [], blocks.conv_block_forward

    def counted(*args):
        calls.append(1)
        return original(*args)
    monkeypatch.setattr(blocks, "conv_block_forward", counted)
    return calls


@pytest.fixture
def max_pool_op_on_the_cpu(monkeypatch):
    """The pools take max_pool2x2 on the CPU too, as on a GPU (pools.OP_DEVICES: CUDA alone)."""
    from qca_lowmem import pools
    monkeypatch.setattr(pools, "OP_DEVICES", frozenset({"cpu", "cuda"}))
