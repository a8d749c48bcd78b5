"""The switch stands in for the operator's code (a fused block for a ConvBlock, the fused step's probe
of its ops, a captured step's replays) only where it follows that code: a block whose call is
stock's by its code, every class torch's, qca_lowmem's or recorded. An edited block, an operator of
a class not recorded, torch's code replaced, or state such code keeps between calls: each against
the users' own run (float64), or a clear refusal naming the cause."""

import copy
import functools
import importlib.util
import itertools
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import classes_in_episodes, follow
from qca_lowmem import stock
from qca_lowmem.atheria import code_identity
from qca_lowmem.atheria.operator_code import class_unfollowed, operator_unfollowed, unfollowed_code
from qca_lowmem.atheria.state_drift import episode_drift
from qca_lowmem.examples import QC_Trainer_v4, make_config
from qca_lowmem.ops import stock_block_call
from qca_lowmem.unet import convert, input_dtype

pytestmark = pytest.mark.usefixtures("one_thread")
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def trainer_with(make_operator, steps=4):
    """A trainer on `make_operator()`, built from one seed."""
    torch.manual_seed(0)
    operator = make_operator()
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=steps, gamma=0.05, dtype=torch.complex128)
    with torch.no_grad():
        operator.outc.weight.normal_(0.0, 0.1)
    return QC_Trainer_v4(cfg, operator=operator.double(), state_object=True)


def losses(trainer, episodes=2, between=None):
    torch.manual_seed(5)
    found = []
    for episode in range(episodes):
        if between is not None and episode:
            between()
        found.append(trainer.train_episode(episode)[0])
    return found, [p.detach().clone() for p in trainer.motor.operator.parameters()]


def assert_same(actual, expected):
    (loss, weights), (stock_loss, stock_weights) = actual, expected
    assert loss == pytest.approx(stock_loss, rel=1e-12, abs=0)
    for w, s in zip(weights, stock_weights, strict=True):
        assert torch.allclose(w, s, rtol=1e-11, atol=1e-15)


def said(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "qca_lowmem"]


# ---------------------------------------------------------------- a block's call, by its code

class ScaledBlock(stock.ConvBlock):
    def forward(self, x):
        return 0.75 * self.conv_block(x)


class RenamedBlock(stock.ConvBlock):
    def forward(self, inputs):
        """Stock's call under another argument name, with a docstring."""
        return self.conv_block(inputs)


def with_blocks(cls, d_state=2, hidden=4):
    operator = stock.UNetUnitary(d_state, hidden)
    for module in operator.modules():
        if type(module) is stock.ConvBlock:
            module.__class__ = cls
    return operator


def test_a_block_is_fused_only_where_its_call_is_stocks_by_its_code():
    assert stock_block_call(stock.ConvBlock) is None and stock_block_call(RenamedBlock) is None
    assert "is not `return self.conv_block(x)`" in stock_block_call(ScaledBlock)
    wrapped = type("Wrapped", (stock.ConvBlock,), {"forward": functools.wraps(stock.ConvBlock.forward)(
        lambda self, x: self.conv_block(x))})
    called = type("Called", (stock.ConvBlock,), {"__call__": lambda self, x: 2 * nn.Module.__call__(self, x)})
    shadowed = type("Shadowed", (stock.ConvBlock,), {"conv_block": property(lambda self: nn.Identity())})
    defaulted = type("Defaulted", (stock.ConvBlock,), {"forward": lambda self, x=None: self.conv_block(x)})
    assert "is not `return self.conv_block(x)`" in stock_block_call(wrapped)
    assert stock_block_call(called) == "Called defines its own __call__"
    assert stock_block_call(shadowed) == "Shadowed defines conv_block on its class"
    assert "is not `return self.conv_block(x)`" in stock_block_call(defaulted)
    _, report = convert(with_blocks(ScaledBlock))
    assert report.converted == [] and len(report.skipped) == 6
    assert all("ScaledBlock.forward" in why for _, why in report.skipped)
    assert len(convert(with_blocks(RenamedBlock))[1].converted) == 6


def test_an_edited_block_keeps_the_users_code_and_their_result(caplog):
    """Before, a fused block stood in for any ConvBlock of stock's shape, so the edit was dropped."""
    expected = losses(trainer_with(lambda: with_blocks(ScaledBlock)))
    trainer = trainer_with(lambda: with_blocks(ScaledBlock))
    with caplog.at_level("INFO", logger="qca_lowmem"):
        qca_lowmem.enable(trainer)
    assert not any(isinstance(m, qca_lowmem.FusedConvBlock) for m in trainer.motor.operator.modules())
    assert "ScaledBlock is not code qca_lowmem follows" in said(caplog)[-1]  # neither fused nor probed
    assert_same(losses(trainer), expected)


def test_a_block_class_edited_after_enable_runs_as_written(caplog):
    """A notebook edits the block's class between episodes: its blocks are put back, said once."""
    def edited_blocks():
        return type("ConvBlock", (stock.ConvBlock,), {})

    runs = {}
    for name in ("stock", "lowmem"):
        blocks = edited_blocks()
        trainer = trainer_with(lambda: with_blocks(blocks))
        if name == "lowmem":
            qca_lowmem.enable(trainer)
        caplog.clear()
        with caplog.at_level("WARNING", logger="qca_lowmem"), classes_in_episodes(trainer) as classes:
            runs[name] = losses(trainer, 3, between=lambda b=blocks: setattr(b, "forward", ScaledBlock.forward))
    assert_same(runs["lowmem"], runs["stock"])
    fused = [sum(issubclass(cls, qca_lowmem.FusedConvBlock) for cls in episode) for episode in classes]
    assert fused[0] == 6 and fused[-1] == 0  # the edit comes after the first episode
    assert [line for line in said(caplog) if "changed since enable()" in line] == [
        "the call of ConvBlock changed since enable() (its forward (ConvBlock.forward) is not `return "
        "self.conv_block(x)`, which a fused block computes): the episodes run those 6 blocks as written, unfused"]
    assert not any(isinstance(m, qca_lowmem.FusedConvBlock) for m in trainer.motor.operator.modules())
    qca_lowmem.disable(trainer)
    assert sum(type(m) is blocks for m in trainer.motor.operator.modules()) == 6


class Described(stock.ConvBlock):
    """Their block with a method of its own (not called by its forward)."""

    def describe(self):
        return f"{self.conv_block[0].out_channels} channels"


def test_the_switch_fuses_their_blocks_in_place(fused_ops_counted):
    """While an episode runs, the very block objects, fused, of their class by isinstance and name,
    with their methods (and their class makes one as theirs does); the fused op runs. Between
    episodes and after disable(), their class exactly: a deep copy and a pickle of the operator are
    their model, as they built it (no class of qca_lowmem's), and compute what it computes."""
    trainer = trainer_with(lambda: with_blocks(Described))
    before = [m for m in trainer.motor.operator.modules() if isinstance(m, Described)]
    qca_lowmem.enable(trainer)
    now = [m for m in trainer.motor.operator.modules() if isinstance(m, Described)]
    assert len(before) == 6 and all(a is b for a, b in zip(now, before, strict=True))
    assert all(type(m) is Described for m in now) and repr(trainer.motor.operator).count("Described(") == 6
    with classes_in_episodes(trainer) as classes:
        trainer.train_episode(0)
    assert fused_ops_counted
    fused = [cls for cls in classes[0] if issubclass(cls, qca_lowmem.FusedConvBlock)]
    assert len(fused) == 6 and all(issubclass(cls, Described) and cls.__name__ == "Described" for cls in fused)
    fresh = fused[0](4, 8)  # a fresh block made from its class, as theirs makes it
    assert isinstance(fresh, Described) and fresh.describe() == "8 channels"
    assert all(type(m) is Described for m in before)
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        for copied in (copy.deepcopy(trainer.motor.operator), pickle.loads(pickle.dumps(trainer.motor.operator))):
            assert [type(m) for m in copied.modules()] == [type(m) for m in trainer.motor.operator.modules()]
            assert not any(isinstance(m, qca_lowmem.FusedConvBlock) for m in copied.modules())
            assert torch.equal(copied(x), trainer.motor.operator(x))
    qca_lowmem.disable(trainer)
    assert all(type(m) is Described for m in before) and not any(
        isinstance(m, qca_lowmem.FusedConvBlock) for m in trainer.motor.operator.modules())


def test_a_block_class_edited_after_an_episode_is_called_as_written_outside_episodes_too():
    """Their inference between episodes (a call of the operator, or of the engine's step) after a
    notebook edit of the block's class runs the edited blocks, as their model does once disable()
    puts the blocks back; before, the fused blocks, proved only at an episode's start, ran unedited."""
    blocks = type("ConvBlock", (stock.ConvBlock,), {})
    trainer = qca_lowmem.enable(trainer_with(lambda: with_blocks(blocks)))
    trainer.train_episode(0)
    blocks.forward = ScaledBlock.forward
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    psi = stock.initial_state(1, 8, 2, dtype=torch.complex128)
    with torch.no_grad():
        called, stepped = trainer.motor.operator(x), trainer.motor.evolve_step(psi)
        qca_lowmem.disable(trainer)
        assert sum(type(m) is blocks for m in trainer.motor.operator.modules()) == 6
        assert torch.equal(called, trainer.motor.operator(x))
        torch.testing.assert_close(stepped, trainer.motor.evolve_step(psi), rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------- the operator's classes

class Counted(stock.UNetUnitary):
    """Every third call scaled, by a counter kept outside its modules."""

    calls = itertools.count(1)

    def forward(self, x):
        return super().forward(x) * (1.25 if next(Counted.calls) % 3 == 0 else 1.0)


def test_an_operator_of_a_class_not_recorded_is_not_called_by_the_probe(caplog):
    """enable()'s probe of the operator's ops called it once more than stock does: with a counter
    outside its modules, every later call was out of step with stock's (the loss 0.5% off).
    Now only code qca_lowmem follows is probed; this one keeps the engine's own step."""
    runs = {}
    for name in ("stock", "lowmem"):
        Counted.calls = itertools.count(1)
        trainer = trainer_with(lambda: Counted(2, 4))
        if name == "lowmem":
            with caplog.at_level("INFO", logger="qca_lowmem"):
                qca_lowmem.enable(trainer, checkpoint="none")
        runs[name] = losses(trainer, 3)
    assert_same(runs["lowmem"], runs["stock"])
    assert re.search(r"the engine's own step and blocks: Counted \(\S*Counted is not code qca_lowmem follows\), so it "
                     r"is not called to check its ops \(a call could move state it keeps outside its tensors\)$",
                     said(caplog)[-1])


def test_a_recorded_class_is_followed_and_a_change_to_it_is_not(monkeypatch):
    operator = Counted(2, 4)
    assert "Counted is not code qca_lowmem follows" in operator_unfollowed(operator)
    follow(monkeypatch, Counted)
    assert operator_unfollowed(operator) is None
    digest = code_identity.class_digest(Counted)
    monkeypatch.setattr(Counted, "extra_repr", lambda self: "edited")  # any code a call could run
    assert code_identity.class_digest(Counted) != digest and operator_unfollowed(operator) is not None
    monkeypatch.undo()
    follow(monkeypatch, Counted)
    monkeypatch.setattr(Counted, "__init__", lambda self, *a: None)  # construction: never in a call
    assert code_identity.class_digest(Counted) == digest


def test_torch_code_replaced_is_not_followed(monkeypatch):
    operator = stock.UNetUnitary(2, 4)
    convert(operator)
    assert operator_unfollowed(operator) is None
    monkeypatch.setattr(nn.GroupNorm, "forward", lambda self, x: x)
    assert operator_unfollowed(operator) == "UNetUnitary.inc.conv_block.1 (GroupNorm.forward is not torch's own code)"
    monkeypatch.undo()
    assert operator_unfollowed(operator) is None
    subclass = type("Norm", (nn.GroupNorm,), {"extra_repr": lambda self: "theirs"})  # any code of the user's
    assert "test_operator_code.Norm is not code qca_lowmem follows" in class_unfollowed(subclass)
    assert class_unfollowed(type("Norm", (nn.GroupNorm,), {})) is None  # nothing of its own: GroupNorm's


# ---------------------------------------------------------------- state such code keeps

def counting(where):
    """A U-Net whose calls move state kept `where`, its output unchanged by it."""
    log = []

    class UNetUnitary(stock.UNetUnitary):
        def forward(self, x):
            if where == "module":
                self.calls = getattr(self, "calls", 0) + 1
            elif where == "closure":
                log.append(None)
            else:
                STATS["calls"] += 1
            return super().forward(x)

    return UNetUnitary(2, 4)


STATS = {"calls": 0}


@pytest.mark.parametrize("where,named", [("module", "UNetUnitary.calls"), ("closure", r"\S*UNetUnitary\.forward's log"),
                                         ("global", r"\S*test_operator_code\.STATS\['calls'\]")])
def test_recomputes_that_move_the_operators_state_refuse_the_episode(where, named):
    """The recomputes call the operator again where stock's episode does not: a counter stock
    would leave at T calls an episode would be at 2T, and a later episode would start from another
    state than stock's. The first episode is refused, naming the state; checkpoint='none' trains."""
    trainer = qca_lowmem.enable(trainer_with(lambda: counting(where)))
    with pytest.raises(RuntimeError, match=f"qca_lowmem: {named} changed during the backward"):
        trainer.train_episode(0)
    stock_run = losses(trainer_with(lambda: counting(where)))
    assert_same(losses(qca_lowmem.enable(trainer_with(lambda: counting(where)), checkpoint="none")), stock_run)


def state_drift(operator):
    return episode_drift([("the operator", *unfollowed_code(operator))])


def test_followed_code_is_not_read_for_drift():
    operator = stock.UNetUnitary(2, 4)
    convert(operator)
    assert state_drift(operator) is None
    assert state_drift(counting("module")) is not None


def test_a_class_defining_nothing_a_call_runs_is_followed_and_a_callable_set_on_a_module_is_not():
    """An empty subclass runs its bases' code alone; a function set on a module's instance is code
    the followed classes may call in place of a submodule, and a closure of it may keep state."""
    empty = type("Renamed", (stock.UNetUnitary,), {"__doc__": "nothing else"})
    assert operator_unfollowed(empty(2, 4)) is None
    operator = stock.UNetUnitary(2, 4)
    calls = []
    operator.inc.log = lambda: calls.append(None)
    assert operator_unfollowed(operator) == "UNetUnitary (ConvBlock.log (function) is set on the instance)"
    drift = state_drift(operator)
    calls.append(None)
    with pytest.raises(RuntimeError, match=r"\S*<lambda>'s calls changed during the backward"):
        drift.check()


def test_an_operator_replaced_after_enable_keeps_the_engines_step(caplog):
    """The fused step was proved on the operator enable() probed: another module set as
    motor.operator runs the engine's own step, said once, and trains as stock does."""
    runs = {}
    for name in ("stock", "lowmem"):
        trainer = trainer_with(lambda: stock.UNetUnitary(2, 4))
        if name == "lowmem":
            qca_lowmem.enable(trainer)

        def replace(t=trainer):
            torch.manual_seed(3)
            t.motor.operator = stock.UNetUnitary(2, 4).double()
            t.optimizer.add_param_group({"params": list(t.motor.operator.parameters())})
        caplog.clear()
        with caplog.at_level("WARNING", logger="qca_lowmem"):
            runs[name] = losses(trainer, 3, between=replace)
    assert runs["lowmem"][0] == pytest.approx(runs["stock"][0], rel=1e-12, abs=0)
    assert said(caplog) == ["motor.operator (UNetUnitary) is not the module enable() checked: the episodes run the "
                            "engine's own step while it is there"]


ATHERIA = os.environ.get("ATHERIA_CHECKOUT")


@pytest.mark.skipif(not ATHERIA, reason="their checkout is not at hand (set ATHERIA_CHECKOUT)")
def test_their_model_families_are_followed_on_this_python():
    """Their families of plain torch layers, as their files at the commit define them, are recorded
    for this Python (scripts/record_digests.py), before and after their blocks are fused; the two
    with stock UNetUnitary's forward and GroupNorm blocks get their input packed in autocast's dtype."""
    spec = importlib.util.spec_from_file_location("record_digests", SCRIPTS / "record_digests.py")
    record_digests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record_digests)
    before = set(sys.modules)
    try:
        for path, classes in record_digests.THEIR_MODULES.items():
            for name in classes:
                cls = getattr(record_digests.their_model_file(ATHERIA, path), name)
                assert code_identity.followed_class(cls) is not None, f"{path} {name}"
                if name == "RMSNorm2d":
                    continue
                operator = cls(d_state=2, hidden_channels=8)
                assert operator_unfollowed(operator) is None, name
                convert(operator)
                assert operator_unfollowed(operator) is None, name
                with torch.autocast("cpu", dtype=torch.bfloat16):  # their forward proved by its code
                    packs = input_dtype(operator, stock.initial_state(1, 8, 2))
                assert (packs == torch.bfloat16) == (name in ("UNet", "UNetUnitary")), name
    finally:
        for name in set(sys.modules) - before:  # their src and src.models, as the script made them
            del sys.modules[name]
