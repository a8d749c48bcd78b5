"""enable()'s swap of the trainer's torch.amp.GradScaler for qca_lowmem.amp.GradScaler
(scaler_swap.lowmem_scaler_from): the swapped scaler has its settings and state at any point of
an iteration, and goes on as theirs would."""

import pytest
import torch
from torch import nn

import qca_lowmem
from fixtures.model_families import make_trainer
from qca_lowmem.amp import GradScaler
from qca_lowmem.atheria.scaler_swap import carry_state, lowmem_scaler_from

STAGES = ["scaled", "unscaled", "stepped"]


def swapped_at(stage, scaler, opt, p, swap):
    """The iteration of `scaler` (its backward done) up to `stage`, then `swap(scaler)` goes on to
    update(); the state and parameter it ends with."""
    if stage != "scaled":
        scaler.unscale_(opt)
    if stage == "stepped":
        scaler.step(opt)
    scaler = swap(scaler)
    if stage != "stepped":
        scaler.step(opt)
    scaler.update()
    return scaler.state_dict(), p.detach().clone()


def kept(scaler):
    return scaler


@pytest.mark.parametrize("stage", STAGES)
def test_swap_mid_iteration_goes_on_as_torch_scaler(stage):
    """A scaler swapped between scale() and update() steps and updates as theirs would, without
    unscaling a second time."""

    def finish(swap):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        scaler.scale((p * 2).sum()).backward()
        return swapped_at(stage, scaler, opt, p, swap)

    (theirs_state, theirs_p), (ours_state, ours_p) = finish(kept), finish(lowmem_scaler_from)
    assert ours_state == theirs_state and ours_state["scale"] == 16.0
    assert torch.equal(ours_p, theirs_p)


def test_swap_keeps_allow_fp16_grads():
    swapped = lowmem_scaler_from(GradScaler("cpu", init_scale=4.0, allow_fp16_grads=True))
    assert isinstance(swapped, GradScaler)
    p = nn.Parameter(torch.randn(3).half())
    swapped.scale(torch.ones(()))
    p.grad = torch.ones(3, dtype=torch.float16)
    swapped.unscale_(torch.optim.SGD([p], lr=0.1))
    assert torch.equal(p.grad, torch.full((3,), 0.25, dtype=torch.float16))


@pytest.mark.parametrize("stage", STAGES)
def test_state_carried_back_mid_iteration_replaces_stale_progress(stage):
    """disable() gives their scaler ours's state: their scaler's own progress, from the iteration
    in which enable() swapped it, must not survive (a stale "unscaled" would refuse the unscale_)."""

    def finish(back):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4))
        opt = torch.optim.SGD([p], lr=0.1)
        theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        theirs.scale(p.sum()).backward()
        theirs.unscale_(opt)  # swapped away here, never updated
        ours = lowmem_scaler_from(theirs)
        ours.step(opt)
        ours.update()
        opt.zero_grad()
        ours.scale((p * 2).sum()).backward()

        def carried_back(scaler):
            carry_state(scaler, theirs)
            return theirs
        return swapped_at(stage, ours, opt, p, carried_back if back else kept)

    (kept_state, kept_p), (back_state, back_p) = finish(False), finish(True)
    assert back_state == kept_state and back_state["scale"] == 32.0
    assert torch.equal(back_p, kept_p)


def enabled_with(scaler):
    trainer = make_trainer("unet_groupnorm")
    trainer.scaler = scaler
    return qca_lowmem.enable(trainer)


def test_a_scaler_class_of_their_own_is_kept():
    """A subclass of theirs (an update() capping the scale, say) is their code: enable() keeps it."""
    class Capped(torch.amp.GradScaler):
        def update(self, new_scale=None):
            super().update(new_scale)
            self._scale.clamp_(max=16.0)

    theirs = Capped("cpu", init_scale=8.0)
    assert enabled_with(theirs).scaler is theirs
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert type(enabled_with(torch_scaler).scaler) is GradScaler


@pytest.mark.parametrize("since", ["none", "deleted", "their_own"])
def test_disable_leaves_a_scaler_they_set_since_enable(since):
    """disable() gives their scaler back where the trainer holds the one enable() set; one they set
    since (None, deleted, another) stays, and disable() completes (it raised half-way, leaving the
    trainer neither enabled nor disabled)."""
    original = torch.amp.GradScaler("cpu", init_scale=8.0)
    trainer = enabled_with(original)
    installed = trainer.scaler
    assert installed is not original
    another = torch.amp.GradScaler("cpu", enabled=False)
    if since == "deleted":
        del trainer.scaler
    else:
        trainer.scaler = None if since == "none" else another
    qca_lowmem.disable(trainer)
    assert not hasattr(trainer, "_qca_lowmem_state") and "train_episode" not in vars(trainer)
    assert getattr(trainer, "scaler", "deleted") == {"none": None, "deleted": "deleted", "their_own": another}[since]


def test_disable_puts_their_scaler_back_with_the_state_it_reached():
    trainer = enabled_with(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1))
    original = trainer._qca_lowmem_state.undo.scaler
    trainer.scaler.scale(torch.ones(()))
    trainer.scaler.update(32.0)
    qca_lowmem.disable(trainer)
    assert trainer.scaler is original and original.get_scale() == 32.0
