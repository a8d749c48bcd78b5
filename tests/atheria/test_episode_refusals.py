"""What an episode does where it cannot run as enable() proved it: a value enable() read once changed
(enable() runs again), or what it cannot run as stock would. Under QCA_LOWMEM=1 alone the trainer
then trains on stock, said once; enabled by enable() or a LOWMEM section, the episode refuses."""

import contextlib
import math

import pytest
import torch

import qca_lowmem
from qca_lowmem.atheria import episode_options
from qca_lowmem.atheria.episode_refusals import ProofStale
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

ENV_ONLY = {}  # a config without a LOWMEM section: QCA_LOWMEM=1 alone switches it on


def make_trainer(**kw):
    torch.manual_seed(1234)
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=3), **kw)


def said(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "qca_lowmem"]


def episodes(trainer, numbers, before=lambda trainer, number: None, context=None):
    """(loss, psi_T, every parameter after it) of each episode, `before(trainer, number)` run first."""
    results = []
    torch.manual_seed(7)
    for number in numbers:
        before(trainer, number)
        with context() if context is not None else contextlib.nullcontext():
            loss, _, psi = trainer.train_episode(number)
        results.append((loss, psi, [p.detach().clone() for p in trainer.motor.operator.parameters()]))
    return results


def assert_same(results, stock_results, rel):
    for (loss, psi, weights), (stock_loss, stock_psi, stock_weights) in zip(results, stock_results, strict=True):
        assert loss == pytest.approx(stock_loss, rel=rel)
        assert torch.allclose(psi, stock_psi, rtol=rel, atol=rel)
        assert all(torch.allclose(w, s, rtol=rel, atol=rel) for w, s in zip(weights, stock_weights, strict=True))


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_under_the_environment_alone_an_episode_it_cannot_run_trains_on_stock_said_once(monkeypatch, caplog):
    """An episode called inside the caller's autocast, which their episode runs its forward in: under
    QCA_LOWMEM=1 alone the trainer is disabled and that episode and the next train on stock, bit for
    bit, said once with why; a LOWMEM section that enables it refuses the episode before anything trains."""
    monkeypatch.setenv("QCA_LOWMEM", "1")
    caplog.set_level("INFO", logger="qca_lowmem")
    stock, lowmem = make_trainer(), make_trainer()
    assert qca_lowmem.enable_from_config(lowmem, ENV_ONLY)
    caplog.clear()
    results = [episodes(trainer, [0, 1], context=bf16_autocast) for trainer in (stock, lowmem)]
    for (loss, psi, weights), (stock_loss, stock_psi, stock_weights) in zip(results[1], results[0]):
        assert loss == stock_loss and torch.equal(psi, stock_psi)
        assert all(torch.equal(w, s) for w, s in zip(weights, stock_weights))
    (line,) = said(caplog)
    assert line.startswith("off from episode 0, QC_Trainer_v4 trains on stock: train_episode was called inside "
                           "torch.autocast('cpu', dtype=torch.bfloat16): ") and line.endswith(
                           "; unset QCA_LOWMEM for it to silence this")
    assert not hasattr(lowmem, "_qca_lowmem_state") and "train_episode" not in vars(lowmem)

    monkeypatch.delenv("QCA_LOWMEM")
    by_section = make_trainer()
    qca_lowmem.enable_from_config(by_section, {"LOWMEM": True})
    weights = [p.detach().clone() for p in by_section.motor.operator.parameters()]
    with bf16_autocast(), pytest.raises(RuntimeError, match=r"^qca_lowmem: train_episode was called inside "
                                                            r"torch\.autocast"):
        by_section.train_episode(0)
    assert all(torch.equal(p, w) for p, w in zip(by_section.motor.operator.parameters(), weights))
    assert hasattr(by_section, "_qca_lowmem_state")


def test_under_the_environment_alone_a_change_enable_now_refuses_trains_on_stock(monkeypatch, caplog):
    """use_amp turned on after enable(): the next episode enables it again, which refuses fp16 on
    the CPU; under QCA_LOWMEM=1 alone that episode trains on stock, said once, naming the change and
    the refusal."""
    monkeypatch.setenv("QCA_LOWMEM", "1")
    caplog.set_level("INFO", logger="qca_lowmem")
    stock, lowmem = make_trainer(), make_trainer()
    assert qca_lowmem.enable_from_config(lowmem, ENV_ONLY)
    caplog.clear()

    def turn_amp_on(trainer, number):
        trainer.use_amp = number > 0

    results = [episodes(trainer, [0, 1, 2], before=turn_amp_on) for trainer in (stock, lowmem)]
    assert_same(results[1], results[0], rel=1e-5)
    assert said(caplog) == [
        "off from episode 1, QC_Trainer_v4 trains on stock: trainer.use_amp is True now (False at enable()), and "
        "enable(): fp16 on the CPU (amp_dtype='fp16', or the trainer's use_amp) is a GPU setting, slower than fp32 "
        "there; use amp_dtype='bf16' (the CPU's half precision) or 'fp32'; unset QCA_LOWMEM for it to silence this"]
    assert not hasattr(lowmem, "_qca_lowmem_state")


def test_enabled_again_the_trainer_keeps_training_on_stock_where_the_environment_alone_asked(monkeypatch, caplog):
    """A grid changed between episodes under QCA_LOWMEM=1 alone: enabled again at the new grid, the
    trainer still trains on stock from an episode it cannot run (the environment's ask is kept)."""
    monkeypatch.setenv("QCA_LOWMEM", "1")
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = make_trainer(state_object=False)
    assert qca_lowmem.enable_from_config(trainer, ENV_ONLY)
    trainer.train_episode(0)
    trainer.grid_size = 16
    assert trainer.train_episode(1)[2].shape == (1, 16, 16, 2)
    assert said(caplog)[-1].startswith("the trainer's grid is 16x16 now (8x8 at enable()): on again, checkpoint=step")
    with bf16_autocast():
        trainer.train_episode(2)
    assert said(caplog)[-1].startswith("off from episode 2, QC_Trainer_v4 trains on stock: train_episode was called")


def test_a_train_episode_held_from_before_runs_what_the_trainer_runs_now(monkeypatch, caplog):
    """A loop holding trainer.train_episode from before: after an episode's enable() again it runs
    the episode installed then (which trains on stock from an episode it cannot run, said as such);
    after the trainer went to stock (QCA_LOWMEM=1), stock's episode."""
    monkeypatch.setenv("QCA_LOWMEM", "1")
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = make_trainer(state_object=False)
    qca_lowmem.enable_from_config(trainer, ENV_ONLY)
    held = trainer.train_episode
    held(0)
    trainer.grid_size = 16
    assert held(1)[2].shape == (1, 16, 16, 2) and trainer.train_episode is not held
    caplog.clear()
    with bf16_autocast():
        held(2)
    (line,) = said(caplog)
    assert line.startswith("off from episode 2, QC_Trainer_v4 trains on stock: train_episode was called inside")
    assert not hasattr(trainer, "_qca_lowmem_state")
    loss, _, psi = held(3)  # stock's episode, at the grid it reads now
    assert math.isfinite(loss) and psi.shape == (1, 16, 16, 2) and not hasattr(trainer, "_qca_lowmem_state")


def test_a_change_that_enabling_again_does_not_clear_raises_rather_than_loops(monkeypatch):
    """Where enable() would read a value otherwise than the episode checks it, the episode enabled
    again raises, naming it, instead of enabling again without end."""
    trainer = make_trainer(state_object=False)
    qca_lowmem.enable(trainer)

    def always_changed(trainer, opts):
        raise ProofStale("qca_lowmem: the grid changed", "the grid is 9x9 now (8x8 at enable())")

    monkeypatch.setattr(episode_options, "_check_psi0_read", always_changed)
    with pytest.raises(RuntimeError, match=r"^qca_lowmem: enabled again for this episode, yet the grid is 9x9 now"):
        trainer.train_episode(0)


def test_a_change_after_an_episode_enabled_again_and_refused_enables_it_again(caplog):
    """The grid changed, the episode enabled it again and was refused (called inside an autocast);
    the grid changed again before the next episode: that one enables it again too, and trains."""
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = make_trainer(state_object=False)
    qca_lowmem.enable(trainer)
    trainer.grid_size = 16
    with bf16_autocast(), pytest.raises(RuntimeError, match=r"^qca_lowmem: train_episode was called inside"):
        trainer.train_episode(0)
    trainer.grid_size = 12
    assert trainer.train_episode(0)[2].shape == (1, 12, 12, 2)
    assert said(caplog)[-1].startswith("the trainer's grid is 12x12 now (16x16 at enable()): on again")


def test_an_episode_under_inference_mode_is_refused_naming_it():
    """Stock's fails at its backward with autograd's "does not require grad"; the fused step failed
    earlier, inside its side state's check, naming neither the mode nor the fix."""
    trainer = make_trainer()
    qca_lowmem.enable(trainer, checkpoint="step")
    weights = [p.detach().clone() for p in trainer.motor.operator.parameters()]
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"^qca_lowmem: train_episode was called under "
                                                                   r"torch\.inference_mode\(\), .*call it outside"):
        trainer.train_episode(0)
    assert all(torch.equal(p, w) for p, w in zip(trainer.motor.operator.parameters(), weights))
    assert math.isfinite(trainer.train_episode(1)[0])
