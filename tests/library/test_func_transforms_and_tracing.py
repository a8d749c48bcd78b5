"""torch.func transforms (vmap, jacrev, jvp, grad), forward-mode AD (torch.autograd.forward_ad)
and torch.jit tracing through qca_lowmem's modules and rollout: the fused block and U-Net run their
stock layers under any (the transform gets stock's answer, to the bit, the trace stock's ops;
outside, they run fused again), the op wrappers name themselves under a transform or given dual
tensors, and rollout refuses both."""

import pytest
import torch
from torch.autograd import forward_ad

import qca_lowmem
from helpers import randomize_affine
from qca_lowmem import stock as R


def _models(kind, recompute="unet"):
    """(stock, fused) in float64: the U-Net, a stock U-Net converted in place, or one block."""
    torch.manual_seed(3)
    if kind == "block":
        stock = randomize_affine(R.ConvBlock(4, 8)).double()
        fused = qca_lowmem.FusedConvBlock.from_stock(R.ConvBlock(4, 8).double())
        fused.load_state_dict(stock.state_dict())
        return stock, fused
    stock = randomize_affine(R.UNetUnitary(2, 4)).double()
    with torch.no_grad():
        stock.outc.weight.normal_(0, 0.3)
    if kind == "converted":
        fused = R.UNetUnitary(2, 4).double()
        fused.load_state_dict(stock.state_dict())
        qca_lowmem.convert(fused)
    else:
        fused = qca_lowmem.UNetUnitary(2, 4, recompute=recompute).double()
        fused.load_state_dict(stock.state_dict())
    return stock, fused


def _transforms(model, x):
    """What a researcher computes with torch.func on a model, by name."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    return {
        "vmap": lambda: torch.func.vmap(model)(x.unsqueeze(1)),
        "jacrev": lambda: torch.func.jacrev(model)(x[:1, :, :4, :4]),
        "jvp": lambda: torch.func.jvp(model, (x,), (torch.ones_like(x),)),
        "grad": lambda: torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square().sum())(params),
        "forward_ad": lambda: _dual_forward(model, x),
    }


def _dual_forward(model, x):
    """torch.autograd.forward_ad's JVP of the model at x along ones: (output, tangent)."""
    with forward_ad.dual_level():
        return tuple(forward_ad.unpack_dual(model(forward_ad.make_dual(x, torch.ones_like(x)))))


@pytest.mark.parametrize("transform", ["vmap", "jacrev", "jvp", "grad", "forward_ad"])
@pytest.mark.parametrize("kind,recompute", [("unet", "unet"), ("unet", "blocks"), ("unet", "none"),
                                            ("converted", None), ("block", None)])
def test_a_transform_of_the_fused_modules_gets_stocks_answer(kind, recompute, transform, fused_ops_counted):
    """Under the transform the fused paths step aside (they raised before: our ops have no rule
    for it); the stock layers run, so the result is stock's bit for bit; outside it again, the
    same module runs fused."""
    stock, fused = _models(kind, recompute)
    x = torch.randn(3, 4, 8, 8, dtype=torch.float64)
    expected = _transforms(stock, x)[transform]()
    got = _transforms(fused, x)[transform]()
    assert not fused_ops_counted, "a fused op ran under the transform"
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(a, b)
    fused(x)
    assert fused_ops_counted, "the module no longer runs fused outside the transform"


def _op_call(name):
    """(a scalar function of one argument calling the op, that argument)."""
    psi = R.initial_state(1, 8, 2, "cpu")
    x = torch.randn(1, 4, 8, 8)
    return {
        "qca_pack": (lambda p: qca_lowmem.qca_pack(p).sum(), psi),
        "qca_update": (lambda d: qca_lowmem.qca_update(psi, d).abs().sum(), x),
        "phase_flip": (lambda p: qca_lowmem.phase_flip(p, 0.5, 1, 1).abs().sum(), psi),
        "groupnorm_elu": (lambda y: qca_lowmem.groupnorm_elu(y, torch.ones(4), torch.zeros(4), 2).sum(), x),
    }[name]


@pytest.mark.parametrize("name", ["qca_pack", "qca_update", "phase_flip", "groupnorm_elu"])
def test_torch_func_through_an_op_names_the_op(name):
    function, argument = _op_call(name)
    with pytest.raises(RuntimeError, match=rf"qca_lowmem.{name}: torch.func transforms .* not supported"):
        torch.func.grad(function)(argument)


@pytest.mark.parametrize("name", ["qca_pack", "qca_update", "phase_flip", "groupnorm_elu"])
def test_a_dual_tensor_through_an_op_names_the_op(name):
    function, argument = _op_call(name)
    with forward_ad.dual_level():
        function(argument)  # no tangent: the op runs
        with pytest.raises(RuntimeError, match=rf"qca_lowmem.{name}: forward-mode AD .* not supported"):
            function(forward_ad.make_dual(argument, torch.ones_like(argument)))


@pytest.mark.parametrize("checkpoint", ["none", "step", "revolve", "auto"])
@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_rollout_inside_a_transform_refuses_naming_itself(checkpoint, transform):
    """Its probe, autograd Function and recomputes cannot run under a transform (torch's error
    named none of them)."""
    options = {"revolve": dict(slots=2), "auto": dict(budget=10**6)}.get(checkpoint, {})

    def episode(psi):
        return qca_lowmem.rollout(lambda s: 0.9 * s + s.sin(), psi, 3, checkpoint=checkpoint, **options)[0].sum()
    run = torch.func.vmap(episode) if transform == "vmap" else torch.func.grad(episode)
    with pytest.raises(RuntimeError, match=r"^rollout: called inside a torch.func transform"):
        run(torch.randn(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", ["none", "step", "revolve", "auto"])
def test_rollout_inside_a_forward_ad_level_refuses_naming_itself(checkpoint):
    options = {"revolve": dict(slots=2), "auto": dict(budget=10**6)}.get(checkpoint, {})
    psi = torch.randn(2, 4, dtype=torch.float64)
    with forward_ad.dual_level():
        with pytest.raises(RuntimeError, match=r"^rollout: called inside a forward-mode AD level"):
            qca_lowmem.rollout(lambda s: 0.9 * s + s.sin(), forward_ad.make_dual(psi, torch.ones_like(psi)), 3,
                               checkpoint=checkpoint, **options)
    qca_lowmem.rollout(lambda s: 0.9 * s + s.sin(), psi, 3, checkpoint=checkpoint, **options)  # outside, it runs


@pytest.mark.parametrize("kind,recompute", [("unet", "unet"), ("unet", "none"), ("converted", None), ("block", None)])
def test_a_trace_of_the_fused_modules_records_the_stock_ops(kind, recompute, fused_ops_counted):
    """torch.jit.trace (and the ONNX export built on it) of a model after enable() or convert():
    the stock layers run while tracing, so the trace holds torch's ops alone (it failed its sanity
    check, on a Python op wrapping our custom ops), computes stock's output, and loads without
    qca_lowmem."""
    stock, fused = _models(kind, recompute)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    traced = torch.jit.trace(fused, x, check_trace=False)  # the check runs the module again, untraced
    assert not fused_ops_counted, "a fused op ran while tracing"
    torch.jit.trace(fused, x)  # with its check
    kinds = {node.kind() for node in traced.inlined_graph.nodes()}
    assert not any(k.startswith("qca_lowmem") or k == "prim::PythonOp" for k in kinds), sorted(kinds)
    y = torch.randn(3, 4, 8, 8, dtype=torch.float64)
    assert torch.equal(traced(y), stock(y))
    fused(x)
    assert fused_ops_counted, "the module no longer runs fused after tracing"


@pytest.mark.parametrize("kind,recompute", [("unet", "unet"), ("unet", "blocks"), ("converted", None), ("block", None)])
def test_a_script_of_the_fused_modules_compiles_the_stock_ops(kind, recompute, fused_ops_counted, tmp_path):
    """torch.jit.script of the fused U-Net, a model converted in place or a fused block (where a
    stock model scripts): TorchScript compiles the stock layers' calls (the fused path is Python
    it cannot compile), on the same Parameters, so the script computes what stock's script does,
    gradients included, and saves and loads as torch's ops alone; the module keeps running fused."""
    stock, fused = _models(kind, recompute)
    scripted, stock_scripted = torch.jit.script(fused), torch.jit.script(stock)
    kinds = {node.kind() for node in scripted.inlined_graph.nodes()}
    assert not any(k.startswith("qca_lowmem") or k == "prim::PythonOp" for k in kinds), sorted(kinds)
    assert {n for n, _ in scripted.named_parameters()} == {n for n, _ in fused.named_parameters()}
    assert all(a is b for a, b in zip(scripted.parameters(), fused.parameters()))
    y = torch.randn(3, 4, 8, 8, dtype=torch.float64)
    out, expected = scripted(y), stock_scripted(y)
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.square().sum(), list(scripted.parameters()))
    expected_grads = torch.autograd.grad(expected.square().sum(), list(stock_scripted.parameters()))
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
    torch.jit.save(scripted, tmp_path / "scripted.pt")
    assert torch.equal(torch.jit.load(tmp_path / "scripted.pt")(y), expected)
    assert not fused_ops_counted
    fused(y)
    assert fused_ops_counted, "the module no longer runs fused after scripting"
