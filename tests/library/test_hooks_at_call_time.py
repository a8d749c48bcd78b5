"""Hooks and forwards set on instances, checked when a fused block or the fused U-Net runs (not
when it was made): while any exists, the stock layers run and the hooks see what the stock
model's see, as often; the U-Net's own checkpoint context enters afresh at every recompute."""

import copy

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import classes_in_episodes, randomize_affine
from qca_lowmem import stock as R


def stock_and_converted_unet(d=2, h=8):
    """A stock U-Net (float64, visible affine and output layer) and a converted deep copy of it."""
    torch.manual_seed(0)
    stock = randomize_affine(R.UNetUnitary(d, h)).double()
    with torch.no_grad():
        stock.outc.weight.normal_(0, 0.3)
    fused = qca_lowmem.UNetUnitary(d, h).double()
    fused.load_state_dict(stock.state_dict(), strict=True)
    return stock, fused


def output_and_grads(model, x):
    x = x.detach().requires_grad_(True)
    y = model(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *model.parameters()])
    return y, grads


def assert_same_run(stock, fused, x):
    y_stock, grads_stock = output_and_grads(stock, x)
    y_fused, grads_fused = output_and_grads(fused, x)
    torch.testing.assert_close(y_fused, y_stock, rtol=1e-10, atol=1e-12)
    assert len(grads_fused) == len(grads_stock)
    for a, b in zip(grads_fused, grads_stock):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def scale_conv_outputs(calls):
    """A global forward hook that changes every Conv2d's output and counts the modules it sees."""

    def hook(module, args, output):
        calls.append(type(module).__name__)
        return output * 1.5 if isinstance(module, nn.Conv2d) else None

    return hook


def test_global_hook_registered_before_conversion_runs_in_the_fused_block_and_stops_when_removed():
    block = randomize_affine(R.ConvBlock(4, 8)).double()
    stock_calls, fused_calls = [], []
    handle = nn.modules.module.register_module_forward_hook(scale_conv_outputs(stock_calls))
    try:
        fused, _ = qca_lowmem.convert(copy.deepcopy(block))
        x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
        y_stock, grads_stock = output_and_grads(block, x)
        handle.remove()
        handle = nn.modules.module.register_module_forward_hook(scale_conv_outputs(fused_calls))
        y_fused, grads_fused = output_and_grads(fused, x)
    finally:
        handle.remove()
    torch.testing.assert_close(y_fused, y_stock, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_fused, grads_stock):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # The same layers called, once each, in order (the block itself by its own class name).
    assert [c.replace("FusedConvBlock", "ConvBlock") for c in fused_calls] == stock_calls
    assert stock_calls.count("Conv2d") == 2
    assert fused.runs_fused()  # removed: the fused path again, equal to stock without the hook
    assert_same_run(block, fused, x)


@pytest.mark.parametrize("kind", ["forward_pre_hook", "forward_hook", "full_backward_hook"])
def test_hook_on_an_inner_conv_added_after_conversion_is_called_as_stock_calls_it(kind):
    stock, fused = stock_and_converted_unet()
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    seen = {"stock": [], "fused": []}
    for name, model in (("stock", stock), ("fused", fused)):
        conv = model.down1[1].conv_block[3]
        if kind == "forward_pre_hook":
            conv.register_forward_pre_hook(lambda m, args, seen=seen[name]: seen.append(1) or (args[0] * 0.5,))
        elif kind == "forward_hook":
            conv.register_forward_hook(lambda m, args, out, seen=seen[name]: seen.append(1) or out + 0.25)
        else:
            conv.register_full_backward_hook(
                lambda m, grad_in, grad_out, seen=seen[name]: seen.append(grad_in[0].clone()) or (grad_in[0] * 2,))
    assert not fused.runs_fused() and not fused.down1[1].runs_fused()
    assert_same_run(stock, fused, x)
    assert len(seen["fused"]) == len(seen["stock"]) == 1
    if kind == "full_backward_hook":
        torch.testing.assert_close(seen["fused"][0], seen["stock"][0], rtol=1e-9, atol=1e-12)


def test_forward_set_on_an_inner_layer_instance_runs():
    stock, fused = stock_and_converted_unet()
    for model in (stock, fused):
        norm = model.bot.conv_block[1]
        norm.forward = lambda x, norm=norm: nn.GroupNorm.forward(norm, x) * 0.7
    assert not fused.bot.runs_fused()
    assert_same_run(stock, fused, torch.randn(1, 4, 8, 8, dtype=torch.float64))


def test_layer_changed_after_conversion_runs_as_stock():
    """A layer replaced (or parametrized, which changes its class) after conversion is run as it is."""
    stock, fused = stock_and_converted_unet()
    for model in (stock, fused):
        model.inc.conv_block[2] = nn.Tanh()
        nn.utils.parametrize.register_parametrization(model.bot.conv_block[0], "weight", _Halved())
    assert not fused.inc.runs_fused() and not fused.bot.runs_fused()
    assert_same_run(stock, fused, torch.randn(1, 4, 8, 8, dtype=torch.float64))


class _Halved(nn.Module):
    def forward(self, weight):
        return weight * 0.5


def test_fused_paths_return_when_hooks_go():
    stock, fused = stock_and_converted_unet()
    handle = fused.conv_up2.conv_block[4].register_forward_hook(lambda m, args, out: out * 3)
    assert not fused.runs_fused()
    handle.remove()
    assert fused.runs_fused() and all(block.runs_fused() for block in (fused.inc, fused.bot, fused.conv_up2))
    assert_same_run(stock, fused, torch.randn(1, 4, 8, 8, dtype=torch.float64))


def rollout_loss(model, psi0, steps, checkpoint, **options):
    psi_T, _ = qca_lowmem.rollout(lambda psi: R.step(psi, model, multiplicative=True), psi0, steps,
                                  checkpoint=checkpoint, **options)
    return psi_T.abs().square().mul(torch.arange(1.0, psi_T.shape[-1] + 1, dtype=torch.float64)).sum()


def test_instance_forward_writing_a_buffer_is_seen_by_the_rollout_watch():
    """A forward set on the fused U-Net's output conv writes a buffer the output then reads: the
    recomputing rollout must see the write at every step (its watch), as plain autograd runs it."""
    results = []
    for checkpoint in ("none", "step"):
        _, fused = stock_and_converted_unet()
        outc = fused.outc
        outc.register_buffer("calls", torch.zeros((), dtype=torch.float64))

        def forward(x, outc=outc):
            outc.calls.add_(1)
            return nn.Conv2d.forward(outc, x) * (1 + 0.1 * outc.calls)

        outc.forward = forward
        psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
        loss = rollout_loss(fused, psi0, 4, checkpoint)
        grads = torch.autograd.grad(loss, list(fused.parameters()))
        results.append((loss.detach(), grads, outc.calls.clone()))
    (loss_plain, grads_plain, calls_plain), (loss_step, grads_step, calls_step) = results
    assert calls_plain.item() == calls_step.item() == 4
    torch.testing.assert_close(loss_step, loss_plain, rtol=1e-12, atol=0)
    for a, b in zip(grads_step, grads_plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-14)


# ---------------------------------------------------------------- the U-Net's checkpoint context


def test_hessian_vector_product_and_second_backward_under_rollout_none_equal_stock():
    stock, fused = stock_and_converted_unet()
    psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
    results = []
    for model in (stock, fused):
        params = list(model.parameters())
        loss = rollout_loss(model, psi0, 3, "none")
        grads = torch.autograd.grad(loss, params, create_graph=True)
        vector = [torch.ones_like(p) for p in params]
        hvp = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vector)), params, retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()  # a second backward through the same graph: twice the first's
        results.append((hvp, [p.grad.clone() for p in params], grads))
    (hvp_stock, twice_stock, grads_stock), (hvp_fused, twice_fused, grads_fused) = results
    for a, b in zip(hvp_fused, hvp_stock):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    for twice, once in zip(twice_fused, grads_fused):
        torch.testing.assert_close(twice, 2 * once.detach(), rtol=1e-9, atol=1e-12)
    for a, b in zip(twice_fused, twice_stock):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_writing_hook_runs_once_a_step_under_rollout_none():
    """A forward hook that writes (counts into a buffer, appends to a list) runs once per step per
    layer, as on the stock model: the U-Net's own checkpoint would run it again in backward."""
    stock, fused = stock_and_converted_unet()
    psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(3))
    counts = []
    for model in (stock, fused):
        written = torch.zeros((), dtype=torch.float64)

        def count(module, args, output, written=written):
            written.add_(1)

        handle = model.bot.conv_block[0].register_forward_hook(count)
        rollout_loss(model, psi0, 5, "none").backward()
        handle.remove()
        counts.append(written.item())
    assert counts == [5.0, 5.0]


@pytest.mark.parametrize("register", [nn.modules.module.register_module_full_backward_hook,
                                      nn.modules.module.register_module_full_backward_pre_hook,
                                      nn.modules.module.register_module_forward_pre_hook],
                         ids=["full_backward", "full_backward_pre", "forward_pre"])
def test_every_kind_of_global_hook_sees_the_stock_calls(register):
    """The fused model does what the stock one does: the same calls, or the same error (torch
    refuses a full backward hook on a module whose output the stock block's ELU(inplace) edits)."""
    stock, fused = stock_and_converted_unet()
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    seen = []
    handle = register(lambda module, *args: seen.append(type(module).__name__))
    try:
        assert not fused.runs_fused() and not fused.inc.runs_fused()
        try:
            y_stock, grads_stock = output_and_grads(stock, x)
        except RuntimeError as error:
            with pytest.raises(RuntimeError) as caught:
                output_and_grads(fused, x)
            assert str(caught.value) == str(error)
            return
        stock_seen, seen[:] = list(seen), []
        y_fused, grads_fused = output_and_grads(fused, x)
    finally:
        handle.remove()
    assert [name.replace("FusedConvBlock", "ConvBlock") for name in seen] == stock_seen and stock_seen
    torch.testing.assert_close(y_fused, y_stock, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_fused, grads_stock):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("checkpoint", ["step", "none"])
def test_enable_with_a_global_hook_registered_before_and_removed_after_an_episode(checkpoint):
    """The users' trainer: a global forward hook that changes every GroupNorm's output, registered
    before enable() and removed after the first episode; the same run as the stock trainer's."""
    from fixtures.model_families import assert_same_run, make_trainer, run

    def halve_norms(module, args, output):
        return output * 0.5 if isinstance(module, nn.GroupNorm) else None

    runs = []
    for switched in (False, True):
        trainer = make_trainer("unet_groupnorm")
        handle = nn.modules.module.register_module_forward_hook(halve_norms)
        try:
            if switched:
                qca_lowmem.enable(trainer, checkpoint=checkpoint)
            with classes_in_episodes(trainer) as classes:
                first = run(trainer, range(1))
        finally:
            handle.remove()
        assert any(issubclass(cls, qca_lowmem.FusedConvBlock) for cls in classes[0]) if switched else not classes
        second = run(trainer, range(1, 2))
        runs.append(([*first[0], *second[0]], second[1], second[2]))
    assert_same_run(runs[1], runs[0])


@pytest.mark.parametrize("where", ["global", "operator", "inner"])
def test_enable_calls_no_hook_and_a_hooked_episode_steps_as_the_engine(where, caplog):
    """enable()'s probes call the operator, which stock never does there: hooks registered before it
    are not called by them; while a hook is there the episodes run the engine's own step (the fused
    step was proved on the operator without hooks), said once, and equal stock's."""
    from fixtures.model_families import assert_same_run, make_trainer, run

    runs = []
    for switched in (False, True):
        trainer = make_trainer("unet_groupnorm")
        calls = []

        def record(module, args, output):
            calls.append(type(module).__name__)

        operator = trainer.motor.operator
        handle = (nn.modules.module.register_module_forward_hook(record) if where == "global"
                  else operator.register_forward_hook(record) if where == "operator"
                  else next(m for m in operator.modules() if isinstance(m, nn.Conv2d)).register_forward_hook(record))
        try:
            if switched:
                with caplog.at_level("INFO", logger="qca_lowmem"):
                    qca_lowmem.enable(trainer, checkpoint="none")
                assert calls == [], f"enable() called the {where} hook {len(calls)} times"
            runs.append(run(trainer, range(2)))
        finally:
            handle.remove()
        if switched:
            assert any("the episodes run the engine's own step while it is there" in r.message for r in caplog.records)
    assert_same_run(runs[1], runs[0])


def test_blocks_trust_the_unets_check_only_inside_its_call():
    """Inside its fused call the U-Net has just checked every module it calls, so its blocks and
    layers do not check again; a block called on its own afterwards (or after a call that raised)
    checks for itself, and a hook added to it since is honoured."""
    stock, fused = stock_and_converted_unet()
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    assert_same_run(stock, fused, x)
    hooked = nn.Identity()
    hooked.register_forward_hook(lambda module, args, output: None)
    with qca_lowmem.ops.calls_checked_by_caller():
        assert qca_lowmem.ops.calls_plain((hooked,))  # trusted inside
    assert not qca_lowmem.ops.calls_plain((hooked,))
    with pytest.raises(RuntimeError), qca_lowmem.ops.calls_checked_by_caller():
        raise RuntimeError("a call that raised inside")
    assert not qca_lowmem.ops.calls_plain((hooked,))
    calls = []
    handle = fused.inc.conv_block[0].register_forward_hook(scale_conv_outputs(calls))
    stock_handle = stock.inc.conv_block[0].register_forward_hook(scale_conv_outputs([]))
    try:
        assert not fused.inc.runs_fused()
        h = torch.randn(1, 4, 8, 8, dtype=torch.float64)
        torch.testing.assert_close(fused.inc(h), stock.inc(h), rtol=1e-10, atol=1e-12)
        assert calls == ["Conv2d"]
        assert_same_run(stock, fused, x)
    finally:
        handle.remove()
        stock_handle.remove()


@pytest.mark.parametrize("options", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2),
                                     dict(checkpoint="auto", budget=0)], ids=["step", "revolve", "auto"])
def test_a_module_backward_hook_steps_as_under_grad_in_the_forward_too(options):
    """torch wraps a module's tensors for its full backward hook only with grad on, and the conv's
    wrapped output (its input NHWC, as the stock pack makes it) comes out NCHW, so the step rounds
    otherwise than without grad. The forward runs such steps with grad, as plain autograd does, and
    so do revolve's advances: the recomputes reproduce it (they were refused) and the gradients
    are plain autograd's."""
    torch.manual_seed(0)
    model = randomize_affine(R.UNetUnitary(2, 8)).double()
    with torch.no_grad():
        model.outc.weight.normal_(0, 0.3)
    called = []
    model.outc.register_full_backward_hook(lambda module, grad_input, grad_output: called.append(None))
    psi0 = R.initial_state(1, 8, 2, dtype=torch.complex128)
    x = R.pack(psi0)
    assert not x.is_contiguous() and model.outc(model.inc(x)).is_contiguous()  # the layout the hook brings

    def step(psi):
        return R.step(psi, model, 0.05)

    def loss_and_grads(final):
        loss = (final.real ** 3).sum() + final.imag.abs().sum()
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    psi = psi0
    for _ in range(6):
        psi = step(psi)
    plain_loss, plain_grads = loss_and_grads(psi)
    plain_calls, called[:] = len(called), []
    loss, grads = loss_and_grads(qca_lowmem.rollout(step, psi0, 6, **options)[0])
    assert loss == plain_loss and len(called) == plain_calls == 6
    for g, expected in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-12, atol=0)
