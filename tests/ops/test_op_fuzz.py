"""Random op arguments (shapes with zero sizes, layouts, dtypes, devices cpu/meta) give either
the reference's result (qca_lowmem.stock or torch's own op) or one clear error naming the op or
the argument; never garbage, never a crash."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qca_lowmem
from helpers import single_thread
from qca_lowmem import stock

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
DEVICES = st.sampled_from(["cpu", "meta"])
REAL = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32]
COMPLEX = [torch.complex64, torch.complex128]
CLEAR_ERRORS = (RuntimeError, ValueError, TypeError)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread keeps the examples fast on a shared machine."""
    with single_thread():
        yield


def laid_out(shape, dtype, order, device):
    """A tensor of `shape` whose memory follows the dimension order `order` (any strides)."""
    base = torch.randn([shape[i] for i in order], dtype=torch.complex128 if dtype.is_complex else torch.float64)
    base = (base * 4).to(dtype)
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return base.permute(inverse).to(device)


@st.composite
def tensors(draw, shape, dtypes, device):
    dtype = draw(st.sampled_from(dtypes))
    order = draw(st.permutations(range(len(shape))))
    return laid_out(shape, dtype, order, device)


def run(ours, reference, names, rtol, atol):
    """ours() either raises a clear error naming one of `names`, or equals reference() (on meta:
    its shape and dtype), which must then not raise."""
    try:
        result = ours()
    except CLEAR_ERRORS as error:
        message = str(error)
        assert any(name in message for name in names), f"unclear error {type(error).__name__}: {message}"
        return
    expected = reference()
    results = result if isinstance(result, tuple) else (result,)
    expecteds = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(results, expecteds):
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
        if got.device.type != "meta":
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


SIZE = st.integers(0, 3)


@FUZZ
@given(st.data(), DEVICES, st.tuples(SIZE, SIZE, SIZE, SIZE))
def test_qca_pack_fuzz(data, device, shape):
    psi = data.draw(tensors(shape, COMPLEX + [torch.float32], device))
    dtype = data.draw(st.sampled_from([None, torch.float32, torch.float64, torch.float16, torch.int32]))
    channels_last = data.draw(st.booleans())

    def reference():
        x = stock.pack(psi)
        return x.to(dtype) if dtype is not None else x

    run(lambda: qca_lowmem.qca_pack(psi, dtype, channels_last=channels_last), reference,
        ["qca_pack", "psi", "dtype"], 0, 0)


@FUZZ
@given(st.data(), DEVICES, st.tuples(SIZE, SIZE, SIZE, st.integers(1, 3)), st.booleans())
def test_qca_update_fuzz(data, device, shape, matching):
    b, h, w, d = shape
    psi = data.draw(tensors(shape, COMPLEX + [torch.float32], device))
    delta_shape = (b, 2 * d, h, w) if matching else data.draw(st.tuples(SIZE, st.integers(0, 6), SIZE, SIZE))
    delta = data.draw(tensors(delta_shape, REAL, device))
    gamma = data.draw(st.sampled_from([0.0, 0.3]))
    multiplicative = data.draw(st.booleans())
    precise = psi.dtype == torch.complex128 and delta.dtype == torch.float64
    run(lambda: qca_lowmem.qca_update(psi, delta, gamma, multiplicative),
        lambda: stock.update(psi, delta, gamma, multiplicative),
        ["qca_update", "psi", "delta"], 1e-10 if precise else 1e-4, 1e-10 if precise else 1e-5)


@FUZZ
@given(st.data(), DEVICES, st.tuples(SIZE, st.sampled_from([0, 1, 2, 4, 6, 8]), SIZE, SIZE),
       st.integers(0, 4), st.booleans())
def test_groupnorm_elu_fuzz(data, device, shape, groups, matching_affine):
    x = data.draw(tensors(shape, REAL, device))
    channels = shape[1] if matching_affine else data.draw(st.integers(0, 9))
    affine_dtype = data.draw(st.sampled_from([torch.float32, x.dtype]))
    weight = (1 + 0.3 * torch.randn(channels)).to(device=device, dtype=affine_dtype)
    bias = (0.3 * torch.randn(channels)).to(device=device, dtype=affine_dtype)
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    low = x.dtype in (torch.float16, torch.bfloat16)

    def reference():
        if x.numel() == 0 and channels == shape[1]:
            return torch.empty_like(x)  # nothing to normalise (torch >= 2.14 refuses no channels or pixels)
        # torch.group_norm: F.group_norm's training-mode refusal of one value per group aside.
        y = F.elu(torch.group_norm(x.to(stat), groups, weight.to(stat), bias.to(stat), 1e-5))
        return y.to(x.dtype)

    run(lambda: qca_lowmem.groupnorm_elu(x, weight, bias, groups), reference,
        ["groupnorm_elu", "x", "weight", "bias", "groups"], 2e-2 if low else 1e-5, 2e-2 if low else 1e-5)


@FUZZ
@given(st.data(), DEVICES, st.tuples(SIZE, SIZE, SIZE, SIZE),
       st.sampled_from([0.0, 0.5, 1.0, -0.1, 1.5, float("nan")]), st.booleans())
def test_noise_fuzz(data, device, shape, rate, bit):
    """No stock counterpart with the same draws: a phase flip keeps every |psi_k|, a bit flip
    gives psi or -psi per cell, rate 0 is the identity and rate 1 hits every cell."""
    psi = data.draw(tensors(shape, COMPLEX + [torch.float32], device))
    seed, step = data.draw(st.integers(-(2**63), 2**64 - 1)), data.draw(st.integers(0, 10))
    op = qca_lowmem.bit_flip if bit else qca_lowmem.phase_flip
    try:
        out = op(psi, rate, seed, step)
    except CLEAR_ERRORS as error:
        assert any(name in str(error) for name in ("bit_flip", "phase_flip", "psi", "rate")), str(error)
        return
    assert out.shape == psi.shape and out.dtype == psi.dtype and out.device == psi.device
    if device == "meta":
        return
    if rate == 0.0:
        torch.testing.assert_close(out, psi, rtol=0, atol=0)
    if bit:
        same = (out == psi).all(-1)
        flipped = (out == -psi).all(-1)
        assert (same | flipped).all()
        if rate == 1.0:
            assert (flipped | (psi == 0).all(-1)).all()
    else:
        torch.testing.assert_close(out.abs(), psi.abs(), rtol=1e-5, atol=1e-6)


@FUZZ
@given(st.data(), DEVICES, st.lists(st.tuples(SIZE, SIZE), min_size=0, max_size=3),
       st.sampled_from([1.0, 0.5, float("inf")]))
def test_amp_unscale_fuzz(data, device, shapes, poison):
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.complex64, torch.int32]))
    grads = [data.draw(tensors(shape, [dtype], device)) for shape in shapes]
    if grads and poison != 1.0 and grads[0].numel() and device != "meta" and dtype != torch.int32:
        grads[0][(0,) * grads[0].dim()] = poison
    inv_scale = torch.full((1,), 0.25, device=device)
    ours, theirs = [g.clone() for g in grads], [g.clone() for g in grads]
    found_ours, found_theirs = torch.zeros(1, device=device), torch.zeros(1, device=device)
    try:
        qca_lowmem.ops.scaler.unscale_(ours, found_ours, inv_scale)
    except CLEAR_ERRORS as error:
        assert any(name in str(error) for name in ("amp_unscale_", "grads", "found_inf", "inv_scale")), str(error)
        return
    if device == "meta":
        return
    # torch's kernel has no complex variant: the same on the real view.
    as_real = [torch.view_as_real(g) if g.is_complex() else g for g in theirs]
    torch._amp_foreach_non_finite_check_and_unscale_(as_real, found_theirs, inv_scale)
    assert torch.equal(found_ours, found_theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def reference_grads(fn, inputs, grad_out):
    """torch.autograd.grad of the reference, on float64/complex128 copies, cast back."""
    wide = [t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_() for t in inputs]
    wide_grad = grad_out.to(torch.complex128 if grad_out.is_complex() else torch.float64)
    grads = torch.autograd.grad(fn(*wide), wide, wide_grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, inputs))


@FUZZ
@given(st.data(), DEVICES, st.tuples(SIZE, SIZE, SIZE, st.integers(1, 3)), st.booleans())
def test_qca_update_backward_fuzz(data, device, shape, matching_grad):
    b, h, w, d = shape
    psi = data.draw(tensors(shape, COMPLEX, device))
    delta = data.draw(tensors((b, 2 * d, h, w), [torch.float64 if psi.dtype == torch.complex128 else torch.float32],
                              device))
    grad_shape = shape if matching_grad else data.draw(st.tuples(SIZE, SIZE, SIZE, SIZE))
    grad_out = data.draw(tensors(grad_shape, COMPLEX, device))
    precise = psi.dtype == torch.complex128
    run(lambda: torch.ops.qca_lowmem.qca_update_backward(grad_out, psi, delta, 0.1, True, 1e-9),
        lambda: reference_grads(lambda p, dl: stock.update(p, dl, 0.1, True), (psi, delta), grad_out),
        ["qca_update_backward", "grad_out", "psi", "delta"], 1e-8 if precise else 1e-3, 1e-8 if precise else 1e-4)


@FUZZ
@given(st.data(), DEVICES, st.tuples(SIZE, st.sampled_from([1, 2, 4]), SIZE, SIZE), st.sampled_from([1, 2]),
       st.booleans())
def test_groupnorm_elu_backward_fuzz(data, device, shape, groups, matching_grad):
    x = data.draw(tensors(shape, [torch.float32, torch.float64], device))
    channels = shape[1]
    weight = (1 + 0.3 * torch.randn(channels)).to(device=device, dtype=x.dtype)
    bias = (0.3 * torch.randn(channels)).to(device=device, dtype=x.dtype)
    grad_y = data.draw(tensors(shape if matching_grad else data.draw(st.tuples(SIZE, SIZE, SIZE, SIZE)),
                               [x.dtype], device))
    ops = torch.ops.qca_lowmem
    groups = groups if channels % groups == 0 else 1
    precise = x.dtype == torch.float64

    def ours():
        _, mean, rstd = ops.groupnorm_elu(x, weight, bias, groups, 1e-5)
        return ops.groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd)

    def reference():
        if x.numel() == 0:  # sums over no element; torch gives NaN (CPU) or divides by zero (meta)
            return torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(bias)
        return reference_grads(lambda t, wt, bs: F.elu(torch.group_norm(t, groups, wt, bs, 1e-5)), (x, weight, bias), grad_y)

    run(ours, reference,
        ["groupnorm_elu_backward", "grad_y", "x"], 1e-8 if precise else 1e-3, 1e-8 if precise else 1e-4)
