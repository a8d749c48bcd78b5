"""The operator computes on the layouts stock's computes on: the switch's fused steps pack NHWC, as
the users' engine's own pack does (torch.cat of the permuted real and imaginary parts), with and
without memory. So a draw made element by element in memory order, torch's Dropout put in the
operator (in a block, after one, after the up-convolution, on delta; with memory; in an MLP)
before enable() or between episodes, lands where stock's lands: every policy gives stock's
episodes (float64). With the NCHW pack the switch drew other masks than stock, on every policy."""

import numpy
import pytest
import torch
from torch import nn

import qca_lowmem
from fixtures.model_families import D_STATE, HIDDEN, assert_same_run, make_operator, make_trainer, memory
from qca_lowmem import stock
from qca_lowmem.atheria import engine_step
from qca_lowmem.ops import qca_step

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = {"none": dict(checkpoint="none"), "step": dict(checkpoint="step"),
            "revolve": dict(checkpoint="revolve", slots=2), "auto": dict(checkpoint="auto", budget=0)}


def _after(name):
    """The operator's layer `name` followed by torch's Dropout."""
    def put(operator):
        setattr(operator, name, nn.Sequential(getattr(operator, name), nn.Dropout(0.3)))
    return put


# Where a researcher puts torch's Dropout: (the family, the edit).
PLACES = {"in a block": ("unet_groupnorm", lambda operator: operator.inc.conv_block.append(nn.Dropout(0.3))),
          "after a fused block": ("unet_groupnorm", lambda operator: operator.down1.append(nn.Dropout(0.3))),
          "after the up-convolution": ("unet_groupnorm", _after("up1")),
          "on delta": ("unet_groupnorm", _after("outc")),
          "in a block, with memory": ("convlstm", lambda operator: operator.inc.conv_block.append(nn.Dropout(0.3))),
          "in an MLP": ("mlp", lambda operator: operator.net.append(nn.Dropout(0.3)))}


def episodes(trainer, put_dropout, dropout_at):
    """Three episodes, `put_dropout(operator)` run before episode `dropout_at` (None: never here)."""
    torch.manual_seed(99)
    numpy.random.seed(99)
    per_episode = []
    for e in range(3):
        if e == dropout_at:
            put_dropout(trainer.motor.operator)
        loss, _, psi = trainer.train_episode(e)
        per_episode.append((loss, psi, memory(trainer)))
    params = list(trainer.motor.operator.named_parameters())
    return per_episode, {n: p.grad.clone() for n, p in params}, {n: p.detach().clone() for n, p in params}


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("when", ["before enable()", "between episodes"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_dropout_in_the_operator_draws_stocks_masks(place, when, policy, caplog):
    caplog.set_level("INFO", logger="qca_lowmem")
    family, put_dropout = PLACES[place]

    def trainer():
        operator = make_operator(family, D_STATE, HIDDEN)
        if when == "before enable()":
            put_dropout(operator)
        return make_trainer(family, operator)

    dropout_at = None if when == "before enable()" else 1
    expected = episodes(trainer(), put_dropout, dropout_at)
    switched = qca_lowmem.enable(trainer(), **POLICIES[policy])
    actual = episodes(switched, put_dropout, dropout_at)
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].endswith(", fused step") and not any("own step" in line for line in lines)  # the fused one ran
    assert_same_run(actual, expected)


@pytest.mark.parametrize("family", ["unet_groupnorm", "convlstm"])
def test_the_fused_step_packs_the_layout_the_engines_own_pack_gives(family, monkeypatch):
    packed = []
    real_pack = engine_step.qca_pack

    def pack(psi, *args, **kwargs):
        x = real_pack(psi, *args, **kwargs)
        packed.append(x.stride())
        return x

    monkeypatch.setattr(engine_step, "qca_pack", pack)
    monkeypatch.setattr(qca_step, "qca_pack", pack)
    trainer = qca_lowmem.enable(make_trainer(family), checkpoint="step")
    trainer.train_episode(0)
    psi = torch.randn(1, 8, 8, D_STATE, dtype=torch.complex128)
    assert packed and set(packed) == {stock.pack(psi).stride()}
    assert stock.pack(psi).is_contiguous(memory_format=torch.channels_last) and not stock.pack(psi).is_contiguous()
