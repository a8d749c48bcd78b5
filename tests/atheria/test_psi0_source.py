"""Where a V4 episode's psi0 comes from is the running episode's own rule, read off the engine at
each episode. Their V4 (Atheria's): `motor.state._reset_state_random()` where the state has one,
then `motor.state.psi` (as it is where there is no reset), or `motor.get_initial_state(batch_size)`
where the engine keeps no state. The stand-in's: the reset where the engine has a state, else its
own draw. A state or engine that episode would fail on is refused by enable(), naming it."""

import numpy
import pytest
import torch

import qca_lowmem
from qca_lowmem.atheria import switch
from qca_lowmem.atheria.code_identity import ATHERIA
from qca_lowmem.atheria.episode_options import TheirPsi0
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")


class FixedState:
    """A state holding one psi, with a reset their episode never calls."""

    def __init__(self, psi):
        self.psi = psi

    def reset_state(self):
        self.psi = torch.randn_like(self.psi)


class KeptState(FixedState):
    """FixedState whose `_reset_state_random` keeps psi: the stand-in's episode then starts where
    their V4 starts on a FixedState."""

    def _reset_state_random(self):
        pass


def psi_of(grid=8, d_state=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    psi = torch.complex(*torch.randn(2, 1, grid, grid, d_state, generator=generator, dtype=torch.float64))
    return psi / psi.abs().pow(2).sum(-1, keepdim=True).sqrt()


def trainer_with(state):
    torch.manual_seed(1)
    trainer = QC_Trainer_v4(make_config(dtype=torch.complex128), state_object=True)
    trainer.motor.operator.double()
    trainer.motor.state = state
    return trainer


def losses(trainer):
    out = []
    for episode in range(2):
        torch.manual_seed(10 + episode)
        numpy.random.seed(10 + episode)
        out.append(trainer.train_episode(episode)[0])
    return out


def test_their_draw_follows_their_episodes_branches():
    class Engine:
        pass

    trainer = type("Trainer", (), {})()
    trainer.motor, trainer.batch_size = Engine(), 3
    draw = TheirPsi0()
    psi = psi_of()
    # A state without their reset: its psi as it is, no generator drawn from.
    trainer.motor.state = FixedState(psi)
    before = torch.get_rng_state()
    assert draw(trainer) is psi and torch.equal(torch.get_rng_state(), before)
    # With their reset: called first.
    trainer.motor.state = KeptState(psi)
    trainer.motor.state._reset_state_random = lambda: setattr(trainer.motor.state, "psi", 2 * psi)
    assert torch.equal(draw(trainer), 2 * psi)
    # No state: the engine's draw at the trainer's batch size, read at each episode; links set up
    # where the engine has them (their LatticeEngine's), as their episode does before it.
    del trainer.motor.state
    asked = []
    trainer.motor.get_initial_state = lambda batch: asked.append(batch) or psi.expand(batch, -1, -1, -1)
    trainer.motor._initialize_links = lambda: "links"
    assert draw(trainer).shape[0] == 3 and trainer.motor.links == "links"
    trainer.batch_size = 2
    assert draw(trainer).shape[0] == 2 and asked == [3, 2]


def test_their_episode_on_a_state_without_their_reset_starts_from_its_psi(monkeypatch):
    """Their V4 (by its code's origin) on a state their episode does not reset trains from that
    state's psi at every episode, as the stand-in does on a state whose reset keeps it; the
    stand-in's own episode, which calls the reset, is refused at enable(), naming it."""
    stock = trainer_with(KeptState(psi_of()))
    refused = trainer_with(FixedState(psi_of()))
    with pytest.raises(TypeError, match=r"^enable\(\): QC_Trainer_v4's episode starts with "
                                        r"motor.state._reset_state_random\(\), which FixedState lacks"):
        qca_lowmem.enable(refused)
    monkeypatch.setattr(switch, "stock_origin", lambda trainer, version: ATHERIA + "src/trainers/qc_trainer_v4.py")
    theirs = trainer_with(FixedState(psi_of()))
    qca_lowmem.enable(theirs)
    assert losses(theirs) == pytest.approx(losses(stock), rel=1e-12, abs=0)
    assert torch.equal(theirs.motor.state.psi, psi_of())  # not redrawn by a reset of another name


def test_their_episode_on_an_engine_with_no_psi_source_is_refused(monkeypatch):
    monkeypatch.setattr(switch, "stock_origin", lambda trainer, version: ATHERIA + "src/trainers/qc_trainer_v4.py")
    trainer = QC_Trainer_v4(make_config())
    assert not hasattr(trainer.motor, "state") and not hasattr(trainer.motor, "get_initial_state")
    with pytest.raises(TypeError, match=r"draws psi0 from motor.state.psi or motor.get_initial_state\(batch_size\), "
                                        r"and Motor has neither: it fails on stock too"):
        qca_lowmem.enable(trainer)
    assert not hasattr(trainer, "_qca_lowmem_state")
