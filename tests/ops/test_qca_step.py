"""The fused QCA step ops against the stock computation (qca_lowmem.stock)."""

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import DEVICES, cuda_only
from qca_lowmem import stock as reference

SHAPES = [(1, 4, 4, 1), (2, 5, 7, 3), (1, 8, 8, 14), (3, 3, 11, 14)]


def random_delta(psi, dtype=torch.float32, channels_last=False, scale=0.5):
    b, h, w, d = psi.shape
    delta = (scale * torch.randn(b, 2 * d, h, w, device=psi.device)).to(dtype)
    return delta.contiguous(memory_format=torch.channels_last) if channels_last else delta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_pack_matches_stock(device, shape, dtype, channels_last):
    psi = torch.randn(shape, dtype=torch.complex64, device=device)
    x = qca_lowmem.qca_pack(psi, dtype, channels_last=channels_last)
    expected = reference.pack(psi).to(dtype or torch.float32)
    assert x.dtype == expected.dtype and x.shape == expected.shape
    assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    # A fused cast must round exactly as .to(dtype) does.
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_pack_rounds_like_torch_on_hard_values():
    # Subnormals, ties, overflow, infinities and NaN exercise every branch of the C conversions.
    values = torch.tensor(
        [0.0, -0.0, 1e-8, 6e-8, -3e-5, 1.0009765625, 65504.0, 65520.0, 70000.0, 1e-40,
         3.4e38, float("inf"), float("-inf"), float("nan"), 1 + 2**-8, 1 + 3 * 2**-9],
        dtype=torch.float32,
    )
    psi = torch.complex(values, values.flip(0)).reshape(1, 1, values.numel(), 1)
    for dtype in (torch.float16, torch.bfloat16):
        x = qca_lowmem.qca_pack(psi, dtype)
        expected = reference.pack(psi).to(dtype)
        assert torch.equal(x.isnan(), expected.isnan())
        finite = ~expected.isnan()
        assert torch.equal(x[finite].view(torch.int16), expected[finite].view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
def test_pack_non_contiguous_psi(device):
    base = torch.randn(2, 9, 10, 6, dtype=torch.complex64, device=device)
    psi = base[:, 1::2, ::3, ::2]  # strided view in every dimension
    assert not psi.is_contiguous()
    torch.testing.assert_close(qca_lowmem.qca_pack(psi), reference.pack(psi), rtol=0, atol=0)
    psi_t = base.transpose(1, 2)
    torch.testing.assert_close(qca_lowmem.qca_pack(psi_t), reference.pack(psi_t), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gamma", [0.0, 0.05])
@pytest.mark.parametrize("multiplicative", [True, False])
@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_update_matches_stock_values_and_grads(device, shape, gamma, multiplicative, delta_dtype):
    psi = torch.randn(shape, dtype=torch.complex64, device=device, requires_grad=True)
    delta = random_delta(psi.detach(), delta_dtype).requires_grad_()
    upstream = torch.randn(shape, dtype=torch.complex64, device=device)

    out = qca_lowmem.qca_update(psi, delta, gamma, multiplicative)
    grad_psi, grad_delta = torch.autograd.grad(out, (psi, delta), upstream)

    # The oracle in float64 on the same (already rounded) delta.
    psi64 = psi.detach().to(torch.complex128).requires_grad_()
    delta64 = delta.detach().double().requires_grad_()
    ref = reference.update(psi64, delta64, gamma, multiplicative)
    ref_grad_psi, ref_grad_delta = torch.autograd.grad(ref, (psi64, delta64), upstream.to(torch.complex128))

    assert out.dtype == torch.complex64 and grad_delta.dtype == delta_dtype
    torch.testing.assert_close(out, ref.to(torch.complex64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_psi, ref_grad_psi.to(torch.complex64), rtol=1e-4, atol=1e-5)
    grad_tol = dict(rtol=1e-4, atol=1e-5) if delta_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_delta, ref_grad_delta.to(delta_dtype), **grad_tol)


@pytest.mark.parametrize("device", DEVICES)
def test_update_fp32_matches_stock_fp32(device):
    psi = torch.randn(2, 8, 8, 14, dtype=torch.complex64, device=device)
    delta = random_delta(psi)
    out = qca_lowmem.qca_update(psi, delta, 0.01, True)
    torch.testing.assert_close(out, reference.update(psi, delta, 0.01, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_update_non_contiguous_and_channels_last(device):
    base = torch.randn(2, 6, 12, 8, dtype=torch.complex64, device=device)
    psi = base[:, :, ::2, :5]
    delta_base = torch.randn(2, 12, 6, 12, device=device)
    delta = delta_base[:, :10, :, ::2]
    expected = reference.update(psi, delta, 0.1, True)
    torch.testing.assert_close(qca_lowmem.qca_update(psi, delta, 0.1), expected, rtol=1e-5, atol=1e-6)
    cl = delta.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(qca_lowmem.qca_update(psi, cl, 0.1), expected, rtol=1e-5, atol=1e-6)


def test_update_gradcheck_float64():
    for multiplicative in (True, False):
        for gamma in (0.0, 0.2):
            psi = torch.randn(2, 3, 4, 3, dtype=torch.complex128, requires_grad=True)
            delta = (0.5 * torch.randn(2, 6, 3, 4, dtype=torch.float64)).requires_grad_()
            assert torch.autograd.gradcheck(
                lambda p, dl: qca_lowmem.qca_update(p, dl, gamma, multiplicative), (psi, delta)
            )


def test_pack_gradcheck_float64():
    psi = torch.randn(2, 3, 4, 3, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: qca_lowmem.qca_pack(p), (psi,))
    assert torch.autograd.gradcheck(lambda p: qca_lowmem.qca_pack(p, channels_last=True), (psi,))


def test_pack_grad_matches_stock_through_cast():
    psi = torch.randn(1, 4, 5, 3, dtype=torch.complex64, requires_grad=True)
    upstream = torch.randn(1, 6, 4, 5).to(torch.bfloat16)
    (grad,) = torch.autograd.grad(qca_lowmem.qca_pack(psi, torch.bfloat16), psi, upstream)
    (ref,) = torch.autograd.grad(reference.pack(psi).to(torch.bfloat16), psi, upstream)
    torch.testing.assert_close(grad, ref, rtol=0, atol=0)


def opcheck_samples(device):
    psi = torch.randn(2, 3, 5, 4, dtype=torch.complex64, device=device, requires_grad=True)
    delta = torch.randn(2, 8, 3, 5, device=device, requires_grad=True)
    upstream = torch.randn(2, 3, 5, 4, dtype=torch.complex64, device=device)
    return [
        (torch.ops.qca_lowmem.qca_pack.default, (psi,), {}),
        (torch.ops.qca_lowmem.qca_pack.default, (psi, torch.bfloat16, True), {}),
        (torch.ops.qca_lowmem.qca_pack_backward.default, (torch.randn(2, 8, 3, 5, device=device), torch.complex64), {}),
        (torch.ops.qca_lowmem.qca_update.default, (psi, delta, 0.1, True, 1e-9), {}),
        (torch.ops.qca_lowmem.qca_update.default, (psi, delta.detach().half(), 0.0, False, 1e-9), {}),
        (
            torch.ops.qca_lowmem.qca_update_backward.default,
            (upstream, psi.detach(), delta.detach(), 0.1, True, 1e-9),
            {},
        ),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args, kwargs in opcheck_samples(device):
        torch.library.opcheck(op, args, kwargs)


class TinyOperator(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv1 = nn.Conv2d(2 * d, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 2 * d, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.tanh(self.conv1(x)))


def fused_step(psi, operator, gamma=0.0):
    return qca_lowmem.qca_update(psi, operator(qca_lowmem.qca_pack(psi)), gamma, True)


def test_fused_step_equals_stock_step_with_gradients():
    operator = TinyOperator(5)
    psi = torch.randn(2, 6, 6, 5, dtype=torch.complex64, requires_grad=True)
    out = fused_step(psi, operator, 0.03)
    ref = reference.step(psi, operator, 0.03, multiplicative=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    params = [psi, *operator.parameters()]
    ours = torch.autograd.grad(out.abs().sum(), params)
    theirs = torch.autograd.grad(ref.abs().sum(), params)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    operator = TinyOperator(3)
    psi = torch.randn(1, 6, 6, 3, dtype=torch.complex64, requires_grad=True)
    compiled = torch.compile(fused_step, fullgraph=True)
    out_c = compiled(psi, operator, 0.1)
    out_e = fused_step(psi, operator, 0.1)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    grads_c = torch.autograd.grad(out_c.abs().sum(), [psi, *operator.parameters()])
    grads_e = torch.autograd.grad(out_e.abs().sum(), [psi, *operator.parameters()])
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [513, 1031, 14337])
def test_wide_states_match_stock(d):
    # Few cells per C tile (14,336 components): 8 at d = 513, 13 at 1031, one above the tile; odd
    # d leaves a component outside the transposes' 2-component blocks.
    psi = reference.initial_state(2, (3, 5), d, dtype=torch.complex128).requires_grad_(True)
    delta = random_delta(psi, torch.float64).requires_grad_(True)
    torch.testing.assert_close(qca_lowmem.qca_pack(psi), reference.pack(psi), rtol=0, atol=0)
    out = qca_lowmem.qca_update(psi, delta, 0.1, True)
    expected = reference.update(psi, delta, 0.1, True)
    torch.testing.assert_close(out, expected)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (psi, delta), upstream)
    for got, want in zip(grads, torch.autograd.grad(expected, (psi, delta), upstream)):
        torch.testing.assert_close(got, want)
    x_grad = torch.randn(2, 2 * d, 3, 5, dtype=torch.float64)
    (pack_grad,) = torch.autograd.grad(qca_lowmem.qca_pack(psi), psi, x_grad)
    (stock_pack_grad,) = torch.autograd.grad(reference.pack(psi), psi, x_grad)
    torch.testing.assert_close(pack_grad, stock_pack_grad, rtol=0, atol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_pack_in_either_tile_size_matches_stock(batch):
    # The C pack transposes a range of up to 2 MiB in small tiles, a larger one (batch 3 here,
    # 2.6 MiB with x) in the update's tiles; both are pure data movement.
    psi = reference.initial_state(batch, 64, 14).requires_grad_(True)
    x = qca_lowmem.qca_pack(psi)
    torch.testing.assert_close(x, reference.pack(psi), rtol=0, atol=0)
    x_grad = torch.randn_like(x)
    (pack_grad,) = torch.autograd.grad(x, psi, x_grad)
    (stock_pack_grad,) = torch.autograd.grad(reference.pack(psi), psi, x_grad)
    torch.testing.assert_close(pack_grad, stock_pack_grad, rtol=0, atol=0)


def test_empty_batch():
    psi = torch.randn(0, 4, 4, 3, dtype=torch.complex64, requires_grad=True)
    delta = torch.randn(0, 6, 4, 4, requires_grad=True)
    x = qca_lowmem.qca_pack(psi)
    out = qca_lowmem.qca_update(psi, delta)
    assert x.shape == (0, 6, 4, 4) and out.shape == (0, 4, 4, 3)
    out.abs().sum().backward()
    assert psi.grad.shape == psi.shape and delta.grad.shape == delta.shape


def test_zero_residual_cell_has_finite_gradient():
    psi = torch.randn(1, 1, 2, 2, dtype=torch.complex64, requires_grad=True)
    delta = torch.zeros(1, 4, 1, 2)
    delta[:, :2, 0, 0] = -1.0  # a = -1 cancels psi in the first cell: n == 0
    out = qca_lowmem.qca_update(psi, delta.requires_grad_())
    out.abs().sum().backward()
    assert torch.isfinite(torch.view_as_real(psi.grad)).all() and torch.isfinite(delta.grad).all()


BAD_INPUTS = [
    (lambda: qca_lowmem.qca_pack(torch.randn(1, 4, 4, 3)), "psi must be complex64 or complex128"),
    (lambda: qca_lowmem.qca_pack(torch.randn(4, 4, 3, dtype=torch.complex64)), "psi must have 4 dimensions"),
    (lambda: qca_lowmem.qca_pack(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.int32), "dtype must be"),
    (lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3), torch.randn(1, 6, 4, 4)), "psi must be complex64"),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 5, 4, 4)),
        r"delta must have 2\*d = 6 channels",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(2, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 6, 4, 4)),
        "delta has batch size 1 but psi has 2",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 6, 4, 5)),
        "spatial size of psi",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.ones(1, 6, 4, 4, dtype=torch.int64)),
        "delta must be float32, float16 or bfloat16",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 6, 4)),
        "delta must have 4 dimensions",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 6, 4, 4), float("nan")),
        "gamma must be finite, got nan",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 6, 4, 4), 0.0, True, -1.0),
        "eps must be finite and >= 0",
    ),
    (
        lambda: qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex128), torch.randn(1, 6, 4, 4)),
        "delta must be float64 for a complex128 psi",
    ),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS)
def test_bad_input_is_named(call, message):
    with pytest.raises(RuntimeError, match=message) as info:
        call()
    assert "shape=" in str(info.value) or "got" in str(info.value)


def test_a_gamma_or_eps_that_is_not_a_number_is_named():
    psi, delta = torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 6, 4, 4)
    with pytest.raises(TypeError, match="qca_update: gamma must be a real number, got 'x'"):
        qca_lowmem.qca_update(psi, delta, gamma="x")
    with pytest.raises(TypeError, match="qca_update: eps must be a real number, got None"):
        qca_lowmem.qca_update(psi, delta, eps=None)


def test_error_shows_received_tensor():
    with pytest.raises(RuntimeError, match=r"Tensor\(dtype=Float, shape=\[1, 5, 4, 4\], device=cpu, strides="):
        qca_lowmem.qca_update(torch.randn(1, 4, 4, 3, dtype=torch.complex64), torch.randn(1, 5, 4, 4))


@cuda_only
@pytest.mark.parametrize("psi_device, delta_device", [("cuda", "cpu"), ("cpu", "cuda")])
def test_device_mismatch_is_named(psi_device, delta_device):
    """Either way round: a CUDA delta sends a CPU psi to the CUDA kernel, whose checks run before
    its device guard."""
    psi = torch.randn(1, 4, 4, 3, dtype=torch.complex64, device=psi_device)
    delta = torch.randn(1, 6, 4, 4, device=delta_device)
    with pytest.raises(RuntimeError, match="delta must be on the same device as psi"):
        qca_lowmem.qca_update(psi, delta)
    with pytest.raises(RuntimeError, match="delta must be on the same device as psi"):
        torch.ops.qca_lowmem.qca_update_backward(psi.clone(), psi, delta, 0.0, True, 1e-9)


@cuda_only
@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(delta_dtype):
    psi = torch.randn(2, 16, 16, 14, dtype=torch.complex64)
    delta = random_delta(psi, delta_dtype)
    upstream = torch.randn_like(psi)
    results = []
    for device in ("cpu", "cuda"):
        p = psi.to(device).requires_grad_()
        dl = delta.to(device).requires_grad_()
        out = qca_lowmem.qca_update(p, dl, 0.05)
        grads = torch.autograd.grad(out, (p, dl), upstream.to(device))
        results.append([t.cpu() for t in (out, *grads, qca_lowmem.qca_pack(p, delta_dtype))])
    # Same per-cell maths on both devices (qca_step_cells.inc), IEEE division and square root,
    # and no FMA on CUDA (test_build.py checks): the same bits.
    for name, a, b in zip(("out", "grad_psi", "grad_delta", "pack"), *results):
        assert torch.equal(a, b), name


def test_saved_bytes_fused_step_keeps_only_its_inputs():
    d, grid = 14, 16
    operator = TinyOperator(d)
    psi = reference.initial_state(1, grid, d).requires_grad_()
    psi_bytes = psi.numel() * psi.element_size()

    def operator_only(p):
        return operator(reference.pack(p).detach())

    stock = qca_lowmem.saved_bytes(lambda p: reference.step(p, operator, 0.01, True), psi)
    fused = qca_lowmem.saved_bytes(lambda p: fused_step(p, operator, 0.01), psi)
    # What the operator itself saves (its input x and activations) is common to both.
    operator_saved = qca_lowmem.saved_bytes(operator_only, psi)
    delta_bytes = 2 * d * grid * grid * 4
    print(f"\nsaved bytes per step: stock {stock}, fused {fused}, operator alone {operator_saved}")
    # Beyond the operator, the fused step keeps its inputs psi and delta and nothing else.
    assert fused == operator_saved + psi_bytes + delta_bytes
    # The stock step's temporaries (complex delta, products, norms) come on top of the same inputs.
    assert stock - operator_saved >= 2 * (psi_bytes + delta_bytes)


def test_saved_bytes_counts_storages_once_and_skips_parameters():
    weight = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)

    def fn(inp):
        y = inp @ weight  # saves inp and weight (a Parameter)
        return (y * y).sum() + (inp[:4] * 2).sum()

    assert qca_lowmem.saved_bytes(fn, x) == x.numel() * 4 + 8 * 64 * 4
    with torch.no_grad():
        assert qca_lowmem.saved_bytes(fn, x) == 0


def test_peak_saved_bytes_counts_what_is_held_at_once():
    """Where a graph's saved tensors are let go (its backward) before the next graph saves, the
    peak is the larger graph's, where saved_bytes sums both; a graph kept alive counts on."""
    weight = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    one_graph = x.numel() * 4 + 8 * 64 * 4  # inp and y, as above (the Parameter skipped)

    def fn(inp):
        y = inp @ weight
        return (y * y).sum()

    def two_trained_in_turn(inp):
        fn(inp).backward()
        fn(inp * 2).backward()

    kept = []
    assert qca_lowmem.peak_saved_bytes(fn, x) == one_graph
    assert qca_lowmem.peak_saved_bytes(two_trained_in_turn, x) == one_graph
    assert qca_lowmem.saved_bytes(two_trained_in_turn, x) == 2 * one_graph
    assert qca_lowmem.peak_saved_bytes(lambda inp: kept.extend([fn(inp), fn(inp * 2)]), x) == 2 * one_graph
