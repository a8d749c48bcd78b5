"""StepGraph's capture on the CPU: the static inputs and outputs, the gradient accumulators, the
carry and the choice of which steps replay, with CUDA graphs replaced by an eager stand-in that
keeps their contract (a replay writes new values into the tensors the capture returned).

What the stand-in cannot show, that the kernels recorded once replay the same work on a GPU, the
CUDA tests in test_rollout.py and test_rollout_carry.py show."""

import itertools

import numpy
import pytest
import torch
from torch import nn

import qca_lowmem
from fixtures.model_families import D_STATE, EPISODES, HIDDEN, assert_same_run, make_trainer, run
from fixtures.replayed_graphs import ReplayedGraphs, replays
from helpers import (
    CARRY_STEPS,
    MemoryCell,
    RecordingMode,
    batchnorm_step,
    carried_grads,
    episode_grads,
    follow,
    fused_step,
    gradient_casts_in,
    host_waits,
    initial_memory,
    initial_state,
    make_conv_net,
    max_relative_error,
    memory_step,
    noisy_schedule,
    randomize_affine,
    weight_casts_in,
)
from qca_lowmem import NoiseSchedule
from qca_lowmem.atheria import mask_free_noise
from qca_lowmem.examples import QC_Trainer_v4, make_config
from qca_lowmem.recompute import step_graph

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
def test_captured_step_equals_eager(replayed_graphs, checkpoint, slots):
    net = make_conv_net()
    params = list(net.parameters())
    psi0 = initial_state()
    expected = [g.clone() for g in episode_grads(fused_step(net), params, psi0, checkpoint, slots, noisy_schedule(),
                                                 history_loss=True)]
    graph = qca_lowmem.StepGraph(fused_step(net))
    for _ in range(2):  # captured, then the capture reused
        actual = episode_grads(graph, params, psi0, checkpoint, slots, noisy_schedule(), history_loss=True)
        assert max_relative_error(actual, expected) == 0
    assert graph.captures_made == 1
    assert replays(replayed_graphs) > 0


@pytest.mark.parametrize("detach", [False, True], ids=["grad-through-memory", "detached-memory"])
def test_the_capture_keeps_no_autograd_graph_of_its_outputs(replayed_graphs, detach):
    """Kept with their graph, the captured outputs would keep the parameters' AccumulateGrad nodes
    made on the capture's side stream, and each later backward on the caller's stream that
    reaches a parameter would sync with that stream (torch warns so on a GPU)."""
    cell = MemoryCell().double()
    graph = qca_lowmem.StepGraph(memory_step(cell, detach))
    carried_grads(graph, cell, initial_state(), initial_memory(requires_grad=not detach), "step", None,
                  memory_loss=not detach)
    capture = graph.capture
    assert capture is not None
    outputs = [capture.lanes[0].static_out, *capture.lanes[0].static_carry_out]
    assert all(o is None or (o.grad_fn is None and not o.requires_grad) for o in outputs)


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 1), ("revolve", 3)])
@pytest.mark.parametrize("detach", [False, True], ids=["grad-through-memory", "detached-memory"])
@pytest.mark.parametrize("first_memory", ["given", "none"])
def test_captured_carried_step_equals_eager(replayed_graphs, checkpoint, slots, detach, first_memory):
    """Loss, every gradient (parameters, psi0, the initial memory when it requires grad) and the
    final memory. A first memory of None is not the captured carry: that step runs eagerly."""
    cell = MemoryCell().double()
    step = memory_step(cell, detach)
    psi0 = initial_state()
    memory0 = initial_memory(requires_grad=not detach) if first_memory == "given" else (None, None)
    noise = NoiseSchedule(0.5, 2000, seed=1)
    loss, expected, memory_expected = carried_grads(step, cell, psi0, memory0, checkpoint, slots, noise=noise,
                                            memory_loss=not detach)
    graph = qca_lowmem.StepGraph(step)
    for _ in range(2):
        loss_g, actual, memory_T = carried_grads(graph, cell, psi0, memory0, checkpoint, slots, noise=noise,
                                         memory_loss=not detach)
        assert torch.equal(loss_g, loss)
        assert len(actual) == len(expected)
        assert max_relative_error(actual, expected) == 0
        assert all(torch.equal(a, e) for a, e in zip(memory_T, memory_expected, strict=True))
    assert graph.captures_made == 1
    # Every step but the first replays its forward (a None memory is not the captured carry).
    assert replays(replayed_graphs) > 2 * (CARRY_STEPS - 1)


def test_captured_carried_step_checks_its_recompute(replayed_graphs):
    """A captured step that reads memory kept outside psi and the carry is caught as an eager one is."""
    cell = MemoryCell().double()
    kept = {}

    def step(psi, memory):
        delta, h, c = cell(qca_lowmem.qca_pack(psi), *(kept.get("memory") or memory))
        kept["memory"] = (h.detach(), c.detach())
        return qca_lowmem.qca_update(psi, delta, gamma=0.05, multiplicative=False), memory

    with pytest.raises(qca_lowmem.RecomputeMismatchError, match="recompute of step"):
        carried_grads(qca_lowmem.StepGraph(step), cell, initial_state(), initial_memory(), "step", memory_loss=False)


@pytest.mark.parametrize("options", [{}, {"cuda_graph": True}], ids=["unset", "true"])
def test_enable_with_cuda_graph_on_a_memory_engine_equals_stock(replayed_graphs, options):
    """enable() where a capture can run (cuda_graph unset or True) on an engine with memory: the
    memory step captured, three episodes equal to stock (loss, psi, memory, gradients, weights)."""
    expected = run(make_trainer("convlstm"))
    trainer = make_trainer("convlstm")
    qca_lowmem.enable(trainer, **options)
    actual = run(trainer)
    assert_same_run(actual, expected)
    graph = getattr(trainer, "_qca_lowmem_state").captures.step_graph
    assert graph is not None and graph.captures_made >= 1 and replays(replayed_graphs) >= EPISODES


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2), ("auto", None)])
def test_a_captured_step_leaves_batchnorm_statistics_as_plain_autograd(replayed_graphs, checkpoint, slots):
    """The capture's warm-up and recording run the step, as do the replays of recomputes: none of
    them counts as a BatchNorm update; the episode ends with plain autograd's statistics."""
    buffers = {}
    for name, graph in (("plain", False), ("captured", True)):
        _, norm, step = batchnorm_step()
        options = dict(checkpoint=checkpoint, slots=slots, budget=20_000 if checkpoint == "auto" else None)
        psi_T, _ = qca_lowmem.rollout(qca_lowmem.StepGraph(step) if graph else step, initial_state(), 4,
                                      **(options if graph else dict(checkpoint="none")))
        psi_T.abs().sum().backward()
        buffers[name] = [b.tolist() for b in norm.buffers()]
    assert buffers["captured"] == buffers["plain"]
    assert replays(replayed_graphs) > 0


def test_statistics_replaced_between_rollouts_are_captured_anew(replayed_graphs):
    """A BatchNorm's running statistics replaced by new tensors between two rollouts (a reset):
    the second rollout's replays write the new ones, as plain autograd's steps do, not the old."""
    buffers = {}
    for name in ("plain", "captured"):
        _, norm, step = batchnorm_step()
        graph = qca_lowmem.StepGraph(step)
        for rollout in range(2):
            if rollout:
                norm.running_mean = torch.zeros_like(norm.running_mean)
                norm.running_var = torch.ones_like(norm.running_var)
            psi_T, _ = qca_lowmem.rollout(graph if name == "captured" else step, initial_state(), 4,
                                          checkpoint="step" if name == "captured" else "none")
            psi_T.abs().sum().backward()
        buffers[name] = [b.double() for b in norm.buffers()]
        assert name == "plain" or graph.captures_made == 2
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(buffers["captured"], buffers["plain"]))


def test_the_capture_starts_from_an_empty_autocast_cache(replayed_graphs, monkeypatch):
    """Autocast's cached weight casts from the eager steps hold the weights' gradient accumulators,
    made on the caller's stream; a CUDA backward capture that reaches one must sync that stream
    with the capture, which CUDA refuses (every bf16 and fp16 capture fell back so on an H200).
    The capture drops the cache first, before its warm-up makes the accumulators anew."""
    events = []
    monkeypatch.setattr(torch, "clear_autocast_cache", lambda: events.append("cache cleared"))
    warming_up = ReplayedGraphs.warming_up
    monkeypatch.setattr(ReplayedGraphs, "warming_up", lambda self: events.append("warm-up") or warming_up(self))
    net = make_conv_net()
    graph = qca_lowmem.StepGraph(fused_step(net))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        episode_grads(graph, list(net.parameters()), initial_state(), "step", None, noisy_schedule(), history_loss=True)
    assert graph.captures_made == 1
    assert events[:2] == ["cache cleared", "warm-up"]


def test_a_step_that_draws_random_numbers_rolls_out_eagerly_with_the_draws_of_no_capture(replayed_graphs):
    """A capture would repeat its draw at every replay: the warm-up's draws are undone and the
    configuration rolls out eagerly after one warning, with what a rollout without a StepGraph
    draws, so the loss and gradients are its own."""
    net = make_conv_net()
    params = list(net.parameters())
    step = fused_step(net)

    def dropping_step(psi):
        keep = (torch.rand(psi.shape[:-1] + (1,), dtype=torch.float64) > 0.2).to(psi.real.dtype)
        return step(psi) * keep + psi * (1 - keep)

    torch.manual_seed(11)
    expected = [g.clone() for g in episode_grads(dropping_step, params, initial_state(), "step", None, None)]
    graph = qca_lowmem.StepGraph(dropping_step)
    torch.manual_seed(11)
    with pytest.warns(qca_lowmem.CaptureFallbackWarning, match="draws random numbers") as caught:
        actual = episode_grads(graph, params, initial_state(), "step", None, None)
    assert len([w for w in caught if issubclass(w.category, qca_lowmem.CaptureFallbackWarning)]) == 1
    assert graph.captures_made == 0 and max_relative_error(actual, expected) == 0


def test_no_capture_without_the_caching_allocator(monkeypatch):
    """memcheck runs with PYTORCH_NO_CUDA_MEMORY_CACHING: every allocation is then a cudaMalloc,
    which a capture cannot make, so steps run eagerly and enable() says why."""
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    assert step_graph.StepGraph.captures_on("cuda")
    assert step_graph.StepGraph.why_not_captured("cuda") is None
    assert "operator is on cpu" in step_graph.StepGraph.why_not_captured("cpu")
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert not step_graph.StepGraph.captures_on("cuda:0")
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING is set" in step_graph.StepGraph.why_not_captured("cuda:0")


def test_a_free_budget_is_read_after_the_capture(replayed_graphs, monkeypatch):
    """budget="free" must see the memory the capture's pool takes: read before it, the first
    episode would budget memory the graphs then hold."""
    from qca_lowmem.recompute import policy as policy_mod
    from qca_lowmem.recompute import schedule as schedule_mod

    read_with_graphs = []
    monkeypatch.setattr(policy_mod.Policy, "check_device", lambda self, device, caller="rollout": None)
    monkeypatch.setattr(schedule_mod, "free_budget",
                        lambda device, step_bytes: read_with_graphs.append(len(replayed_graphs)) or 1 << 40)
    net = make_conv_net()
    graph = qca_lowmem.StepGraph(fused_step(net))
    psi_T, _ = qca_lowmem.rollout(graph, initial_state().requires_grad_(True), 4, checkpoint="auto", budget="free")
    psi_T.abs().sum().backward()
    assert read_with_graphs == [1]


def fused_step_of(unet):
    return qca_lowmem.ops.qca_step.fused_step(unet, 0.0, True)


def _bf16_unet():
    torch.manual_seed(1)
    unet = randomize_affine(qca_lowmem.UNetUnitary(2, 8))
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.3)
    return unet


def _bf16_grads(step, unet, steps=4):
    """psi_T and every gradient of a bf16 autocast episode of `step` over `unet`."""
    for p in unet.parameters():
        p.grad = None
    torch.manual_seed(3)
    psi0 = qca_lowmem.stock.initial_state(1, 8, 2).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        psi_T, history = qca_lowmem.rollout(step, psi0, steps, checkpoint="step", record_every=2)
        loss, _ = qca_lowmem.stock.evolutionary_loss(history, psi0)
    loss.backward()
    return [psi_T.detach(), psi0.grad] + [p.grad for p in unet.parameters()]


def test_a_captured_step_casts_its_weights_once_an_episode(replayed_graphs):
    """Inside the graphs the half-precision weights are copies made outside them, written again
    before each episode's replays: bitwise the eager episode's, not a cast at every replay, and
    never stale after the weights change."""
    unet = _bf16_unet()
    graph = qca_lowmem.StepGraph(fused_step_of(unet))
    eager = _bf16_grads(fused_step_of(unet), unet)
    assert max_relative_error(_bf16_grads(graph, unet), eager) == 0  # the capture's episode
    assert max_relative_error(_bf16_grads(graph, unet), eager) == 0  # an episode of replays
    fused_convs = 2 * sum(isinstance(m, qca_lowmem.FusedConvBlock) for m in unet.modules())
    casts = [weight_casts_in(lambda: _bf16_grads(graph, unet, steps)) for steps in (3, 9)]
    assert casts == [fused_convs, fused_convs] and replays(replayed_graphs) > 0  # the eager probe step's
    with torch.no_grad():
        for p in unet.parameters():
            p.mul_(1.5)  # an optimizer step, in place: the copies must follow
    assert max_relative_error(_bf16_grads(graph, unet), _bf16_grads(fused_step_of(unet), unet)) == 0
    assert graph.captures_made == 1


def test_no_host_wait_in_a_captured_step_of_the_default_episode(replayed_graphs, monkeypatch):
    """enable()'s defaults where a capture runs, a noisy episode with the users' injector replayed
    as on CUDA: the waits an episode makes (its loss's reads) do not grow with its steps."""
    monkeypatch.setattr(mask_free_noise, "index_waits", lambda device: True)
    waits = []
    for steps in (3, 6):
        torch.manual_seed(3)
        trainer = QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=steps), max_noise=0.5)
        qca_lowmem.enable(trainer)
        trainer.train_episode(2000)  # captures
        waits.append(host_waits(lambda: trainer.train_episode(2000)))
        assert getattr(trainer, "_qca_lowmem_state").captures.step_graph.captures_made == 1
    assert waits[0] == waits[1]
    assert replays(replayed_graphs) > 0


def test_the_captured_backward_adds_half_gradients_without_casting_them(replayed_graphs, monkeypatch):
    """What the backward graph records (outside the reverse pass, whose eager steps add to sums
    of their own): the bf16 weight gradients and the fp32 ones added to their fp32 accumulators by
    one accumulate_ (one launch on CUDA, reading the half operands), no cast first and no add of
    its own; the episodes the same bits as eager."""
    recorded, accumulations = [], []

    class CountedGraphs(ReplayedGraphs):
        def capture(self, body):
            captured = []
            with RecordingMode() as mode:
                recorded.append(gradient_casts_in(lambda: captured.append(super(CountedGraphs, self).capture(body))))
            accumulations.append(sum(name.startswith(("aten.add_", "aten._foreach_add", "qca_lowmem.accumulate_"))
                                     for name in mode.seen))
            return captured[0]

    monkeypatch.setattr(step_graph, "_graphs", CountedGraphs)
    unet = _bf16_unet()
    graph = qca_lowmem.StepGraph(fused_step_of(unet))
    eager = _bf16_grads(fused_step_of(unet), unet)
    assert max_relative_error(_bf16_grads(graph, unet), eager) == 0  # the capture's episode
    assert recorded == [0, 0]  # the forward graph, the backward graph
    assert accumulations == [0, 1]
    accumulators = graph.capture.accumulators
    assert {a.dtype for a in accumulators} == {torch.float32} and all(graph.capture.reached)
    assert max_relative_error(_bf16_grads(graph, unet), eager) == 0
    assert replays(replayed_graphs) > 0


def counting_step(late):
    """A step that changes with the calls made of it (state kept on an object, no host read):
    from its second call on it adds `late(x)` ("leaf") or counts its calls in a buffer ("write")."""
    net = make_conv_net()
    extra = torch.nn.Conv2d(4, 4, 1).double()
    counter = torch.zeros((), dtype=torch.float64)
    calls = [0]

    def step(psi):
        calls[0] += 1
        x = qca_lowmem.qca_pack(psi)
        h = net(x)
        if calls[0] > 1 and late == "leaf":
            h = h + extra(x)
        if calls[0] > 1 and late == "write":
            counter.add_(1)
        return qca_lowmem.qca_update(psi, h, gamma=0.05, multiplicative=False)

    return step, list(net.parameters()) + list(extra.parameters()), counter


def test_a_capture_reaching_a_leaf_the_first_steps_did_not_is_refused(replayed_graphs):
    """Captured at the probed state, the step reaches a parameter the probe did not see: a replay
    would drop its gradient and its recompute would agree with its forward. Refused, the eager
    steps see the step change and say so."""
    step, params, _ = counting_step("leaf")
    psi = initial_state().requires_grad_()
    first_steps_did_not = r"step_fn reaches a tensor requiring grad \(shape \(4,\)\) that the episode's first steps did not"
    with pytest.warns(qca_lowmem.CaptureFallbackWarning, match=first_steps_did_not):
        with pytest.raises(qca_lowmem.RecomputeMismatchError, match="recompute of step"):
            psi_T, _ = qca_lowmem.rollout(qca_lowmem.StepGraph(step), psi, 4, checkpoint="step")
            psi_T.abs().sum().backward()
    assert params[-1].grad is None


def test_a_capture_writing_a_tensor_the_first_steps_did_not_is_refused_and_undone(replayed_graphs):
    """Captured at the probed state, the step writes a tensor the probe did not see written (the
    episode would neither keep nor put it back). The write is undone and the episode runs eagerly,
    ending with plain autograd's count."""
    counts = {}
    for name in ("plain", "captured"):
        step, _, counter = counting_step("write")
        psi = initial_state().requires_grad_()
        if name == "plain":
            psi_T, _ = qca_lowmem.rollout(step, psi, 4, checkpoint="none")
        else:
            with pytest.warns(qca_lowmem.CaptureFallbackWarning, match=r"writes a tensor \(a storage of 8 bytes\)"):
                psi_T, _ = qca_lowmem.rollout(qca_lowmem.StepGraph(step), psi, 4, checkpoint="step")
        psi_T.abs().sum().backward()
        counts[name] = counter.item()
    assert counts["captured"] == counts["plain"] == 3


def test_enable_runs_the_steps_eagerly_while_the_operator_has_a_hook(replayed_graphs, caplog):
    """A replay runs no Python, so no module hook: while the operator has one (added after enable(),
    on a step enable() captures: the engine's own, fused_step_ops=False), the episodes run eagerly,
    said once; removed, the step is captured again."""
    caplog.set_level("WARNING", logger="qca_lowmem")
    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer, fused_step_ops=False)
    conv = next(m for m in trainer.motor.operator.modules() if isinstance(m, torch.nn.Conv2d))
    calls = []
    handle = conv.register_forward_hook(lambda module, args, output: None if qca_lowmem.recomputing() else calls.append(1))
    for episode in range(2):
        trainer.train_episode(episode)
    assert replays(replayed_graphs) == 0 and len(calls) > 0
    said = [r.getMessage() for r in caplog.records if "eagerly while it is there" in r.getMessage()]
    assert said == [f"a hook on {type(trainer.motor.operator).__name__}.inc.conv_block.0: the episodes run their steps "
                    "eagerly while it is there (a captured step's replays would run no hook)"]
    handle.remove()
    trainer.train_episode(2)
    assert replays(replayed_graphs) > 0


def _first(operator, kind):
    return next(m for m in operator.modules() if isinstance(m, kind))


def _norm_as_batchnorm(operator):
    """The operator's first GroupNorm replaced by a BatchNorm (running statistics, written by every step)."""
    parent = next(m for m in operator.modules() if any(isinstance(c, torch.nn.GroupNorm) for c in m.children()))
    name = next(n for n, c in parent.named_children() if isinstance(c, torch.nn.GroupNorm))
    setattr(parent, name, torch.nn.BatchNorm2d(getattr(parent, name).num_channels, momentum=0.3).double())


def _statistics_reset(operator):
    norm = _first(operator, torch.nn.BatchNorm2d)
    norm.running_mean = torch.zeros_like(norm.running_mean)  # a new tensor: the capture's was the old one's memory
    norm.running_var = torch.ones_like(norm.running_var)


def _frozen_weight_replaced(operator):
    # The second: with the first frozen, torch 2.13's CPU GroupNorm backward after it (channels_last
    # input, no input gradient asked) crashes stock's episode.
    conv = [m for m in operator.modules() if isinstance(m, torch.nn.Conv2d)][1]
    conv.weight = torch.nn.Parameter(conv.weight.detach() * 0.5, requires_grad=False)


def _numpy_eps(value):
    return lambda op: setattr(_first(op, torch.nn.GroupNorm), "eps", numpy.float32(value))


def _dilation_as_list(value):
    def edit(operator):
        conv = _first(operator, torch.nn.Conv2d)
        conv.padding, conv.dilation = [value, value], [value, value]  # as a JSON config gives them
    return edit


# (edit before enable(), edit between episodes): what a replay keeps from its capture, changed.
SETTING_EDITS = {
    "eps": (None, lambda op: setattr(_first(op, torch.nn.GroupNorm), "eps", 0.5)),
    "eps_numpy": (_numpy_eps(1e-5), _numpy_eps(0.5)),
    "dilation_list": (_dilation_as_list(1), _dilation_as_list(2)),
    "statistics_reset": (_norm_as_batchnorm, _statistics_reset),
    "frozen_weight_replaced": (None, _frozen_weight_replaced),
}


@pytest.mark.parametrize("edit", sorted(SETTING_EDITS))
def test_a_layer_setting_changed_between_episodes_makes_a_new_capture(replayed_graphs, edit):
    """A replay keeps the values its capture read (a GroupNorm's eps, of any number type; a
    convolution's dilation, as a list) and the memory of the tensors it reads and writes (a buffer
    or frozen weight replaced, not written in place): changed between episodes, the step is
    captured again, and the episodes are stock's (parameters, gradients and buffers), not refused."""
    before, between = SETTING_EDITS[edit]
    results = {}
    for name in ("stock", "captured"):
        trainer = make_trainer("unet_groupnorm")
        if before is not None:
            before(trainer.motor.operator)
        if name == "captured":
            qca_lowmem.enable(trainer)
        losses = []
        torch.manual_seed(99)
        for episode in range(2):
            if episode:
                between(trainer.motor.operator)
            losses.append(trainer.train_episode(episode)[0])
        operator = trainer.motor.operator
        results[name] = losses, [p.grad.clone() for p in operator.parameters() if p.grad is not None], \
            [b.clone() for b in operator.buffers()]
    assert getattr(trainer, "_qca_lowmem_state").captures.step_graph.captures_made == 1  # the new one's
    assert replays(replayed_graphs) > 0
    assert results["captured"][0] == pytest.approx(results["stock"][0], rel=1e-12)
    assert max_relative_error(results["captured"][1], results["stock"][1]) < 1e-9
    buffers = results["captured"][2], results["stock"][2]
    assert len(buffers[0]) == len(buffers[1])
    assert all(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-12) for a, b in zip(*buffers))


def test_an_operator_keeping_a_call_counter_on_itself_is_not_captured(replayed_graphs, monkeypatch):
    """Its forward changes with the calls made of it (every third call scaled): a replay, running
    no Python, would repeat one call. Were its class recorded as followed code, its first watched
    warm-up run changes the counter, so the capture is refused, said once, and the episodes run
    eagerly, where the recompute check sees the step change."""
    from fixtures.model_families import D_STATE, HIDDEN, make_operator

    operator = make_operator("unet_groupnorm", D_STATE, HIDDEN)
    unet = type(operator)

    class Counting(unet):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x) * (1.0 if self.calls % 3 else 1.25)

    operator.__class__ = Counting
    follow(monkeypatch, Counting)  # the second line of defence, behind the class not being followed
    trainer = make_trainer("unet_groupnorm", operator=operator)
    qca_lowmem.enable(trainer)
    with pytest.warns(qca_lowmem.CaptureFallbackWarning, match="a call of step_fn changed a value its objects hold"):
        with pytest.raises(qca_lowmem.RecomputeMismatchError, match="recompute of step"):
            for episode in range(2):
                trainer.train_episode(episode)
    assert replays(replayed_graphs) == 0


def counted_unet(counter):
    """The stand-in's U-Net with every third call scaled by a counter outside its modules."""
    class UNetUnitary(qca_lowmem.stock.UNetUnitary):
        def forward(self, x):
            return super().forward(x) * (1.25 if next(counter) % 3 == 0 else 1.0)
    return UNetUnitary


def test_an_operator_of_code_not_followed_is_not_captured(replayed_graphs, caplog):
    """A replay runs no Python: an operator whose class qca_lowmem does not follow (a counter kept in
    a closure, which no check of its modules sees) is not captured (cuda_graph unset is off) and
    cuda_graph=True is refused; its episodes are stock's under the policy that calls it as stock does."""
    runs = []
    for switched in (False, True):
        torch.manual_seed(7)
        operator = counted_unet(itertools.count(1))(D_STATE, HIDDEN).double()
        trainer = make_trainer("unet_groupnorm", operator=operator)
        if switched:
            with caplog.at_level("INFO", logger="qca_lowmem"):
                qca_lowmem.enable(trainer, checkpoint="none", cuda_graph=False)
        runs.append(run(trainer))
    assert_same_run(runs[1], runs[0])
    with pytest.raises(ValueError, match=r"cuda_graph=True, but UNetUnitary \(\S*UNetUnitary is not code qca_lowmem "
                                         r"follows\): a capture would replay"):
        qca_lowmem.enable(make_trainer("unet_groupnorm", operator=counted_unet(itertools.count(1))(D_STATE, HIDDEN)
                                       .double()), cuda_graph=True)
    unset = qca_lowmem.enable(make_trainer("unet_groupnorm",
                                           operator=counted_unet(itertools.count(1))(D_STATE, HIDDEN).double()))
    assert not getattr(unset, "_qca_lowmem_state").options.cuda_graph  # where a followed one's is on:
    assert getattr(qca_lowmem.enable(make_trainer("unet_groupnorm")), "_qca_lowmem_state").options.cuda_graph
    assert replays(replayed_graphs) == 0


def test_an_operator_swapped_for_code_not_followed_runs_eagerly(replayed_graphs, caplog):
    """Checked at every episode: a block of the captured operator swapped for a module of the
    user's after enable() (its class not recorded) runs the engine's own step, eagerly, said once;
    the episodes stay stock's."""
    class Halved(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 0.5 * self.inner(x)

    runs = []
    for switched in (False, True):
        trainer = make_trainer("unet_groupnorm")
        if switched:
            qca_lowmem.enable(trainer)
        first = run(trainer, range(1))
        operator = trainer.motor.operator
        operator.bot = Halved(operator.bot)
        replayed = replays(replayed_graphs)
        caplog.clear()
        with caplog.at_level("WARNING", logger="qca_lowmem"):
            second = run(trainer, range(1, 3))
        runs.append(([*first[0], *second[0]], second[1], second[2]))
    assert_same_run(runs[1], runs[0])
    assert replayed > 0 and replays(replayed_graphs) == replayed
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("UNetUnitary.bot (") and said[0].endswith(
        "Halved is not code qca_lowmem follows): the episodes run the engine's own step while it is there"), said
