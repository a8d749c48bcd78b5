"""Steps as users write them, against plain autograd: every policy gives its answer or refuses by
name. Here: rollouts inside one autocast block, the step called by nobody but the episode
(checkpoint="auto" measures its real first steps), and weight casts that follow every change of
a weight."""

import contextlib
import functools
import re
from unittest import mock

import pytest
import torch

import qca_lowmem
from helpers import batchnorm_step
from qca_lowmem import _torch_private as torch_private
from qca_lowmem import stock

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = [dict(checkpoint="step"), dict(checkpoint="revolve", slots=1), dict(checkpoint="revolve", slots=2),
            dict(checkpoint="auto", budget=0), dict(checkpoint="auto", budget=30_000),
            dict(checkpoint="auto", budget=10**9)]
IDS = ["step", "revolve1", "revolve2", "auto0", "auto-some", "auto-all"]


def unet_and_conv():
    torch.manual_seed(0)
    unet = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)
    conv = torch.nn.Conv2d(4, 4, 1)  # a plain torch layer: autocast's cache casts its weight
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.1)
    params = list(unet.parameters()) + list(conv.parameters())

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        return qca_lowmem.qca_update(psi, unet(x) + 0.1 * conv(x), 0.05)

    return params, conv, step


def weighted(psi):
    return psi.abs().square().mul(torch.linspace(0.5, 2.0, psi.numel()).reshape(psi.shape)).sum()


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_rollouts_and_a_model_call_in_one_autocast_block(policy):
    """Autocast caches a cast of a plain layer's weight for the rest of its block: a model call
    before the rollout, or an earlier rollout (accumulation, the stock pattern), hands step 0 a
    cast made before it, which is a cast of a parameter and nothing else."""
    params, conv, step = unet_and_conv()
    psi0 = stock.initial_state(1, 8, 2, generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            conv(qca_lowmem.qca_pack(psi0))
            loss = sum(weighted(qca_lowmem.rollout(step, psi0, 4, **options)[0]) for _ in range(2))
        loss.backward()
        grads[name] = [p.grad for p in params]
    for got, expected in zip(grads["policy"], grads["plain"]):  # within bf16's rounding
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 2e-2


def bf16_episodes(unet, optimizer, steps, scope, edit=None):
    """Three optimizer steps of one bf16 episode each, all inside one shared_weight_casts() scope
    when `scope`; `edit(unet)` after each step. Returns the losses."""
    psi0 = stock.initial_state(1, 8, 2, generator=torch.Generator().manual_seed(2))

    def step(psi):
        return qca_lowmem.qca_update(psi, unet(qca_lowmem.qca_pack(psi)), 0.05)

    losses = []
    with qca_lowmem.shared_weight_casts() if scope else contextlib.nullcontext():
        for _ in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = weighted(qca_lowmem.rollout(step, psi0, 3)[0])
            loss.backward()
            optimizer.step()
            if edit is not None:
                edit(unet)
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("change", ["fused AdamW", "p.data = ...", "load_state_dict"])
def test_shared_weight_casts_follow_every_change_of_a_weight(change):
    """A fused optimizer changes weights without bumping their versions; `p.data = new` gives them
    new memory; load_state_dict copies in place. The scope's copies follow all three, so the
    losses are those of casting per episode."""
    runs = []
    for scope in (False, True):
        torch.manual_seed(0)
        unet = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)
        optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-2, fused=change == "fused AdamW")
        saved = {k: v.clone() * 0.9 for k, v in unet.state_dict().items()}
        edit = {"fused AdamW": None,
                "p.data = ...": lambda m: setattr(m.inc.conv_block[0].weight, "data", m.inc.conv_block[0].weight.data * 1.1),
                "load_state_dict": lambda m: m.load_state_dict(saved)}[change]
        runs.append(bf16_episodes(unet, optimizer, 3, scope, edit))
    assert runs[1] == runs[0]


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_the_episode_calls_the_step_as_plain_autograd_does(policy):
    """No call of the step that the episode does not make: "auto" measures its real first steps,
    so a step drawing random numbers (dropout) gets the same draws, the loss and gradients are
    plain autograd's, and the generator is left where plain autograd leaves it."""
    torch.manual_seed(0)
    unet = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8).double()
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.1)
    calls = []

    def step(psi):
        calls.append(torch.is_grad_enabled())
        x = qca_lowmem.qca_pack(psi)
        return qca_lowmem.qca_update(psi, torch.nn.functional.dropout(unet(x), 0.3), 0.05)

    psi0 = stock.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    results = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        unet.zero_grad(set_to_none=True)
        calls.clear()
        torch.manual_seed(7)
        loss = weighted(qca_lowmem.rollout(step, psi0, 5, **options)[0])
        forward_calls = len(calls)
        loss.backward()
        results[name] = (loss.item(), [p.grad for p in unet.parameters()], torch.get_rng_state(), forward_calls)
    (loss, grads, rng, forward_calls), (plain_loss, plain_grads, plain_rng, _) = results["policy"], results["plain"]
    assert forward_calls == 5 and loss == pytest.approx(plain_loss, rel=1e-12)
    for got, expected in zip(grads, plain_grads):
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10
    assert torch.equal(rng, plain_rng)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_memory_made_by_the_first_step_reaches_its_parameters(policy):
    """The users' ConvLSTM engine hands a first step h = None and runs its hidden-to-hidden conv
    only from the second step on: the episode finds that conv's parameters by probing up to the
    first step with the whole carry, so they get plain autograd's gradients."""
    torch.manual_seed(0)
    into = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    hidden = torch.nn.Conv2d(4, 4, 3, padding=1).double()  # used from step 1 on
    params = list(into.parameters()) + list(hidden.parameters())

    def step(psi, carry):
        x = qca_lowmem.qca_pack(psi)
        h = carry[0]
        h = torch.tanh(into(x) + (hidden(h) if h is not None else 0))
        return qca_lowmem.qca_update(psi, 0.1 * h, 0.05), (h,)

    psi0 = stock.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        for p in params:
            p.grad = None
        psi_T, _, (h_T,) = qca_lowmem.rollout(step, psi0, 5, carry=(None,), **options)
        (weighted(psi_T) + h_T.square().sum()).backward()
        grads[name] = [p.grad for p in params]
    for got, expected in zip(grads["policy"], grads["plain"]):
        assert got is not None and ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_batchnorm_statistics_end_as_plain_autograd_leaves_them(policy):
    """A BatchNorm in train mode updates its running statistics in every forward: recomputes start
    from the values their forward step saw, and the episode ends with the values plain autograd
    leaves, with its loss and gradients."""
    results = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        conv, norm, step = batchnorm_step()
        psi0 = stock.initial_state(2, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
        loss = weighted(qca_lowmem.rollout(step, psi0, 4, **options)[0])
        loss.backward()
        results[name] = (loss.item(), [p.grad for p in [*conv.parameters(), *norm.parameters()]],
                         [b.clone() for b in norm.buffers()])
    (loss, grads, buffers), (plain_loss, plain_grads, plain_buffers) = results["policy"], results["plain"]
    assert loss == pytest.approx(plain_loss, rel=1e-12)
    for got, expected in zip(grads, plain_grads):
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10
    assert [b.tolist() for b in buffers] == [b.tolist() for b in plain_buffers]  # num_batches_tracked 4, not more


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_parameter_first_used_by_a_later_step_gets_its_gradient(policy):
    """A step that routes on psi's values uses `late` only once psi has grown (from step 1 on):
    the first step's graph does not reach it, a recompute (or the kept chain) does, and it gets
    plain autograd's gradient, through its own hooks once."""
    torch.manual_seed(0)
    early = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    late = torch.nn.Conv2d(4, 4, 3, padding=1).double()
    params = [*early.parameters(), *late.parameters()]
    hook_calls = []
    late.weight.register_hook(lambda grad: hook_calls.append(1))

    def step(psi):
        h = early(psi)
        if psi.abs().mean().item() > 1.1:  # False at step 0 only
            h = h + late(psi)
        return 1.2 * psi + 0.01 * torch.tanh(h)

    psi0 = torch.rand(1, 4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    psi0 = psi0 / psi0.abs().mean()
    grads = {}
    for name, options in (("plain", dict(checkpoint="none")), ("policy", policy)):
        for p in params:
            p.grad = None
        hook_calls.clear()
        psi_T, history = qca_lowmem.rollout(step, psi0, 5, record_every=2, **options)
        (weighted(psi_T) + history[1].sum()).backward()
        grads[name] = [p.grad for p in params]
        assert hook_calls == [1], name
    for got, expected in zip(grads["policy"], grads["plain"]):
        assert got is not None and ((got - expected).abs().max() / expected.abs().max()).item() < 1e-10


class ForgottenMemory:
    """A step that keeps a memory on itself (as the users' engine keeps h on motor.state) and was
    not given carry=...: each call reads the memory the previous call left."""

    def __init__(self, unet, weight: float):
        self.unet, self.weight, self.memory = unet, weight, None

    def __call__(self, psi):
        x = qca_lowmem.qca_pack(psi)
        delta = self.unet(x)
        if self.memory is not None:
            delta = delta + self.weight * self.memory
        self.memory = delta.detach()
        return qca_lowmem.qca_update(psi, delta, 0.0)


@pytest.mark.parametrize("policy", POLICIES[:3], ids=IDS[:3])
def test_the_check_sees_a_forgotten_memory_at_the_stock_heads_initialisation(policy):
    """The stock U-Net's output layer starts at N(0, 1e-5): a step moves psi by about 1e-5, so a
    difference relative to psi hid under complex64's rounding; relative to the step's change, it
    shows."""
    torch.manual_seed(0)
    unet = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 1e-5)
    psi0 = stock.initial_state(1, 8, 2, generator=torch.Generator().manual_seed(1))
    psi_T, _ = qca_lowmem.rollout(ForgottenMemory(unet, 0.5), psi0, 4, **policy)
    with pytest.raises(qca_lowmem.RecomputeMismatchError, match="what each recomputed step changed"):
        weighted(psi_T).backward()


@pytest.mark.parametrize("policy", POLICIES[:3], ids=IDS[:3])
def test_the_check_sees_a_dependence_of_one_part_in_a_billion(policy):
    torch.manual_seed(0)
    unet = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8).double()
    psi0 = stock.initial_state(1, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    psi_T, _ = qca_lowmem.rollout(ForgottenMemory(unet, 1e-9), psi0, 4, **policy)
    with pytest.raises(qca_lowmem.RecomputeMismatchError, match=r"recompute of step \d+"):
        weighted(psi_T).backward()


def test_on_a_gpu_the_check_allows_rounding_of_the_compute_precision():
    from qca_lowmem.recompute.check import ROUNDING_UNITS, _tolerance

    on_gpu = torch.empty(2, dtype=torch.complex64, device="meta")
    assert _tolerance(on_gpu, torch.bfloat16) == ROUNDING_UNITS * torch.finfo(torch.bfloat16).eps
    assert _tolerance(torch.empty(2, dtype=torch.complex64), torch.bfloat16) == 0.0  # the CPU: bit for bit


@pytest.mark.parametrize("cudnn_tf32, matmul_precision, units_of", [
    (True, "highest", 2.0**-10), (False, "high", 2.0**-10), (False, "highest", torch.finfo(torch.float32).eps)])
def test_on_a_gpu_float32_steps_may_round_as_tf32_where_torch_allows_it(monkeypatch, cudnn_tf32, matmul_precision,
                                                                         units_of):
    """cuDNN computes float32 convs in TF32 by default, and with cudnn.benchmark each thread may pick
    another algorithm: a recompute on autograd's device thread differed by 0.64 TF32 units (H200)."""
    from qca_lowmem.recompute.check import ROUNDING_UNITS, _tolerance

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        assert _tolerance(torch.empty(2, dtype=torch.complex64, device="meta"), None) == ROUNDING_UNITS * units_of
    finally:
        torch.set_float32_matmul_precision(precision)


def hooked_step(guarded: bool, calls: list):
    """A step registering a gradient hook on its operator's output (halving that gradient, counting
    its runs), only where the output requires grad or always."""
    unet = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)

    def halve(grad):
        calls.append(None)
        return grad * 0.5

    def step(psi):
        delta = unet(qca_lowmem.qca_pack(psi))
        if delta.requires_grad or not guarded:
            delta.register_hook(halve)
        return qca_lowmem.qca_update(psi, delta, 0.05)

    return list(unet.parameters()), step


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_gradient_hook_a_step_registers_runs_as_plain_autograd_or_is_refused_by_name(policy):
    """A hook registered where the output requires grad: the recompute registers it, and it runs
    once a step in the backward, the gradients plain autograd's. Registered always: the forward,
    run without grad, is refused naming the hook and the guard (torch's own error said otherwise)."""
    psi0 = stock.initial_state(1, 8, 2, generator=torch.Generator().manual_seed(1))
    results = []
    for options in (dict(checkpoint="none"), policy):
        calls = []
        torch.manual_seed(0)
        params, step = hooked_step(True, calls)
        psi, _ = qca_lowmem.rollout(step, psi0, 5, **options)
        results.append((torch.autograd.grad(weighted(psi), params), len(calls)))
    (plain, plain_calls), (grads, hook_calls) = results
    assert plain_calls == hook_calls == 5
    for got, expected in zip(grads, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)

    calls = []
    _, unguarded = hooked_step(False, calls)
    if policy.get("budget") == 10**9:  # every step kept whole: run once, with grad, as plain autograd
        weighted(qca_lowmem.rollout(unguarded, psi0, 5, **policy)[0]).backward()
        assert len(calls) == 5
        return
    with pytest.raises(RuntimeError, match=r"^rollout: step \d+ runs without grad here .* step_fn registers a hook "
                                           r"on a tensor \(Tensor\.register_hook\); register it only where"):
        qca_lowmem.rollout(unguarded, psi0, 5, **policy)


def halving_hook_step(on_input: bool):
    """A step halving a gradient in the backward (per-step clipping through time): on its input
    psi, or on its output."""
    torch.manual_seed(0)
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def step(psi):
        if on_input and psi.requires_grad:
            psi.register_hook(lambda grad: grad * 0.5)
        out = torch.tanh(psi @ weight)
        if not on_input and out.requires_grad:
            out.register_hook(lambda grad: grad * 0.5)
        return out
    return weight, step


@pytest.mark.parametrize("on_input", [True, False], ids=["on_input", "on_output"])
@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_hook_a_step_sets_on_its_input_is_refused_on_its_output_runs(policy, on_input):
    """Each step runs on a copy of its input state: a hook set there would see that step's share
    of psi's gradient alone, not the history's (the weight's gradient 2.7 off plain's, silently)."""
    psi0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    results = []
    for options in (dict(checkpoint="none"), policy):
        weight, step = halving_hook_step(on_input)
        if on_input and options is policy:
            with pytest.raises(RuntimeError, match=rf"^rollout\(checkpoint='{policy['checkpoint']}'\): step_fn "
                                                   r"registered a hook on its input psi at step 0 .* register it on "
                                                   r"the step's output"):
                qca_lowmem.rollout(step, psi0, 4, record_every=1, **options)
            return
        psi, history = qca_lowmem.rollout(step, psi0, 4, record_every=1, **options)
        results.append(torch.autograd.grad(psi.sum() + sum(h.sum() for h in history[:-1]), (weight, psi0)))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


class HoldsCompiled:
    """A callable object whose call reaches a compiled module through its attribute."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, psi):
        return torch.tanh(self.compiled(psi))


class CallsCompiled:
    """A callable object whose call reaches a compiled function through its module's global."""

    def __call__(self, psi):
        return torch.tanh(COMPILED_LAYER(psi))


COMPILED_LAYER = torch.compile(torch.nn.Linear(4, 4).double(), backend="eager")


class Engine:
    """An engine whose step method calls a compiled operator it holds."""

    def __init__(self, operator):
        self.operator = operator

    def step(self, psi):
        return torch.tanh(self.operator(psi))


class Settings(dict):
    """A config read by attribute, as many are: a missing key raises KeyError, not AttributeError."""

    __getattr__ = dict.__getitem__


SETTINGS = Settings(scale=0.5)
LOGGER = mock.MagicMock()  # answers every attribute, torch.compile's marker too


@torch.compiler.disable
def uncompiled_helper(psi):
    return psi * SETTINGS.scale


def compiled_steps():
    """Steps reaching a compiled function or module as users write them: compiled themselves, a
    closure's, a partial's, a default argument's, an object's attribute, a StepGraph's step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.2)).double()
    compiled_model = torch.compile(model, backend="eager")
    compiled = torch.compile(lambda psi: torch.tanh(model(psi)), backend="eager")

    def calls_compiled(psi):
        return torch.tanh(compiled_model(psi))
    return model, compiled, {
        "step": compiled, "closure": calls_compiled, "partial": functools.partial(lambda psi, f: f(psi), f=compiled),
        "default": lambda psi, f=compiled: f(psi), "attribute": HoldsCompiled(compiled_model),
        "method": CallsCompiled(), "bound": Engine(compiled_model).step, "step_graph": qca_lowmem.StepGraph(compiled)}


@pytest.mark.parametrize("called", ["step", "closure", "partial", "default", "attribute", "method", "bound",
                                    "step_graph"])
@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_compiled_step_is_refused_where_the_episode_would_run_it_uncompiled(policy, called):
    """Under the episode's hooks torch.compile's code does not run: the step ran as eager torch,
    drawing its dropout otherwise than plain autograd's compiled graph (loss 33.59 against 34.20
    under inductor), silently, and torch.compile marked the function to run eagerly for good."""
    model, compiled, steps = compiled_steps()
    psi0 = torch.randn(3, 4, dtype=torch.float64)
    said = {"step": "step_fn is a torch.compile'd function", "closure": "compiled_model (held by step_fn) is a "
            "torch.compile'd Sequential", "partial": "f (held by step_fn) is a torch.compile'd function",
            "default": "f (held by step_fn) is a torch.compile'd function", "attribute": "compiled (held by step_fn) is "
            "a torch.compile'd Sequential", "step_graph": "its step (held by step_fn) is a torch.compile'd function",
            "method": "its __call__'s COMPILED_LAYER (held by step_fn) is a torch.compile'd Linear",
            "bound": "its object's operator (held by step_fn) is a torch.compile'd Sequential"}
    with pytest.raises(RuntimeError, match=rf"^rollout\(checkpoint='{policy['checkpoint']}'\): "
                                           rf"{re.escape(said[called])}, which this episode would run uncompiled"):
        qca_lowmem.rollout(steps[called], psi0, 3, **policy)
    torch.manual_seed(1)
    plain, _ = qca_lowmem.rollout(steps[called], psi0, 3, checkpoint="none")  # nothing recomputed: compiled
    with torch.no_grad():
        torch.manual_seed(1)
        assert torch.equal(qca_lowmem.rollout(steps[called], psi0, 3, **policy)[0], plain)
    assert compiled(psi0).requires_grad and plain.requires_grad


@pytest.mark.parametrize("policy", POLICIES[:3], ids=IDS[:3])
def test_a_compiled_noise_is_refused_and_what_only_looks_compiled_runs(policy):
    """A compiled noise runs uncompiled as a compiled step does. A MagicMock (answering every
    attribute), a torch.compiler.disable'd helper (marked as compiled wrappers are) and a config
    whose __getattr__ raises KeyError were refused or raised inside the check."""
    psi0 = torch.randn(3, 4, dtype=torch.float64)
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    noise = torch.compile(lambda psi, t: psi * 0.99, backend="eager")
    with pytest.raises(RuntimeError, match=r"\): noise is a torch\.compile'd function, which this episode would run"):
        qca_lowmem.rollout(lambda psi: torch.tanh(psi @ weight), psi0, 3, noise=noise, **policy)

    def step(psi):
        LOGGER.debug("step")
        return torch.tanh(uncompiled_helper(psi) @ weight)
    grads = [torch.autograd.grad(qca_lowmem.rollout(step, psi0, 3, **options)[0].sum(), weight)[0]
             for options in (dict(checkpoint="none"), policy)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_a_refused_compiled_step_stays_compiled():
    """torch.compile, seeing the episode's dispatch mode, marks the code it was about to compile to
    run eagerly from then on: refused before it runs, the function stays compiled."""
    ran = []

    def backend(graph, example_inputs):
        def compiled_graph(*args):
            ran.append(None)
            return graph(*args)
        return compiled_graph
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda psi: torch.tanh(psi @ weight), backend=backend)
    psi0 = torch.randn(3, 4, dtype=torch.float64)
    compiled(psi0)
    with pytest.raises(RuntimeError, match="its function \\(held by step_fn\\) is a torch.compile'd function"):
        qca_lowmem.rollout(functools.partial(compiled), psi0, 3, checkpoint="step")
    ran.clear()
    compiled(psi0)
    assert ran


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_leaf_the_step_makes_itself_is_plain_autograds_or_refused_naming_it(policy):
    """`x = psi.detach().requires_grad_()` (a local derivative): a leaf made at each run of the step,
    another one at its recompute, which the recompute cannot tell from a parameter it never saw."""
    torch.manual_seed(0)
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    psi0 = torch.randn(3, 4, dtype=torch.float64)

    def step(psi):
        return psi + 0.1 * torch.tanh(psi.detach().requires_grad_(True) @ weight)
    plain = torch.autograd.grad(qca_lowmem.rollout(step, psi0, 4, checkpoint="none")[0].sum(), weight)[0]
    psi, _ = qca_lowmem.rollout(step, psi0, 4, **policy)
    try:
        grad = torch.autograd.grad(psi.sum(), weight)[0]
    except RuntimeError as refused:
        assert re.match(rf"rollout\(checkpoint='{policy['checkpoint']}'\): the recompute of step 3 reached a tensor "
                        r"requiring grad .* a leaf it makes itself \(x = psi\.detach\(\)\.requires_grad_\(\)\) is "
                        r"read only by checkpoint='none'", str(refused))
        assert policy["checkpoint"] != "auto" or policy["budget"] == 0  # keeping the graphs, it answers
        return
    torch.testing.assert_close(grad, plain, rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_buffer_written_through_data_is_replayed_as_plain_autograd_sees_it(policy):
    """`count.data += 1`: each `.data` is another tensor of the same memory, which the episode kept
    once per step seen, each with other values before it (refused as a mismatch, plain answering)."""
    results = []
    for options in (dict(checkpoint="none"), policy):
        torch.manual_seed(0)
        weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        count = torch.zeros((), dtype=torch.float64)

        def step(psi):
            count.data += 1
            return torch.tanh(psi @ weight) * (1 + 0.01 * count)
        psi, history = qca_lowmem.rollout(step, torch.randn(3, 4, dtype=torch.float64), 5, **options)
        results.append((torch.autograd.grad(psi.sum() + sum(h.sum() for h in history), weight)[0], count.item()))
    (plain, plain_count), (grad, counted) = results
    assert counted == plain_count == 5
    torch.testing.assert_close(grad, plain, rtol=0, atol=0)


@pytest.mark.parametrize("threshold", [1.6, 0.6])
@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_buffer_written_through_two_aliases_is_replayed_whole(policy, threshold):
    """The buffer, then a slice of its `.data`: each alias kept apart, the slice's value before the
    step was read after the whole had been written. Where the buffer gates the gradient alone (the
    values the same) the gradient was 26.0 against plain autograd's 11.4, silently. What a step
    writes is kept by its whole storage."""
    results = []
    for options in (dict(checkpoint="none"), policy):
        buffer = torch.ones(4)
        weight = torch.tensor(0.8, requires_grad=True)

        def step(psi):
            buffer.mul_(0.5)
            buffer.data[:2].add_(1.0)
            moved = psi * weight
            return torch.where(buffer[0] < threshold, moved, moved.detach())
        psi0 = torch.randn(2, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
        psi, history = qca_lowmem.rollout(step, psi0, 5, record_every=1, **options)
        loss = psi.abs().square().sum() + sum(h.abs().square().sum() for h in history)
        results.append((torch.autograd.grad(loss, weight, allow_unused=True)[0], buffer.clone()))
    (plain, plain_buffer), (grad, buffer_after) = results
    assert torch.equal(buffer_after, plain_buffer)
    assert (grad is None and plain is None) or torch.equal(grad, plain)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_step_reading_a_sparse_matrix_is_plain_autograds(policy):
    """A constant sparse operator (a lattice Laplacian): the probe copied every tensor a step reads,
    and a sparse one has no storage to copy (NotImplementedError from inside the probe)."""
    n = 8
    rows = list(range(n)) + list(range(n - 1))
    laplacian = torch.sparse_coo_tensor(torch.tensor([rows, list(range(n)) + list(range(1, n))]),
                                        torch.linspace(-1.0, 1.0, 2 * n - 1, dtype=torch.float64), (n, n)).coalesce()
    weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    psi0 = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = [torch.autograd.grad(qca_lowmem.rollout(lambda psi: torch.sparse.mm(laplacian, psi) * weight, psi0, 3,
                                                    **options)[0].square().sum(), weight)[0]
             for options in (dict(checkpoint="none"), policy)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_buffers_in_disjoint_parts_of_one_storage_are_kept_apart(policy):
    """Two buffers made as slices of one tensor, one written from a later step on; the rest of the
    storage, which no step writes, changed by the caller between the forward and the backward,
    stays as the caller left it: the backward puts back what it found, as plain autograd's writes
    nothing (the values the forward left put the caller's change back)."""
    results = []
    for options in (dict(checkpoint="none"), policy):
        flat = torch.zeros(24, dtype=torch.float64)
        first, second, untouched = flat[:8], flat[8:16], flat[16:]
        weight = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()

        def step(psi):
            first.add_(1)
            if first[0] > 2.5:
                second.add_(psi.detach()[0])
            return torch.tanh(psi @ weight) * (1 + 0.01 * second) + 0.01 * first
        psi0 = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        psi, _ = qca_lowmem.rollout(step, psi0, 5, **options)
        untouched.fill_(5.0)
        results.append((torch.autograd.grad(psi.square().sum(), weight)[0], flat.clone()))
    (plain, plain_flat), (grad, flat_after) = results
    assert torch.equal(grad, plain) and torch.equal(flat_after, plain_flat) and bool((flat_after[16:] == 5).all())


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_one_memory_written_through_overlapping_tensors_and_views_is_plain_autograds(policy):
    """A registered buffer that is a view of a larger tensor, written whole and through a slice the
    step takes; another tensor made on its storage (as_strided), neither a view of the other; a
    strided view interleaved with another."""
    results = []
    for options in (dict(checkpoint="none"), policy):
        big = torch.zeros(16, dtype=torch.float64)
        buffer, odd = big[2:10], big[11::2]
        overlapping = torch.empty(0, dtype=torch.float64).set_(big.untyped_storage(), 4, (4,), (1,))
        weight = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()

        def step(psi):
            buffer.mul_(0.5)
            buffer[0] += 1
            overlapping.add_(psi.detach()[0, :4])
            odd.mul_(1.5).add_(1)
            return torch.tanh(psi @ weight) * (1 + 0.01 * buffer) + 0.01 * big[8:].sum()
        psi0 = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        psi, _ = qca_lowmem.rollout(step, psi0, 5, **options)
        results.append((torch.autograd.grad(psi.square().sum(), weight)[0], big.clone()))
    (plain, plain_big), (grad, big_after) = results
    assert torch.equal(grad, plain) and torch.equal(big_after, plain_big)


def test_a_sparse_tensor_saved_is_counted_by_its_indices_and_values():
    """saved_bytes raised (a sparse tensor has no storage of its own)."""
    laplacian = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.ones(3), (3, 3))
    x = torch.ones(3, 2, requires_grad=True)
    expected = laplacian._indices().nbytes + laplacian._values().nbytes  # sparse.mm saves the matrix alone
    assert qca_lowmem.saved_bytes(lambda: torch.sparse.mm(laplacian, x)) == expected
    assert qca_lowmem.peak_saved_bytes(lambda: torch.sparse.mm(laplacian, x).sum().backward()) == expected


@pytest.fixture
def one_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_a_static_graph_ddp_module_in_the_step_is_refused_naming_it(policy, one_process_group):
    """DDP(static_graph=True) queues its all-reduce at its first backward, which the episode's
    recompute runs and ends before the parameters get their gradients: DDP then took every
    parameter for unused and never reduced them (two ranks kept their own gradients, silently)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4).double(), static_graph=True)
    psi0 = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"^rollout\(checkpoint='{policy['checkpoint']}'\): the step runs a "
                                           r"DistributedDataParallel module with static_graph=True"):
        qca_lowmem.rollout(lambda psi: torch.tanh(model(psi)), psi0, 3, **policy)
    dynamic = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4).double())
    psi, _ = qca_lowmem.rollout(lambda psi: torch.tanh(dynamic(psi)), psi0, 3, **policy)
    psi.sum().backward()
    assert all(p.grad is not None for p in dynamic.parameters())


@pytest.mark.parametrize("policy", POLICIES[:4], ids=IDS[:4])
def test_a_parameter_a_step_changes_in_place_is_refused_naming_it(policy):
    """`w.mul_(0.99)` under no_grad inside the step: plain autograd's backward refuses it with a
    version error; the recompute saw another w than its forward, refused as a mismatch blaming state
    kept outside psi."""
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def step(psi):
        if through_data:
            weight.data.mul_(0.99)
        else:
            with torch.no_grad():
                weight.mul_(0.99)
        return torch.tanh(psi @ weight)
    for through_data in (False, True):
        with pytest.raises(RuntimeError, match=r"^rollout: step_fn changed a tensor requiring grad in place \(shape "
                                               r"\(4, 4\); a parameter changed under torch\.no_grad\(\) or through "
                                               r"\.data\)"):
            qca_lowmem.rollout(step, torch.randn(3, 4, dtype=torch.float64), 4, **policy)


@pytest.mark.parametrize("interrupted_at", [1, 3, 5])
def test_a_backward_interrupted_while_the_parameters_hooks_are_set_aside_puts_them_back(interrupted_at, monkeypatch):
    """A Ctrl-C in the backward as it sets each parameter's hooks aside for its gradient buffers:
    every parameter keeps its own hooks after it (one kept the buffer's hook, whose gradients it
    swallowed, silently, from then on), and the next backward is plain autograd's."""
    params, _, step = unet_and_conv()
    seen = []
    params[0].register_hook(lambda grad: seen.append(None))
    hooks_before = [dict(p._backward_hooks or {}) for p in params]
    psi0 = stock.initial_state(1, 8, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(2))
    real, calls = torch_private.backward_hooks, []

    def interrupting(tensor):
        calls.append(None)
        if len(calls) == interrupted_at:
            raise KeyboardInterrupt("Ctrl-C")
        return real(tensor)
    with monkeypatch.context() as patch:
        patch.setattr(torch_private, "backward_hooks", interrupting)
        psi, _ = qca_lowmem.rollout(step, psi0, 3, checkpoint="step")
        with pytest.raises(KeyboardInterrupt):
            weighted(psi).backward()
    assert [dict(p._backward_hooks or {}) for p in params] == hooks_before
    for p in params:
        p.grad = None
    psi, _ = qca_lowmem.rollout(step, psi0, 3, checkpoint="step")
    weighted(psi).backward()
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    psi, _ = qca_lowmem.rollout(step, psi0, 3, checkpoint="none")
    weighted(psi).backward()
    assert all(torch.allclose(g, p.grad, rtol=1e-4, atol=1e-6) and g.abs().max() > 0 for g, p in zip(got, params))
    assert len(seen) == 2
