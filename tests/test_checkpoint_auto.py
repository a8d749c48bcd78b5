"""rollout(checkpoint="auto", budget=N): the full graphs of as many last steps as N bytes allow,
"step" before them (revolve when not even that fits); gradients as the full graph's, what is
kept within the budget."""

from types import SimpleNamespace

import pytest
import torch
from conftest import randomize_affine

import qca_lowmem
from qca_lowmem import auto_checkpoint, rollout, saved_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 7


def fused_unet_step():
    torch.manual_seed(1)
    unet = randomize_affine(qca_lowmem.UNetUnitary(2, 4)).double()
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.3)
    return list(unet.parameters()), lambda psi: qca_lowmem.qca_update(psi, unet(qca_lowmem.qca_pack(psi)), 0.05)


def initial_state():
    torch.manual_seed(3)
    return qca_lowmem.stock.initial_state(1, 8, 2, dtype=torch.complex128)


def grads(step, params, checkpoint, **options):
    for p in params:
        p.grad = None
    psi0 = initial_state().requires_grad_()
    psi_T, history = rollout(step, psi0, STEPS, checkpoint=checkpoint, noise=qca_lowmem.NoiseSchedule(0.5, 2000, seed=1),
                             record_every=3, **options)
    loss, _ = qca_lowmem.stock.evolutionary_loss(history, psi0)
    loss = loss + sum((h.real * (i + 1)).sum() for i, h in enumerate(history))
    loss.backward()
    return len(history), [psi0.grad] + [p.grad for p in params]


def sizes(step):
    psi = initial_state()
    return psi.nbytes, auto_checkpoint.step_graph_bytes(step, psi)


def budgets(step):
    """Budgets for: revolve with 2 slots, step only, 3 full graphs, everything full."""
    state, graph = sizes(step)
    return {"revolve": 2 * state, "step": STEPS * state, "3 full": STEPS * state + 3 * (graph - state),
            "all full": STEPS * graph}


@pytest.mark.parametrize("case", ["revolve", "step", "3 full", "all full"])
def test_gradients_equal_the_full_graph(case):
    params, step = fused_unet_step()
    expected_length, expected = grads(step, params, "none")
    budget = budgets(step)[case]
    assert auto_checkpoint.policy_for_budget(STEPS, *sizes(step), budget) == {
        "revolve": (0, 2), "step": (0, None), "3 full": (3, None), "all full": (STEPS, None)}[case]
    length, got = grads(step, params, "auto", budget=budget)
    assert length == expected_length
    for g, e in zip(got, expected):
        assert ((g - e).abs().max() / e.abs().max()).item() < 1e-12


def test_what_the_episode_keeps_stays_within_the_budget():
    params, step = fused_unet_step()
    kept = {}
    for case, budget in budgets(step).items():
        psi0 = initial_state().requires_grad_()
        kept[case] = saved_bytes(lambda: rollout(step, psi0, STEPS, checkpoint="auto", budget=budget))
        assert kept[case] <= budget, case
    assert kept["revolve"] < kept["step"] < kept["3 full"] < kept["all full"]


def test_policy_for_budget_keeps_as_many_full_graphs_as_fit():
    for budget in range(0, 400, 7):
        kept, slots = auto_checkpoint.policy_for_budget(10, 3, 20, budget)
        if budget < 30:
            assert kept == 0 and slots == max(1, budget // 3)
        else:
            assert slots is None and (10 - kept) * 3 + kept * 20 <= budget
            assert kept == 10 or (10 - kept - 1) * 3 + (kept + 1) * 20 > budget


def test_budget_free_reads_the_devices_free_memory(monkeypatch):
    monkeypatch.setattr(auto_checkpoint, "free_bytes", lambda device: 11_000)
    cuda_psi = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert auto_checkpoint.resolve_budget("free", cuda_psi, step_bytes=1_000) == 9_000
    assert auto_checkpoint.resolve_budget("2KiB", cuda_psi, step_bytes=1_000) == 2048


@pytest.mark.parametrize("options,message", [
    (dict(checkpoint="auto"), "checkpoint='auto' needs budget"),
    (dict(checkpoint="step", budget=10), "budget applies only to checkpoint='auto'"),
    (dict(checkpoint="auto", budget=-1), "budget must be an int >= 0.*got -1"),
    (dict(checkpoint="auto", budget="lots"), "budget must be a number of bytes.*got 'lots'"),
    (dict(checkpoint="auto", budget=True), "budget must be an int >= 0.*got True"),
    (dict(checkpoint="auto", budget="free"), "budget='free' reads the free memory of a CUDA device.*cpu"),
])
def test_clear_errors(options, message):
    params, step = fused_unet_step()
    with pytest.raises(ValueError, match=message):
        rollout(step, initial_state().requires_grad_(), 3, **options)
