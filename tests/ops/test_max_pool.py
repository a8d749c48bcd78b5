"""max_pool2x2 against torch's max_pool2d(x, 2): the same values and gradients, bit for bit, on
random inputs and on the cases where a rule decides (ties, NaN, -infinity, -0 gradients); its
layouts, checks, opcheck and gradcheck."""

import pytest
import torch
import torch.nn.functional as F

from helpers import DEVICES, pool_specials
from qca_lowmem.ops.max_pool import layout, max_pool2x2

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(1, 1, 2, 2), (2, 3, 5, 7), (3, 16, 8, 8), (0, 4, 6, 6), (1, 64, 17, 4)]


def bits(t):
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def same_as_torch(x, grad_y_of):
    """max_pool2x2 and F.max_pool2d on copies of x, then their gradients for grad_y_of(y): values
    (NaN where NaN), strides and gradient bits (the sign of zero included) equal."""
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, expected = max_pool2x2(ours), F.max_pool2d(theirs, 2)
    assert y.shape == expected.shape and y.stride() == expected.stride() and y.dtype == expected.dtype
    assert torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y.nan_to_num(0.0), expected.nan_to_num(0.0))
    grad_y = grad_y_of(expected)
    y.backward(grad_y)
    expected.backward(grad_y)
    assert ours.grad.stride() == theirs.grad.stride()
    assert torch.equal(bits(ours.grad), bits(theirs.grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_inputs_equal_torch(dtype, channels_last, device):
    g = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        x = torch.randn(shape, generator=g).to(dtype).to(device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        same_as_torch(x, lambda y: torch.randn(y.shape, generator=g).to(dtype).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_nan_infinities_and_negative_zero_gradients_equal_torch(dtype, channels_last, device):
    """The first of equal maxima, the last NaN, a window of -infinities (where torch's kernel for
    the device and layout sends its gradient) and -0 gradients (+0 after torch's 0 + grad)."""
    g = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        x = pool_specials(shape, dtype, channels_last, g).to(device)

        def grad_y_of(y):
            grad = torch.randn(y.shape, generator=g).to(dtype).to(device)
            return torch.where(grad > 0.5, -0.0, grad).contiguous(memory_format=layout(x))

        same_as_torch(x, grad_y_of)


def test_a_strided_input_is_read_as_nchw():
    x = torch.randn(2, 6, 8, 10)[:, ::2, :, 1:9]
    assert layout(x) == torch.contiguous_format
    same_as_torch(x, lambda y: torch.randn(y.shape))


def test_the_backward_keeps_x_alone():
    """What the op saves for backward: x itself, no indices."""
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        max_pool2x2(x)
    assert len(saved) == 1 and saved[0] is x


@pytest.mark.parametrize("x, match", [
    (torch.randn(3, 4, 4), "4 dimensions"),
    (torch.randn(1, 2, 1, 4), "at least 2"),
    (torch.randn(1, 2, 4, 1), "at least 2"),
    (torch.ones(1, 2, 4, 4, dtype=torch.int32), "float16, bfloat16, float32 or float64"),
], ids=["3d", "one_row", "one_column", "int"])
def test_bad_input_is_refused_naming_it(x, match):
    with pytest.raises(RuntimeError, match=f"max_pool2x2: x.*{match}"):
        max_pool2x2(x)


def test_backward_op_checks_grad_y():
    x = torch.randn(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="max_pool2x2_backward: grad_y must have x's dtype and the pooled shape"):
        torch.ops.qca_lowmem.max_pool2x2_backward(torch.randn(1, 2, 4, 4), x)
    with pytest.raises(RuntimeError, match="max_pool2x2_backward: grad_y must have x's dtype"):
        torch.ops.qca_lowmem.max_pool2x2_backward(torch.randn(1, 2, 2, 2, dtype=torch.float64), x)


def test_backward_op_is_not_differentiable():
    x = torch.randn(1, 2, 4, 4)
    grad_y = torch.randn(1, 2, 2, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="max_pool2x2_backward"):
        torch.ops.qca_lowmem.max_pool2x2_backward(grad_y, x).sum().backward()


def test_gradcheck_and_second_order():
    """float64 gradcheck on distinct values (no tie where a step of eps changes the pick), and
    gradgradcheck through torch's max_pool2d."""
    x = torch.randperm(2 * 3 * 6 * 7, dtype=torch.float64).view(2, 3, 6, 7).div_(10).requires_grad_()
    assert torch.autograd.gradcheck(max_pool2x2, (x,))
    assert torch.autograd.gradgradcheck(max_pool2x2, (x,))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_opcheck(channels_last):
    x = torch.randn(2, 3, 6, 7, requires_grad=True)
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    torch.library.opcheck(torch.ops.qca_lowmem.max_pool2x2.default, (x,))
    torch.library.opcheck(torch.ops.qca_lowmem.max_pool2x2_backward.default,
                          (torch.randn(2, 3, 3, 3).contiguous(memory_format=layout(x)), x.detach()))


def test_compiles_fullgraph():
    x = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(max_pool2x2, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), F.max_pool2d(x, 2))
