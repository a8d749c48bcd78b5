"""The fused blocks' half-precision weights are cast once per episode: the same values and
gradients, bit for bit, as casting at every call; the number of casts does not grow with the
number of steps."""

import contextlib

import pytest
import torch
from conftest import randomize_affine

import qca_lowmem
from qca_lowmem import rollout, weight_casts
from qca_lowmem.ops.qca_step import fused_step

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [("none", None), ("step", None), ("revolve", 2)]


def fused_unet(d_state=2, hidden=8):
    torch.manual_seed(1)
    unet = randomize_affine(qca_lowmem.UNetUnitary(d_state, hidden))
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.3)
    return unet


def bf16_episode(unet, steps, checkpoint, slots):
    """psi_T, the gradient w.r.t. psi0 and the parameters' gradients of a bf16 autocast episode."""
    for p in unet.parameters():
        p.grad = None
    torch.manual_seed(3)
    psi0 = qca_lowmem.stock.initial_state(1, 8, 2).requires_grad_()
    noise = qca_lowmem.NoiseSchedule(0.5, 2000, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        psi_T, history = rollout(fused_step(unet, 0.0, True), psi0, steps, checkpoint=checkpoint, slots=slots,
                                 noise=noise, record_every=2)
        loss, _ = qca_lowmem.stock.evolutionary_loss(history, psi0)
    loss.backward()
    return [psi_T.detach(), psi0.grad] + [p.grad for p in unet.parameters()]


@pytest.fixture
def cast_per_call(monkeypatch):
    def install():
        monkeypatch.setattr(weight_casts.WeightCasts, "active", lambda self: contextlib.nullcontext())

    return install


@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_bitwise_the_same_as_casting_per_call(checkpoint, slots, cast_per_call):
    unet = fused_unet()
    cached = bf16_episode(unet, 5, checkpoint, slots)
    cast_per_call()
    per_call = bf16_episode(unet, 5, checkpoint, slots)
    assert all(g is not None for g in cached)
    assert all(torch.equal(a, b) for a, b in zip(cached, per_call))


def _weight_casts_in(episode):
    """aten::_to_copy calls from float32 3x3 conv weights (the fused blocks'), by the profiler; the
    gradients' casts back to float32, one per use as per call, are not weight casts."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        episode()
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
               and len(e.input_shapes[0]) == 4 and e.input_shapes[0][2:] == [3, 3] and e.input_dtypes[0] == "float")


@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_weight_casts_per_episode_do_not_grow_with_steps(checkpoint, slots, cast_per_call):
    unet = fused_unet()
    fused_convs = 2 * sum(isinstance(m, qca_lowmem.FusedConvBlock) for m in unet.modules())
    counts = [_weight_casts_in(lambda: bf16_episode(unet, steps, checkpoint, slots)) for steps in (3, 9)]
    assert counts == [fused_convs, fused_convs]
    cast_per_call()  # the count sees the casts: per call they grow with the steps
    assert _weight_casts_in(lambda: bf16_episode(unet, 3, checkpoint, slots)) > 3 * fused_convs
