"""What the probe (the episode's first step) does not see, against plain autograd in float64: a
buffer written only by later steps, a parameter only later steps reach (with `inputs=`,
`torch.autograd.grad` and hooks), and a step that changes its input in place."""

import pytest
import torch

import qca_lowmem
from helpers import RecordingMode
from qca_lowmem import stock
from qca_lowmem.recompute import weight_casts
from qca_lowmem.recompute.watch import StepWatch

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = [dict(checkpoint="step"), dict(checkpoint="revolve", slots=1), dict(checkpoint="revolve", slots=2),
            dict(checkpoint="auto", budget=0), dict(checkpoint="auto", budget=30_000),
            dict(checkpoint="auto", budget=10**9)]
IDS = ["step", "revolve1", "revolve2", "auto0", "auto-some", "auto-all"]
STEPS = 5


def psi0():
    return stock.initial_state(2, 6, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))


def weighted(psi):
    return psi.abs().square().mul(torch.linspace(0.5, 2.0, psi.numel(), dtype=torch.float64).reshape(psi.shape)).sum()


def branch_step(gate):
    """(conv, norm, step): a BatchNorm in train mode that only the steps `gate(psi, calls)`
    picks run, so the first step does not."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    norm = torch.nn.BatchNorm2d(4).double()
    calls = [0]

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        h = conv(x)
        if gate(psi, calls[0]):
            h = norm(h)
        calls[0] += 1
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(h), 0.05)

    return conv, norm, step


def grown(psi, call):  # a function of psi: False at step 0, True later (the update grows the phase)
    return psi.real.sum().item() < SPLIT


psi_0 = psi0()
SPLIT = psi_0.real.sum().item()


def run(step, params, options):
    for p in params:
        p.grad = None
    loss = weighted(qca_lowmem.rollout(step, psi0(), STEPS, **options)[0])
    loss.backward()
    return loss.item(), [p.grad for p in params]


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_buffer_written_only_by_later_steps_ends_as_plain_autograd_leaves_it(policy):
    results = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        conv, norm, step = branch_step(grown)
        results[name] = (*run(step, [*conv.parameters(), *norm.parameters()], options),
                         [b.tolist() for b in norm.buffers()])
    (loss, grads, buffers), (plain_loss, plain_grads, plain_buffers) = results["policy"], results["plain"]
    assert plain_buffers[2] != 0 and plain_buffers[2] < STEPS  # some steps, not the first, ran it
    assert buffers == plain_buffers
    assert loss == pytest.approx(plain_loss, rel=1e-12)
    for got, expected in zip(grads, plain_grads):
        assert (got is None) == (expected is None)
        assert expected is None or ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_buffer_written_every_second_call_is_plain_autograds_or_refused(policy):
    """Not a function of psi: each recompute is another call. Either the answer is plain
    autograd's, buffers included, or the recompute check refuses it, naming the step."""
    conv, norm, step = branch_step(lambda psi, call: call % 2 == 1)
    plain = (*run(step, [*conv.parameters(), *norm.parameters()], dict(checkpoint="none")),
             [b.tolist() for b in norm.buffers()])
    conv, norm, step = branch_step(lambda psi, call: call % 2 == 1)
    try:
        got = (*run(step, [*conv.parameters(), *norm.parameters()], policy), [b.tolist() for b in norm.buffers()])
    except qca_lowmem.RecomputeMismatchError as error:
        assert "recompute of step" in str(error)
        return
    assert got[2] == plain[2] and got[0] == pytest.approx(plain[0], rel=1e-12)


def late_model():
    torch.manual_seed(0)
    early = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    late = torch.nn.Conv2d(4, 4, 3, padding=1).double()

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        h = early(x)
        if grown(psi, 0):
            h = h + late(x)
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(h), 0.05)

    return early, late, step


def clipped(grad):
    """A hook whose result is not additive: two partial sums clipped give another gradient."""
    return grad.clamp(-0.05, 0.05)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
@pytest.mark.parametrize("ask", ["backward", "inputs=[early]", "grad(early)", "grad(late)"])
def test_a_late_parameter_gets_its_gradient_only_when_asked_in_one_accumulation(policy, ask):
    """`late` is first used at step 1 and in the loss directly, with a clipping hook: its `.grad`
    is plain autograd's (one clipped sum, the hook run once), and a backward asking only for
    `early` leaves it None."""
    results = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        early, late, step = late_model()
        calls = []
        late.weight.register_hook(lambda grad: calls.append(1) or clipped(grad))
        psi_T, _ = qca_lowmem.rollout(step, psi0(), STEPS, **options)
        loss = weighted(psi_T) + late.weight.sum()
        asked = None
        if ask == "backward":
            loss.backward()
        elif ask == "inputs=[early]":
            loss.backward(inputs=[early.weight])
        else:
            asked = torch.autograd.grad(loss, [early.weight if ask == "grad(early)" else late.weight])[0]
        results[name] = (early.weight.grad, late.weight.grad, late.bias.grad, asked, len(calls))
    got, plain = results["policy"], results["plain"]
    for a, b in zip(got[:4], plain[:4]):
        assert (a is None) == (b is None), ask
        assert b is None or ((a - b).abs().max() / b.abs().max()).item() < 1e-10
    assert got[4] == plain[4]


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
@pytest.mark.parametrize("late_only", [False, True])
def test_a_step_changing_its_input_in_place_is_refused_in_one_line(policy, late_only):
    """Plain autograd lets a step scale psi in place (psi.mul_), and with it the caller's psi0 or
    the history entry that psi is: a recomputing episode, which keeps psi for its backward,
    refuses it at the forward, naming the rollout, the step and what to change. A budget that
    holds every step's graph recomputes nothing after step 0 (plain autograd): plain's answer."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).double()

    def step(psi):
        if not late_only or grown(psi, 0):
            psi.mul_(0.9)
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(conv(qca_lowmem.qca_pack(psi))), 0.05)

    plain_loss = weighted(qca_lowmem.rollout(step, psi0(), STEPS, checkpoint="none")[0])
    plain_loss.backward()  # plain autograd accepts it
    if late_only and policy == dict(checkpoint="auto", budget=10**9):
        plain_grads = [p.grad.clone() for p in conv.parameters()]
        conv.zero_grad()
        loss = weighted(qca_lowmem.rollout(step, psi0(), STEPS, **policy)[0])
        loss.backward()
        assert loss.item() == plain_loss.item()
        assert all(torch.equal(p.grad, g) for p, g in zip(conv.parameters(), plain_grads))
        return
    with pytest.raises(RuntimeError) as error:
        qca_lowmem.rollout(step, psi0(), STEPS, **policy)
    message = str(error.value)
    assert "\n" not in message and f"rollout(checkpoint={policy['checkpoint']!r})" in message
    assert "in place" in message and "step " in message and "out of place" in message


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_parameter_no_earlier_step_reaches_gets_its_gradient(policy):
    """The first step reaches no parameter and psi0 requires no grad: the later steps that reach
    one still give it plain autograd's gradient."""
    results = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(4, 4, 3, padding=1).double()

        def step(psi):
            x = qca_lowmem.qca_pack(psi)
            delta = 0.1 * torch.tanh(conv(x)) if grown(psi, 0) else torch.full_like(x, 0.1)
            return qca_lowmem.qca_update(psi, delta, 0.05)

        results[name] = run(step, list(conv.parameters()), options)
    (loss, grads), (plain_loss, plain_grads) = results["policy"], results["plain"]
    assert loss == pytest.approx(plain_loss, rel=1e-12)
    for got, expected in zip(grads, plain_grads):
        assert got is not None and ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10


def late_block_model(gate=grown):
    """`late` is a fused block (whose ops run hidden from the forward's watch, which it tells what
    they read and made) that only the steps `gate` picks reach; its output is then changed in
    place. `taken` lists the gate's answers."""
    torch.manual_seed(0)
    early = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    late = qca_lowmem.FusedConvBlock(4, 4).double()
    taken = []

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        h = early(x)
        taken.append(gate(psi, 0))
        if taken[-1]:
            y = late(x)
            y.mul_(0.5)  # the block made y: a write the step's own, no buffer to keep
            h = h + y
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(h), 0.05)

    return early, late, step, taken


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_fused_block_only_later_steps_reach_gets_plain_autograds_gradients(policy):
    results = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        early, late, step, taken = late_block_model()
        results[name] = run(step, [*early.parameters(), *late.parameters()], options)
        assert not taken[0] and any(taken)
    (loss, grads), (plain_loss, plain_grads) = results["policy"], results["plain"]
    assert loss == pytest.approx(plain_loss, rel=1e-12)
    for got, expected in zip(grads, plain_grads):
        assert got is not None and ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad step", "kept-graph step"])
def test_the_watch_sees_a_fused_blocks_reads_and_takes_its_outputs_for_the_steps_own(grad):
    early, late, step, _ = late_block_model(gate=lambda psi, call: True)
    psi = psi0()
    watch = StepWatch(known_leaves={id(p): p for p in early.parameters()}, known_writes=set(), inputs={id(psi)})
    with torch.set_grad_enabled(grad), watch:
        step(psi)
    assert {id(p) for p in watch.leaves} == {id(p) for p in late.parameters()}
    assert watch.writes == []


@pytest.mark.parametrize("hook", [None, "layer", "global"])
def test_the_watch_sees_what_the_fused_unets_hidden_layers_read_and_what_a_hook_writes(hook):
    """The fused U-Net's blocks and torch layers run hidden from the watch, telling it their
    parameters; a hook (on a layer, or on every module) makes the layer run watched, so what the
    hook writes is seen."""
    torch.manual_seed(0)
    model = qca_lowmem.UNetUnitary(2, 8).double()
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    counter = torch.zeros((), dtype=torch.float64)

    def count(module, args, out):
        if module in (model.down1[0], model.up1):
            counter.add_(1)

    handle = None
    if hook == "layer":
        handle = model.down1[0].register_forward_hook(count)
    elif hook == "global":
        handle = torch.nn.modules.module.register_module_forward_hook(count)
    watch = StepWatch(known_leaves={}, known_writes=set(), inputs={id(x)})
    try:
        with torch.no_grad(), watch:
            model(x)
    finally:
        if handle is not None:
            handle.remove()
    assert {id(p) for p in watch.leaves} == {id(p) for p in model.parameters()}
    written = [tensor.untyped_storage().data_ptr() for tensor, _ in watch.writes]  # kept by its whole storage
    assert written == ([] if hook is None else [counter.untyped_storage().data_ptr()])


@pytest.mark.parametrize("model", ["block", "unet"])
def test_the_watch_is_told_the_weights_a_step_reads_through_the_episodes_casts(model):
    """Without grad under autocast a fused block reads its conv weights through the episode's
    bf16 copies, made before the step: the cast tells the watch (through the dispatch-mode stack,
    as everything the watch is told), so every parameter is found."""
    torch.manual_seed(0)
    module = qca_lowmem.FusedConvBlock(4, 4) if model == "block" else qca_lowmem.UNetUnitary(2, 8)
    x = torch.randn(1, 4, 8, 8)
    casts = weight_casts.WeightCasts()
    with casts.active(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)  # the copies, made before the step
        watch = StepWatch(known_leaves={}, known_writes=set(), inputs={id(x)})
        with watch:
            module(x)
    assert len(casts.copies()) >= 2
    assert {id(p) for p in watch.leaves} == {id(p) for p in module.parameters()}


class SeeingWatch(StepWatch):
    """A StepWatch that lists the ops its dispatch sees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return super().__torch_dispatch__(func, types, args, kwargs)


def noisy_fused_step(model, drift):
    """pack -> the fused U-Net -> update, then an update by the leaf `drift` -> the stock noise (a
    bit flip at step 0 of seed 2), and a write into what the pack made."""
    noise = qca_lowmem.NoiseSchedule(0.5, 2000, seed=2)
    assert noise.bit_flips_at(0)

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        x.mul_(1.0)  # the pack made x: the step's own tensor, no buffer
        psi = qca_lowmem.qca_update(psi, model(x), 0.05)
        return noise(qca_lowmem.qca_update(psi, drift, 0.0), 0)

    return step


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad step", "kept-graph step"])
def test_the_step_ops_and_the_unets_cat_run_hidden_from_the_watch_and_tell_it_their_reads(grad):
    torch.manual_seed(0)
    model = qca_lowmem.UNetUnitary(2, 8).double()
    psi = stock.initial_state(2, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    drift = (0.01 * torch.randn(2, 4, 8, 8, dtype=torch.float64)).requires_grad_()
    step = noisy_fused_step(model, drift)
    watch = SeeingWatch(known_leaves={}, known_writes=set(), inputs={id(psi)})
    with torch.set_grad_enabled(grad), watch:
        step(psi)
    # Only the step's own op between the fused ones; and with grad, on torch before 2.13, the two
    # empty tensors the U-Net's torch.utils.checkpoint makes to save its inputs (_NoopSaveInputs).
    checkpoint_dummies = ["aten.empty"] * 2 if grad and hasattr(torch.utils.checkpoint, "_NoopSaveInputs") else []
    assert watch.seen == ["aten.mul_", *checkpoint_dummies]
    # drift reaches the step only through the hidden update: it told the watch.
    assert {id(p) for p in watch.leaves} == {id(p) for p in [*model.parameters(), drift]}
    assert watch.writes == []

    counting = RecordingMode()  # any other mode sees every op
    with torch.set_grad_enabled(grad), counting:
        step(psi.clone())
    for op in ("qca_lowmem.qca_pack", "qca_lowmem.qca_update", "qca_lowmem.phase_flip", "qca_lowmem.bit_flip",
               "qca_lowmem.noise_coin", "aten.cat"):
        assert op in counting.seen, op
