import os
import sys

import pytest
import torch

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
