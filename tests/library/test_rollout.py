"""qca_lowmem.rollout: gradients of the recomputing modes equal the full graph's, memory is flat
in the number of steps, noise and autocast replay, hooks fire once, no_grad keeps nothing."""

import importlib
import math
import random
import weakref

import numpy
import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import (
    DEVICES,
    RECORD_EVERY,
    STEPS,
    cuda_only,
    episode_grads,
    episode_loss,
    fused_step,
    initial_state,
    make_conv_net,
    max_relative_error,
    noisy_schedule,
    randomize_affine,
)
from qca_lowmem import block_keeps_intermediates, rollout, saved_bytes
from qca_lowmem import stock as reference
from qca_lowmem.recompute import revolve

pytestmark = pytest.mark.usefixtures("one_thread")


MODES = [("step", None), ("revolve", 1), ("revolve", 2), ("revolve", 3), ("revolve", 5)]


def make_unet(dtype=torch.float64, device="cpu", d_state=2, hidden=4):
    torch.manual_seed(1)
    op = randomize_affine(reference.UNetUnitary(d_state, hidden))
    with torch.no_grad():
        op.outc.weight.normal_(0.0, 0.3)  # the stock 1e-5 would make every step nearly the identity
    return op.to(device=device, dtype=dtype)


def reference_step(op):
    return lambda psi: reference.step(psi, op)


_reference_grads = {}

# Every mode with noise and history terms and without either; the mixed cases for two modes.
GRADIENT_CASES = [(m, s, noise, hist) for m, s in MODES for noise, hist in [(False, False), (True, True)]] + [
    (m, s, noise, hist) for m, s in [("step", None), ("revolve", 3)] for noise, hist in [(True, False), (False, True)]
]


@pytest.mark.parametrize(
    "checkpoint,slots,with_noise,history_loss",
    GRADIENT_CASES,
    ids=[f"{m}{s or ''}-{'noise' if n else 'clean'}-{'history' if h else 'final'}-loss" for m, s, n, h in GRADIENT_CASES],
)
def test_gradients_equal_full_graph(checkpoint, slots, with_noise, history_loss):
    op = make_unet()
    params = list(op.parameters())
    psi0 = initial_state()
    noise = noisy_schedule() if with_noise else None
    key = (with_noise, history_loss)
    if key not in _reference_grads:
        _reference_grads[key] = episode_grads(reference_step(op), params, psi0, "none", noise=noise, history_loss=history_loss)
    grads = episode_grads(reference_step(op), params, psi0, checkpoint, slots, noise, history_loss)
    assert max_relative_error(grads, _reference_grads[key]) <= 1e-9


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_gradients_equal_full_graph_fused_ops(checkpoint, slots):
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    expected = episode_grads(fused_step(net), params, psi0, "none", noise=noisy_schedule(), history_loss=True)
    grads = episode_grads(fused_step(net), params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
    assert max_relative_error(grads, expected) <= 1e-9


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
def test_fused_unet_recomputes_each_step_once(checkpoint, slots, monkeypatch):
    """With qca_lowmem.UNetUnitary, gradients equal the stock model's full graph, and inside the
    rollout's recompute the fused blocks keep their intermediates: each convolution runs once per
    recomputed step, never a third time."""
    blocks = importlib.import_module("qca_lowmem.ops.conv_block")
    stock = make_unet()
    fused = qca_lowmem.UNetUnitary(2, 4).to(torch.float64)
    fused.load_state_dict(stock.state_dict())
    psi0 = initial_state()

    def fused_step_fn(psi):
        return qca_lowmem.qca_update(psi, fused(qca_lowmem.qca_pack(psi)), multiplicative=True)

    expected = _reference_grads.get((True, True))
    if expected is None:
        expected = _reference_grads[True, True] = episode_grads(
            reference_step(stock), list(stock.parameters()), psi0, "none", noise=noisy_schedule(), history_loss=True)
    conv_calls = []
    conv3x3 = blocks._conv3x3
    monkeypatch.setattr(blocks, "_conv3x3", lambda x, w: conv_calls.append(1) or conv3x3(x, w))
    for p in fused.parameters():
        p.grad = None
    psi = psi0.detach().requires_grad_()
    psi_T, history = rollout(fused_step_fn, psi, STEPS, checkpoint=checkpoint, slots=slots, noise=noisy_schedule(),
                             record_every=RECORD_EVERY)
    forward_calls = len(conv_calls)
    conv_calls.clear()
    episode_loss(psi_T, history, psi, True).backward()
    names = [n for n, _ in stock.named_parameters()]
    grads = [psi.grad] + [dict(fused.named_parameters())[n].grad for n in names]
    assert max_relative_error(grads, expected) <= 1e-9
    convs_per_step = forward_calls // STEPS
    assert convs_per_step == 12  # 6 blocks, 2 convolutions each
    advances = 0 if checkpoint == "step" else revolve.cost(STEPS, slots) - revolve.first_sweep(STEPS, slots)[-1]
    assert len(conv_calls) == convs_per_step * (STEPS + advances)


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_random_draws_replay(checkpoint, slots):
    """Dropout in the step and the stock (torch.rand) noise injector recompute the same draws."""
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    injector = reference.NoiseInjector()

    def step_fn(psi):
        delta = nn.functional.dropout(net(qca_lowmem.qca_pack(psi)), 0.3, training=True)
        return qca_lowmem.qca_update(psi, delta, gamma=0.05, multiplicative=False)

    def run(checkpoint, slots=None, preserve_rng_state=True, check_recompute=True):
        for p in params:
            p.grad = None
        torch.manual_seed(5)
        psi_T, history = rollout(step_fn, psi0, STEPS, checkpoint=checkpoint, slots=slots, record_every=RECORD_EVERY,
                                 noise=lambda psi, t: injector.apply_phase_flip(psi, 0.3), preserve_rng_state=preserve_rng_state,
                                 check_recompute=check_recompute)
        history_terms = sum((i + 1) * h.real.square().sum() for i, h in enumerate(history[:-1]))
        (episode_loss(psi_T, history, psi0, False) + history_terms).backward()
        return [p.grad for p in params], torch.rand(4)

    expected, next_draws = run("none")
    grads, draws = run(checkpoint, slots)
    assert max_relative_error(grads, expected) <= 1e-9
    assert torch.equal(draws, next_draws)  # the recompute leaves the global generator alone
    # Without the replay the recompute draws other numbers: the check refuses its gradients...
    with pytest.raises(qca_lowmem.RecomputeMismatchError, match=r"recompute of step \d+ in backward"):
        run(checkpoint, slots, preserve_rng_state=False)
    # ...which are wrong indeed.
    unreplayed, _ = run(checkpoint, slots, preserve_rng_state=False, check_recompute=False)
    assert max_relative_error(unreplayed, expected) > 1e-3


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2), ("auto", None)])
def test_numpy_and_python_draws_replay(checkpoint, slots):
    """Noise drawing from NumPy's and Python's global generators (the users' coin is
    numpy.random.random()) recomputes the same draws and leaves both generators as stock does."""
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()

    def noise(psi, t):
        sign = -1.0 if numpy.random.random() < 0.5 else 1.0
        return psi * complex(sign * math.cos(random.uniform(0, 6.3)), math.sin(random.uniform(0, 6.3)))

    def run(checkpoint, slots=None):
        for p in params:
            p.grad = None
        numpy.random.seed(3)
        random.seed(3)
        psi_T, history = rollout(fused_step(net), psi0, STEPS, checkpoint=checkpoint, slots=slots,
                                 budget=2**12 if checkpoint == "auto" else None, noise=noise)
        episode_loss(psi_T, history, psi0, False).backward()
        return [p.grad for p in params], numpy.random.random(3), random.random()

    expected, numpy_next, python_next = run("none")
    grads, numpy_after, python_after = run(checkpoint, slots)
    assert max_relative_error(grads, expected) <= 1e-9
    assert (numpy_after == numpy_next).all() and python_after == python_next


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_gradcheck_through_the_episode(checkpoint, slots):
    net = make_conv_net()
    psi0 = initial_state(grid=4).requires_grad_()

    def episode(psi):
        psi_T, history = rollout(fused_step(net), psi, 4, checkpoint=checkpoint, slots=slots, noise=noisy_schedule(),
                                 record_every=2)
        return psi_T, history[0]

    assert torch.autograd.gradcheck(episode, (psi0,), fast_mode=True)


@pytest.mark.parametrize("steps", [1, 2, 3, 6])
def test_short_episodes_and_more_slots_than_steps(steps):
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state(grid=4)

    def grads(checkpoint, slots=None):
        for p in params:
            p.grad = None
        psi = psi0.detach().requires_grad_()
        psi_T, history = rollout(fused_step(net), psi, steps, checkpoint=checkpoint, slots=slots, noise=noisy_schedule(),
                                 record_every=1)
        assert len(history) == steps and history[-1] is psi_T
        (psi_T.abs().sum() + sum(h.real.sum() for h in history)).backward()
        return [psi.grad] + [p.grad for p in params]

    expected = grads("none")
    for checkpoint, slots in [("step", None), ("revolve", 1), ("revolve", 2), ("revolve", 10)]:
        assert max_relative_error(grads(checkpoint, slots), expected) <= 1e-9


def test_none_matches_the_stock_rollout():
    op = make_unet()
    psi0 = initial_state()
    expected_T, expected_history = reference.rollout(psi0, op, STEPS)
    for checkpoint, slots in [("none", None), ("step", None), ("revolve", 3)]:
        psi_T, history = rollout(reference_step(op), psi0, STEPS, checkpoint=checkpoint, slots=slots)
        assert history[-1] is psi_T
        assert len(history) == len(expected_history)
        for h, e in zip(history, expected_history):
            torch.testing.assert_close(h, e, rtol=1e-12, atol=1e-12)


def test_noise_replays_the_schedule():
    op = make_unet()
    psi0 = initial_state()
    schedule = noisy_schedule()
    with torch.no_grad():
        psi = psi0
        for t in range(STEPS):
            psi = schedule(reference.step(psi, op), t)
    for checkpoint, slots in [("none", None), ("step", None), ("revolve", 2)]:
        psi_T, _ = rollout(reference_step(op), psi0, STEPS, checkpoint=checkpoint, slots=slots, noise=schedule)
        assert torch.equal(psi_T.detach(), psi)


@pytest.mark.parametrize("grid,d_state,hidden", [(8, 2, 4), (64, 14, 8)], ids=["tiny", "default-psi"])
def test_memory_flat_in_steps(grid, d_state, hidden):
    op = make_unet(torch.float32, d_state=d_state, hidden=hidden)
    psi0 = initial_state(dtype=torch.complex64, grid=grid, d_state=d_state)
    psi_bytes = psi0.numel() * psi0.element_size()
    step_fn = reference_step(op)

    def kept(checkpoint, steps, slots=None, check_recompute=True):
        return saved_bytes(lambda: rollout(step_fn, psi0, steps, checkpoint=checkpoint, slots=slots,
                                           check_recompute=check_recompute))

    stock = {n: kept("none", n) for n in (8, 16)}
    step = {n: kept("step", n) for n in (8, 24)}
    revolve = {n: kept("revolve", n, 4) for n in (8, 64)}
    per_step = (step[24] - step[8]) / 16 / psi_bytes
    assert 0.9 <= per_step <= 1.05
    # The recompute check keeps psi_T too (the loss's psi_T: the same storage in a real episode).
    assert revolve[8] == revolve[64] <= 5 * psi_bytes
    assert kept("revolve", 64, 4, check_recompute=False) <= 4 * psi_bytes
    print(f"\nsaved bytes per step, grid {grid}, d {d_state}, hidden {hidden} (psi = {psi_bytes} bytes): "
          f"stock {(stock[16] - stock[8]) / 8:.0f}, "
          f"step {(step[24] - step[8]) / 16:.0f}, revolve(4 slots) {revolve[64] / 64:.0f} at 64 steps "
          f"({revolve[64]} bytes in all, {revolve[8]} at 8 steps)")


def test_no_grad_keeps_nothing():
    net = make_conv_net(torch.float32)
    psi0 = initial_state(dtype=torch.complex64)
    fused = fused_step(net)
    inputs = []

    def step_fn(psi):
        inputs.append(weakref.ref(psi))
        return fused(psi)

    expected, _ = rollout(fused, psi0, 6, checkpoint="step")
    for context in (torch.no_grad, torch.inference_mode):
        for checkpoint, slots in [("step", None), ("revolve", 2), ("none", None)]:
            inputs.clear()
            with context():
                assert saved_bytes(lambda: rollout(step_fn, psi0, 6, checkpoint=checkpoint, slots=slots)) == 0
                psi_T, history = rollout(step_fn, psi0, 6, checkpoint=checkpoint, slots=slots, record_every=100)
            assert psi_T.grad_fn is None and torch.equal(psi_T, expected.detach())
            # Only psi0 and the history (t = 0 and the last step) are still alive.
            alive = [r() for r in inputs[-6:] if r() is not None]
            assert all(any(a is h for h in history) or a is psi0 for a in alive)
            assert len(alive) <= 2


def test_nothing_requires_grad_keeps_nothing():
    op = make_unet(torch.float32).requires_grad_(False)
    psi0 = initial_state(dtype=torch.complex64)
    assert saved_bytes(lambda: rollout(reference_step(op), psi0, 5)) == 0
    psi_T, history = rollout(reference_step(op), psi0, 5)
    assert psi_T.grad_fn is None and len(history) == 5


def test_each_hook_fires_once_and_grad_accumulates_once():
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state().requires_grad_()
    expected = episode_grads(fused_step(net), params, psi0, "none", history_loss=True)
    for checkpoint, slots in [("step", None), ("revolve", 2)]:
        calls = {}

        def count(key):
            calls[key] = calls.get(key, 0) + 1

        handles = []
        for i, p in enumerate(params):
            handles.append(p.register_hook(lambda g, i=i: count(("pre", i))))
            handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i: count(("post", i))))
            p.grad = torch.ones_like(p)
        psi_T, history = rollout(fused_step(net), psi0, STEPS, checkpoint=checkpoint, slots=slots, record_every=RECORD_EVERY)
        episode_loss(psi_T, history, psi0, True).backward()
        assert calls == {(kind, i): 1 for kind in ("pre", "post") for i in range(len(params))}
        assert max_relative_error([p.grad - 1 for p in params], expected[1:]) <= 1e-9
        # The hooks set aside during the backward are back in place.
        calls.clear()
        (params[0].sum() * 2).backward()
        assert calls == {("pre", 0): 1, ("post", 0): 1}
        for h in handles:
            h.remove()


def test_autograd_grad_with_parameters_as_inputs():
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state().requires_grad_()
    expected = episode_grads(fused_step(net), params, psi0, "none")
    for p in params:
        p.grad = None
    psi_T, history = rollout(fused_step(net), psi0, STEPS, checkpoint="step", record_every=RECORD_EVERY)
    grads = torch.autograd.grad(episode_loss(psi_T, history, psi0, False), [psi0, *params])
    assert max_relative_error(list(grads), expected) <= 1e-9
    assert all(p.grad is None for p in params)


def test_psi0_without_grad_and_history_only_loss():
    net = make_conv_net()
    params = list(net.parameters())
    fused = fused_step(net)
    psi0 = initial_state()
    calls = []

    def step_fn(psi):
        calls.append(torch.is_grad_enabled())
        return fused(psi)

    def grads(checkpoint):
        for p in params:
            p.grad = None
        psi_T, history = rollout(step_fn, psi0, STEPS, checkpoint=checkpoint, record_every=RECORD_EVERY)
        calls.clear()
        (history[1].abs() ** 3).sum().backward()  # history[1] is psi after step 3
        return [p.grad for p in params]

    expected = grads("none")
    got = grads("step")
    assert max_relative_error(got, expected) <= 1e-9
    assert calls == [True] * 4  # steps 4..10 do not reach the loss: not recomputed


def test_revolve_cost_is_optimal():
    cost = {}
    for length in range(1, 31):
        for slots in range(1, 7):
            if length == 1:
                best = 0
            elif slots == 1:
                best = length * (length - 1) // 2
            else:
                best = min(m + cost[length - m, slots - 1] + cost[m, slots] for m in range(1, length))
            cost[length, slots] = best
            assert revolve.cost(length, slots) == best


@pytest.mark.parametrize("steps,slots", [(11, 1), (11, 2), (11, 3), (20, 4), (7, 10), (13, 5)])
def test_revolve_recomputes_follow_the_schedule(steps, slots):
    fused = fused_step(make_conv_net(torch.float32))
    psi0 = initial_state(dtype=torch.complex64)
    calls = []

    def step_fn(psi):
        calls.append(torch.is_grad_enabled())
        return fused(psi)

    psi_T, _ = rollout(step_fn, psi0, steps, checkpoint="revolve", slots=slots)
    assert len(calls) == steps
    calls.clear()
    psi_T.abs().sum().backward()
    first_sweep = revolve.first_sweep(steps, slots)
    advances = revolve.cost(steps, slots) - (first_sweep[-1] if first_sweep else 0)
    assert calls.count(True) == steps and calls.count(False) == advances


def test_revolve_memory_bounded_by_slots():
    fused = fused_step(make_conv_net(torch.float32))
    psi0 = initial_state(dtype=torch.complex64)
    psi_bytes = psi0.numel() * psi0.element_size()
    for slots in (1, 2, 5):
        kept = saved_bytes(lambda: rollout(fused, psi0, 30, checkpoint="revolve", slots=slots, check_recompute=False))
        assert kept == slots * psi_bytes
        # The recompute check keeps psi_T besides (an output: the loss keeps it too).
        assert saved_bytes(lambda: rollout(fused, psi0, 30, checkpoint="revolve", slots=slots)) == (slots + 1) * psi_bytes


def test_autocast_replays():
    op = make_unet(torch.float32)
    psi0 = initial_state(dtype=torch.complex64)
    seen = []

    def step_fn(psi):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled(),
                     block_keeps_intermediates()))
        return reference.step(psi, op)

    def run(checkpoint, cache_enabled, slots=None):
        for p in op.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
            psi_T, history = rollout(step_fn, psi0, 7, checkpoint=checkpoint, slots=slots)
        seen.clear()
        psi_T.abs().sum().backward()
        return psi_T.detach(), [p.grad.clone() for p in op.parameters()]

    # Without the weight-cast cache, the full graph accumulates each step's gradient in fp32 as
    # the rollout does, so the two agree exactly.
    expected_T, expected = run("none", cache_enabled=False)
    for checkpoint, slots in [("step", None), ("revolve", 2)]:
        psi_T, grads = run(checkpoint, False, slots)
        assert torch.equal(psi_T, expected_T)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))
        recomputes = [s for s in seen if s[2]]
        assert len(recomputes) == 7 and set(recomputes) == {(True, torch.bfloat16, True, True)}
    # With the cache, the full graph sums the steps' weight gradients in bf16 first.
    cached_T, cached = run("none", cache_enabled=True)
    psi_T, grads = run("step", cache_enabled=True)
    assert torch.equal(psi_T, cached_T)
    assert max_relative_error(grads, cached) < 2e-2


@pytest.mark.parametrize("with_noise", [False, True], ids=["clean", "noise"])
def test_identity_step_and_no_parameters(with_noise):
    psi0 = initial_state().requires_grad_()
    noise = noisy_schedule() if with_noise else None

    def grad(checkpoint):
        psi_T, history = rollout(lambda psi: psi, psi0, 4, checkpoint=checkpoint, noise=noise, record_every=1)
        return torch.autograd.grad(psi_T.real.sum() + history[0].imag.sum(), psi0)[0]

    torch.testing.assert_close(grad("step"), grad("none"), rtol=1e-14, atol=1e-14)


def test_history_shares_the_episode_node():
    op = make_unet()
    psi0 = initial_state().requires_grad_()
    psi_T, history = rollout(reference_step(op), psi0, STEPS, record_every=RECORD_EVERY)
    assert len(history) == 5 and history[-1] is psi_T
    assert len({h.grad_fn for h in history}) == 1


def test_clear_errors():
    op = make_unet(torch.float32)
    psi0 = initial_state(dtype=torch.complex64)
    step_fn = reference_step(op)
    with pytest.raises(ValueError, match=r"step_fn must keep psi's shape.*shape=\(1, 8, 8, 2\).*returned shape=\(1, 8, 8, 1\)"):
        rollout(lambda psi: psi[..., :1], psi0, 3)
    with pytest.raises(ValueError, match=r"dtype=torch.complex64.*returned.*dtype=torch.complex128"):
        rollout(lambda psi: psi.to(torch.complex128), psi0, 3)
    with pytest.raises(TypeError, match="step_fn must return a tensor like psi, at step 0 it returned tuple"):
        rollout(lambda psi: (psi,), psi0, 3)
    with pytest.raises(ValueError, match="noise must keep psi's shape"):
        rollout(step_fn, psi0, 3, noise=lambda psi, t: psi[:, :4])
    with pytest.raises(ValueError, match="slots must be an int >= 1.*got 0"):
        rollout(step_fn, psi0, 3, checkpoint="revolve", slots=0)
    with pytest.raises(ValueError, match="checkpoint='revolve' needs slots"):
        rollout(step_fn, psi0, 3, checkpoint="revolve")
    with pytest.raises(ValueError, match="slots applies only to checkpoint='revolve'"):
        rollout(step_fn, psi0, 3, checkpoint="step", slots=4)
    with pytest.raises(ValueError, match=r"checkpoint must be one of \('none', 'step', 'revolve', 'auto'\), got 'steps'"):
        rollout(step_fn, psi0, 3, checkpoint="steps")
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        rollout(step_fn, psi0, 0)
    with pytest.raises(ValueError, match="record_every must be an int >= 1"):
        rollout(step_fn, psi0, 3, record_every=0)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        rollout(None, psi0, 3)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 3.0"):
        rollout(step_fn, psi0, 3.0)
    for measure in (qca_lowmem.saved_bytes, qca_lowmem.peak_saved_bytes):
        with pytest.raises(TypeError, match=f"{measure.__name__}: fn must be callable .*, got int"):
            measure(5)
    history = rollout(step_fn, psi0, numpy.int64(3), record_every=1)[1]  # NumPy's ints are ints
    assert len(history) == len(rollout(step_fn, psi0, 3, record_every=1)[1]) == 3
    with pytest.raises(TypeError, match=r"psi0 must be a complex or floating tensor, got dtype=torch.int64 shape=\(2, 3\)"):
        rollout(step_fn, torch.zeros(2, 3, dtype=torch.int64), 3)
    scaled = op.outc.weight * 2  # requires grad, computed outside step_fn

    def uses_scaled(psi):
        return reference.update(psi, nn.functional.conv2d(reference.pack(psi), scaled, op.outc.bias))

    with pytest.raises(RuntimeError, match="computed outside step_fn"):
        rollout(uses_scaled, psi0, 3)


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
@pytest.mark.parametrize("hooks", ["save_on_cpu", "saved_bytes", "peak_saved_bytes"])
def test_gradients_under_saved_tensor_hooks(checkpoint, slots, hooks):
    # Saved-tensor hooks hand back copies of what was saved; the parameters must still get theirs.
    op = make_conv_net()
    params = list(op.parameters())
    psi0 = initial_state()
    expected = episode_grads(reference_step(op), params, psi0, "none", steps=5)
    if hooks == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            grads = episode_grads(reference_step(op), params, psi0, checkpoint, slots, steps=5)
    else:
        kept = []
        getattr(qca_lowmem, hooks)(
            lambda: kept.append(episode_grads(reference_step(op), params, psi0, checkpoint, slots, steps=5)))
        grads = kept[0]
    assert max_relative_error(grads, expected) <= 1e-9


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_parameter_changed_before_backward_is_an_error(checkpoint, slots):
    net = make_conv_net()
    psi_T, _ = rollout(fused_step(net), initial_state(), 4, checkpoint=checkpoint, slots=slots)
    with torch.no_grad():
        net[0].weight.add_(1.0)  # e.g. optimizer.step() between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        psi_T.abs().sum().backward()


def test_exported():
    assert "rollout" in qca_lowmem.__all__ and qca_lowmem.rollout is rollout


@cuda_only
@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
def test_cuda_gradients_equal_full_graph(checkpoint, slots):
    op = make_unet(device="cuda")
    params = list(op.parameters())
    psi0 = initial_state("cuda")
    expected = episode_grads(reference_step(op), params, psi0, "none", noise=noisy_schedule(), history_loss=True)
    grads = episode_grads(reference_step(op), params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
    assert max_relative_error(grads, expected) <= 1e-9


@cuda_only
def test_cuda_autocast_fp16_replays():
    op = make_unet(torch.float32, "cuda")
    psi0 = initial_state("cuda", torch.complex64)
    seen = []

    def step_fn(psi):
        seen.append((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_grad_enabled()))
        return reference.step(psi, op)

    def run(checkpoint):
        for p in op.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            psi_T, _ = rollout(step_fn, psi0, 5, checkpoint=checkpoint, noise=noisy_schedule())
        seen.clear()
        psi_T.abs().sum().backward()
        return psi_T.detach(), [p.grad.clone() for p in op.parameters()]

    expected_T, expected = run("none")
    psi_T, grads = run("step")
    assert seen == [(True, torch.float16, True)] * 5
    torch.testing.assert_close(psi_T, expected_T, rtol=1e-3, atol=1e-3)
    assert max_relative_error(grads, expected) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_saved_states_live_on_the_device(device):
    op = make_unet(torch.float32, device)
    psi0 = initial_state(device, torch.complex64)
    psi_T, _ = rollout(reference_step(op), psi0, 3)
    assert psi_T.device.type == device
    psi_T.abs().sum().backward()
    assert all(p.grad.device.type == device for p in op.parameters())


# ---------------------------------------------------------------- StepGraph (captured CUDA graphs)


def fused_unet_step(dtype=torch.float32, device="cuda", d_state=2, hidden=8):
    """The library's own step: fused U-Net (stock weights) between qca_pack and qca_update."""
    op = make_unet(dtype, device, d_state, hidden)
    fused = qca_lowmem.UNetUnitary(d_state, hidden).to(device=device, dtype=dtype)
    fused.load_state_dict(op.state_dict())

    def step(psi):
        pack_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        return qca_lowmem.qca_update(psi, fused(qca_lowmem.qca_pack(psi, pack_dtype)), gamma=0.05)

    return fused, step


def graph_and_eager_grads(step, params, psi0, checkpoint, slots=None, autocast_dtype=None):
    graph = qca_lowmem.StepGraph(step)
    results = []
    for step_fn in (step, graph, graph):  # eager, then the graph captured and then reused
        with torch.autocast("cuda", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None,
                            cache_enabled=False):
            grads = episode_grads(step_fn, params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
        results.append([g.clone() for g in grads])
    return graph, results


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
def test_step_graph_on_cpu_is_the_plain_step(checkpoint, slots):
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    expected = episode_grads(fused_step(net), params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
    graph = qca_lowmem.StepGraph(fused_step(net))
    grads = episode_grads(graph, params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
    assert graph.capture is None and graph.captures_made == 0
    assert max_relative_error(grads, expected) == 0


@cuda_only
@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_graph_equals_eager_cuda(checkpoint, slots, autocast_dtype):
    fused, step = fused_unet_step()
    params = list(fused.parameters())
    psi0 = initial_state("cuda", torch.complex64)
    graph, (eager, captured, replayed) = graph_and_eager_grads(step, params, psi0, checkpoint, slots, autocast_dtype)
    assert graph.captures_made == 1
    # The same kernels on the same data; cuDNN may pick another algorithm inside a capture.
    assert max_relative_error(captured, eager) < 1e-5
    assert max_relative_error(replayed, captured) == 0


@cuda_only
def test_step_graph_follows_inplace_updates_and_recaptures_new_storage():
    fused, step = fused_unet_step()
    params = list(fused.parameters())
    psi0 = initial_state("cuda", torch.complex64)
    graph = qca_lowmem.StepGraph(step)
    episode_grads(graph, params, psi0, "step")
    with torch.no_grad():  # what an optimizer step does: same storage, new values
        for p in params:
            p.add_(0.01 * torch.randn_like(p))
    grads = [g.clone() for g in episode_grads(graph, params, psi0, "step")]
    assert graph.captures_made == 1
    assert max_relative_error(grads, episode_grads(step, params, psi0, "step")) < 1e-5
    for p in params:  # new storage: the old graphs would read freed memory
        p.data = p.data.clone()
    grads = [g.clone() for g in episode_grads(graph, params, psi0, "step")]
    assert graph.captures_made == 2
    assert max_relative_error(grads, episode_grads(step, params, psi0, "step")) < 1e-5


@cuda_only
def test_step_graph_runs_parameter_hooks_once_with_the_total():
    fused, step = fused_unet_step()
    params = list(fused.parameters())
    psi0 = initial_state("cuda", torch.complex64)
    expected = episode_grads(step, params, psi0, "step")[1:]
    seen = []
    params[0].register_hook(lambda g: seen.append(g.clone()))
    grads = episode_grads(qca_lowmem.StepGraph(step), params, psi0, "step")[1:]
    assert len(seen) == 1 and max_relative_error([seen[0]], [expected[0]]) < 1e-5
    assert max_relative_error(grads, expected) < 1e-5


@cuda_only
def test_step_graph_rolls_a_step_that_draws_random_numbers_out_eagerly():
    fused, step = fused_unet_step()
    psi0 = initial_state("cuda", torch.complex64).requires_grad_()
    graph = qca_lowmem.StepGraph(lambda psi: step(psi) * (1 + 0 * torch.rand((), device="cuda")))
    with pytest.warns(qca_lowmem.CaptureFallbackWarning, match="draws random numbers"):
        rollout(graph, psi0, 3)
    assert graph.captures_made == 0 and graph.failed_keys


def test_a_new_policy_is_a_schedule_subclass(monkeypatch):
    """A Schedule subclass naming a mode is all a new policy's episode needs: choose finds it by the
    policy's mode, the forward keeps the states it says, its reverse drives the steps (here every
    other state kept, the others re-advanced), and the gradients are plain autograd's."""
    from qca_lowmem.recompute import Policy, schedule

    monkeypatch.setattr(schedule.Schedule, "_by_mode", dict(schedule.Schedule._by_mode))
    reversed_steps = []

    class EveryOther(schedule.Recomputing):
        mode = "every other"

        def __init__(self, steps):
            self.steps = steps

        @classmethod
        def for_episode(cls, policy, start, check_recompute):
            return cls(start.steps)

        def keeps_state(self, t):
            return t % 2 == 0

        def reverse(self, kept, reverser):
            for t in reversed(range(self.steps)):
                reverser.backprop(t, kept[t] if t % 2 == 0 else reverser.advance(kept[t - 1], t - 1, t))
                reversed_steps.append(t)

    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    expected = episode_grads(fused_step(net), params, psi0, "none", noise=noisy_schedule(), history_loss=True)
    grads = episode_grads(fused_step(net), params, psi0, Policy("every other"), noise=noisy_schedule(),
                          history_loss=True)
    assert reversed_steps == list(reversed(range(STEPS)))
    assert max_relative_error(grads, expected) <= 1e-9
