"""The one place that saves and puts back the random generators (python/qca_lowmem/recompute/generators.py)."""

import random

import numpy
import pytest
import torch

from qca_lowmem.recompute import generators


def draws():
    return torch.rand(3).tolist(), numpy.random.random(3).tolist(), [random.random() for _ in range(3)]


def test_left_as_found_puts_back_every_generator_it_covers_after_an_error():
    before = generators.save()
    expected = draws()
    before.restore()
    with pytest.raises(RuntimeError), generators.left_as_found():
        draws()
        raise RuntimeError("inside")
    assert draws() == expected


@pytest.mark.parametrize("torch_cpu, host", [(False, True), (True, False)])
def test_only_the_generators_named_are_put_back(torch_cpu, host):
    start = generators.save()
    first = draws()
    start.restore()
    with generators.left_as_found(torch_cpu=torch_cpu, host=host):
        draws()
    second = draws()
    assert (second[0] == first[0]) == torch_cpu
    assert (second[1:] == first[1:]) == host


def test_torchs_draws_are_told_apart_and_cuda_is_left_uninitialised():
    before = generators.save(generators.every_cuda("cpu"), host=False)
    numpy.random.random()
    assert not before.torch_drawn_from()
    torch.rand(1)
    assert before.torch_drawn_from()
    before.restore()
    assert not before.torch_drawn_from()
    assert generators.cuda_of("cpu") == () and generators.cuda_of("cuda:1") == (torch.device("cuda:1"),)
    if not torch.cuda.is_initialized():
        assert generators.every_cuda() == () and not torch.cuda.is_initialized()
