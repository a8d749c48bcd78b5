"""Second-order gradients (create_graph=True): every differentiable op gives torch's answer
(gradgradcheck in float64, values against qca_lowmem.stock), and what cannot build a graph raises
naming itself. Never the silent zero of an op whose backward has no autograd."""

import pytest
import torch
from torch.autograd import gradgradcheck

import qca_lowmem
from helpers import randomize_affine
from qca_lowmem import stock
from qca_lowmem.ops.qca_step import fused_step

OPS = torch.ops.qca_lowmem


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny float64 graphs: one thread keeps them fast on a shared machine."""


def complex_state(b=1, h=3, w=4, d=2):
    return torch.randn(b, h, w, d, dtype=torch.complex128, requires_grad=True)


def real(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


@pytest.mark.parametrize("multiplicative, gamma", [(True, 0.0), (False, 0.1)])
def test_qca_update_gradgradcheck(multiplicative, gamma):
    psi, delta = complex_state(1, 2, 3, 2), real(1, 4, 2, 3)
    assert gradgradcheck(lambda p, dl: qca_lowmem.qca_update(p, dl, gamma, multiplicative), (psi, delta))


@pytest.mark.parametrize("channels_last", [False, True])
def test_qca_pack_gradgradcheck(channels_last):
    assert gradgradcheck(lambda p: qca_lowmem.qca_pack(p, channels_last=channels_last), (complex_state(),))


def test_groupnorm_elu_gradgradcheck():
    x, weight, bias = real(2, 4, 2, 2), 1 + 0.3 * real(4, requires_grad=False), 0.3 * real(4, requires_grad=False)
    weight.requires_grad_(), bias.requires_grad_()
    assert gradgradcheck(lambda *a: qca_lowmem.groupnorm_elu(*a, groups=2), (x, weight, bias))


@pytest.mark.parametrize("conjugate", [False, True])
def test_noise_gradgradcheck(conjugate):
    psi = complex_state(2, 3, 3, 2)
    assert gradgradcheck(lambda p: qca_lowmem.phase_flip(p, 0.5, 7, 3, conjugate=conjugate), (psi,))
    assert gradgradcheck(lambda p: qca_lowmem.bit_flip(p, 0.5, 7, 3), (psi,))


def second_order(fn, inputs, params):
    """d/d params of |d sum(fn(inputs)) / d inputs|^2: a gradient penalty."""
    grads = torch.autograd.grad(fn(*inputs).abs().sum(), inputs, create_graph=True)
    penalty = sum((g.abs() ** 2).sum() for g in grads)
    return torch.autograd.grad(penalty, params)


def assert_same_nonzero(ours, expected):
    assert any(e.abs().max() > 1e-3 for e in expected), "the stock second-order gradient is ~0: a weak test"
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_qca_update_penalty_equals_stock():
    psi, delta = complex_state(), real(1, 4, 3, 4)
    ours = second_order(lambda p: qca_lowmem.qca_update(p, delta), (psi,), (psi, delta))
    expected = second_order(lambda p: stock.update(p, delta), (psi,), (psi, delta))
    assert_same_nonzero(ours, expected)


def test_groupnorm_elu_penalty_equals_stock():
    x, weight, bias = real(2, 8, 3, 3), real(8), real(8)
    ours = second_order(lambda t: qca_lowmem.groupnorm_elu(t, weight, bias, 4), (x,), (x, weight, bias))
    expected = second_order(lambda t: torch.nn.functional.elu(torch.nn.functional.group_norm(t, 4, weight, bias)),
                            (x,), (x, weight, bias))
    assert_same_nonzero(ours, expected)


@pytest.mark.parametrize("recompute", [True, False])
def test_fused_block_penalty_equals_stock(recompute):
    block = randomize_affine(stock.ConvBlock(3, 16)).double()
    fused = qca_lowmem.FusedConvBlock.from_stock(block, recompute=recompute)
    x = real(1, 3, 5, 5)
    params = (x, *block.parameters())
    assert_same_nonzero(second_order(fused, (x,), params), second_order(block, (x,), params))


@pytest.mark.parametrize("recompute", ["unet", "blocks", "none"])
def test_fused_unet_step_penalty_equals_stock(recompute):
    """A Hessian-vector product's worth of the whole fused step (pack, U-Net, update)."""
    model = randomize_affine(stock.UNetUnitary(2, 8)).double()
    with torch.no_grad():
        model.outc.weight.normal_(0.0, 0.3)
    fused = qca_lowmem.UNetUnitary(2, 8, recompute=recompute).double()
    fused.load_state_dict(model.state_dict())
    psi = complex_state(1, 8, 8, 2)
    ours = second_order(fused_step(fused, 0.0, True), (psi,), (psi, *fused.parameters()))
    expected = second_order(lambda p: stock.step(p, model), (psi,), (psi, *model.parameters()))
    assert_same_nonzero(ours, expected)


def test_first_order_under_create_graph_equals_the_kernels():
    psi, delta = complex_state(), real(1, 4, 3, 4)
    grad_out = torch.randn(1, 3, 4, 2, dtype=torch.complex128)
    plain = torch.autograd.grad(qca_lowmem.qca_update(psi, delta), (psi, delta), grad_out)
    graphed = torch.autograd.grad(qca_lowmem.qca_update(psi, delta), (psi, delta), grad_out, create_graph=True)
    for a, b in zip(graphed, plain):
        assert a.requires_grad
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def not_implemented(op):
    return pytest.raises(RuntimeError, match=rf"derivative for .*qca_lowmem::{op}.* is not implemented")


def test_ops_without_a_derivative_refuse_by_name():
    """The backward ops (and groupnorm_elu_apply, a recompute helper) have no autograd: their
    outputs raise when differentiated, never a silent zero."""
    psi, delta = complex_state(), real(1, 4, 3, 4)
    grad_psi, _ = OPS.qca_update_backward(torch.ones_like(psi), psi, delta, 0.0, True, 1e-9)
    with not_implemented("qca_update_backward"):
        grad_psi.abs().sum().backward()
    with not_implemented("qca_pack_backward"):
        OPS.qca_pack_backward(real(1, 4, 3, 4), torch.complex128).abs().sum().backward()
    x, weight, bias = real(2, 4, 3, 3), real(4), real(4)
    _, mean, rstd = OPS.groupnorm_elu(x.detach(), weight.detach(), bias.detach(), 2, 1e-5)
    grad_x, _, _ = OPS.groupnorm_elu_backward(torch.ones_like(x), x, weight, bias, mean, rstd)
    with not_implemented("groupnorm_elu_backward"):
        grad_x.sum().backward()
    with not_implemented("groupnorm_elu_apply"):
        OPS.groupnorm_elu_apply(x, weight, bias, mean, rstd).sum().backward()


@pytest.mark.parametrize("checkpoint, slots", [("step", None), ("revolve", 2)])
def test_recomputing_rollout_refuses_a_graph_and_none_gives_stock(checkpoint, slots):
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Tanh()).double()
    step = fused_step(net, 0.05, False)
    psi0 = complex_state(1, 4, 4, 2)

    def run(mode, slots=None, fn=step):
        psi_T, _ = qca_lowmem.rollout(fn, psi0, 3, checkpoint=mode, slots=slots)
        return psi_T.abs().sum()

    with pytest.raises(RuntimeError, match=rf"rollout\(checkpoint='{checkpoint}'\): no second-order gradients"):
        torch.autograd.grad(run(checkpoint, slots), psi0, create_graph=True)
    first = torch.autograd.grad(run(checkpoint, slots), psi0)[0]  # first order still works
    params = (psi0, *net.parameters())
    ours = torch.autograd.grad(run("none"), psi0, create_graph=True)[0]
    stock_fn = lambda p: stock.update(p, net(stock.pack(p)), 0.05, False)  # noqa: E731
    expected = torch.autograd.grad(run("none", fn=stock_fn), psi0, create_graph=True)[0]
    torch.testing.assert_close(first, expected.detach(), rtol=1e-9, atol=1e-12)
    assert_same_nonzero(torch.autograd.grad((ours.abs() ** 2).sum(), params),
                        torch.autograd.grad((expected.abs() ** 2).sum(), params))
