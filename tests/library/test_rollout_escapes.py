"""Tensors that leave a step other than through psi: an exact gradient, or an error naming the
rollout, the step and the fix; never torch's unpack TypeError or a gradient silently lost."""

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import initial_state
from qca_lowmem.recompute.escapes import EscapedTensorError

STEPS = 4
RECOMPUTING = [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2), dict(checkpoint="auto", budget=20000)]
IDS = ["step", "revolve", "auto-keeping-the-last-steps"]


def final_loss(psi_T):
    return psi_T.abs().square().mul(torch.arange(1.0, psi_T.shape[-1] + 1, dtype=torch.float64)).sum()


def penalised_conv():
    """A conv step whose forward hook records an activity penalty, as the loss later reads it."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1).double()
    penalties = []
    conv.register_forward_hook(lambda module, args, output: penalties.append(output.square().mean()))

    def step(psi):
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(conv(qca_lowmem.qca_pack(psi))), 0.05)

    return conv, penalties, step


@pytest.mark.parametrize("options", RECOMPUTING, ids=IDS)
def test_activity_penalty_from_a_forward_hook_is_refused_naming_the_rollout_step_and_fix(options):
    conv, penalties, step = penalised_conv()
    psi_T, _ = qca_lowmem.rollout(step, initial_state(), STEPS, **options)
    loss = final_loss(psi_T) + sum(penalties)
    with pytest.raises(EscapedTensorError) as caught:
        torch.autograd.grad(loss, list(conv.parameters()))
    message = str(caught.value)
    assert f"rollout(checkpoint={options['checkpoint']!r})" in message
    assert "step " in message and "left the step other than through psi" in message
    assert "checkpoint='none'" in message and "carry" in message


def test_activity_penalty_under_checkpoint_none_is_plain_autograd():
    conv, penalties, step = penalised_conv()
    psi0 = initial_state()
    psi_T, _ = qca_lowmem.rollout(step, psi0, STEPS, checkpoint="none")
    grads = torch.autograd.grad(final_loss(psi_T) + sum(penalties), list(conv.parameters()))
    penalties.clear()
    psi = psi0
    for _ in range(STEPS):
        psi = step(psi)
    expected = torch.autograd.grad(final_loss(psi) + sum(penalties), list(conv.parameters()))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_penalty_from_the_first_step_only_is_refused_not_a_torch_type_error():
    """Step 0 runs in the probe, with grad: its saved tensors are gone once it ends."""
    conv, penalties, step = penalised_conv()
    psi_T, _ = qca_lowmem.rollout(step, initial_state(), STEPS, checkpoint="step")
    with pytest.raises(EscapedTensorError, match="step 0"):
        torch.autograd.grad(final_loss(psi_T) + penalties[0], list(conv.parameters()))


def hamiltonian_step():
    """An operator that calls torch.autograd.grad inside its forward: dpsi from the gradient of a
    learned energy H(x) with respect to the packed state, its graph kept (create_graph)."""
    torch.manual_seed(1)
    energy = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.Tanh(), nn.Conv2d(6, 1, 1)).double()

    def step(psi):
        with torch.enable_grad():
            x = qca_lowmem.qca_pack(psi)
            x.requires_grad_(True)  # a leaf at step 0 of plain autograd, whose psi0 needs no grad
            (dx,) = torch.autograd.grad(energy(x).sum(), x, create_graph=True)
        return qca_lowmem.qca_update(psi, 0.1 * dx, 0.05)

    return [p for name, p in energy.named_parameters() if name != "2.bias"], step  # the energy's bias has no dx


@pytest.mark.parametrize("options", RECOMPUTING + [dict(checkpoint="none")], ids=IDS + ["none"])
def test_autograd_grad_inside_the_step_gives_plain_autograds_gradients(options):
    params, step = hamiltonian_step()
    psi0 = initial_state()
    psi_T, _ = qca_lowmem.rollout(step, psi0, STEPS, **options)
    loss = final_loss(psi_T)
    grads = torch.autograd.grad(loss, params)
    psi = psi0
    for _ in range(STEPS):
        psi = step(psi)
    expected_loss = final_loss(psi)
    expected = torch.autograd.grad(expected_loss, params)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-13, atol=0)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-15)


def test_penalty_handed_out_through_the_carry_gets_its_gradient():
    """The fix the error names: the penalty summed in the carry is differentiated exactly."""
    conv, _, step = penalised_conv()

    def carried(psi, carry):
        out = step(psi)
        delta = conv(qca_lowmem.qca_pack(psi))
        return out, (carry[0] + delta.square().mean(),)

    psi0, zero = initial_state(), torch.zeros((), dtype=torch.float64)
    psi_T, _, (penalty,) = qca_lowmem.rollout(carried, psi0, STEPS, checkpoint="step", carry=(zero,))
    grads = torch.autograd.grad(final_loss(psi_T) + penalty, list(conv.parameters()))
    psi, total = psi0, zero
    for _ in range(STEPS):
        psi, (total,) = carried(psi, (total,))
    expected = torch.autograd.grad(final_loss(psi) + total, list(conv.parameters()))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-15)


def grad_mode_of_each_call(step):
    modes = []

    def recording(psi):
        modes.append(torch.is_grad_enabled())
        return step(psi)

    return modes, recording


def test_forward_runs_without_grad_unless_a_probed_step_hands_something_out():
    conv, penalties, step = penalised_conv()
    modes, recording = grad_mode_of_each_call(step)
    qca_lowmem.rollout(recording, initial_state(), STEPS, checkpoint="step")
    assert modes == [True] * STEPS  # the probe, then the forward with grad: the hook hands a tensor out
    conv._forward_hooks.clear()
    modes.clear()
    qca_lowmem.rollout(recording, initial_state(), STEPS, checkpoint="step")
    assert modes == [True] + [False] * (STEPS - 1)


def test_tensor_kept_for_inspection_changes_no_gradient():
    """A step keeping a detached copy of its update for a visualisation (as the users' engine keeps
    last_delta_psi) is not refused, and its gradients are plain autograd's."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1).double()
    kept = {}

    def step(psi):
        delta = 0.1 * torch.tanh(conv(qca_lowmem.qca_pack(psi)))
        kept["last_delta"] = delta.detach().clone()
        return qca_lowmem.qca_update(psi, delta, 0.05)

    psi0 = initial_state()
    psi_T, _ = qca_lowmem.rollout(step, psi0, STEPS, checkpoint="step")
    grads = torch.autograd.grad(final_loss(psi_T), list(conv.parameters()))
    psi = psi0
    for _ in range(STEPS):
        psi = step(psi)
    expected = torch.autograd.grad(final_loss(psi), list(conv.parameters()))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("options", RECOMPUTING[:2], ids=IDS[:2])
def test_penalty_recorded_only_after_the_first_steps_is_refused_at_the_forward(options):
    """The probed step hands nothing out, so the forward runs without grad; a later step's
    penalty would be a constant: refused where the forward makes it, naming the step."""
    conv, penalties, step = penalised_conv()
    conv._forward_hooks.clear()
    calls = []

    def later_penalty(module, args, output):
        calls.append(1)
        if len(calls) > 2:
            penalties.append(output.square().mean())

    conv.register_forward_hook(later_penalty)
    with pytest.raises(EscapedTensorError, match=r"step 2 handed out a tensor.*checkpoint='none'"):
        qca_lowmem.rollout(step, initial_state(), STEPS, **options)
