"""enable() installs the fused Cartesian step only on an engine where it is exact: an engine whose
state is not a complex tensor, or whose own evolve_step is not the Cartesian step, is refused in
one line naming the engine class, and the trainer is left as it was. Small stand-in engines,
each the shape of one way an engine can differ."""

import random

import numpy
import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_operator
from qca_lowmem.examples.qc_trainer_v4 import MemoryMotor, Motor, QC_Trainer_v4, QuantumState, make_config
from qca_lowmem.stock import pack, step, update

pytestmark = pytest.mark.usefixtures("one_thread")

D_STATE, HIDDEN = 2, 4


def make_trainer(engine=Motor, gamma=0.05, dtype=torch.complex128, memory=False, **config):
    """A stand-in trainer whose engine is `engine(operator, cfg, state)`, its state already reset."""
    cfg = make_config(grid=8, d_state=D_STATE, hidden=HIDDEN, qca_steps=4, gamma=gamma, dtype=dtype, **config)
    operator = make_operator("convlstm" if memory else "unet_groupnorm", D_STATE, HIDDEN)
    if dtype == torch.complex128:
        operator = operator.double()
    trainer = QC_Trainer_v4(cfg, state_object=True, operator=operator, memory=memory)
    trainer.motor = engine(operator, cfg, trainer.motor.state)
    trainer.motor.state._reset_state_random()
    return trainer


def snapshot(trainer):
    """What enable() may not change when it refuses, or change by probing when it accepts."""
    motor, state = trainer.motor, getattr(trainer.motor, "state", None)
    attributes = dict(vars(state)) if state is not None else {}
    tensors = {name: value.clone() for name, value in attributes.items() if isinstance(value, torch.Tensor)}
    return dict(
        trainer=dict(vars(trainer)), motor=dict(vars(motor)), state=attributes, tensors=tensors,
        blocks=[type(m) for m in motor.operator.modules()],
        weights=[p.detach().clone() for p in motor.operator.parameters()],
        torch_rng=torch.get_rng_state(), python_rng=random.getstate(), numpy_rng=numpy.random.get_state()[1].copy(),
    )


def assert_unchanged(trainer, before, *, installed=False):
    after = snapshot(trainer)
    if installed:  # enable() sets exactly these when it accepts
        for name in ("train_episode", "scaler", "_qca_lowmem_state", "__reduce_ex__"):
            after["trainer"].pop(name, None), before["trainer"].pop(name, None)
        after["motor"].pop("evolve_step", None)
    for part in ("trainer", "motor", "state"):
        assert after[part].keys() == before[part].keys(), part
        assert all(after[part][k] is v for k, v in before[part].items()), part
    assert after["tensors"].keys() == before["tensors"].keys()
    assert all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items())
    if not installed:
        assert after["blocks"] == before["blocks"]
    assert all(torch.equal(a, b) for a, b in zip(after["weights"], before["weights"], strict=True))
    assert torch.equal(after["torch_rng"], before["torch_rng"])
    assert after["python_rng"] == before["python_rng"]
    assert (after["numpy_rng"] == before["numpy_rng"]).all()


def refused(trainer, match, **options):
    before = snapshot(trainer)
    with pytest.raises(TypeError, match=match) as error:
        qca_lowmem.enable(trainer, **options)
    first, *rest = str(error.value).split("\n")
    assert len(first) <= 200, first  # what and why, with the advice; the details on the second line
    assert rest and rest[0].startswith("qca_lowmem supports engines whose state psi is a complex (B, H, W, d) tensor")
    assert_unchanged(trainer, before)
    return str(error.value)


def accepted(trainer, **options):
    before = snapshot(trainer)
    qca_lowmem.enable(trainer, **options)
    assert_unchanged(trainer, before, installed=True)


def run(trainer, episodes=range(2), seed=5):
    torch.manual_seed(seed)
    return [trainer.train_episode(e) for e in episodes]


def assert_same_runs(actual, expected, rel=1e-10):
    for (loss, _, psi), (stock_loss, _, stock_psi) in zip(actual, expected, strict=True):
        assert loss == pytest.approx(stock_loss, rel=rel, abs=0)
        assert ((psi - stock_psi).abs().max() / stock_psi.abs().max()).item() <= rel


class HalfStepMotor(Motor):
    """Another update rule: half an Euler step of the operator's delta."""

    def evolve_step(self, psi):
        return update(psi, 0.5 * self.operator(pack(psi)), self.cfg.GAMMA_DECAY)


class NoDecayMotor(Motor):
    """The Cartesian step without the GAMMA_DECAY term."""

    def evolve_step(self, psi):
        return step(psi, self.operator, 0.0)


class PhaseKickMotor(Motor):
    """A subclass that adds its own term after the Cartesian step."""

    def evolve_step(self, psi):
        return super().evolve_step(psi) * torch.exp(torch.tensor(0.01j, dtype=psi.dtype))


class LayoutMotor(Motor):
    """Feeds the operator (B, 2d, W, H) (transposed) and reads delta back the same way."""

    def evolve_step(self, psi):
        delta = self.operator(pack(psi).transpose(2, 3)).transpose(2, 3)
        return update(psi, delta, self.cfg.GAMMA_DECAY)


class ForgetfulMemoryMotor(MemoryMotor):
    """An engine with memory that starts every step from no memory."""

    def evolve_step(self, psi):
        delta, h, c = self.operator(pack(psi), None, None)
        self.state.h_state, self.state.c_state = h.detach(), c.detach()
        return update(psi, delta, self.cfg.GAMMA_DECAY)


class MagnitudePhase:
    """A state kept as magnitude and phase, not as a complex tensor."""

    def __init__(self, psi):
        self.magnitude, self.phase = psi.abs(), psi.angle()


class PolarState(QuantumState):
    def _reset_state_random(self):
        super()._reset_state_random()
        self.psi = MagnitudePhase(self.psi)


class SubclassKeepingTheStep(Motor):
    """Adds views, not physics: the Cartesian step is exact here."""

    def bulk(self):
        return self.state.psi.abs()


ON_STOCK_TEXT = "no setting changes that: train this engine on stock, without enable()"


def keeps_its_own_step(trainer, caplog, **options):
    """enable() accepts the engine, keeps its own step and says why in its line."""
    name = type(trainer.motor).__name__
    with caplog.at_level("INFO", logger="qca_lowmem"):
        accepted(trainer, **options)
    assert "evolve_step" not in vars(trainer.motor)
    assert f"the engine's own step and blocks: {name}.evolve_step is not, by its code, a Cartesian engine step " \
           "qca_lowmem follows" in caplog.text


@pytest.mark.parametrize("engine", [HalfStepMotor, NoDecayMotor, PhaseKickMotor, LayoutMotor])
def test_an_engine_stepping_otherwise_keeps_its_own_step(engine, caplog):
    """An evolve_step that is not, by its code, one qca_lowmem follows keeps the engine's own step
    (not decided by a numerical match): the episodes equal stock's."""
    trainer, stock = make_trainer(engine), make_trainer(engine)
    keeps_its_own_step(trainer, caplog)
    assert_same_runs(run(trainer), run(stock))


def test_a_change_below_the_probes_tolerance_keeps_its_own_step(caplog):
    """Without GAMMA_DECAY=1e-7 in complex64 the step differs by less than the probe's 64 units of
    rounding: the code tells it apart, and the episodes are stock's."""
    trainer, stock = (make_trainer(NoDecayMotor, gamma=1e-7, dtype=torch.complex64) for _ in range(2))
    for t in (trainer, stock):
        t.motor.operator.float()
    keeps_its_own_step(trainer, caplog)
    assert_same_runs(run(trainer), run(stock), rel=0)
    accepted(make_trainer(Motor, gamma=1e-4, dtype=torch.complex64))


def test_a_memory_engine_stepping_otherwise_keeps_its_own_step(caplog):
    def forgetful():
        trainer = make_trainer(ForgetfulMemoryMotor, memory=True)
        trainer.motor.state.h_state = torch.zeros(1, HIDDEN, 4, 4, dtype=torch.float64)
        trainer.motor.state.c_state = torch.ones(1, HIDDEN, 4, 4, dtype=torch.float64)
        return trainer
    trainer, stock = forgetful(), forgetful()
    keeps_its_own_step(trainer, caplog)
    assert_same_runs(run(trainer), run(stock))


def polar_trainer():
    trainer = make_trainer()
    trainer.motor.state = PolarState(trainer.cfg, trainer.device)
    trainer.motor.state._reset_state_random()
    return trainer


@pytest.mark.parametrize("fused_step_ops", [True, False])
def test_a_state_that_is_not_a_complex_tensor_is_refused(fused_step_ops):
    trainer = polar_trainer()
    message = refused(trainer, r"^enable\(\): Motor\.state\.psi is a MagnitudePhase, not a complex \(B, H, W, d\) "
                               r"tensor; ", fused_step_ops=fused_step_ops)
    assert message.split("\n")[0].endswith(f"; {ON_STOCK_TEXT}")  # fused_step_ops=False cannot carry it either
    trainer.motor.state.psi = torch.ones(1, 8, 8, D_STATE)
    refused(trainer, r"Motor\.state\.psi is a torch\.float32 tensor of shape \(1, 8, 8, 2\), not a complex",
            fused_step_ops=fused_step_ops)


@pytest.mark.parametrize("engine,memory", [(Motor, False), (SubclassKeepingTheStep, False), (MemoryMotor, True)])
def test_a_cartesian_engine_is_accepted_and_left_as_found(engine, memory):
    trainer = make_trainer(engine, memory=memory)
    if memory:  # the probe sets its own memory on the state; enable() puts this one back
        trainer.motor.state.h_state = torch.zeros(1, HIDDEN, 4, 4, dtype=torch.float64)
        trainer.motor.state.c_state = torch.ones(1, HIDDEN, 4, 4, dtype=torch.float64)
    accepted(trainer)
    stock = make_trainer(engine, memory=memory)
    if memory:
        stock.motor.state.h_state = torch.zeros(1, HIDDEN, 4, 4, dtype=torch.float64)
        stock.motor.state.c_state = torch.ones(1, HIDDEN, 4, 4, dtype=torch.float64)
    assert_same_runs(run(trainer), run(stock))


def test_an_engine_without_a_state_is_probed_on_the_trainer_grid(caplog):
    trainer = make_trainer(HalfStepMotor)
    del trainer.motor.state
    keeps_its_own_step(trainer, caplog)
    trainer = make_trainer(Motor)
    del trainer.motor.state
    accepted(trainer)


def test_fused_step_ops_false_rolls_out_the_engines_own_step():
    """Refused fused, an engine whose state is a complex tensor trains exactly on its own step."""
    trainer, stock = make_trainer(HalfStepMotor), make_trainer(HalfStepMotor)
    accepted(trainer, fused_step_ops=False)
    assert "evolve_step" not in vars(trainer.motor)
    assert_same_runs(run(trainer), run(stock))


def test_the_environment_switch_leaves_an_engine_it_cannot_run_on_stock(monkeypatch, caplog):
    """QCA_LOWMEM=1 asks for the library wherever it can run: a refused engine trains on stock,
    said in one warning that says why and how to silence it."""
    monkeypatch.setenv("QCA_LOWMEM", "1")
    trainer = polar_trainer()
    before = snapshot(trainer)
    with caplog.at_level("INFO", logger="qca_lowmem"):
        assert qca_lowmem.enable_from_config(trainer, None) is False
    assert_unchanged(trainer, before)
    [line] = [r.getMessage() for r in caplog.records]
    assert caplog.records[0].levelname == "WARNING" and "\n" not in line and len(line) <= 200, line
    assert line.startswith("off, QC_Trainer_v4 trains on stock: Motor.state.psi is a MagnitudePhase, not a complex")
    assert line.endswith("; unset QCA_LOWMEM for it to silence this")


class ActionEngine:
    """An engine without the step the switch replaces, as their LAGRANGIAN one: a model and an
    integrator of its own, no operator, no evolve_step."""

    def __init__(self, model):
        self.model = model

    def evolve_internal_state(self):
        pass


def test_the_environment_switch_names_what_an_engine_without_our_step_lacks(monkeypatch, caplog):
    monkeypatch.setenv("QCA_LOWMEM", "1")
    trainer = make_trainer()
    trainer.motor = ActionEngine(trainer.motor.operator)
    with caplog.at_level("INFO", logger="qca_lowmem"):
        assert qca_lowmem.enable_from_config(trainer, None) is False
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("off, QC_Trainer_v4 trains on stock: QC_Trainer_v4 lacks motor.operator, motor.evolve_step (its "
                    "motor: ActionEngine), which the switch replaces or reads; unset QCA_LOWMEM for it to silence this")


def test_a_lowmem_section_that_asks_for_it_is_refused_in_its_own_terms(monkeypatch):
    """The section's user reads the refusal as section keys, and can set every one of them."""
    monkeypatch.setenv("QCA_LOWMEM", "1")  # the section asks too: a refusal stands
    with pytest.raises(ValueError, match=r"^enable\(\): LOWMEM\.channels_last: true needs the fused step") as error:
        qca_lowmem.enable_from_config(make_trainer(HalfStepMotor), {"LOWMEM": {"enabled": True, "channels_last": True}})
    first, *rest = str(error.value).split("\n")
    assert len(first) <= 200 and rest[-1] == "LOWMEM: false trains this experiment on stock."
    trainer = make_trainer(HalfStepMotor)
    assert qca_lowmem.enable_from_config(trainer, {"LOWMEM": {"enabled": True, "fused_step_ops": "false"}})
    assert trainer._qca_lowmem_state.options.fused_step_ops is False


def test_a_section_is_told_the_setting_that_trains_an_engine_it_cannot_run_on_stock(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    with pytest.raises(TypeError, match=r"^enable\(\): Motor\.state\.psi is a MagnitudePhase.*; no setting changes "
                                        r"that: train this engine on stock, with LOWMEM: false\n"):
        qca_lowmem.enable_from_config(polar_trainer(), {"LOWMEM": True})


class FrozenMotor(Motor):
    """An engine refusing attribute writes once built (a frozen dataclass's way)."""

    def __setattr__(self, name, value):
        if getattr(self, "frozen", False):
            raise AttributeError(f"frozen engine: cannot set {name}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError(f"frozen engine: cannot delete {name}")


def test_a_frozen_engine_takes_the_fused_step_for_its_episodes():
    """The fused step goes on the engine for an episode and off after it past the engine's own
    __setattr__ (the episodes failed with its AttributeError, which named no library)."""
    trainers = [make_trainer(FrozenMotor) for _ in range(2)]
    for trainer in trainers:
        trainer.motor.frozen = True
    trainer, stock = trainers
    qca_lowmem.enable(trainer)
    assert_same_runs(run(trainer), run(stock))
    assert "evolve_step" not in vars(trainer.motor)


def test_an_engine_without_an_instance_dict_is_refused_naming_it():
    class SlottedMotor:
        __slots__ = ("operator", "cfg", "state")
        evolve_step = Motor.evolve_step

        def __init__(self, operator, cfg, state):
            self.operator, self.cfg, self.state = operator, cfg, state

    trainer = make_trainer()
    trainer.motor = SlottedMotor(trainer.motor.operator, trainer.motor.cfg, trainer.motor.state)
    with pytest.raises(TypeError, match=r"^enable\(\): SlottedMotor keeps its attributes in __slots__"):
        qca_lowmem.enable(trainer)
    assert "train_episode" not in vars(trainer) and not hasattr(trainer, "_qca_lowmem_state")
