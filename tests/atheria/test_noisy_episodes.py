"""Noisy episodes through enable(): the trainer's own noise injector, drawing from torch's and
NumPy's global generators, makes the same draws as stock and is replayed by every recompute, so
weights, losses and the generators after the episodes equal stock's in float64 under every
policy; the fused NoiseSchedule stays an option."""

import random

import numpy
import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_operator
from qca_lowmem.examples.qc_trainer_v4 import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

D_STATE, HIDDEN, STEPS = 2, 4, 5
EPISODES = (2000, 2001, 2002)  # the curriculum's full rate: noise every step
POLICIES = [("none", {}), ("step", {}), ("revolve", {"slots": 1}), ("revolve", {"slots": 2}),
            ("auto", {"budget": 0}), ("auto", {"budget": 2**15}), ("auto", {"budget": 2**30})]


class TossingInjector:
    """The users' injector's shape (phase flips from torch's generator, their mask drawn before
    the angles), with bit flips drawn from NumPy's: a replay must restore both generators."""

    def apply_phase_flip(self, psi, rate=0.01):
        mask = (torch.rand(psi.shape[:3]) < rate).unsqueeze(-1).expand_as(psi)
        angle = torch.rand(psi.shape, dtype=psi.real.dtype) * 2 * torch.pi
        return torch.where(mask, psi * torch.complex(torch.cos(angle), torch.sin(angle)), psi)

    def apply_bit_flip(self, psi, rate=0.005):
        mask = torch.from_numpy(numpy.random.random(psi.shape[:3]) < rate).unsqueeze(-1)
        return torch.where(mask, -psi, psi)


def make_trainer(family):
    cfg = make_config(grid=8, d_state=D_STATE, hidden=HIDDEN, qca_steps=STEPS, gamma=0.05, dtype=torch.complex128)
    trainer = QC_Trainer_v4(cfg, state_object=True, operator=make_operator(family, D_STATE, HIDDEN),
                            memory=family == "convlstm", max_noise=0.3)
    trainer.noise_injector = TossingInjector()
    return trainer


def generators():
    return torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()


def run(trainer):
    """Per episode: loss, final psi and the weights after it; then the generators' states."""
    torch.manual_seed(99)
    numpy.random.seed(99)
    random.seed(99)
    episodes = []
    for e in EPISODES:
        loss, _, psi = trainer.train_episode(e)
        episodes.append((loss, psi, [p.detach().clone() for p in trainer.motor.operator.parameters()]))
    return episodes, generators()


def relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


_stock = {}


def stock_run(family):
    if family not in _stock:
        _stock[family] = run(make_trainer(family))
    return _stock[family]


@pytest.mark.parametrize("checkpoint,options", POLICIES, ids=[f"{c}-{o}" for c, o in POLICIES])
@pytest.mark.parametrize("family", ["unet_groupnorm", "convlstm"])
def test_noisy_episodes_equal_stock(family, checkpoint, options):
    trainer = make_trainer(family)
    qca_lowmem.enable(trainer, checkpoint=checkpoint, **options)
    (episodes, after), (stock_episodes, stock_after) = run(trainer), stock_run(family)
    for e, ((loss, psi, weights), (stock_loss, stock_psi, stock_weights)) in enumerate(zip(episodes, stock_episodes)):
        assert loss == pytest.approx(stock_loss, rel=1e-10, abs=0), f"loss, episode {e}"
        assert relative(psi, stock_psi) <= 1e-10, f"final psi, episode {e}"
        worst = max(relative(w, s) for w, s in zip(weights, stock_weights))
        assert worst <= 1e-9, f"weights after episode {e}: {worst:.2e}"
    torch_state, numpy_state, python_state = after
    assert torch.equal(torch_state, stock_after[0]) and (numpy_state == stock_after[1]).all()
    assert python_state == stock_after[2]


def test_the_noise_is_on_and_comes_from_the_injector():
    """The episodes above are noisy: without the injector's draws (a quiet injector) they differ."""

    class Quiet:
        def apply_phase_flip(self, psi, rate):
            return psi

        apply_bit_flip = apply_phase_flip

    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer)
    trainer.noise_injector = Quiet()  # read at each episode
    (episodes, _), (stock_episodes, _) = run(trainer), stock_run("unet_groupnorm")
    assert relative(episodes[0][1], stock_episodes[0][1]) > 1e-2


def test_fused_noise_is_the_noise_schedule(caplog):
    """noise="fused": qca_lowmem's keyed NoiseSchedule, the same for every policy, not stock's draws."""
    caplog.set_level("INFO", logger="qca_lowmem")
    results = []
    for checkpoint, options in (("none", {}), ("revolve", {"slots": 2})):
        trainer = make_trainer("unet_groupnorm")
        del trainer.noise_injector  # not needed
        qca_lowmem.enable(trainer, checkpoint=checkpoint, noise="fused", **options)
        results.append(run(trainer)[0])
    assert caplog.records[-1].getMessage().endswith(", fused noise")
    (none, revolve), (stock, _) = results, stock_run("unet_groupnorm")
    assert all(relative(w, s) <= 1e-9 for w, s in zip(revolve[-1][2], none[-1][2]))
    assert relative(none[0][1], stock[0][1]) > 1e-2


def test_noise_source_is_refused_where_it_cannot_work():
    trainer = make_trainer("unet_groupnorm")
    with pytest.raises(ValueError, match=r"noise must be one of \('trainer', 'fused'\), got 'stock'"):
        qca_lowmem.enable(trainer, noise="stock")
    trainer.noise_injector = object()
    with pytest.raises(TypeError, match=r"noise_injector \(object\) has no apply_phase_flip, apply_bit_flip; "
                                        r"noise='fused'"):
        qca_lowmem.enable(trainer)
    assert not hasattr(trainer, "_qca_lowmem_state")
