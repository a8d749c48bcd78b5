"""torch.jit.script of the operator of a trainer, as a researcher scripts a model to export it or
to train on the script: after enable() it is their model between episodes (the blocks are fused
only while an episode runs); a block fused in place (what an episode runs) scripts to the stock
layers' calls (their class's, where its call changed since), on the same Parameters; and a
scripted operator set on the engine runs the engine's own step: episodes equal stock's."""

import pytest
import torch

import qca_lowmem
from qca_lowmem import stock
from qca_lowmem.atheria.fused_blocks import swap_in
from qca_lowmem.blocks import fused_in_place
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")]


class TheirBlock(stock.ConvBlock):
    """A block class of the researcher's own, stock's call until its forward is edited."""


def doubled_forward(self, x):
    return 2.0 * self.conv_block(x)


def make_trainer(block_class=stock.ConvBlock):
    torch.manual_seed(1234)
    trainer = QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=8, qca_steps=3, gamma=0.05, dtype=torch.complex128),
                            state_object=True)
    trainer.motor.operator.double()
    for block in trainer.motor.operator.modules():
        if type(block) is stock.ConvBlock:
            block.__class__ = block_class
    with torch.no_grad():
        trainer.motor.operator.outc.weight.normal_(0.0, 0.05)
    return trainer


def test_a_script_of_the_enabled_operator_is_their_model():
    trainer = make_trainer()
    qca_lowmem.enable(trainer)
    trainer.train_episode(0)
    scripted = torch.jit.script(trainer.motor.operator)
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    assert not any(fused_in_place(type(m)) for m in trainer.motor.operator.modules())
    assert torch.equal(scripted(x), trainer.motor.operator(x))


def test_a_script_of_blocks_fused_in_place_computes_stocks_on_the_same_parameters():
    stock_trainer, trainer = make_trainer(), make_trainer()
    swap_in(trainer.motor.operator)  # as an episode runs them
    fused = [m for m in trainer.motor.operator.modules() if fused_in_place(type(m))]
    assert len(fused) == 6
    scripted = torch.jit.script(trainer.motor.operator)
    assert all(a is b for a, b in zip(scripted.parameters(), trainer.motor.operator.parameters()))
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    assert torch.equal(scripted(x), torch.jit.script(stock_trainer.motor.operator)(x))
    assert all(fused_in_place(type(m)) for m in fused), "scripting gave a block its class back"


def test_a_script_compiles_their_block_forward_edited_after_fusing(monkeypatch):
    stock_trainer, trainer = make_trainer(TheirBlock), make_trainer(TheirBlock)
    swap_in(trainer.motor.operator)  # as an episode runs them
    assert any(fused_in_place(type(m)) is TheirBlock for m in trainer.motor.operator.modules())
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    unedited = stock_trainer.motor.operator(x)
    monkeypatch.setattr(TheirBlock, "forward", doubled_forward, raising=False)
    scripted = torch.jit.script(trainer.motor.operator)
    edited = torch.jit.script(stock_trainer.motor.operator)(x)
    assert torch.equal(scripted(x), edited)
    assert not torch.equal(edited, unedited)


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
@pytest.mark.parametrize("when", ["before enable", "between episodes"])
def test_a_scripted_operator_trains_as_stocks(when, checkpoint, slots, caplog):
    caplog.set_level("INFO", logger="qca_lowmem")

    def run(trainer, lowmem):
        if when == "before enable":
            trainer.motor.operator = torch.jit.script(trainer.motor.operator)
        if lowmem:
            qca_lowmem.enable(trainer, checkpoint=checkpoint, slots=slots)
        torch.manual_seed(99)
        losses = []
        for episode in range(3):
            if episode == 1 and when == "between episodes":
                trainer.motor.operator = torch.jit.script(trainer.motor.operator)
            losses.append(trainer.train_episode(episode)[0])
        return losses, [p.detach().clone() for p in trainer.motor.operator.parameters()]

    stock_losses, stock_weights = run(make_trainer(), lowmem=False)
    losses, weights = run(make_trainer(), lowmem=True)
    assert losses == pytest.approx(stock_losses, rel=1e-12, abs=0)
    assert max((w - s).abs().max().item() for w, s in zip(weights, stock_weights)) <= 1e-12
    assert any("RecursiveScriptModule" in r.message and "own step" in r.message for r in caplog.records)
