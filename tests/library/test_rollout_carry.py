"""qca_lowmem.rollout with state besides psi (carry=...): exact gradients through the carry in
every mode, and the recompute check that refuses a step depending on state outside its inputs."""

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import CARRY_STEPS as STEPS
from helpers import MemoryCell, carried_grads, cuda_only, full_step_bytes, initial_memory, initial_state, memory_step
from qca_lowmem import NoiseSchedule, RecomputeMismatchError, rollout, saved_bytes
from qca_lowmem import stock as reference

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [("none", None), ("step", None), ("revolve", 1), ("revolve", 3)]


def assert_same(actual, expected, rel=1e-10):
    for a, e in zip(actual, expected, strict=True):
        assert a is not None and e is not None
        err = ((a - e).abs().max() / e.abs().max().clamp_min(1e-300)).item()
        assert err <= rel, f"relative error {err:.3e}"


@pytest.mark.parametrize("checkpoint,slots", MODES[1:])
@pytest.mark.parametrize("detach", [False, True], ids=["grad-through-memory", "detached-memory"])
def test_carry_gradients_equal_plain_autograd(checkpoint, slots, detach):
    cell = MemoryCell().double()
    step = memory_step(cell, detach)
    psi0, memory0 = initial_state(), initial_memory(requires_grad=not detach)
    noise = NoiseSchedule(0.5, 2000, seed=1)
    loss, expected, memory_expected = carried_grads(step, cell, psi0, memory0, "none", noise=noise, memory_loss=not detach)
    loss_r, actual, memory_T = carried_grads(step, cell, psi0, memory0, checkpoint, slots, noise=noise, memory_loss=not detach)
    assert torch.equal(loss_r, loss)
    assert_same(actual, expected)
    assert_same(memory_T, memory_expected, rel=0.0)
    # The gradient reaches the initial memory exactly when the step lets it through.
    assert len(actual) == len(list(cell.parameters())) + (1 if detach else 3)


@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_memory_made_by_the_first_step(checkpoint, slots):
    """carry entries may start as None (the users' engine's first episode)."""
    cell = MemoryCell().double()
    step = memory_step(cell, detach=True)
    _, expected, memory_expected = carried_grads(step, cell, initial_state(), (None, None), "none")
    _, actual, memory_T = carried_grads(step, cell, initial_state(), (None, None), checkpoint, slots)
    assert_same(actual, expected)
    assert_same(memory_T, memory_expected, rel=0.0)


def test_integer_carry_and_autocast():
    """A step counter carried as an integer tensor makes a step that reads it pure; bf16 autocast
    is replayed around the recompute."""
    net = nn.Conv2d(4, 4, 3, padding=1).double()

    def step(psi, carry):
        (count,) = carry
        delta = torch.tanh(net(qca_lowmem.qca_pack(psi))) * (1.0 + 0.1 * count.to(torch.float64))
        return qca_lowmem.qca_update(psi, delta, multiplicative=False), (count + 1,)

    def run(checkpoint):
        for p in net.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            psi_T, history, (count,) = rollout(step, initial_state(), STEPS, checkpoint=checkpoint,
                                               carry=(torch.zeros((), dtype=torch.long),))
        psi_T.abs().square().mul(torch.arange(psi_T.numel()).view_as(psi_T)).sum().backward()
        return [p.grad for p in net.parameters()], count

    expected, count = run("none")
    actual, count_step = run("step")
    assert count.item() == count_step.item() == STEPS
    assert_same(actual, expected)


class Counter:
    """A step that keeps state outside its inputs: a hidden counter, bumped on every call."""

    def __init__(self, net):
        self.net, self.calls = net, 0

    def __call__(self, psi):
        self.calls += 1
        delta = torch.tanh(self.net(qca_lowmem.qca_pack(psi))) * (1.0 + 0.1 * self.calls)
        return qca_lowmem.qca_update(psi, delta, multiplicative=False)


@pytest.mark.parametrize("checkpoint,slots", MODES[1:])
def test_impure_step_raises(checkpoint, slots):
    net = nn.Conv2d(4, 4, 3, padding=1).double()
    psi0 = initial_state().requires_grad_()
    psi_T, history = rollout(Counter(net), psi0, STEPS, checkpoint=checkpoint, slots=slots)
    with pytest.raises(RecomputeMismatchError) as error:
        psi_T.abs().sum().backward()
    message = str(error.value)
    assert f"checkpoint={checkpoint!r}" in message and "recompute of step" in message
    assert "carry=" in message and "checkpoint='none'" in message and "check_recompute=False" in message
    assert net.weight.grad is None and psi0.grad is None  # no gradient was handed back
    # Switched off explicitly, the same episode runs (and its gradients are wrong).
    psi_T, _ = rollout(Counter(net), psi0, STEPS, checkpoint=checkpoint, slots=slots, check_recompute=False)
    psi_T.abs().sum().backward()
    assert net.weight.grad is not None


def test_memory_kept_on_an_object_raises_and_carry_fixes_it():
    """The users' engine's shape: the step reads its memory from an object and writes it back."""
    cell = MemoryCell().double()

    class Engine:
        h = c = None

        def step(self, psi):
            delta, h, c = cell(qca_lowmem.qca_pack(psi), self.h, self.c)
            self.h, self.c = h.detach(), c.detach()
            return qca_lowmem.qca_update(psi, delta, multiplicative=False)

    psi_T, history = rollout(Engine().step, initial_state(), STEPS, checkpoint="step")
    with pytest.raises(RecomputeMismatchError, match=r"step \d+ .*psi differs"):
        reference.evolutionary_loss(history, history[0])[0].backward()


def test_carry_refused_where_it_cannot_work():
    cell = MemoryCell().double()
    step = memory_step(cell, detach=True)
    psi0 = initial_state()
    with pytest.raises(TypeError, match="carry must be a tuple of tensors"):
        rollout(step, psi0, 3, carry=torch.zeros(1))
    with pytest.raises(TypeError, match=r"must return \(psi, carry\)"):
        rollout(lambda psi, carry: psi, psi0, 3, carry=(None,))
    with pytest.raises(ValueError, match="keep the carry's length 2, got 1"):
        rollout(lambda psi, carry: (psi, carry[:1]), psi0, 3, carry=(None, None))
    with pytest.raises(TypeError, match="check_recompute must be True or False, got 'no'"):
        rollout(step, psi0, 3, carry=(None, None), check_recompute="no")
    with pytest.raises(ValueError, match="psi0 is on the meta device"):
        rollout(step, torch.empty(1, 4, 4, 2, dtype=torch.complex128, device="meta"), 3, carry=(None, None))


def test_saved_bytes_psi_and_memory_per_step():
    cell = MemoryCell().float()
    step = memory_step(cell, detach=True)
    psi0 = reference.initial_state(1, 16, 2)
    memory0 = tuple(m.float() for m in initial_memory(grid=16))
    psi_bytes = psi0.numel() * psi0.element_size()
    memory_bytes = sum(m.numel() * m.element_size() for m in memory0)

    def kept(steps, checkpoint="step", slots=None):
        return saved_bytes(lambda: rollout(step, psi0, steps, checkpoint=checkpoint, slots=slots, carry=memory0))

    per_step = (kept(20) - kept(8)) / 12
    assert per_step == psi_bytes + memory_bytes
    # And "revolve" keeps its slots (plus psi_T and the final memory for the check), whatever the steps.
    assert kept(8, "revolve", 3) == kept(24, "revolve", 3) <= 4 * (psi_bytes + memory_bytes)


@cuda_only
@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 3)])
@pytest.mark.parametrize("detach", [False, True], ids=["grad-through-memory", "detached-memory"])
def test_step_graph_carries_memory_on_cuda(checkpoint, slots, detach):
    """A StepGraph of a carried step: captured once, the same gradients and memory as eager (the
    same kernels; cuDNN may pick another algorithm inside a capture), replays bit for bit."""
    cell = MemoryCell().to("cuda")
    step = memory_step(cell, detach)
    psi0 = initial_state().to("cuda", torch.complex64)
    memory0 = tuple(m.to("cuda", torch.float32).requires_grad_(not detach) for m in initial_memory())
    noise = NoiseSchedule(0.5, 2000, seed=1)
    _, eager, eager_memory = carried_grads(step, cell, psi0, memory0, checkpoint, slots, noise=noise, memory_loss=not detach)
    eager = [g.clone() for g in eager]
    graph = qca_lowmem.StepGraph(step)
    runs = [carried_grads(graph, cell, psi0, memory0, checkpoint, slots, noise=noise, memory_loss=not detach)
            for _ in range(2)]
    assert graph.captures_made == 1
    (_, captured, captured_memory), (_, replayed, replayed_memory) = runs
    assert_same(captured, eager, rel=1e-5)
    assert_same(captured_memory, eager_memory, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(replayed + list(replayed_memory), captured + list(captured_memory)))


@pytest.mark.parametrize("detach", [False, True], ids=["grad-through-memory", "detached-memory"])
@pytest.mark.parametrize("first_memory", ["given", "none"])
def test_auto_carries_memory_within_its_budget(detach, first_memory):
    """checkpoint='auto' with a carry: the budget counts psi and the memory per state; from no
    budget (revolve) through one state per step and some full graphs to all of them, the same
    loss, gradients and final memory as plain autograd, and never more kept than the budget plus
    one step's graph."""
    cell = MemoryCell().double()
    step = memory_step(cell, detach)
    psi0 = initial_state()
    memory0 = initial_memory(requires_grad=not detach) if first_memory == "given" else (None, None)
    made = memory0 if memory0[0] is not None else initial_memory()
    state_bytes = psi0.nbytes + sum(m.nbytes for m in made)
    step_bytes = full_step_bytes(step, psi0, made)
    assert state_bytes == psi0.nbytes + 2 * initial_memory()[0].nbytes  # a memory not made yet counted as made
    loss, expected, memory_expected = carried_grads(step, cell, psi0, memory0, "none", memory_loss=not detach)
    by_budget = {}
    recompute_state = state_bytes  # what the recompute check holds besides
    for budget in (0, (STEPS + 1) * state_bytes + recompute_state, STEPS * state_bytes + 2 * step_bytes + recompute_state,
                   2 ** 30):
        loss_a, actual, memory_T = carried_grads(step, cell, psi0, memory0, "auto", budget=budget, memory_loss=not detach)
        assert torch.equal(loss_a, loss)
        assert_same(actual, expected)
        assert_same(memory_T, memory_expected, rel=0.0)
        psi_in = psi0.detach().requires_grad_()
        by_budget[budget] = saved_bytes(lambda: rollout(step, psi_in, STEPS, checkpoint="auto", budget=budget,
                                                        carry=memory0))
        assert by_budget[budget] <= max(budget, state_bytes) + step_bytes
    small, per_step, some, all_of_them = by_budget.values()
    assert small < per_step < some < all_of_them
