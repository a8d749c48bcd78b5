"""step_difference, the recompute check's measure: against the same measure in torch's ops (the
check's formulation before the op, float64 where the inputs are), on random inputs of every dtype
with and without `before`, with equal, NaN and infinite elements, empty and non-contiguous
tensors; errors that name the argument; opcheck; no derivative."""

import math

import pytest
import torch
from torch.library import opcheck

from helpers import DEVICES
from qca_lowmem.ops.step_difference import MEASURED_DTYPES, step_difference

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = torch.finfo(torch.float32).tiny


def reference(actual, expected, before=None):
    """The measure in torch's ops, in float64 (complex128) whatever the inputs' precision."""
    wide = torch.complex128 if actual.is_complex() else torch.float64
    actual, expected = actual.to(wide), expected.to(wide)
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    difference = torch.where(same, 0.0, (actual - expected).abs())
    change = expected if before is None else expected - before.to(wide)
    scale = change.abs().nan_to_num(0.0, 0.0, 0.0)
    if actual.numel() == 0:
        return torch.tensor(0.0)
    return (difference.amax() / scale.amax().clamp_min(TINY)).to(torch.float32)


def case(dtype, shape, seed, with_before=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    expected = torch.randn(shape, generator=g, dtype=torch.complex128 if dtype.is_complex else torch.float64)
    before = expected + 0.1 * torch.randn(shape, generator=g, dtype=expected.dtype)
    actual = expected + 1e-4 * torch.randn(shape, generator=g, dtype=expected.dtype)
    if actual.numel() > 3:
        actual.view(-1)[::3] = expected.view(-1)[::3]  # some elements equal
    to = lambda t: t.to(dtype).to(device)  # noqa: E731
    return to(actual), to(expected), to(before) if with_before else None


def assert_measures_like_torch(actual, expected, before):
    ours = step_difference(actual, expected, before)
    wanted = reference(actual.cpu(), expected.cpu(), None if before is None else before.cpu())
    assert ours.dtype == torch.float32 and ours.shape == () and ours.device == actual.device
    # float32 arithmetic (float, half and bfloat16 parts) against float64: a few units of rounding
    rtol = 1e-12 if actual.dtype in (torch.float64, torch.complex128) else 4e-7
    torch.testing.assert_close(ours.cpu(), wanted, rtol=rtol, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MEASURED_DTYPES, ids=str)
@pytest.mark.parametrize("with_before", [True, False])
def test_measures_as_torchs_ops(device, dtype, with_before):
    for seed, shape in enumerate([(1, 8, 8, 3), (2, 17, 5, 4), (1,), (300, 257)]):
        assert_measures_like_torch(*case(dtype, shape, seed, with_before, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.complex128], ids=str)
def test_nan_and_infinite_elements(device, dtype):
    nan, inf = math.nan, math.inf
    actual, expected, before = case(dtype, (64,), 5, device=device)
    for i, (a, e, b) in enumerate([(nan, nan, 0.0), (inf, inf, 0.0), (inf, inf, inf), (2.0, 2.0, nan)]):
        actual[i], expected[i], before[i] = a, e, b  # equal or both NaN: not a difference
    assert_measures_like_torch(actual, expected, before)
    assert step_difference(actual, expected, before).item() < 1e-2
    for a, e in [(nan, 1.0), (1.0, nan), (inf, 1.0), (-inf, inf)]:
        broken = actual.clone()
        broken[10], expected_10 = a, expected[10].clone()
        expected[10] = e
        assert_measures_like_torch(broken, expected, before)
        value = step_difference(broken, expected, before).item()
        assert math.isnan(value) or value == inf
        expected[10] = expected_10
    if dtype.is_complex:  # a NaN part makes the element NaN: NaN and NaN in another part are equal
        actual[20], expected[20] = complex(nan, 1.0), complex(2.0, nan)
        assert_measures_like_torch(actual, expected, before)


@pytest.mark.parametrize("device", DEVICES)
def test_identical_empty_and_changeless_steps(device):
    actual, expected, before = case(torch.complex64, (2, 4, 4, 3), 1, device=device)
    assert step_difference(expected, expected, before).item() == 0.0
    empty = torch.zeros(0, 3, device=device)
    assert step_difference(empty, empty, empty).item() == 0.0 and step_difference(empty, empty).item() == 0.0
    # no change at all: the difference over the float32 tiny, as the check's clamp has it
    zero = torch.zeros(5, device=device)
    assert step_difference(zero + 1e-30, zero, zero).item() == pytest.approx(1e-30 / TINY)


def test_non_contiguous_inputs():
    actual, expected, before = case(torch.complex64, (6, 8, 8, 3), 3)
    views = [t.transpose(1, 2)[::2] for t in (actual, expected, before)]
    assert not views[0].is_contiguous()
    assert_measures_like_torch(*views)
    assert step_difference(*views) == step_difference(*(v.contiguous() for v in views))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for with_before in (True, False):
        opcheck(torch.ops.qca_lowmem.step_difference, case(torch.complex64, (1, 4, 4, 2), 0, with_before, device))
        opcheck(torch.ops.qca_lowmem.step_difference, case(torch.float32, (3, 5), 1, with_before, device))


def test_not_differentiable():
    actual, expected, before = case(torch.float32, (4,), 0)
    actual.requires_grad_(True)
    out = torch.ops.qca_lowmem.step_difference(actual, expected, before)
    with pytest.raises(RuntimeError, match="derivative for .*step_difference.* is not implemented"):
        out.backward()


def test_bad_inputs_name_the_argument():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"step_difference: actual must be a float16, .* got Tensor\(dtype=Long"):
        step_difference(x.long(), x.long())
    with pytest.raises(RuntimeError, match=r"step_difference: expected must have actual's dtype and shape .*"
                                           r"got Tensor\(dtype=Double, shape=\[3, 4\]"):
        step_difference(x, x.double())
    with pytest.raises(RuntimeError, match=r"step_difference: before must have actual's dtype and shape .*"
                                           r"got Tensor\(dtype=Float, shape=\[4, 3\]"):
        step_difference(x, x, x.t().contiguous())
    with pytest.raises(RuntimeError, match=r"step_difference: before must be on the same device as actual \(cpu\), "
                                           r"got Tensor\(dtype=Float, shape=\[3, 4\], device=meta"):
        step_difference(x, x, x.to("meta"))
