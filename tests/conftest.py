import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


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
