"""`qca_lowmem.recomputing()`: true only while a recomputing rollout's backward runs, so that a
forward hook recording what the steps saw can skip the recomputes' calls and keep plain
autograd's record under every policy."""

import pytest
import torch

import qca_lowmem
from qca_lowmem import stock

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 5
POLICIES = [dict(checkpoint="none"), dict(checkpoint="step"), dict(checkpoint="revolve", slots=2),
            dict(checkpoint="auto", budget=2**12)]


def episode(policy, guarded):
    """A rollout whose model's forward hook records each call's output norm and whether
    recomputing() was true; (the record, the flags seen, the gradients)."""
    torch.manual_seed(0)
    model = stock.UNetUnitary(2, 4).double()
    record, flags = [], []

    def hook(module, args, output):
        flags.append(qca_lowmem.recomputing())
        if guarded and qca_lowmem.recomputing():
            return
        record.append(output.detach().norm().item())

    model.register_forward_hook(hook)
    psi0 = stock.initial_state(1, 8, 2, dtype=torch.complex128)
    psi_T, _ = qca_lowmem.rollout(lambda psi: stock.step(psi, model, 0.05), psi0, STEPS, **policy)
    psi_T.abs().square().sum().backward()
    assert not qca_lowmem.recomputing()  # after the backward, as before it
    return record, flags, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_a_guarded_hook_keeps_plain_autograds_record(policy):
    record, flags, grads = episode(policy, guarded=True)
    expected, expected_flags, expected_grads = episode(POLICIES[0], guarded=True)
    assert record == pytest.approx(expected, rel=1e-12, abs=0) and len(record) == STEPS
    assert not any(expected_flags)  # plain autograd recomputes nothing
    assert flags[:STEPS] == [False] * STEPS and all(flags[STEPS:]) and len(flags) > STEPS  # the forward, then recomputes
    for g, e in zip(grads, expected_grads, strict=True):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-14)


def test_an_unguarded_hook_sees_the_recomputes():
    """What the guard is for: unguarded, the recomputes' calls are recorded too."""
    record, _, _ = episode(POLICIES[1], guarded=False)
    assert len(record) == 2 * STEPS
