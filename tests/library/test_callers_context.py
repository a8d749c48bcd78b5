"""The caller's context around a call: a torch function or dispatch mode of theirs sees each op run,
a saved-tensors hook (`torch.autograd.graph.saved_tensors_hooks`) what autograd saves. A fused path
runs and saves other ops than the stock ones it stands for, and an episode that recomputes others
than plain autograd, so under such a context that changes values (here: every convolution's output
bent a little, or what is saved rounded through bfloat16, as a researcher compresses activations)
their results would differ. There the fused block and U-Net run the stock layers and the
recomputing rollout refuses, naming it; torch's own modes and hooks (a default device, save_on_cpu)
and those marked `qca_lowmem.keeps_values` keep the fused paths."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qca_lowmem
from fixtures.switch_variants import CALLER_CONTEXTS, VALUE_KEEPING_CONTEXTS
from helpers import randomize_affine
from qca_lowmem import stock as R
from qca_lowmem.blocks import FusedConvBlock

CONTEXTS = ["none", *sorted(CALLER_CONTEXTS)]
CHANGING = [name for name in sorted(CALLER_CONTEXTS) if name not in VALUE_KEEPING_CONTEXTS]


def entered(context):
    """A context by its name in CALLER_CONTEXTS ("none": none), or made by calling `context`."""
    if callable(context):
        return context()
    return contextlib.nullcontext() if context == "none" else CALLER_CONTEXTS[context]()


def stock_and_fused_unet():
    torch.manual_seed(0)
    stock = randomize_affine(R.UNetUnitary(2, 8)).double()
    fused = qca_lowmem.UNetUnitary(2, 8).double()
    fused.load_state_dict(stock.state_dict(), strict=True)
    return stock, fused


def output_and_grads(model, x, context):
    x = x.detach().requires_grad_(True)
    with entered(context):
        y = model(x)
        return y, torch.autograd.grad(y.square().sum(), [x, *model.parameters()])


@pytest.mark.parametrize("context", CHANGING)
def test_the_fused_unet_under_a_value_changing_context_is_stocks_run_under_it(context):
    stock, fused = stock_and_fused_unet()
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    y_stock, grads_stock = output_and_grads(stock, x, context)
    y_fused, grads_fused = output_and_grads(fused, x, context)
    assert torch.equal(y_fused, y_stock)
    assert all(torch.equal(a, b) for a, b in zip(grads_fused, grads_stock))
    # The context changes stock's gradients (so the comparison above can fail): the fused run
    # without it is another one.
    _, grads_outside = output_and_grads(fused, x, "none")
    assert not torch.allclose(grads_outside[1], grads_stock[1], rtol=1e-4, atol=0)


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_fused_block_runs_fused_unless_the_context_may_change_values(context):
    torch.manual_seed(1)
    block = randomize_affine(R.ConvBlock(4, 8)).double()
    fused = FusedConvBlock.from_stock(block)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    y_stock, grads_stock = output_and_grads(block, x, context)
    y_fused, grads_fused = output_and_grads(fused, x, context)
    ran_fused = y_fused.grad_fn.name() != y_stock.grad_fn.name()
    assert ran_fused == (context not in CHANGING)
    if ran_fused:  # other kernels: rounding apart
        torch.testing.assert_close(y_fused, y_stock, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads_fused, grads_stock):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    else:
        assert torch.equal(y_fused, y_stock) and all(torch.equal(a, b) for a, b in zip(grads_fused, grads_stock))
    with entered(context), torch.no_grad():  # nothing saved, but a step entering the hook takes one path
        assert fused.runs_fused() == (context not in CHANGING)


def episode_grads(model, options, context):
    psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
    with entered(context):
        psi_T, _ = qca_lowmem.rollout(lambda psi: R.step(psi, model, multiplicative=True), psi0, 3, **options)
        return torch.autograd.grad(psi_T.abs().square().mean(), list(model.parameters()))


@pytest.mark.parametrize("options", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2),
                                     dict(checkpoint="auto", budget=10**9)], ids=["step", "revolve", "auto"])
@pytest.mark.parametrize("context", CHANGING)
def test_a_recomputing_rollout_refuses_a_value_changing_context(context, options):
    stock, _ = stock_and_fused_unet()
    named = {"rounding": "saved-tensors hook .*_through_bf16", "dispatch_mode": "torch dispatch mode .*BendConvolutions",
             "function_mode": "torch function mode .*BendConv2d"}[context]
    with pytest.raises(RuntimeError, match=rf"rollout\(checkpoint=.*under the {named}.*checkpoint='none'"):
        episode_grads(stock, options, context)


@pytest.mark.parametrize("options", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2),
                                     dict(checkpoint="auto", budget=10**9)], ids=["step", "revolve", "auto"])
@pytest.mark.parametrize("context", VALUE_KEEPING_CONTEXTS)
def test_a_recomputing_rollout_under_torchs_own_context_equals_plain_autograd(context, options):
    stock, _ = stock_and_fused_unet()
    plain = episode_grads(stock, dict(checkpoint="none"), context)
    for a, b in zip(episode_grads(stock, options, context), plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("context", CHANGING)
def test_plain_autograd_rollout_of_the_fused_unet_under_the_context_is_stocks(context):
    stock, fused = stock_and_fused_unet()
    plain = dict(checkpoint="none")
    for a, b in zip(episode_grads(fused, plain, context), episode_grads(stock, plain, context)):
        assert torch.equal(a, b)


class CountOps(TorchDispatchMode):
    """A researcher's op counter: it keeps every value."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_or_hook_marked_keeps_values_keeps_the_fused_paths():
    torch.manual_seed(1)
    fused = FusedConvBlock.from_stock(randomize_affine(R.ConvBlock(4, 8)).double())
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    with CountOps():
        assert not fused.runs_fused()
    with qca_lowmem.keeps_values(type("MarkedCountOps", (CountOps,), {}))() as marked:
        assert fused.runs_fused() and "conv_block" in fused(x).grad_fn.name().lower() and marked.ops > 0

    stock, _ = stock_and_fused_unet()
    packed = []

    @qca_lowmem.keeps_values
    def pack(tensor):  # a memory measure
        packed.append(tensor.nbytes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
        psi_T, _ = qca_lowmem.rollout(lambda psi: R.step(psi, stock, multiplicative=True), psi0, 3)
    assert packed and torch.isfinite(psi_T).all()


def test_keeps_values_marks_a_bound_method_by_its_function_and_refuses_what_it_cannot_mark():
    class Measure:
        def pack(self, tensor):
            return tensor

    measure = Measure()
    with torch.autograd.graph.saved_tensors_hooks(measure.pack, lambda tensor: tensor):
        assert qca_lowmem.ops.foreign_context() == \
            f"saved-tensors hook {__name__}.{Measure.pack.__qualname__} (torch.autograd.graph.saved_tensors_hooks)"
    assert qca_lowmem.keeps_values(measure.pack) == measure.pack
    with torch.autograd.graph.saved_tensors_hooks(Measure().pack, lambda tensor: tensor):
        assert qca_lowmem.ops.foreign_context() is None
    with pytest.raises(TypeError, match=r"keeps_values: cannot mark <built-in function len> \(a builtin_function"):
        qca_lowmem.keeps_values(len)


@pytest.mark.parametrize("options", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2)],
                         ids=["step", "revolve"])
@pytest.mark.parametrize("context", CHANGING)
def test_a_step_entering_a_value_changing_context_itself_equals_plain_autograd(context, options):
    """A context the step enters itself is there in its forward (without grad) and in its
    recompute (with grad) alike: the fused U-Net runs the stock layers in both, as in plain
    autograd, whose saved tensors the hook sees the same."""
    _, fused = stock_and_fused_unet()
    psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))

    def step(psi):
        with entered(context):
            return R.step(psi, fused, multiplicative=True)

    grads = []
    for checkpoint in (dict(checkpoint="none"), options):
        psi_T, _ = qca_lowmem.rollout(step, psi0, 3, **checkpoint)
        grads.append(torch.autograd.grad(psi_T.abs().square().mean(), list(fused.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


BACKWARD_POLICIES = [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2), dict(checkpoint="none")]


def backward_under(context, options, model):
    """The gradients of a rollout of `model` whose backward alone runs under `context` (the loss
    computed before it is entered)."""
    psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
    psi_T, _ = qca_lowmem.rollout(lambda psi: R.step(psi, model, multiplicative=True), psi0, 3, **options)
    loss = psi_T.abs().square().mean()
    with entered(context):
        return torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("options", BACKWARD_POLICIES, ids=["step", "revolve", "none"])
def test_a_pack_hook_entered_around_the_backward_alone_changes_no_gradient(options):
    """Stock's backward saves nothing through it; the recomputes save past it, bit for bit."""
    _, fused = stock_and_fused_unet()
    assert all(torch.equal(a, b) for a, b in zip(backward_under("rounding", options, fused),
                                                 backward_under("none", options, fused)))


@pytest.mark.parametrize("options", BACKWARD_POLICIES, ids=["step", "revolve", "none"])
def test_a_dispatch_mode_entered_around_the_backward_alone_is_refused_unless_marked(options):
    """The backward would run ops under it that stock's does not (the recomputes, the fused
    backward kernels): refused, naming it; a counter marked keeps_values changes nothing. (A
    torch function mode does not reach a backward: torch leaves it out there.)"""
    _, fused = stock_and_fused_unet()
    with pytest.raises(RuntimeError, match=r"its backward runs under the torch dispatch mode .*BendConvolutions.*"
                                           r"keeps_values"):
        backward_under("dispatch_mode", options, fused)
    assert all(torch.equal(a, b) for a, b in zip(backward_under("function_mode", options, fused),
                                                 backward_under("none", options, fused)))
    counter = qca_lowmem.keeps_values(type("MarkedCountOps", (CountOps,), {}))
    assert all(torch.equal(a, b) for a, b in zip(backward_under(counter, options, fused),
                                                 backward_under("none", options, fused)))
