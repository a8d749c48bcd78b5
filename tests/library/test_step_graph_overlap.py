"""StepGraph(overlap=True) on the CPU: two lanes, the reverse pass running the forward of the step
it reverses next ahead, with CUDA graphs and streams replaced by the eager stand-in
(fixtures/replayed_graphs.py). Work run ahead is run at once ("queued") or only when the reverse
joins it ("joined"): a second stream's two extremes. The gradients must be those of eager steps
bit for bit either way; "never" shows that a run ahead that is not waited for is seen.

On a GPU, this file's CUDA cases compare the overlapped replays with one lane's: bitwise under
cuDNN's deterministic algorithms, to rounding under its defaults."""

import pytest
import torch

import qca_lowmem
from fixtures.replayed_graphs import ReplayedGraphs, replays
from helpers import (
    CARRY_STEPS,
    RECORD_EVERY,
    STEPS,
    MemoryCell,
    batchnorm_step,
    carried_grads,
    cuda_only,
    episode,
    episode_grads,
    episode_loss,
    fused_step,
    initial_memory,
    initial_state,
    make_conv_net,
    max_relative_error,
    memory_step,
    noisy_schedule,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def ran_ahead(made):
    return sum(graphs.ran_ahead for graphs in made)


@pytest.mark.parametrize("ahead_runs", ["queued", "joined"])
@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
def test_overlapped_replays_equal_eager_steps(replayed_graphs, monkeypatch, ahead_runs, checkpoint, slots):
    monkeypatch.setattr(ReplayedGraphs, "ahead_runs", ahead_runs)
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    expected = episode_grads(fused_step(net), params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
    graph = qca_lowmem.StepGraph(fused_step(net), overlap=True)
    for _ in range(2):  # captured, then the capture reused
        actual = episode_grads(graph, params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
        assert max_relative_error(actual, expected) == 0
    assert graph.captures_made == 1 and len(graph.capture.lanes) == 2
    assert len(replayed_graphs) == 2  # one set of graphs a lane
    # "step" keeps every step's input: each step but the last reversed runs the next one ahead.
    # Revolve hands over states it re-advances: nothing runs ahead.
    assert ran_ahead(replayed_graphs) == (2 * (STEPS - 1) if checkpoint == "step" else 0)


def test_a_run_ahead_not_waited_for_is_seen(replayed_graphs, monkeypatch):
    """The stand-in's "never" leaves a lane holding the outputs of its previous replay, as a read
    before the second stream is done would: the recompute check sees the step differ from its
    forward, so the tests above would see a reverse that reads a lane before joining it."""
    monkeypatch.setattr(ReplayedGraphs, "ahead_runs", "never")
    net = make_conv_net()
    graph = qca_lowmem.StepGraph(fused_step(net), overlap=True)
    with pytest.raises(qca_lowmem.RecomputeMismatchError, match="recompute of step"):
        episode_grads(graph, list(net.parameters()), initial_state(), "step", None, noisy_schedule(), history_loss=True)
    assert ran_ahead(replayed_graphs) > 0


@pytest.mark.parametrize("ahead_runs", ["queued", "joined"])
def test_overlap_under_auto_runs_ahead_only_over_the_recomputed_steps(replayed_graphs, monkeypatch, ahead_runs):
    monkeypatch.setattr(ReplayedGraphs, "ahead_runs", ahead_runs)
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    expected = episode_grads(fused_step(net), params, psi0, "none", None, noisy_schedule(), history_loss=True)
    graph = qca_lowmem.StepGraph(fused_step(net), overlap=True)
    # A budget of a few full step graphs: the last steps keep theirs, the others are recomputed.
    actual = episode(graph, params, psi0, STEPS, lambda psi0, psi_T, history: episode_loss(psi_T, history, psi0, True),
                     checkpoint="auto", budget=60_000, noise=noisy_schedule(), record_every=RECORD_EVERY).grads
    assert max_relative_error(actual, expected) < 1e-12
    assert 0 < ran_ahead(replayed_graphs) < STEPS - 1


@pytest.mark.parametrize("ahead_runs", ["queued", "joined"])
@pytest.mark.parametrize("first_memory", ["given", "none"])
def test_overlapped_carried_step_equals_eager(replayed_graphs, monkeypatch, ahead_runs, first_memory):
    """A carry (a ConvLSTM's memory) is run ahead with psi; a first memory of None is not the
    captured carry, so step 0 is not run ahead and runs eagerly."""
    monkeypatch.setattr(ReplayedGraphs, "ahead_runs", ahead_runs)
    cell = MemoryCell().double()
    step = memory_step(cell, False)
    psi0 = initial_state()
    memory0 = initial_memory(requires_grad=True) if first_memory == "given" else (None, None)
    loss, expected, memory_expected = carried_grads(step, cell, psi0, memory0, "step", None,
                                                    noise=qca_lowmem.NoiseSchedule(0.5, 2000, seed=1))
    graph = qca_lowmem.StepGraph(step, overlap=True)
    loss_g, actual, memory_T = carried_grads(graph, cell, psi0, memory0, "step", None,
                                             noise=qca_lowmem.NoiseSchedule(0.5, 2000, seed=1))
    assert torch.equal(loss_g, loss)
    assert max_relative_error(actual, expected) == 0
    assert all(torch.equal(a, e) for a, e in zip(memory_T, memory_expected, strict=True))
    assert ran_ahead(replayed_graphs) == CARRY_STEPS - (1 if first_memory == "given" else 2)


def test_steps_that_write_buffers_are_not_run_ahead(replayed_graphs):
    """Their values are loaded before each recompute on the caller's stream: BatchNorm's
    statistics end as plain autograd's, and no step runs ahead."""
    buffers = {}
    for name, overlap in (("plain", None), ("overlapped", True)):
        _, norm, step = batchnorm_step()
        options = dict(checkpoint="step") if overlap else dict(checkpoint="none")
        psi_T, _ = qca_lowmem.rollout(qca_lowmem.StepGraph(step, overlap=True) if overlap else step, initial_state(), 4,
                                      **options)
        psi_T.abs().sum().backward()
        buffers[name] = [b.tolist() for b in norm.buffers()]
    assert buffers["overlapped"] == buffers["plain"]
    assert replays(replayed_graphs) > 0 and ran_ahead(replayed_graphs) == 0


def test_the_recompute_check_passes_on_overlapped_replays(replayed_graphs, monkeypatch):
    monkeypatch.setattr(ReplayedGraphs, "ahead_runs", "joined")
    net = make_conv_net()
    params = list(net.parameters())
    psi = initial_state().requires_grad_()
    psi_T, history = qca_lowmem.rollout(qca_lowmem.StepGraph(fused_step(net), overlap=True), psi, STEPS,
                                        checkpoint="step", check_recompute=True, noise=noisy_schedule())
    (psi_T.abs() ** 2).sum().backward()
    assert psi.grad is not None and all(p.grad is not None for p in params)
    assert ran_ahead(replayed_graphs) > 0


@pytest.mark.parametrize("overlap", ["yes", 1, None])
def test_overlap_must_be_a_bool(overlap):
    with pytest.raises(TypeError, match=f"overlap must be True or False, got {overlap!r}"):
        qca_lowmem.StepGraph(fused_step(make_conv_net()), overlap=overlap)


def one_lane_and_two(device, autocast_dtype, channels_last):
    """The gradients of 3 episodes of the library's step (fused U-Net, pack and update), captured
    on one lane and on two, the recompute check on."""
    model = qca_lowmem.UNetUnitary(2, 8).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    params = list(model.parameters())

    def step(psi):
        pack_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        x = qca_lowmem.qca_pack(psi, pack_dtype, channels_last=channels_last)
        return qca_lowmem.qca_update(psi, model(x), gamma=0.05)

    psi0 = initial_state(device, torch.complex64, grid=16)
    results = {}
    for overlap in (False, True):
        graph = qca_lowmem.StepGraph(step, overlap=overlap)
        with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None,
                            cache_enabled=False):
            results[overlap] = [[g.clone() for g in episode(
                graph, params, psi0, STEPS, lambda psi0, psi_T, history: episode_loss(psi_T, history, psi0, True),
                checkpoint="step", noise=noisy_schedule(), record_every=RECORD_EVERY, check_recompute=True).grads]
                for _ in range(3)]
        assert graph.captures_made == 1 and len(graph.capture.lanes) == (2 if overlap else 1)
    return results[False], results[True]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_overlapped_replays_equal_one_lane(request, device, autocast_dtype, channels_last):
    """On a GPU: the same kernels on the same data in the same order on each stream, so the same
    bits, episode after episode, where each kernel gives the same bits wherever it runs: cuDNN's
    deterministic algorithms (on the CPU, the stand-in runs the test's own code)."""
    if device == "cpu":
        request.getfixturevalue("replayed_graphs")
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        one_lane, two_lanes = one_lane_and_two(device, autocast_dtype, channels_last)
    for a, b in zip(one_lane, two_lanes, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@cuda_only
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlapped_replays_match_one_lane_with_cudnns_defaults(autocast_dtype, channels_last):
    """cuDNN's default algorithms may add in an order that depends on what else runs on the GPU
    (an H200 gave other bits in fp32 NCHW with two lanes): the gradients then agree to rounding,
    where a read of a lane before it is joined would give another step's values."""
    one_lane, two_lanes = one_lane_and_two("cuda", autocast_dtype, channels_last)
    tolerance = 1e-4 if autocast_dtype is None else 1e-2
    for a, b in zip(one_lane, two_lanes, strict=True):
        assert max_relative_error(b, a) <= tolerance
