"""qca_lowmem's gradient accumulation op (accumulate_: a list of gradients of any floating dtypes
added into their accumulators in one pass) against torch's own add_, bit for bit."""

import pytest
import torch

from fixtures.scaler import CHUNK, bits_equal, ops
from qca_lowmem.ops.scaler import accumulate_

REALS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def expected(accumulators, grads):
    return [a.clone().add_(g) for a, g in zip(accumulators, grads)]


def assert_adds_like_torch(accumulators, grads):
    want = expected(accumulators, grads)
    ops.accumulate_(accumulators, grads)
    for i, (a, w) in enumerate(zip(accumulators, want)):
        assert a.dtype == w.dtype and bits_equal(a, w), f"pair {i}: {a.dtype} += {grads[i].dtype}"


@pytest.mark.parametrize("acc_dtype", REALS, ids=str)
def test_every_dtype_pair_adds_as_add_(acc_dtype):
    g = torch.Generator().manual_seed(3)
    sizes = [0, 1, 1000, CHUNK + 5]
    accumulators = [(torch.randn(n, generator=g, dtype=torch.float64) * 50).to(acc_dtype)
                    for _ in REALS for n in sizes]
    grads = [(torch.randn(n, generator=g, dtype=torch.float64) * 0.01).to(grad_dtype)
             for grad_dtype in REALS for n in sizes]
    assert_adds_like_torch(accumulators, grads)


def test_complex_pairs():
    accumulators = [torch.randn(7, dtype=torch.complex64), torch.randn(3, 2, dtype=torch.complex128)]
    grads = [torch.randn(7, dtype=torch.complex128), torch.randn(3, 2, dtype=torch.complex64)]
    assert_adds_like_torch(accumulators, grads)
    # a lazily conjugated gradient is read as its values
    accumulators, grads = [torch.randn(5, dtype=torch.complex64)], [torch.randn(5, dtype=torch.complex64).conj()]
    assert_adds_like_torch(accumulators, grads)


def test_layouts():
    """Accumulators and gradients in different layouts: channels_last against contiguous, a
    transpose, a stepped slice (not dense), a zero-stride gradient."""
    w = torch.randn(8, 6, 3, 3)
    cases = [
        (w.clone().to(memory_format=torch.channels_last), torch.randn(8, 6, 3, 3, dtype=torch.bfloat16)),
        (w.clone(), torch.randn(8, 6, 3, 3).to(torch.float16, memory_format=torch.channels_last)),
        (torch.randn(5, 4).t(), torch.randn(4, 5, dtype=torch.float16)),
        (torch.randn(20)[::3], torch.randn(7, dtype=torch.float64)),
        (torch.randn(6), torch.randn(1, dtype=torch.float16).expand(6)),
    ]
    for acc, grad in cases:
        want = acc.clone().add_(grad)
        ops.accumulate_([acc], [grad])
        assert bits_equal(acc.contiguous(), want.contiguous())
    storage = torch.randn(20)
    before = storage.clone()
    ops.accumulate_([storage[::3]], [torch.ones(7)])
    gaps = torch.ones(20, dtype=torch.bool)
    gaps[::3] = False
    assert bits_equal(storage[gaps], before[gaps]) and bits_equal(storage[::3], before[::3] + 1)


def test_a_gradient_that_is_its_accumulator():
    t = torch.randn(100)
    want = t * 2
    ops.accumulate_([t], [t])
    assert bits_equal(t, want)


def test_results_do_not_depend_on_threads():
    g = torch.Generator().manual_seed(4)
    accumulators = [torch.randn(3 * CHUNK + 11, generator=g) for _ in range(3)]
    grads = [torch.randn(3 * CHUNK + 11, generator=g).to(torch.bfloat16) for _ in range(3)]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            ours = [a.clone() for a in accumulators]
            ops.accumulate_(ours, grads)
            results.append(ours)
    finally:
        torch.set_num_threads(threads)
    assert all(bits_equal(a, b) for a, b in zip(*results))


def test_bumps_version_counters_of_accumulators_only():
    acc, grad = torch.randn(4), torch.randn(4)
    before = (acc._version, grad._version)
    ops.accumulate_([acc], [grad])
    assert acc._version > before[0] and grad._version == before[1]


def test_opcheck():
    torch.library.opcheck(ops.accumulate_, ([torch.randn(70000), torch.randn(3, 2), torch.empty(0)],
                                            [torch.randn(70000, dtype=torch.bfloat16), torch.randn(3, 2),
                                             torch.empty(0, dtype=torch.float16)]))


def test_empty_lists_do_nothing():
    accumulate_([], [])  # the wrapper's: torch cannot dispatch an op on no tensor at all


def test_bad_inputs_raise_clearly():
    a, b = torch.zeros(3), torch.zeros(3)
    cases = [
        (([a], [b, b]), r"accumulators and grads must be lists of one length, got 1 and 2"),
        (([a], [torch.zeros(4)]), r"grads\[0\] must have the shape of accumulators\[0\] \(\[3\]\), got .*shape=\[4\]"),
        (([a], [torch.arange(3)]), r"grads\[0\] must be a float32, .* tensor, got .*Long"),
        (([torch.zeros(3, dtype=torch.int32)], [b]), r"accumulators\[0\] must be a float32, .*Int"),
        (([a], [torch.zeros(3, dtype=torch.complex64)]), r"must be both complex or both real"),
        (([torch.zeros(1).expand(3)], [b]), r"accumulators\[0\] has elements that share memory"),
        (([a, a[1:]], [b, b[1:]]), r"accumulators\[0\] and accumulators\[1\] share memory"),
        (([a, b], [b, a]), r"accumulators\[0\] shares memory with grads\[1\]"),
        (([a], [torch.zeros(3).to_sparse()]), r"grads\[0\] must be a strided"),
        (([torch.zeros(3, dtype=torch.complex64).conj()], [torch.zeros(3, dtype=torch.complex64)]),
         r"materialize all the conjugate"),  # torch's own check
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.accumulate_(*args)
