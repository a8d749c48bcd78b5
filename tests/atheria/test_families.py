"""enable() on each model family the users' trainer builds (fixtures/model_families.py), the
ConvLSTM one on an engine with memory: loss, gradients, weights and memory over three episodes
equal to stock in float64 under every policy; what cannot work is refused by enable() itself."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import qca_lowmem
from fixtures.model_families import (
    D_STATE,
    FAMILIES,
    HIDDEN,
    MEMORY_FAMILIES,
    SpikingOperator,
    assert_same_run,
    make_operator,
    make_trainer,
    run,
)
from helpers import classes_in_episodes
from qca_lowmem import RecomputeMismatchError, saved_bytes
from qca_lowmem.atheria.engine_step import FusedMemoryStep

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = [("none", None), ("step", None), ("revolve", 2)]


_stock_runs = {}


def stock_run(family):
    if family not in _stock_runs:
        _stock_runs[family] = run(make_trainer(family))
    return _stock_runs[family]


@pytest.mark.parametrize("fused_step_ops", [True, False], ids=["fused-step", "engine-step"])
@pytest.mark.parametrize("fused_blocks", [True, False], ids=["fused-blocks", "stock-blocks"])
@pytest.mark.parametrize("checkpoint,slots", POLICIES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_stock(family, checkpoint, slots, fused_blocks, fused_step_ops):
    trainer = make_trainer(family)
    qca_lowmem.enable(trainer, checkpoint=checkpoint, slots=slots, fused_blocks=fused_blocks,
                      fused_step_ops=fused_step_ops)
    theirs = [type(m) for m in trainer.motor.operator.modules()]
    with classes_in_episodes(trainer) as classes:
        result = run(trainer)
    converted = any(issubclass(cls, qca_lowmem.FusedConvBlock) for cls in classes[0])
    assert converted == (fused_blocks and family in ("unet_groupnorm", "deep_stack", "convlstm"))
    assert [type(m) for m in trainer.motor.operator.modules()] == theirs  # their classes between episodes
    if family in MEMORY_FAMILIES:
        assert len(result[0][-1][2]) == 2  # the memory is on motor.state after each episode
    assert_same_run(result, stock_run(family))


@pytest.mark.parametrize("budget", [0, 2**15, 2**30])
def test_memory_family_auto_matches_stock(budget):
    trainer = make_trainer("convlstm")
    qca_lowmem.enable(trainer, checkpoint="auto", budget=budget)
    assert_same_run(run(trainer), stock_run("convlstm"))


def test_other_norm_left_alone_with_the_reason():
    _, report = qca_lowmem.convert(make_operator("unet_rmsnorm", D_STATE, HIDDEN))
    assert not report.converted
    assert ("inc", "layer 1 is ChannelRMSNorm, expected GroupNorm") in report.skipped


@pytest.mark.parametrize("checkpoint,slots", POLICIES[1:])
def test_impure_operator_raises_through_the_trainer(checkpoint, slots):
    """A spiking operator that forgets to reset its membrane depends on every call before it."""

    class LeakyMembrane(SpikingOperator):
        def forward(self, x):
            current = self.enc(x)
            if self.membrane is None:
                self.membrane = torch.zeros_like(current)
            self.membrane = (self.beta * self.membrane + current).detach()
            return self.outc(torch.sigmoid(4.0 * (self.membrane - 1.0)))

    torch.manual_seed(7)
    trainer = make_trainer("spiking", LeakyMembrane(D_STATE, HIDDEN).double())
    qca_lowmem.enable(trainer, checkpoint=checkpoint, slots=slots)
    weights = [p.detach().clone() for p in trainer.motor.operator.parameters()]
    with pytest.raises(RecomputeMismatchError, match=rf"checkpoint={checkpoint!r}.*recompute of step \d+"):
        trainer.train_episode(0)
    assert all(torch.equal(p, w) for p, w in zip(trainer.motor.operator.parameters(), weights))


def test_disable_restores_a_memory_engine():
    stock, trainer = make_trainer("convlstm"), make_trainer("convlstm")
    engine_step = trainer.motor.evolve_step
    blocks_before = [type(m) for m in trainer.motor.operator.modules()]
    qca_lowmem.enable(trainer)
    assert trainer.motor.evolve_step == engine_step  # the fused step only while an episode runs
    assert trainer._qca_lowmem_state.undo.installed_step is not None
    lowmem_first = run(trainer, range(2))
    stock_first = run(stock, range(2))
    assert_same_run(lowmem_first, stock_first)
    qca_lowmem.disable(trainer)
    assert [type(m) for m in trainer.motor.operator.modules()] == blocks_before
    assert "train_episode" not in vars(trainer) and "evolve_step" not in vars(trainer.motor)
    # Stock again, from the memory the lowmem episodes left: as a trainer that never changed.
    assert_same_run(run(trainer, range(2, 4), seed=5), run(stock, range(2, 4), seed=5))


def test_enable_refuses_what_the_engine_cannot_call():
    class NeedsMemory(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1).double()

        def forward(self, x, h, c):
            return self.conv(x), h, c

    def refused(trainer, match, error=TypeError, **options):
        with pytest.raises(error, match=match):
            qca_lowmem.enable(trainer, **options)
        assert "train_episode" not in vars(trainer) and "evolve_step" not in vars(trainer.motor)
        assert not any(isinstance(m, qca_lowmem.FusedConvBlock) for m in trainer.motor.operator.modules())

    refused(make_trainer("mlp", NeedsMemory()), r"NeedsMemory\.forward\(x, h, c\) cannot be called as the engine "
                                                r"calls it, operator\(x\) .*has_memory=True")
    refused(make_trainer("convlstm", make_operator("mlp", D_STATE, HIDDEN)),
            r"MLPOperator\.forward\(x\) cannot be called as the engine calls it, operator\(x, h, c\)")
    trainer = make_trainer("convlstm")
    trainer.motor.has_memory = "yes"
    refused(trainer, "motor.has_memory must be True or False, got 'yes'", ValueError)
    trainer = make_trainer("convlstm")
    del trainer.motor.state.c_state
    refused(trainer, "has_memory is True but motor.state has no c_state", ValueError)


def test_memory_model_on_an_engine_without_memory_says_so():
    trainer = make_trainer("mlp", make_operator("convlstm", D_STATE, HIDDEN))
    qca_lowmem.enable(trainer)
    with pytest.raises(TypeError, match="ConvLSTMOperator returned tuple.*needs an engine with has_memory=True"):
        trainer.train_episode(0)


def test_convlstm_step_episode_keeps_psi_and_memory_per_step():
    op = make_operator("convlstm", D_STATE, HIDDEN).float()
    step = FusedMemoryStep(SimpleNamespace(operator=op))  # no cfg: no decay
    psi0 = qca_lowmem.stock.initial_state(1, 16, D_STATE)
    memory0 = (torch.zeros(1, HIDDEN, 8, 8), torch.zeros(1, HIDDEN, 8, 8))
    psi_bytes = psi0.numel() * psi0.element_size()
    memory_bytes = 2 * memory0[0].numel() * memory0[0].element_size()

    def kept(steps):
        return saved_bytes(lambda: qca_lowmem.rollout(step, psi0, steps, carry=memory0))

    assert kept(16) - kept(6) == 10 * (psi_bytes + memory_bytes)
    assert kept(6) <= (6 + 1) * (psi_bytes + memory_bytes)  # and psi_T with the final memory, for the check


@pytest.mark.slow
def test_compiled_operator_runs_its_module(family="convlstm"):
    """As their compile_model() leaves it: motor.operator a torch.compile of the model. The fused
    step runs the module it wraps (the engine's class rule still reads the compiled one's)."""

    def compiled_trainer():
        trainer = make_trainer(family)
        trainer.motor.operator = torch.compile(trainer.motor.operator)
        return trainer

    trainer = compiled_trainer()
    qca_lowmem.enable(trainer, checkpoint="step")
    assert_same_run(run(trainer), run(compiled_trainer()), rel=1e-9)
