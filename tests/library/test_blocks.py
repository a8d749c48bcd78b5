"""Fused GroupNorm+ELU ops, FusedConvBlock, the fused UNetUnitary and convert(), against the
stock modules of qca_lowmem.stock."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import qca_lowmem
from helpers import DEVICES, cuda_only, randomize_affine
from qca_lowmem import stock as R
from qca_lowmem.ops.conv_block import conv_block, conv_block_keep

OPS = torch.ops.qca_lowmem


@pytest.fixture(autouse=True)
def _no_tf32():
    """Full fp32 convolutions on a GPU, so fused and stock compare at fp32 tolerances."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved

# (N, C, H, W, groups): several groups, one group, a group per channel, odd and 1-wide sizes
SHAPES = [(2, 12, 5, 7, 3), (1, 8, 3, 3, 1), (3, 16, 4, 5, 16), (2, 6, 1, 9, 2), (1, 24, 7, 2, 3)]
# tolerance relative to the largest reference value, per dtype
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel_err(actual, expected):
    if expected.is_complex():
        actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def make_input(shape, dtype, device, channels_last, requires_grad=False):
    n, c, h, w, _ = shape
    x = (torch.randn(n, c, h, w, dtype=torch.float64) * 1.7 + 0.4).to(device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(requires_grad)


def make_affine(channels, dtype, device):
    weight = (1.0 + 0.3 * torch.randn(channels, dtype=torch.float64)).to(device=device, dtype=dtype)
    bias = (0.3 * torch.randn(channels, dtype=torch.float64)).to(device=device, dtype=dtype)
    return weight, bias


def stock_gn_elu(x, weight, bias, groups):
    """nn.GroupNorm(eps=1e-5) then nn.ELU(), in float64."""
    return F.elu(F.group_norm(x, groups, weight, bias, 1e-5))


# ---------------------------------------------------------------- GroupNorm + ELU op


def check_gn_elu(shape, dtype, device, channels_last):
    groups = shape[-1]
    affine_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = make_input(shape, dtype, device, channels_last, requires_grad=True)
    weight, bias = make_affine(shape[1], affine_dtype, device)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    y = qca_lowmem.groupnorm_elu(x, weight, bias, groups)
    assert y.dtype == dtype and y.shape == x.shape
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last and not x.is_contiguous()
                           else torch.contiguous_format)

    # Reference on the same (rounded) values, in float64.
    xr = x.detach().double().requires_grad_(True)
    wr = weight.detach().double().requires_grad_(True)
    br = bias.detach().double().requires_grad_(True)
    yr = stock_gn_elu(xr, wr, br, groups)
    grad_y = torch.randn_like(yr)
    yr.backward(grad_y)
    y.backward(grad_y.to(dtype))
    tol = TOL[dtype]
    assert rel_err(y, yr) < tol
    assert rel_err(x.grad, xr.grad) < (tol if dtype == torch.float64 else 10 * tol)
    assert rel_err(weight.grad, wr.grad) < (tol if dtype == torch.float64 else 10 * tol)
    assert rel_err(bias.grad, br.grad) < (tol if dtype == torch.float64 else 10 * tol)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_groupnorm_elu_matches_stock(shape, dtype, channels_last):
    check_gn_elu(shape, dtype, "cpu", channels_last)


@cuda_only
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(2, 1024, 5, 6, 1), (1, 96, 33, 17, 2), (4, 128, 64, 64, 16)], ids=str)
def test_groupnorm_elu_matches_stock_cuda(shape, dtype, channels_last):
    check_gn_elu(shape, dtype, "cuda", channels_last)


@cuda_only
@pytest.mark.parametrize("x_device, weight_device", [("cpu", "cuda"), ("cuda", "cpu")])
def test_groupnorm_elu_names_a_device_mix(x_device, weight_device):
    """A CUDA weight sends a CPU x to the CUDA kernels, whose checks run before their device
    guard: the message names the tensors, in every entry point."""
    x = torch.randn(2, 8, 4, 4, device=x_device)
    weight, bias = (t.to(weight_device) for t in make_affine(8, torch.float32, "cpu"))
    stats = [torch.zeros(2, 4, device=x_device), torch.ones(2, 4, device=x_device)]
    message = "weight must be on the same device as x"
    with pytest.raises(RuntimeError, match=message):
        OPS.groupnorm_elu(x, weight, bias, 4, 1e-5)
    with pytest.raises(RuntimeError, match=message):
        OPS.groupnorm_elu_apply(x, weight, bias, *stats)
    with pytest.raises(RuntimeError, match=message):
        OPS.groupnorm_elu_backward(torch.ones_like(x), x, weight, bias, *stats)


@cuda_only
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_groupnorm_elu_cuda_is_deterministic(channels_last):
    """Small batches split each group over several blocks; the partials merge in a fixed order."""
    shape = (1, 128, 64, 64, 16)
    x = make_input(shape, torch.float32, "cuda", channels_last)
    weight, bias = make_affine(128, torch.float32, "cuda")
    grad_y = torch.randn_like(x)
    first = OPS.groupnorm_elu(x, weight, bias, 16, 1e-5)
    first_grads = OPS.groupnorm_elu_backward(grad_y, x, weight, bias, first[1], first[2])
    for _ in range(3):
        again = OPS.groupnorm_elu(x, weight, bias, 16, 1e-5)
        for a, b in zip(again + OPS.groupnorm_elu_backward(grad_y, x, weight, bias, again[1], again[2]),
                        first + first_grads):
            assert torch.equal(a, b)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_groupnorm_elu_cpu_bits_do_not_depend_on_threads_or_batch(channels_last, dtype):
    """The CPU kernels split (sample, group) pairs over threads, channels_last in runs of
    neighbouring groups; each group still adds in one fixed order, so neither the thread count
    nor the batch a sample is in changes a bit (1,030 channels in one group: column segments)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    threads = torch.get_num_threads()
    try:
        for shape, groups in (((3, 64, 32, 32), 8), ((2, 1030, 8, 8), 1)):
            x = torch.randn(*shape).to(dtype).contiguous(memory_format=fmt)
            weight, bias = torch.randn(shape[1]).to(dtype), torch.randn(shape[1]).to(dtype)
            grad_y = torch.randn_like(x)
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                y, mean, rstd = OPS.groupnorm_elu(x, weight, bias, groups, 1e-5)
                results.append((y, mean, rstd, *OPS.groupnorm_elu_backward(grad_y, x, weight, bias, mean, rstd)))
            for one, two in zip(*results):
                assert torch.equal(one, two)
            alone = OPS.groupnorm_elu(x[1:2].contiguous(memory_format=fmt), weight, bias, groups, 1e-5)[0]
            assert torch.equal(alone[0], results[0][0][1])
    finally:
        torch.set_num_threads(threads)


@cuda_only
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_groupnorm_elu_cuda_gives_a_sample_the_same_bits_in_any_batch(channels_last):
    """Alone, a sample's groups are split over several blocks; in a batch of 140 each group is one
    block: the same bits either way (the kernels reduce fixed chunks in a fixed order)."""
    batch = make_input((140, 16, 128, 128, 4), torch.float32, "cuda", channels_last)
    weight, bias = make_affine(16, torch.float32, "cuda")
    grad_y = torch.randn_like(batch)
    alone, in_batch = batch[70:71].clone(memory_format=torch.preserve_format), batch
    outputs = []
    for x, g in [(alone, grad_y[70:71].clone(memory_format=torch.preserve_format)), (in_batch, grad_y)]:
        y, mean, rstd = OPS.groupnorm_elu(x, weight, bias, 4, 1e-5)
        grad_x = OPS.groupnorm_elu_backward(g, x, weight, bias, mean, rstd)[0]
        outputs.append([y, mean, rstd, grad_x])
    for a, b in zip(outputs[0], outputs[1]):
        assert torch.equal(a[0], b[70])


@pytest.mark.parametrize("device", DEVICES)
def test_groupnorm_elu_statistics(device):
    x = make_input((2, 12, 5, 7, 3), torch.float32, device, False)
    weight, bias = make_affine(12, torch.float32, device)
    _, mean, rstd = OPS.groupnorm_elu(x, weight, bias, 3, 1e-5)
    grouped = x.double().reshape(2, 3, -1)
    assert mean.dtype == torch.float32 and mean.shape == (2, 3)
    torch.testing.assert_close(mean.double(), grouped.mean(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd.double(), 1 / torch.sqrt(grouped.var(-1, unbiased=False) + 1e-5), rtol=1e-5, atol=0)
    # A large offset next to a small spread: no catastrophic cancellation in the statistics;
    # as accurate as nn.GroupNorm's own float32 kernel.
    shifted = x * 0.1 + 300
    y, _, _ = OPS.groupnorm_elu(shifted, weight, bias, 3, 1e-5)
    expected = stock_gn_elu(shifted.double(), weight.double(), bias.double(), 3)
    stock_error = rel_err(stock_gn_elu(shifted, weight, bias, 3), expected)
    assert rel_err(y, expected) < max(2 * stock_error, 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_groupnorm_elu_apply_uses_given_statistics(device, channels_last):
    x = make_input((2, 12, 5, 7, 3), torch.float32, device, channels_last)
    weight, bias = make_affine(12, torch.float32, device)
    y, mean, rstd = OPS.groupnorm_elu(x, weight, bias, 3, 1e-5)
    torch.testing.assert_close(OPS.groupnorm_elu_apply(x, weight, bias, mean, rstd), y, rtol=0, atol=0)
    # Other statistics give the matching affine map, so the op really reads them.
    other = OPS.groupnorm_elu_apply(x, weight, bias, mean + 1, rstd * 2)
    grouped = x.double().reshape(2, 3, 4, 5, 7)
    xhat = ((grouped - (mean.double() + 1)[:, :, None, None, None]) * 2 * rstd.double()[:, :, None, None, None]).reshape(x.shape)
    expected = F.elu(xhat * weight.double()[:, None, None] + bias.double()[:, None, None])
    assert rel_err(other, expected) < 1e-5


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_groupnorm_elu_gradcheck(channels_last):
    x = make_input((2, 6, 3, 4, 2), torch.float64, "cpu", channels_last, requires_grad=True)
    weight, bias = make_affine(6, torch.float64, "cpu")
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: qca_lowmem.groupnorm_elu(*a, 2), (x, weight, bias))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_groupnorm_elu_ops(device):
    for channels_last in (False, True):
        x = make_input((2, 12, 5, 7, 3), torch.float32, device, channels_last, requires_grad=True)
        weight, bias = (t.requires_grad_(True) for t in make_affine(12, torch.float32, device))
        torch.library.opcheck(OPS.groupnorm_elu, (x, weight, bias, 3, 1e-5))
        y, mean, rstd = OPS.groupnorm_elu(x.detach(), weight.detach(), bias.detach(), 3, 1e-5)
        plain = (x.detach(), weight.detach(), bias.detach())
        torch.library.opcheck(OPS.groupnorm_elu_apply, (*plain, mean, rstd))
        torch.library.opcheck(OPS.groupnorm_elu_backward, (torch.randn_like(y), *plain, mean, rstd))


def block_args(device, dtype=torch.float32, channels_last=False, requires_grad=True):
    block = randomize_affine(R.ConvBlock(5, 16, 12)).to(device=device, dtype=dtype)
    conv1, norm1, _, conv2, norm2, _ = block.conv_block
    x = torch.randn(2, 5, 6, 7, device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    tensors = [t.detach().clone().requires_grad_(requires_grad) for t in
               (x, conv1.weight, norm1.weight, norm1.bias, conv2.weight, norm2.weight, norm2.bias)]
    return (*tensors, norm1.num_groups, norm2.num_groups, 1e-5, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [conv_block, conv_block_keep], ids=["recompute", "keep"])
def test_opcheck_block_ops(device, op):
    for channels_last in (False, True):
        torch.library.opcheck(op, block_args(device, channels_last=channels_last))


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(2, 12, 5, 7)
    weight, bias = make_affine(12, torch.float32, "cpu")
    y, mean, rstd = OPS.groupnorm_elu(x, weight, bias, 3, 1e-5)
    cases = [
        (lambda: OPS.groupnorm_elu(x[0], weight, bias, 3, 1e-5),
         r"x must have 4 dimensions \(N, C, H, W\), got Tensor\(dtype=Float, shape=\[12, 5, 7\]"),
        (lambda: OPS.groupnorm_elu(x.int(), weight, bias, 3, 1e-5),
         r"x must be float32, float64, float16 or bfloat16, got Tensor\(dtype=Int"),
        (lambda: OPS.groupnorm_elu(x, weight[:5], bias, 3, 1e-5),
         r"weight must have shape \(C,\) with C = 12 .*got Tensor\(dtype=Float, shape=\[5\]"),
        (lambda: OPS.groupnorm_elu(x, weight, bias.double(), 3, 1e-5), r"weight and bias must have the same dtype"),
        (lambda: OPS.groupnorm_elu(x, weight, bias, 5, 1e-5),
         r"groups must be positive and divide the channels of x \(12\), got 5"),
        (lambda: OPS.groupnorm_elu(x, weight, bias, 0, 1e-5), r"groups must be positive .* got 0"),
        (lambda: OPS.groupnorm_elu(x, weight, bias, 3, -1.0), r"eps must be finite and >= 0, got -1"),
        (lambda: OPS.groupnorm_elu(x, weight, bias, 3, float("nan")), r"eps must be finite"),
        (lambda: OPS.groupnorm_elu_apply(x, weight, bias, mean.double(), rstd), r"mean must be Float .*got Tensor\(dtype=Double"),
        (lambda: OPS.groupnorm_elu_apply(x, weight, bias, mean, rstd[:, :2]),
         r"rstd must have shape|mean and rstd must have the same shape"),
        (lambda: OPS.groupnorm_elu_apply(x, weight, bias, mean[:1], rstd[:1]),
         r"mean must have shape \(N, groups\) with N = 2, got Tensor\(dtype=Float, shape=\[1, 3\]"),
        (lambda: OPS.groupnorm_elu_backward(y[:1], x, weight, bias, mean, rstd),
         r"grad_y must have the shape and dtype of x .*got Tensor\(dtype=Float, shape=\[1, 12, 5, 7\]"),
        (lambda: OPS.groupnorm_elu_backward(y.double(), x, weight, bias, mean, rstd),
         r"grad_y must have the shape and dtype of x"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_python_wrapper_is_the_op():
    x = torch.randn(2, 12, 5, 7)
    weight, bias = make_affine(12, torch.float32, "cpu")
    expected = OPS.groupnorm_elu(x, weight, bias, 3, 1e-5)[0]
    torch.testing.assert_close(qca_lowmem.groupnorm_elu(x, weight, bias, 3), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- FusedConvBlock


def grads_of(module, x, output, grad_output):
    tensors = [x] + list(module.parameters())
    return torch.autograd.grad(output, tensors, grad_output)


def compare_modules(stock, fused, x, out_tol, grad_tol, autocast_dtype=None):
    xs = x.detach().clone().requires_grad_(True)
    xf = x.detach().clone().requires_grad_(True)
    device = x.device.type
    with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        ys = stock(xs)
        yf = fused(xf)
    assert yf.shape == ys.shape
    grad_output = torch.randn(ys.shape, dtype=torch.float64, device=x.device)
    gs = grads_of(stock, xs, ys, grad_output.to(ys.dtype))
    gf = grads_of(fused, xf, yf, grad_output.to(yf.dtype))
    assert rel_err(yf, ys) <= out_tol
    names = ["input"] + [name for name, _ in fused.named_parameters()]
    for name, a, b in zip(names, gf, gs):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) <= grad_tol, (name, rel_err(a, b))
    return ys, yf


def compare_under_autocast(stock, fused, x, dtype, slack=2.0):
    """Under autocast the fused module is about as close to the float64 truth as the stock one.

    Their bits differ (GN+ELU rounds its output to `dtype` where stock keeps float32, so grads
    meeting at a skip connection add in `dtype`; cuDNN reduces in its own order), and one tensor's
    error varies a lot from seed to seed for both. So each is measured against the same float64
    computation, per tensor as ||a - truth|| / ||truth||, and the mean over the output and every
    gradient must stay within `slack` times stock's (0.7-1.6x over 40 seeds on the CPU).
    Returns the fused output."""
    truth = copy.deepcopy(stock).double()
    xt = x.detach().double().requires_grad_(True)
    yt = truth(xt)
    grad_output = torch.randn(yt.shape, dtype=torch.float64, device=x.device)
    expected = [yt] + list(grads_of(truth, xt, yt, grad_output))
    mean_error = {}
    for kind, module in (("stock", stock), ("fused", fused)):
        xi = x.detach().clone().requires_grad_(True)
        with torch.autocast(x.device.type, dtype=dtype):
            y = module(xi)
        if kind == "fused":
            fused_output = y
        values = [y] + list(grads_of(module, xi, y, grad_output.to(y.dtype)))
        errors = [((v.double() - t).norm() / t.norm()).item() for v, t in zip(values, expected)]
        mean_error[kind] = sum(errors) / len(errors)
    assert mean_error["fused"] <= slack * mean_error["stock"], mean_error
    return fused_output


def stock_and_fused_block(dtype, device="cpu", mid=None):
    stock = randomize_affine(R.ConvBlock(5, 16, mid)).to(device=device, dtype=dtype)
    fused = qca_lowmem.FusedConvBlock(5, 16, mid).to(device=device, dtype=dtype)
    fused.load_state_dict(stock.state_dict(), strict=True)
    return stock, fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_block_matches_stock(device, keep, channels_last, dtype):
    stock, fused = stock_and_fused_block(dtype, device, mid=24)
    fused.recompute = not keep
    x = torch.randn(2, 5, 9, 7, dtype=dtype, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    tight = dtype == torch.float64
    compare_modules(stock, fused, x, 1e-12 if tight else 1e-5, 1e-12 if tight else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_block_bf16_autocast(device):
    stock, fused = stock_and_fused_block(torch.float32, device)
    yf = compare_under_autocast(stock, fused, torch.randn(2, 5, 8, 8, device=device), torch.bfloat16)
    assert yf.dtype == torch.bfloat16  # the next convolution would cast to it anyway


def test_block_parameters_and_keys_match_stock():
    stock = R.ConvBlock(5, 16, 24)
    fused = qca_lowmem.FusedConvBlock(5, 16, 24)
    assert list(fused.state_dict()) == list(stock.state_dict())
    assert [(n, p.shape) for n, p in fused.named_parameters()] == [(n, p.shape) for n, p in stock.named_parameters()]
    for channels in (1, 8, 12, 16, 24, 30, 128):
        assert (qca_lowmem.FusedConvBlock(3, channels).conv_block[4].num_groups
                == R.ConvBlock(3, channels).conv_block[4].num_groups)


@qca_lowmem.keeps_values  # it changes no value: the fused backward runs under it
class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def forward_convolutions(counts):
    """Forward convolutions among counted ops: a block's own run below autograd shows them as
    conv2d (its composite is not taken apart there), autograd's as convolution."""
    return counts.get(torch.ops.aten.convolution.default, 0) + counts.get(torch.ops.aten.conv2d.default, 0)


def backward_counts(module, x, **keep):
    y = module(x, **keep) if keep else module(x)
    with CountOps() as counter:
        y.sum().backward()
    return counter.counts


def test_block_switch_keeps_intermediates_and_recomputes_nothing():
    stock, fused = stock_and_fused_block(torch.float32)
    x = torch.randn(1, 5, 8, 8, requires_grad=True)
    recompute = backward_counts(fused, x)
    assert forward_convolutions(recompute) == 2
    with qca_lowmem.keep_block_intermediates():
        assert qca_lowmem.block_keeps_intermediates()
        kept = backward_counts(fused, x)
        saved_keep = qca_lowmem.saved_bytes(fused, x)
    assert not qca_lowmem.block_keeps_intermediates()
    assert forward_convolutions(kept) == 0
    assert kept[torch.ops.aten.convolution_backward.default] == 2
    saved_recompute = qca_lowmem.saved_bytes(fused, x)
    # the input and 2x2 statistics (2 groups each), versus also h1, a1 and h2 (16 channels each)
    assert saved_recompute == x.numel() * 4 + 4 * 2 * 4 * 1
    assert saved_keep == saved_recompute + 3 * 16 * 64 * 4
    fused.recompute = False
    assert forward_convolutions(backward_counts(fused, x)) == 0


def test_block_recompute_replays_forward_autocast():
    """Forward under bf16 autocast, backward outside it: the recompute runs in bf16 again, so the
    gradients equal those of the block that kept its bf16 intermediates, bit for bit."""
    _, fused = stock_and_fused_block(torch.float32)
    x = torch.randn(2, 5, 8, 8, requires_grad=True)
    grads = []
    for keep in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fused(x, keep_intermediates=keep)
        grads.append(torch.autograd.grad(y.float().square().sum(), [x] + list(fused.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- UNetUnitary


def stock_and_fused_unet(dtype=torch.float32, device="cpu", recompute="unet", d=2, h=8):
    stock = randomize_affine(R.UNetUnitary(d, h)).to(device=device, dtype=dtype)
    with torch.no_grad():  # a visible output layer, so the gradients reach every block
        stock.outc.weight.normal_(0, 0.3)
    fused = qca_lowmem.UNetUnitary(d, h, recompute=recompute).to(device=device, dtype=dtype)
    fused.load_state_dict(stock.state_dict(), strict=True)
    return stock, fused


@pytest.mark.parametrize("swapped", ["all", "inc.conv_block.0.weight"])
@pytest.mark.parametrize("recompute", ["unet", "blocks", "none"])
def test_unet_under_functional_call_differentiates_the_parameters_given(recompute, swapped):
    """torch.func.functional_call swaps the given tensors in for its call alone: the U-Net's
    checkpoint recomputes in backward, after the call, on the tensors its forward ran on (it
    recomputed on the module's own, 10-30% off in every gradient)."""
    stock, fused = stock_and_fused_unet(torch.float64, recompute=recompute)
    given = {name: (p.detach() * 1.1).requires_grad_() for name, p in stock.named_parameters()
             if swapped == "all" or name == swapped}
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    grads = []
    for model in (stock, fused):
        y = torch.func.functional_call(model, given, (x,))
        grads.append(torch.autograd.grad(y.square().sum(), list(given.values())))
        assert all(p.grad is None for p in model.parameters())
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_unet_state_dict_is_the_stock_one():
    stock, fused = R.UNetUnitary(3, 8), qca_lowmem.UNetUnitary(3, 8)
    assert list(fused.state_dict()) == list(stock.state_dict())
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in stock.parameters())
    stock.load_state_dict(fused.state_dict(), strict=True)
    assert fused.outc.weight.std() < 1e-4  # stock init of the output layer
    with pytest.raises(ValueError, match="recompute must be one of"):
        qca_lowmem.UNetUnitary(3, 8, recompute="sometimes")
    with pytest.raises(ValueError, match="UNetUnitary: d_state must be an int >= 1, got 0"):
        qca_lowmem.UNetUnitary(0, 8)
    with pytest.raises(ValueError, match="UNetUnitary: hidden_channels must be an int >= 1, got 8.0"):
        qca_lowmem.UNetUnitary(3, 8.0)
    with pytest.raises(ValueError, match="FusedConvBlock: in_channels must be an int >= 1, got 0"):
        qca_lowmem.FusedConvBlock(0, 4)
    with pytest.raises(ValueError, match="FusedConvBlock: mid_channels must be an int >= 1, got 0"):
        qca_lowmem.FusedConvBlock(4, 4, 0)
    with pytest.raises(TypeError, match="convert: module must be a torch.nn.Module, got int"):
        qca_lowmem.convert(5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", ["unet", "blocks", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_unet_matches_stock(device, recompute, dtype):
    stock, fused = stock_and_fused_unet(dtype, device, recompute)
    x = torch.randn(2, 4, 8, 12, dtype=dtype, device=device)
    tight = dtype == torch.float64
    compare_modules(stock, fused, x, 1e-12 if tight else 1e-5, 1e-12 if tight else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_unet_bf16_autocast(device, seed):
    torch.manual_seed(seed)
    stock, fused = stock_and_fused_unet(torch.float32, device)
    compare_under_autocast(stock, fused, torch.randn(2, 4, 8, 8, device=device), torch.bfloat16)


def test_unet_in_a_qca_step_matches_stock():
    stock, fused = stock_and_fused_unet(torch.float64, d=3)
    psi = R.initial_state(2, 8, 3, dtype=torch.complex128).requires_grad_(True)
    outputs = [R.step(psi, m, gamma=0.1, multiplicative=True) for m in (stock, fused)]
    grads = [torch.autograd.grad(R.evolutionary_loss([o], psi)[0], [psi] + list(m.parameters()))
             for o, m in zip(outputs, (stock, fused))]
    assert rel_err(outputs[1], outputs[0]) < 1e-12
    for a, b in zip(grads[1], grads[0]):
        assert rel_err(a, b) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_unet_equals_eager(device):
    _, fused = stock_and_fused_unet(torch.float32, device)
    x = torch.randn(2, 4, 8, 8, device=device, requires_grad=True)
    eager_y = fused(x)
    eager_grads = torch.autograd.grad(eager_y.square().sum(), [x] + list(fused.parameters()))
    compiled = torch.compile(fused, fullgraph=True)
    y = compiled(x)
    grads = torch.autograd.grad(y.square().sum(), [x] + list(fused.parameters()))
    assert rel_err(y, eager_y) < 1e-5
    for a, b in zip(grads, eager_grads):
        assert rel_err(a, b) < 1e-4


@pytest.mark.slow
def test_compiled_block_follows_the_switch():
    """Reading the switch compiles (fullgraph) and is guarded: the compiled block keeps its
    intermediates inside keep_block_intermediates() and recomputes outside it."""
    _, fused = stock_and_fused_block(torch.float32)
    compiled = torch.compile(fused, fullgraph=True)
    x = torch.randn(1, 5, 8, 8, requires_grad=True)
    for keep, convolutions in ((False, 2), (True, 0), (False, 2)):
        with qca_lowmem.keep_block_intermediates(keep):
            y = compiled(x)
        torch.testing.assert_close(y, fused(x), rtol=1e-6, atol=1e-6)
        with CountOps() as counter:
            y.sum().backward()
        assert forward_convolutions(counter.counts) == convolutions


def test_step_saved_bytes_fused_unet_at_least_3x_below_stock():
    stock, fused = stock_and_fused_unet(torch.float32, d=14, h=16)
    psi = R.initial_state(1, 32, 14).requires_grad_(True)
    stock_bytes = qca_lowmem.saved_bytes(R.step, psi, stock)
    fused_bytes = qca_lowmem.saved_bytes(R.step, psi, fused, multiplicative=True)
    per_block = copy.deepcopy(fused)
    per_block.recompute = "blocks"
    block_bytes = qca_lowmem.saved_bytes(R.step, psi, per_block, multiplicative=True)
    print(f"\nsaved bytes of one QCA step (grid 32, d 14, hidden 16): stock UNet {stock_bytes}, "
          f"fused UNet {fused_bytes} ({stock_bytes / fused_bytes:.2f}x less), "
          f"per-block recompute {block_bytes} ({stock_bytes / block_bytes:.2f}x less)")
    assert stock_bytes >= 3 * fused_bytes
    # The U-Net keeps only its input: the rest is the stock step's own (psi, a, n, |n|, ...).
    x_bytes = 2 * 14 * 32 * 32 * 4
    assert fused_bytes == x_bytes + qca_lowmem.saved_bytes(R.step, psi, lambda t: t * 1.0, multiplicative=True)
    assert stock_bytes >= 1.8 * block_bytes


def test_unet_inside_keep_switch_saves_like_stock_and_recomputes_nothing():
    _, fused = stock_and_fused_unet(torch.float32)
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    # By default backward re-runs the U-Net once, its blocks keeping their intermediates then.
    counts = backward_counts(fused, x)
    assert counts.get(torch.ops.qca_lowmem.conv_block_keep.default, 0) == 6
    assert counts.get(torch.ops.qca_lowmem.conv_block.default, 0) == 0
    assert forward_convolutions(counts) >= 1  # up-convolutions
    with qca_lowmem.keep_block_intermediates():
        counts = backward_counts(fused, x)
        kept = qca_lowmem.saved_bytes(fused, x)
    assert counts.get(torch.ops.qca_lowmem.conv_block_keep.default, 0) == 0
    assert forward_convolutions(counts) == 0
    fused.recompute = "none"
    assert qca_lowmem.saved_bytes(fused, x) == kept
    fused.recompute = "unet"
    assert qca_lowmem.saved_bytes(fused, x) < kept / 3


# ---------------------------------------------------------------- convert()


class OtherBlock(nn.Module):
    def __init__(self, norm, act, bias=False):
        super().__init__()
        self.conv_block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=bias), norm, act, nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.GroupNorm(1, 8), nn.ELU())

    def forward(self, x):
        return self.conv_block(x)


def test_convert_keeps_parameters_and_matches():
    model = randomize_affine(R.UNetUnitary(2, 8))
    reference = copy.deepcopy(model)
    params_before = {name: p for name, p in model.named_parameters()}
    converted, report = qca_lowmem.convert(model)
    assert converted is model
    assert sorted(report.converted) == sorted(["inc", "down1.1", "down2.1", "bot", "conv_up1", "conv_up2"])
    assert report.skipped == []
    assert "converted 6" in str(report)
    assert all(isinstance(model.get_submodule(name), qca_lowmem.FusedConvBlock) for name in report.converted)
    assert {name: p for name, p in model.named_parameters()}.keys() == params_before.keys()
    assert all(p is params_before[name] for name, p in model.named_parameters())
    x = torch.randn(2, 4, 8, 8)
    compare_modules(reference, model, x, 1e-5, 1e-4)


def test_adamw_step_after_convert_equals_one_before():
    torch.manual_seed(1)
    model = randomize_affine(R.UNetUnitary(2, 8))
    with torch.no_grad():
        model.outc.weight.normal_(0, 0.3)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 4, 8, 8)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=1e-5) for m in (model, twin)]
    for step in range(2):
        if step == 1:
            qca_lowmem.convert(model)  # the optimizer built before still holds the right Parameters
        for m, opt in zip((model, twin), optimizers):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert any(isinstance(m, qca_lowmem.FusedConvBlock) for m in model.modules())


def test_convert_leaves_other_blocks_alone_and_reports_them():
    class WithExtra(R.ConvBlock):
        def __init__(self):
            super().__init__(8, 8)
            self.skip = nn.Identity()

    model = nn.ModuleDict({
        "stock": R.ConvBlock(8, 8),
        "batchnorm": OtherBlock(nn.BatchNorm2d(8), nn.ELU()),
        "relu": OtherBlock(nn.GroupNorm(1, 8), nn.ReLU()),
        "elu_alpha": OtherBlock(nn.GroupNorm(1, 8), nn.ELU(alpha=0.5)),
        "conv_bias": OtherBlock(nn.GroupNorm(1, 8), nn.ELU(), bias=True),
        "extra": WithExtra(),
    })
    kept = {name: model[name] for name in model if name != "stock"}
    _, report = qca_lowmem.convert(model)
    assert report.converted == ["stock"]
    reasons = dict(report.skipped)
    assert "expected GroupNorm" in reasons["batchnorm"] and "BatchNorm2d" in reasons["batchnorm"]
    assert "ReLU" in reasons["relu"] and "expected ELU" in reasons["relu"]
    assert "alpha=0.5" in reasons["elu_alpha"]
    assert "bias" in reasons["conv_bias"]
    assert "besides conv_block" in reasons["extra"]
    assert all(model[name] is module for name, module in kept.items())
    assert "left 5 alone" in str(report)


@pytest.mark.parametrize("affine", ["weight", "bias"])
def test_a_groupnorm_affine_set_to_none_runs_the_stock_layers_and_is_not_converted(affine):
    """A GroupNorm keeps affine=True when a researcher sets its weight or bias to None (torch's
    group_norm then skips it): the fused block, asking at each call, runs the stock layers, and
    convert() leaves such a block alone, naming it."""
    stock_block = randomize_affine(R.ConvBlock(4, 8))
    fused, _ = qca_lowmem.convert(copy.deepcopy(stock_block))
    for block in (stock_block, fused):
        setattr(block.conv_block[4], affine, None)
    x = torch.randn(2, 4, 8, 8)
    assert not fused.runs_fused()
    assert torch.equal(fused(x), stock_block(x))
    _, report = qca_lowmem.convert(nn.ModuleDict({"edited": stock_block}))
    assert report.converted == [] and f"GroupNorm whose {affine} is None" in dict(report.skipped)["edited"]


def test_convert_root_block_and_shared_block():
    block = randomize_affine(R.ConvBlock(4, 8))
    fused, report = qca_lowmem.convert(block)
    assert isinstance(fused, qca_lowmem.FusedConvBlock) and report.converted == [""]
    assert fused.conv_block is block.conv_block
    shared = R.ConvBlock(8, 8)
    model = nn.Sequential(shared, shared)
    qca_lowmem.convert(model)
    assert model[0] is model[1] and isinstance(model[0], qca_lowmem.FusedConvBlock)
    assert qca_lowmem.convert(model)[1].converted == []  # converting twice changes nothing


@pytest.mark.slow
def test_compiled_block_under_autocast_equals_eager():
    _, fused = stock_and_fused_block(torch.float32)
    compiled = torch.compile(fused, fullgraph=True)
    x = torch.randn(2, 5, 8, 8, requires_grad=True)
    results = []
    for run in (fused, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(x)
        results.append((y, torch.autograd.grad(y.float().square().sum(), [x] + list(fused.parameters()))))
    (y_eager, g_eager), (y_compiled, g_compiled) = results
    assert y_compiled.dtype == torch.bfloat16
    assert rel_err(y_compiled, y_eager) < 1e-2
    for a, b in zip(g_compiled, g_eager):
        assert a.dtype == b.dtype and rel_err(a, b) < 3e-2


@pytest.mark.slow
def test_benchmark_script_runs_its_help_without_a_gpu():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_block.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--batches" in result.stdout and "block_<device>.json" in result.stdout


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 3, 3), (2, 32, 64, 64)])
def test_groupnorm_elu_with_a_non_finite_value_gives_what_torch_gives_group_by_group(value, channels_last, dtype, shape):
    """An inf or NaN anywhere in a group, not only first: the whole group NaN, as torch's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    per_group = shape[1] // 2
    x[0, per_group - 1, shape[2] // 2, shape[3] - 1] = value
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    affine = torch.float32 if dtype == torch.bfloat16 else dtype
    weight, bias = torch.rand(shape[1], generator=g).to(affine) + 0.5, torch.randn(shape[1], generator=g).to(affine)
    ours = qca_lowmem.groupnorm_elu(x, weight, bias, 2, 1e-5).float()
    theirs = F.elu(F.group_norm(x.to(affine), 2, weight, bias, 1e-5)).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert bool(ours[0, :per_group].isnan().all()) and not bool(ours[1].isnan().any())
