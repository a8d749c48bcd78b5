"""An enabled trainer copied (copy.deepcopy) or pickled, and its engine copied alone as a
snapshot: each copy trains itself, never the original, its episodes equal the original's, and
disable() on a copy puts the stock trainer back there. A shallow copy (copy.copy) runs its own
settings on the engine it shares, as stock's copy does, and refuses where that engine changed."""

import copy
import pickle
import pickletools
from unittest import mock

import numpy
import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_trainer
from qca_lowmem.atheria import switch
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

TRAINERS = {
    "v4": lambda: QC_Trainer_v4(make_config(grid=8, qca_steps=3), max_noise=1.0),
    "v4-state": lambda: QC_Trainer_v4(make_config(grid=8, qca_steps=3), state_object=True),
    "v4-memory": lambda: make_trainer("convlstm"),
    "v3": lambda: QC_Trainer_v3(make_config(grid=8, qca_steps=3), batch_size=2),
}
COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda trainer: pickle.loads(pickle.dumps(trainer))}


def weights(trainer):
    return [p.detach().clone() for p in trainer.motor.operator.parameters()]


def episode(trainer, seed=5):
    torch.manual_seed(seed)
    numpy.random.seed(seed)  # the noise's bit-flip coin
    return trainer.train_episode(3000)[0]


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("kind", TRAINERS)
def test_a_copy_of_an_enabled_trainer_trains_itself(kind, how):
    torch.manual_seed(0)
    trainer = qca_lowmem.enable(TRAINERS[kind]())
    duplicate = COPIES[how](trainer)
    original = weights(trainer)
    loss = episode(duplicate)
    assert all(p.grad is None for p in trainer.motor.operator.parameters())  # the original's untouched
    assert all(torch.equal(a, b) for a, b in zip(weights(trainer), original))
    assert not all(torch.equal(a, b) for a, b in zip(weights(duplicate), original))
    assert episode(trainer) == loss  # the same episode, the same loss
    assert all(torch.equal(a, b) for a, b in zip(weights(trainer), weights(duplicate)))
    qca_lowmem.disable(duplicate)
    assert "evolve_step" not in vars(duplicate.motor) and "train_episode" not in vars(duplicate)
    assert hasattr(trainer, "_qca_lowmem_state") and not hasattr(duplicate, "_qca_lowmem_state")
    episode(duplicate)  # the stock episode runs on the copy


def test_a_copy_of_an_enabled_engine_steps_its_own_operator():
    torch.manual_seed(0)
    trainer = qca_lowmem.enable(TRAINERS["v4"]())
    snapshot = copy.deepcopy(trainer.motor)
    psi = qca_lowmem.stock.initial_state(1, 8, 4)
    snapshot.evolve_step(psi).abs().sum().backward()
    assert all(p.grad is None for p in trainer.motor.operator.parameters())
    assert all(p.grad is not None for p in snapshot.operator.parameters())


def library_globals(pickled: bytes) -> set:
    """The qca_lowmem modules a pickle names, aside from the stand-ins of the users' code (the
    examples' trainers, stock's model)."""
    names = {arg.split(" ")[0] if op.name == "GLOBAL" else arg
             for op, arg, _ in pickletools.genops(pickled) if op.name in ("GLOBAL", "SHORT_BINUNICODE", "BINUNICODE")}
    return {name for name in names if isinstance(name, str) and name.startswith("qca_lowmem")
            and not name.startswith(("qca_lowmem.examples", "qca_lowmem.stock"))}


@pytest.mark.parametrize("kind", TRAINERS)
def test_the_engine_between_episodes_is_theirs_and_pickles_without_the_library(kind):
    """The fused step is on the engine while an episode runs and its own step between episodes, so
    torch.save of the engine (or of their model) loads where qca_lowmem is not installed."""
    torch.manual_seed(0)
    trainer = qca_lowmem.enable(TRAINERS[kind]())
    installed = trainer._qca_lowmem_state.undo.installed_step
    seen, real = [], switch.train_episode

    def recording(enabled, *args, **kwargs):
        seen.append(vars(enabled.motor).get("evolve_step"))
        return real(enabled, *args, **kwargs)

    with mock.patch.object(switch, "train_episode", recording):
        episode(trainer)
    assert seen == [installed] and installed is not None
    assert "evolve_step" not in vars(trainer.motor)
    for saved in (trainer.motor, trainer.motor.operator):
        assert library_globals(pickle.dumps(saved)) == set()


@pytest.mark.parametrize("how", [*COPIES, "copy"])
@pytest.mark.parametrize("kind", TRAINERS)
def test_every_copy_runs_its_own_settings(kind, how):
    """A copy's episodes read the copy's attributes (qca_steps here), as the stock copy's do."""
    torch.manual_seed(0)
    trainer = qca_lowmem.enable(TRAINERS[kind]())
    duplicate = {**COPIES, "copy": copy.copy}[how](trainer)
    assert duplicate.train_episode.trainer is duplicate and trainer.train_episode.trainer is trainer
    assert vars(duplicate)["__reduce_ex__"].trainer is duplicate
    steps = []
    # A spy that records the forward's calls only, as stock's backward makes none.
    duplicate.motor.operator.register_forward_pre_hook(
        lambda module, args: None if qca_lowmem.recomputing() else steps.append(1))
    duplicate.qca_steps = 2
    episode(duplicate)
    assert len(steps) == 2  # its 2 steps, not the original's 3
    assert copy.copy(copy.deepcopy(duplicate)).train_episode.trainer is not trainer


def test_a_shallow_copy_trains_the_model_it_shares_as_the_stock_copy_does():
    """copy.copy shares the engine, optimizer and scaler: the copy's episode trains that model,
    as stock's copy.copy would, with the copy's own settings."""
    results = []
    for enabled in (False, True):
        torch.manual_seed(0)
        trainer = TRAINERS["v4"]()
        if enabled:
            qca_lowmem.enable(trainer)
        duplicate = copy.copy(trainer)
        duplicate.qca_steps = 2
        loss = episode(duplicate)
        results.append((loss, weights(trainer), weights(duplicate)))
    (stock_loss, stock_original, stock_copy), (loss, original, copied) = results
    assert loss == pytest.approx(stock_loss, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(copied, stock_copy))
    assert all(a is not b and torch.equal(a, b) for a, b in zip(original, copied))  # one model


def test_disable_on_one_of_two_trainers_sharing_an_engine():
    """disable() on the original puts the shared engine back; the shallow copy then refuses to
    train until disable() is called on it too, which leaves it stock."""
    torch.manual_seed(0)
    trainer = qca_lowmem.enable(TRAINERS["v4"]())
    duplicate = copy.copy(trainer)
    qca_lowmem.disable(trainer)
    assert "evolve_step" not in vars(trainer.motor) and "__reduce_ex__" not in vars(trainer)
    with pytest.raises(RuntimeError, match=r"disable\(\) was called on a trainer sharing this one's engine .* "
                                           r"call qca_lowmem.disable\(\) on this trainer too"):
        episode(duplicate)
    qca_lowmem.disable(duplicate)
    assert not {"train_episode", "_qca_lowmem_state", "__reduce_ex__"} & set(vars(duplicate))
    assert type(duplicate.scaler) is type(trainer.scaler)
    episode(duplicate)  # stock's episode
    qca_lowmem.enable(duplicate)  # and enabled again, on its own


def test_a_copy_given_another_engine_refuses_to_train_on_it():
    torch.manual_seed(0)
    trainer = qca_lowmem.enable(TRAINERS["v4"]())
    duplicate = copy.copy(trainer)
    duplicate.motor = copy.deepcopy(TRAINERS["v4"]().motor)
    with pytest.raises(RuntimeError, match=r"trainer.motor \(.*\) is not the engine enable\(\) changed"):
        episode(duplicate)
    episode(trainer)


class OwnReduce(QC_Trainer_v4):
    def __reduce__(self):
        return (OwnReduce.__new__, (OwnReduce,), dict(vars(self)))


def test_a_trainer_with_its_own_reduce_refuses_to_be_copied_while_enabled():
    trainer = qca_lowmem.enable(OwnReduce(make_config(grid=8, qca_steps=3)))
    for how in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"OwnReduce has its own __reduce__.*qca_lowmem.disable\(trainer\) before "
                                            r"copying it"):
            how(trainer)
    qca_lowmem.disable(trainer)
    copy.copy(trainer)
