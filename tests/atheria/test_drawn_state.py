"""An engine that keeps no state.psi (its `state` a property that fails) starts its episodes from
`motor.get_initial_state(batch)`: the users' HARMONIC engine gives a real (B, d, H, W) tensor there
and its step hands psi back untouched, so no gradient reaches the operator. enable() refuses it
by that state, naming the engine class, for V4 and V3 alike and whatever fused_step_ops says, and
leaves the trainer, its engine and every generator as found; under QCA_LOWMEM=1 the trainer's own
episode runs, said in one warning."""

import random

import numpy
import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_operator
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

D_STATE, HIDDEN, GRID = 2, 4, 8
REFUSAL = (r"^enable\(\): StillEngine\.get_initial_state\(1\), where it keeps no state\.psi, gives a torch\.float32 "
           r"tensor of shape \(1, 2, 8, 8\), not a complex \(B, H, W, d\) tensor; no setting changes that: train "
           r"this engine on stock, without enable\(\)\n")


class StillEngine:
    """The shape of their SparseHarmonicEngine: the model as `operator`, a `state` property that
    fails (its cache was never set up), a step that moves its own bookkeeping and returns psi as
    it came, and a zeros (B, d, H, W) initial state."""

    def __init__(self, operator, cfg):
        self.operator, self.cfg, self.step_count = operator, cfg, 0

    @property
    def state(self):
        return self._cached_state  # never set: AttributeError, as theirs

    def evolve_step(self, psi):
        self.step_count += 1
        return psi

    def get_initial_state(self, batch_size=1):
        return torch.zeros(batch_size, D_STATE, GRID, GRID)

    def get_model_for_params(self):
        return self.operator

    def compile_model(self):
        pass


def make_trainer(version):
    cfg = make_config(grid=GRID, d_state=D_STATE, hidden=HIDDEN, qca_steps=3, gamma=0.05)
    operator = make_operator("unet_groupnorm", D_STATE, HIDDEN).float()
    trainer = QC_Trainer_v4(cfg, operator=operator) if version == "v4" else QC_Trainer_v3(cfg, operator=operator)
    trainer.motor = StillEngine(operator, cfg)
    return trainer


def generators():
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()


@pytest.mark.parametrize("fused_step_ops", [True, False])
@pytest.mark.parametrize("version", ["v4", "v3"])
def test_an_engine_whose_drawn_state_is_not_complex_is_refused(version, fused_step_ops):
    trainer = make_trainer(version)
    trainer_attributes, engine_attributes = dict(vars(trainer)), dict(vars(trainer.motor))
    torch_rng, python_rng, numpy_rng = generators()
    with pytest.raises(TypeError, match=REFUSAL):
        qca_lowmem.enable(trainer, fused_step_ops=fused_step_ops)
    assert vars(trainer) == trainer_attributes and vars(trainer.motor) == engine_attributes
    after = generators()
    assert torch.equal(after[0], torch_rng) and after[1] == python_rng and (after[2] == numpy_rng).all()


@pytest.mark.parametrize("version", ["v4", "v3"])
def test_under_the_environment_switch_it_trains_on_stock_said_once(version, monkeypatch, caplog):
    monkeypatch.setenv("QCA_LOWMEM", "1")
    trainer, stock = make_trainer(version), make_trainer(version)
    with caplog.at_level("INFO", logger="qca_lowmem"):
        assert qca_lowmem.enable_from_config(trainer, {}) is False
    lines = [r.getMessage() for r in caplog.records if r.name == "qca_lowmem"]
    assert len(lines) == 1 and lines[0].startswith(
        f"off, {type(trainer).__name__} trains on stock: StillEngine.get_initial_state(1), where it "
        "keeps no state.psi, gives a torch.float32 tensor of shape (1, 2, 8, 8), not a complex")
    assert "train_episode" not in vars(trainer)  # their own episode runs, as written
    assert vars(trainer).keys() == vars(stock).keys() and vars(trainer.motor).keys() == vars(stock.motor).keys()
