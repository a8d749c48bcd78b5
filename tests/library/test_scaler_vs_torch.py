"""qca_lowmem.amp.GradScaler side by side with torch.amp.GradScaler: the same scales, skipped
steps, weights, errors and state_dict, through torch's AMP recipes, several optimizers, sparse
gradients and a build without native kernels."""

import pickle
import warnings
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import qca_lowmem
from fixtures.scaler import INJECT, Net, bits_equal, ops, reference_unscale, run_training, twin_runs
from helpers import CUDA
from qca_lowmem.amp import GradScaler


@pytest.mark.parametrize("explicit_unscale,clip", [(False, False), (True, False), (True, True)])
def test_side_by_side_with_torch_scaler(explicit_unscale, clip):
    model, opt, twin, twin_opt = twin_runs()
    ours = GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    scales = run_training(model, opt, ours, 60, INJECT, explicit_unscale, clip)
    twin_scales = run_training(twin, twin_opt, theirs, 60, INJECT, explicit_unscale, clip)
    assert scales == twin_scales
    skipped = [i for i in range(1, 60) if scales[i] < scales[i - 1]] + ([0] if scales[0] < 2.0**12 else [])
    assert sorted(skipped) == sorted(INJECT)
    assert sum(scales[i] > scales[i - 1] for i in range(1, 60)) >= 4  # grew several times
    for p, q in zip(model.parameters(), twin.parameters()):
        assert bits_equal(p, q)
    assert opt.state_dict()["state"][0]["step"] == twin_opt.state_dict()["state"][0]["step"] == 60 - len(INJECT)
    assert ours.state_dict() == theirs.state_dict()


def test_is_a_torch_grad_scaler_with_same_defaults():
    ours, theirs = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    assert isinstance(ours, torch.amp.GradScaler)
    assert ours.state_dict() == theirs.state_dict()
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (2.0, 0.5, 2000)
    ours.set_growth_factor(3.0)
    ours.set_backoff_factor(0.25)
    ours.set_growth_interval(7)
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (3.0, 0.25, 7)
    assert ours.is_enabled()
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.0)):
        with pytest.raises(AssertionError, match="factor must be"):
            GradScaler("cpu", **bad)


def stage_error_messages(scaler_cls):
    messages = []

    def attempt(fn):
        try:
            fn()
        except (RuntimeError, AssertionError, ValueError) as e:
            messages.append((type(e).__name__, str(e)))
        else:
            messages.append(None)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu")
    attempt(lambda: scaler.unscale_(opt))  # before scale()
    attempt(lambda: scaler.step(opt))
    attempt(lambda: scaler.update())
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    attempt(lambda: scaler.step(opt, closure=lambda: 0.0))
    scaler.unscale_(opt)
    attempt(lambda: scaler.unscale_(opt))
    scaler.step(opt)
    attempt(lambda: scaler.unscale_(opt))
    attempt(lambda: scaler.step(opt))
    scaler.update()
    attempt(lambda: scaler.update())  # no inf checks recorded
    attempt(lambda: scaler.update(torch.tensor([1.0, 2.0])))
    attempt(lambda: scaler.update(torch.tensor(2.0, requires_grad=True)))
    half = nn.Parameter(torch.randn(3).half())
    half.grad = torch.ones(3, dtype=torch.float16)
    other = torch.optim.SGD([half], lr=0.1)
    attempt(lambda: scaler.unscale_(other))
    return messages


def test_stage_errors_match_torch():
    ours, theirs = stage_error_messages(GradScaler), stage_error_messages(torch.amp.GradScaler)
    assert ours == theirs
    assert all(m is not None for m in ours)
    assert ("RuntimeError", "unscale_() has already been called on this optimizer since the last update().") in ours


def test_fp16_grads_allowed_on_request():
    p = nn.Parameter(torch.randn(5).half())
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, allow_fp16_grads=True)
    scaler.scale(torch.zeros(()))
    p.grad = (torch.randn(5) * 4).half()
    expected = reference_unscale(p.grad, 0.25)
    scaler.unscale_(opt)
    assert bits_equal(p.grad, expected)


def test_disabled_scaler_is_torch_like():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(torch.randn(3, 6)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    scaler.update()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    scaler.load_state_dict({"scale": 3.0})  # no-op
    assert scaler.clip_grad_norm_(model.parameters(), 1.0) > 0
    assert scaler.overflow_report() == []


@pytest.mark.skipif(CUDA, reason="the warning is about CUDA being unavailable")
def test_cuda_scaler_without_cuda_disables_with_torch_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = GradScaler()
    assert not scaler.is_enabled()
    assert any("CUDA is not available" in str(w.message) for w in caught)


def test_multiple_optimizers_side_by_side():
    def run(scaler_cls):
        torch.manual_seed(0)
        m1, m2 = Net(), Net()
        o1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
        o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
        scaler = scaler_cls("cpu", init_scale=2.0**8, growth_interval=3)
        scales = []
        for step in range(20):
            o1.zero_grad()
            o2.zero_grad()
            x = torch.randn(4, 6)
            scaler.scale(m1(x).sum() + m2(x).pow(2).sum()).backward()
            if step in (4, 9):
                m2.b.bias.grad[0] = float("inf")
            if step == 9:
                m1.a.bias.grad[0] = float("nan")
            scaler.unscale_(o1)
            scaler.step(o1)
            scaler.step(o2)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in [*m1.parameters(), *m2.parameters()]]

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0]
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_state_dict_round_trips_both_ways():
    model, opt, _, _ = twin_runs()
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    run_training(model, opt, ours, 7, {2: float("inf")}, False, False)
    state = ours.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert state["_growth_tracker"] == 1 and state["scale"] == 2.0**10
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.state_dict() == state
    again = GradScaler("cpu")
    again.load_state_dict(theirs.state_dict())
    assert again.state_dict() == state
    # loaded values drive the next updates identically
    for scaler in (theirs, again):
        scaler.scale(torch.ones(()))
    for _ in range(2):
        for scaler in (theirs, again):
            scaler._per_optimizer_states[0]["found_inf_per_device"] = {torch.device("cpu"): torch.zeros(())}
            scaler.update()
    assert theirs.state_dict() == again.state_dict()
    assert again.state_dict()["scale"] == 2.0**11
    with pytest.raises(RuntimeError, match="source state dict is empty"):
        again.load_state_dict({})
    restored = pickle.loads(pickle.dumps(ours))
    assert restored.state_dict() == ours.state_dict() and isinstance(restored, GradScaler)


@pytest.mark.parametrize("new_scale", [123.0, torch.tensor(77.0)], ids=["float", "tensor"])
def test_update_with_new_scale(new_scale):
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu")
        scaler.scale(torch.ones(()))
        scaler.update(new_scale)
        results.append(scaler.state_dict())
    assert results[0] == results[1]
    assert results[0]["scale"] == float(new_scale)


def test_step_supports_amp_scaling_optimizer_matches_torch():
    def run(scaler_cls):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        assert opt._step_supports_amp_scaling
        scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3)
        scales = run_training(model, opt, scaler, 12, {4: float("inf")}, False, False)
        return scales, [p.detach().clone() for p in model.parameters()]

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0]
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_sparse_gradients_match_torch():
    def run(scaler_cls):
        torch.manual_seed(0)
        emb = nn.Embedding(20, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = scaler_cls("cpu", init_scale=2.0**6, growth_interval=2)
        scales = []
        for step in range(8):
            opt.zero_grad()
            idx = torch.tensor([1, 3, 3, 7])
            scaler.scale(emb(idx).pow(2).sum()).backward()
            if step == 3:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, emb.weight.detach().clone()

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0] and bits_equal(ours[1], theirs[1])


def test_package_exports_scaler():
    assert qca_lowmem.amp.GradScaler is GradScaler
    assert "amp" in qca_lowmem.__all__
    # the scaler only: the precision switches and the kernels' wrappers are imported from their modules
    assert qca_lowmem.amp.__all__ == ["GradScaler"] and not hasattr(qca_lowmem.amp, "autocast")



# ----------------------------------------------------------------------------------------------
# torch's AMP recipes, side by side (accumulation, gradient penalty, several outputs)


def recipe_run(scaler_cls, recipe):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for step in range(12):
        opt.zero_grad()
        xs = torch.randn(3, 4, 6)
        if recipe == "accumulation":
            for x in xs:
                scaler.scale(model(x).pow(2).mean() / len(xs)).backward()
        elif recipe == "penalty":
            loss = model(xs[0]).pow(2).mean()
            scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in scaled).sqrt()
            scaler.scale(loss + penalty).backward()
        else:  # several outputs, nested
            a, (b, c) = scaler.scale([model(xs[0]).sum(), (model(xs[1]).sum(), model(xs[2]).sum())])
            (a + b + c).backward()
        if step == 5:
            model.b.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["accumulation", "penalty", "outputs"])
def test_amp_recipes_match_torch(recipe):
    ours, theirs = recipe_run(GradScaler, recipe), recipe_run(torch.amp.GradScaler, recipe)
    scales = ours[0]
    assert scales == theirs[0]
    assert max(scales) > 2.0**10 and any(later < earlier for earlier, later in zip(scales, scales[1:]))
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_optimizer_taking_grad_scaler_gets_ours():
    class SelfUnscaling(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.seen = grad_scaler
            return super().step(closure)

    model = Net()
    opt = SelfUnscaling(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(opt)
    assert opt.seen is scaler


def test_without_native_kernels_falls_back_to_torch():
    model, opt, twin, twin_opt = twin_runs()
    ours = GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    ours._native = False  # as on a device our build has no kernels for
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    with mock.patch.object(ops, "amp_unscale_", side_effect=AssertionError("used our kernel")):
        scales = run_training(model, opt, ours, 20, INJECT, True, True)
    assert scales == run_training(twin, twin_opt, theirs, 20, INJECT, True, True)
    assert all(bits_equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert ours.overflow_report() == []


# ----------------------------------------------------------------------------------------------
# what torch's scaler does that a wrapper's conversions or bookkeeping could change


def test_skipped_step_keeps_no_gradient_alive_after_update():
    """torch's scaler holds no gradient past update(); held ones would double the gradients'
    memory in the next iteration after every skipped step."""
    p = nn.Parameter(torch.randn(8))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    p.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    skipped_grad = weakref.ref(p.grad)
    opt.zero_grad(set_to_none=True)
    assert skipped_grad() is None
    assert scaler.overflow_report() == ["optimizer[0].param_groups[0].params[0]"]


@pytest.mark.parametrize("setting,value", [("growth_interval", 2.5), ("growth_interval", True),
                                           ("growth_interval", "3"), ("growth_factor", "3"),
                                           ("backoff_factor", None)])
def test_update_refuses_settings_of_a_wrong_type_as_torch(setting, value):
    """torch's update() raises TypeError for these; converting them would truncate 2.5 to 2."""
    for cls in (GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu", init_scale=4.0, growth_interval=1)
        getattr(scaler, f"set_{setting}")(value)
        p = nn.Parameter(torch.randn(3))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        with pytest.raises(TypeError, match=setting):
            scaler.update()
        assert (scaler.get_scale(), scaler._get_growth_tracker()) == (4.0, 0)


@pytest.mark.parametrize("settings", [dict(growth_interval=np.int64(1)), dict(growth_interval=torch.tensor(1)),
                                      dict(growth_factor=3), dict(backoff_factor=torch.tensor(0.25)),
                                      dict(growth_factor=np.bool_(True)), dict(backoff_factor=np.float32(0.5))])
def test_update_takes_the_numbers_torch_takes(settings):
    states = []
    for cls in (GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu", init_scale=4.0, growth_interval=1)
        for name, value in settings.items():
            getattr(scaler, f"set_{name}")(value)
        p = nn.Parameter(torch.randn(3))
        opt = torch.optim.SGD([p], lr=0.1)
        for bad in (False, True):
            scaler.scale(p.sum()).backward()
            if bad:
                p.grad[0] = float("nan")
            scaler.step(opt)
            scaler.update()
        states.append((scaler.get_scale(), scaler._get_growth_tracker()))
    assert states[0] == states[1]


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")])
def test_any_spelling_of_the_cpu_runs_our_kernels(device):
    """torch.device("cpu") and "cpu:0" are the CPU to torch's scaler: ours keeps its complex
    gradients for them (torch's kernel refuses those)."""
    p = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    scaler = GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((3,), 2 + 4j, dtype=torch.complex64)
    scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    assert torch.equal(p.grad, torch.full((3,), 0.5 + 1j, dtype=torch.complex64))
    assert pickle.loads(pickle.dumps(GradScaler(device)))._native
