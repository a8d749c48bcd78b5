"""qca_lowmem.amp.GradScaler beyond torch's: complex and bfloat16 gradients, clip_grad_norm_
reusing the unscale pass's sums (and measuring again where it cannot), overflow_report."""

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from fixtures.scaler import Net, bits_equal, reference_unscale
from qca_lowmem.amp import GradScaler

# ----------------------------------------------------------------------------------------------
# Complex and bfloat16 gradients


class ComplexAndBf16(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, dtype=torch.complex64))
        self.v = nn.Parameter(torch.randn(6).bfloat16())

    def forward(self, x):
        return (self.w * x).abs().pow(2).sum() + (self.v.float() * x.real).sum()


@pytest.mark.parametrize("bad_param", ["w", "v"])
def test_complex_and_bf16_gradients(bad_param):
    model = ComplexAndBf16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(6, dtype=torch.complex64)
    scaler.scale(model(x)).backward()
    scaled = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaler.unscale_(opt)
    for n, p in model.named_parameters():
        assert bits_equal(p.grad, reference_unscale(scaled[n], 2.0**-8)), n
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="ComplexFloat"):  # what this scaler is for
        torch_scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**8

    # a non-finite gradient: detected, step skipped, scale backed off, reported
    opt.zero_grad()
    scaler.scale(model(x)).backward()
    getattr(model, bad_param).grad[2] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(bits_equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7
    assert scaler.overflow_report(model) == [bad_param]


# ----------------------------------------------------------------------------------------------
# clip_grad_norm_ and overflow_report


def scaled_grads_twice(dtype=torch.float32):
    torch.manual_seed(0)
    model = Net()
    model.extra = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    twin = copy.deepcopy(model)
    for m in (model, twin):
        torch.manual_seed(1)
        x = torch.randn(4, 6)
        loss = m(x).pow(2).sum() * 1000 + (m.extra.abs() ** 2).sum()
        (loss * 2.0**10).backward()
    return model, twin


def unscale_ours_and_by_hand(model, twin):
    """Our scaler unscales model's gradients; twin's are unscaled by hand, as torch would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    for p in twin.parameters():
        p.grad.mul_(2.0**-10)
    return scaler


@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_clip_grad_norm_uses_unscale_norm_and_matches_torch(max_norm):
    model, twin = scaled_grads_twice()
    scaler = unscale_ours_and_by_hand(model, twin)
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", side_effect=AssertionError("took torch's path")):
        ours = scaler.clip_grad_norm_(model.parameters(), max_norm, reuse_unscale_norm=True)  # the fused path only
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        if max_norm > 1e8:  # no clipping: untouched
            assert bits_equal(p.grad, q.grad)
    # clipping changed the gradients: a second clip measures them again
    torch_clip = torch.nn.utils.clip_grad_norm_
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", wraps=torch_clip) as spy:
        again = scaler.clip_grad_norm_(model.parameters(), max_norm, reuse_unscale_norm=True)
    assert spy.call_count == 1
    torch.testing.assert_close(again, torch_clip(twin.parameters(), max_norm), rtol=2e-7, atol=0)


def test_clip_grad_norm_bf16_matches_torch():
    model, twin = scaled_grads_twice()
    del model.extra, twin.extra
    model.bfloat16()
    twin.bfloat16()
    scaler = unscale_ours_and_by_hand(model, twin)
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0, reuse_unscale_norm=True)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_grad_norm_falls_back_to_torch():
    model, twin = scaled_grads_twice()
    scaler = GradScaler("cpu")
    # not unscaled by this scaler: exactly torch's
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert bits_equal(ours, theirs)
    # unscaled, then changed behind the scaler's back: the cache is not trusted
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    for p in twin.parameters():
        p.grad.mul_(2.0**-16)
    model.a.weight.grad.mul_(3.0)
    twin.a.weight.grad.mul_(3.0)
    assert scaler._reusable_sums(list(model.parameters())) is None
    assert bits_equal(scaler.clip_grad_norm_(model.parameters(), 1.0), torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0))
    # other norm types
    inf_ours = scaler.clip_grad_norm_(model.parameters(), 1.0, norm_type="inf")
    assert bits_equal(inf_ours, torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0, norm_type="inf"))


def test_clip_grad_norm_nonfinite_error_like_torch():
    model, _ = scaled_grads_twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    model.b.bias.grad[0] = float("inf")
    scaler.unscale_(opt)
    assert torch.isnan(scaler.clip_grad_norm_(model.parameters(), 1.0, reuse_unscale_norm=True))  # torch: inf or nan
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        scaler.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_overflow_report_names_parameters():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    model.a.bias.grad[3] = float("inf")
    model.b.weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    assert scaler.overflow_report(model) == ["a.bias", "b.weight"]
    scaler.update()
    assert scaler.overflow_report(model) == ["a.bias", "b.weight"]  # still there after update
    assert scaler.overflow_report() == ["optimizer[0].param_groups[0].params[1]", "optimizer[0].param_groups[0].params[2]"]
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.overflow_report(model) == []


def test_clip_grad_norm_subsets_and_several_optimizers():
    model, twin = scaled_grads_twice()
    for p in twin.parameters():
        p.grad.mul_(2.0**-10)
    first = torch.optim.SGD(list(model.a.parameters()) + [model.extra], lr=0.1)
    second = torch.optim.SGD(model.b.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    scaler.unscale_(first)
    # a subset of one optimizer's parameters
    ours = scaler.clip_grad_norm_([model.a.weight, model.extra], 0.5, reuse_unscale_norm=True)
    theirs = torch.nn.utils.clip_grad_norm_([twin.a.weight, twin.extra], 0.5)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    # parameters of an optimizer not unscaled yet: torch's path on the scaled grads
    assert scaler._reusable_sums(list(model.parameters())) is None
    scaler.unscale_(second)
    assert scaler._reusable_sums(list(model.b.parameters()) + [model.a.bias]) is not None
    ours = scaler.clip_grad_norm_(list(model.b.parameters()) + [model.a.bias], 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(list(twin.b.parameters()) + [twin.a.bias], 0.5)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_clip_grad_norm_of_a_parameter_listed_twice_is_torchs():
    """Torch counts it twice and clips it twice; the kept sums took its whole optimizer group (the
    norm 21.3 against 15.9, a parameter not passed clipped)."""
    model, twin = scaled_grads_twice()
    for p in twin.parameters():
        p.grad.mul_(2.0**-10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    # as many as the float32 gradients unscale_ kept sums of, b.bias not among them
    listed, twin_listed = ([m.a.weight, m.a.bias, m.b.weight, m.a.weight] for m in (model, twin))
    ours = scaler.clip_grad_norm_(listed, 0.5, reuse_unscale_norm=True)
    theirs = torch.nn.utils.clip_grad_norm_(twin_listed, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_clip_grad_norm_measures_by_default_a_gradient_changed_through_data():
    """Old-style value clipping edits gradients through .data, which keeps their versions: only
    measuring them again sees it, so that is the default; reuse_unscale_norm=True is the caller's
    word that nothing did."""
    model, twin = scaled_grads_twice()
    scaler = unscale_ours_and_by_hand(model, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        if not p.grad.is_complex():
            p.grad.data.clamp_(-0.01, 0.01)
            q.grad.clamp_(-0.01, 0.01)
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert bits_equal(p.grad, q.grad)
