"""A differential fuzzer of the rollout: step programs drawn from the pieces users write, run under
every policy and under plain autograd, which must agree on the loss, the gradients, the buffers
and the random generator's state (or the policy refuses, naming the cause). Among the pieces,
what the episode's first step does not show: a parameter, a BatchNorm or a counter that only
later steps reach, backwards that ask for some leaves only (`inputs=`, `autograd.grad`), a hook
that does not add up, a step that changes psi in place (refused in one line).

CI runs a fixed number of examples; QCA_FUZZ_EXAMPLES=2000 runs a long search. A failure it finds
becomes a named test in test_rollout_semantics.py.
"""

import os
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qca_lowmem
from fixtures import replayed_graphs
from qca_lowmem import stock

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = int(os.environ.get("QCA_FUZZ_EXAMPLES", "25"))
STEPS = 5
POLICIES = [dict(checkpoint="step"), dict(checkpoint="revolve", slots=1), dict(checkpoint="revolve", slots=3),
            dict(checkpoint="auto", budget=0), dict(checkpoint="auto", budget=6_000),
            dict(checkpoint="auto", budget=10**9)]


@dataclass(frozen=True)
class Program:
    kernel: int  # the operator's convolution: 1x1 or 3x3
    branch: bool  # a branch on psi's values picks a second convolution
    late_from: int  # a third convolution from this step on (STEPS: never), counted in the carry
    memory: str  # "none", "detached", "grad" (h keeps its graph), "first-none" (h is None at step 0)
    dropout: bool
    batchnorm: bool
    frozen: bool  # the first convolution's weight does not require grad
    tied: bool  # the second convolution shares the first one's weight
    conj: bool  # the step returns a conj view
    noise: bool
    bf16: bool
    later: str  # from step 1 on (psi no longer psi0): "none", "leaf" (a fourth conv), "batchnorm", "counter"
    ask: str  # the backward: "backward", "inputs" (backward(inputs=ASKED)), "grad" (autograd.grad of ASKED)
    hooked: bool  # `late` also in the loss, with a clipping hook (not additive: partial sums would show)
    in_place: bool  # the step scales psi in place
    # The step as a StepGraph on the stand-in of CUDA graphs (fixtures/replayed_graphs.py): "none",
    # "one lane", or two lanes with the recompute run ahead at once ("queued") or when joined.
    graph: str


programs = st.builds(Program, kernel=st.sampled_from([1, 3]), branch=st.booleans(),
                     late_from=st.integers(0, STEPS), memory=st.sampled_from(["none", "detached", "grad", "first-none"]),
                     dropout=st.booleans(), batchnorm=st.booleans(), frozen=st.booleans(), tied=st.booleans(),
                     conj=st.booleans(), noise=st.booleans(), bf16=st.booleans(),
                     later=st.sampled_from(["none", "leaf", "batchnorm", "counter"]),
                     ask=st.sampled_from(["backward", "inputs", "grad"]), hooked=st.booleans(),
                     in_place=st.sampled_from([False, False, False, True]),
                     graph=st.sampled_from(["none", "one lane", "queued", "joined"]))


class Model(torch.nn.Module):
    def __init__(self, program: Program):
        super().__init__()
        k = program.kernel
        self.first = torch.nn.Conv2d(4, 4, k, padding=k // 2)
        self.second = torch.nn.Conv2d(4, 4, k, padding=k // 2)
        self.late = torch.nn.Conv2d(4, 4, k, padding=k // 2)
        self.memory = torch.nn.Conv2d(4, 4, 1)
        self.norm = torch.nn.BatchNorm2d(4) if program.batchnorm else None
        self.later = torch.nn.Conv2d(4, 4, k, padding=k // 2)
        self.later_norm = torch.nn.BatchNorm2d(4)
        self.register_buffer("counter", torch.zeros(()))
        if program.tied:
            self.second.weight = self.first.weight
        if program.frozen:
            self.first.weight.requires_grad_(False)


def make(program: Program, seed: int):
    torch.manual_seed(seed)
    model = Model(program).double()
    carried = program.memory != "none"

    def step(psi, carry=None):
        later = not torch.equal(psi, PSI0)  # steps 1 on: the probe's first step does not see it
        if program.in_place:
            psi.mul_(1.0)
        x = qca_lowmem.qca_pack(psi)
        h = model.first(x)
        if later and program.later == "leaf":
            h = h + model.later(x)
        elif later and program.later == "batchnorm":
            h = model.later_norm(h)
        elif later and program.later == "counter":
            model.counter.add_(1)
        if program.branch and psi.real.sum() > 0:
            h = h + model.second(x)
        if carry is not None:
            count, memory = carry
            if count.item() >= program.late_from:
                h = h + model.late(x)
            if memory is not None:
                h = h + model.memory(memory)
        if model.norm is not None:
            h = model.norm(h)
        h = torch.nn.functional.dropout(torch.tanh(h), 0.2 if program.dropout else 0.0)
        out = qca_lowmem.qca_update(psi, 0.2 * h, 0.05)
        out = out.conj() if program.conj else out
        if carry is None:
            return out
        memory = h if program.memory == "grad" else h.detach()
        return out, (count + 1, memory)

    carry0 = None
    if carried:
        count0 = torch.zeros((), dtype=torch.int64)
        memory0 = None if program.memory == "first-none" else torch.zeros(1, 4, 6, 6, dtype=torch.float64)
        carry0 = (count0, memory0)
    return model, step, carry0


PSI0 = stock.initial_state(1, 6, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))


def clipped(grad):
    return grad.clamp(-0.05, 0.05)


def episode(program: Program, options: dict):
    """(loss, .grad of every parameter, the gradients asked for, buffers, generator state) of one
    episode, or the qca_lowmem error."""
    model, step, carry0 = make(program, seed=0)
    if program.graph != "none":
        with replayed_graphs.installed("queued" if program.graph == "one lane" else program.graph), \
                warnings.catch_warnings():
            # dropout draws random numbers: that step is not captured, and says so
            warnings.simplefilter("ignore", qca_lowmem.CaptureFallbackWarning)
            return run_episode(program, options, model, qca_lowmem.StepGraph(step, overlap=program.graph != "one lane"),
                               carry0)
    return run_episode(program, options, model, step, carry0)


def run_episode(program: Program, options: dict, model, step, carry0):
    psi0 = PSI0.clone()
    if program.hooked:
        model.late.weight.register_hook(clipped)
    noise = qca_lowmem.NoiseSchedule(0.3, 3000, seed=5) if program.noise else None
    torch.manual_seed(11)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=program.bf16):
        kwargs = dict(noise=noise, record_every=2, **options)
        if carry0 is not None:
            psi_T, history, carry_T = qca_lowmem.rollout(step, psi0, STEPS, carry=carry0, **kwargs)
        else:
            psi_T, history = qca_lowmem.rollout(step, psi0, STEPS, **kwargs)
            carry_T = ()
        weights = torch.linspace(0.5, 2.0, psi_T.numel(), dtype=torch.float64).reshape(psi_T.shape)
        loss = (psi_T.abs().square() * weights).sum() + history[1].real.sum()
        if program.memory == "grad":
            loss = loss + carry_T[1].square().sum()
        if program.hooked:
            loss = loss + model.late.weight.sum()
    # Late leaves, and one with a gradient above rounding (a bias before a BatchNorm has none).
    asked = [model.late.weight, model.later.weight, model.norm.weight if program.batchnorm else model.first.bias]
    if program.ask == "backward":
        loss.backward()
        got = []
    elif program.ask == "inputs":
        loss.backward(inputs=asked)
        got = []
    else:
        got = list(torch.autograd.grad(loss, asked, allow_unused=True))
    params = [p for p in model.parameters() if p.requires_grad]
    return (loss.item(), [p.grad for p in params] + got, [b.clone() for b in model.buffers()], torch.get_rng_state())


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float, scale: float) -> bool:
    """Within `tolerance` of b's largest value, or of 1e-4 of the largest gradient (`scale`)
    when b is smaller: a gradient that is zero up to rounding (a bias before a BatchNorm) is that
    rounding, a different one on each path."""
    return (a - b).abs().max().item() <= tolerance * max(b.abs().max().item(), 1e-4 * scale)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(program=programs)
def test_every_policy_gives_plain_autograds_answer(program):
    if program.in_place:  # plain autograd changes the caller's tensors with it: refused, in one line
        for options in POLICIES:
            with pytest.raises(RuntimeError, match=r"^rollout\(checkpoint='\w+'\): step_fn changed its input psi in "
                                                   r"place at step \d+ [^\n]*out of place") as error:
                episode(program, options)
            assert "\n" not in str(error.value)
        return
    loss, grads, buffers, rng = episode(program, dict(checkpoint="none"))
    tolerance = 2e-2 if program.bf16 else 1e-9
    for options in POLICIES:
        try:
            got_loss, got_grads, got_buffers, got_rng = episode(program, options)
        except qca_lowmem.RecomputeMismatchError as error:  # a refusal must name the step
            assert "recompute of step" in str(error), (program, options, error)
            continue
        assert got_loss == pytest.approx(loss, rel=tolerance), (program, options)
        assert [g is None for g in got_grads] == [g is None for g in grads], (program, options)
        scale = max((g.abs().max().item() for g in grads if g is not None), default=1.0)
        for got, expected in zip(got_grads, grads):
            assert expected is None or close(got, expected, tolerance, scale), (program, options)
        assert all(torch.equal(a, b) for a, b in zip(got_buffers, buffers)), (program, options)
        assert torch.equal(got_rng, rng), (program, options)
