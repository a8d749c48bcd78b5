"""An enabled trainer copied (copy.deepcopy) or pickled, and its engine copied alone as a
snapshot: each copy trains itself, never the original, its episodes equal the original's, and
disable() on a copy puts the stock trainer back there."""

import copy
import pickle

import numpy
import pytest
import torch

from fixtures.model_families import make_trainer

import qca_lowmem
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
