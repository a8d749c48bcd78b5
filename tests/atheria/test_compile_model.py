"""The engine's compile_model() (which rebinds motor.operator to torch.compile(operator)) is seen
whether it comes before or after enable(): the installed step reads the engine's operator at each
step and runs the module it wraps, uncompiled (a compiled graph would run without grad in the
forward and with grad in the recompute, which can round differently), says so once, and the
results equal stock compiled."""

import functools

import pytest
import torch

import qca_lowmem
from fixtures import researcher_config
from qca_lowmem import stock
from qca_lowmem.examples.qc_trainer_v4 import Motor, QC_Trainer_v4, make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # torch.compile runs

EPISODES = range(2)
compiled_calls = []


def counting_backend(graph_module, example_inputs):
    """A torch.compile backend that runs the captured graph as it is and counts its runs."""

    def run(*args):
        compiled_calls.append(1)
        return graph_module.forward(*args)

    return run


class CompilingMotor(Motor):
    """The users' engine's compile_model(): motor.operator becomes the compiled module."""

    def compile_model(self):
        self.operator = torch.compile(self.operator, backend=counting_backend)


def make_trainer():
    torch.manual_seed(1234)
    trainer = QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=8, qca_steps=4, gamma=0.05, dtype=torch.complex128),
                            state_object=True)
    trainer.motor.__class__ = CompilingMotor
    trainer.motor.operator.double()
    with torch.no_grad():
        trainer.motor.operator.outc.weight.normal_(0.0, 0.05)
    return trainer


def run(trainer):
    torch._dynamo.reset()
    compiled_calls.clear()
    torch.manual_seed(99)
    losses = [trainer.train_episode(e)[0] for e in EPISODES]
    return losses, [p.detach().clone() for p in trainer.model_operator.parameters()], len(compiled_calls)


def relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()



def assert_runs_as_compiled_stock(trainer, stock_trainer):
    """Both trainers' episodes run the compiled graphs as often, to the same losses and weights, bit for bit."""
    (losses, weights, calls), (stock_losses, stock_weights, stock_calls) = run(trainer), run(stock_trainer)
    assert calls == stock_calls > 0 and losses == stock_losses
    assert all(torch.equal(w, s) for w, s in zip(weights, stock_weights))

@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
@pytest.mark.parametrize("order", ["compile-then-enable", "enable-then-compile"])
def test_compile_before_or_after_enable_equals_stock_compiled(order, checkpoint, slots, caplog):
    caplog.set_level("INFO", logger="qca_lowmem")
    stock = make_trainer()
    stock.motor.compile_model()
    stock_losses, stock_weights, stock_calls = run(stock)
    assert stock_calls > 0

    trainer = make_trainer()
    if order == "compile-then-enable":
        trainer.motor.compile_model()
    qca_lowmem.enable(trainer, checkpoint=checkpoint, slots=slots)
    if order == "enable-then-compile":
        trainer.motor.compile_model()
    losses, weights, calls = run(trainer)
    assert calls == 0, "a compiled frame ran in the low-memory episodes"
    assert sum("module it wraps, uncompiled" in r.message or "module uncompiled" in r.message
               for r in caplog.records) == 1
    assert losses == pytest.approx(stock_losses, rel=1e-10, abs=0)
    assert max(relative(w, s) for w, s in zip(weights, stock_weights)) <= 1e-9


def test_a_compiled_operator_is_not_the_uncompiled_one():
    """The comparison above can fail: the engine's step on the compiled operator is not the
    uncompiled step (stock's rule reads the operator's class name, which compile changes)."""
    compiled, plain = make_trainer(), make_trainer()
    compiled.motor.compile_model()
    assert relative(run(compiled)[1][0], run(plain)[1][0]) > 1e-6


@pytest.mark.parametrize("checkpoint", ["step", "none"])
@pytest.mark.parametrize("wrap", ["torch.compile", "functools.wraps"])
def test_a_wrapped_train_episode_runs_the_lowmem_episode_eagerly(checkpoint, wrap, caplog):
    """torch.compile(trainer.train_episode) of an enabled trainer, or a decorator of theirs around
    it: the low-memory episode runs inside (it once ran their episode as written, at stock's memory,
    taking the wrapper for an edit). Its rollout and reverse pass keep Python state a trace would
    lose (dynamo tracing into them crashed), so it runs as the eager episode does, to the bit."""
    eager, wrapped = make_trainer(), make_trainer()
    for trainer in (eager, wrapped):
        qca_lowmem.enable(trainer, checkpoint=checkpoint)
    episode, timed = wrapped.train_episode, []
    if wrap == "torch.compile":
        wrapped.train_episode = torch.compile(episode, backend=counting_backend)
    else:
        @functools.wraps(episode)
        def timing(episode_num):
            timed.append(episode_num)
            return episode(episode_num)
        wrapped.train_episode = timing
    eager_losses, eager_weights, _ = run(eager)
    with caplog.at_level("WARNING", logger="qca_lowmem"):
        losses, weights, calls = run(wrapped)
    assert not [r for r in caplog.records if "not the stock episode recognised" in r.getMessage()]
    assert calls == 0 and losses == eager_losses and timed == ([] if wrap == "torch.compile" else list(EPISODES))
    assert all(torch.equal(w, e) for w, e in zip(weights, eager_weights))


def with_dropout(trainer):
    """torch's Dropout appended to the operator's first block (its module's, when compiled)."""
    getattr(trainer.motor.operator, "_orig_mod", trainer.motor.operator).inc.conv_block.append(torch.nn.Dropout(0.3))
    return trainer


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2), ("auto", None)])
def test_a_compiled_operator_that_draws_is_refused_where_the_episode_recomputes(checkpoint, slots):
    """Its compiled code draws other random numbers than its module run eagerly, which the fused
    step runs (torch's inductor, as their pipeline compiles); the engine's own step would run it
    as two compiled graphs. Refused naming the layer; checkpoint='none' runs the engine's own step,
    the compiled one, as stock does."""
    trainer = with_dropout(make_trainer())
    trainer.motor.compile_model()
    options = dict(slots=slots) if slots else dict(budget=0) if checkpoint == "auto" else {}
    with pytest.raises(TypeError, match=r"inc\.conv_block\.6 \(Dropout\) draws random numbers, which OptimizedModule"):
        qca_lowmem.enable(trainer, checkpoint=checkpoint, **options)
    assert not hasattr(trainer, "_qca_lowmem_state")


def test_a_compiled_operator_that_draws_takes_the_engines_own_step_without_recompute(caplog):
    caplog.set_level("INFO", logger="qca_lowmem")
    stock, trainer = with_dropout(make_trainer()), with_dropout(make_trainer())
    for each in (stock, trainer):
        each.motor.compile_model()
    qca_lowmem.enable(trainer, checkpoint="none")
    assert "the engine's own step and blocks: " in caplog.records[-1].getMessage()
    assert_runs_as_compiled_stock(trainer, stock)


def test_a_draw_put_in_a_compiled_operator_after_enable_is_refused_by_the_recomputing_episode(caplog):
    """The episode after it would fall back to the engine's own step, the compiled graphs twice."""
    trainer = make_trainer()
    trainer.motor.compile_model()
    qca_lowmem.enable(trainer, checkpoint="step")
    torch._dynamo.reset()
    trainer.train_episode(0)
    with_dropout(trainer)
    weights = [p.detach().clone() for p in trainer.model_operator.parameters()]
    with pytest.raises(RuntimeError, match=r"^qca_lowmem: the episode runs the engine's own step now, on "
                                           r"OptimizedModule .* checkpoint='none'"):
        trainer.train_episode(1)
    assert all(torch.equal(p, w) for p, w in zip(trainer.model_operator.parameters(), weights))  # nothing trained
    assert any("(Dropout) draws random numbers" in r.getMessage() for r in caplog.records)


def their_forward(self, x):
    return stock.UNetUnitary.forward(self, x)


def edited(trainer):
    """The operator of a class of the researcher's (its forward code qca_lowmem does not follow):
    enable() keeps the engine's own step."""
    trainer.motor.operator.__class__ = type("UNetUnitary", (stock.UNetUnitary,), {"forward": their_forward})
    return trainer


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_an_operator_on_the_engines_own_step_compiled_after_enable_is_refused_where_the_episode_recomputes(
        checkpoint, slots, caplog):
    """The step enable() kept for it would run the compiled operator without grad and again in the
    backward (no compiled frame ran: the module it wraps, eagerly, not stock's compiled graph)."""
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = edited(make_trainer())
    qca_lowmem.enable(trainer, checkpoint=checkpoint, slots=slots)
    assert "the engine's own step and blocks: " in caplog.records[-1].getMessage()
    trainer.motor.compile_model()
    weights = [p.detach().clone() for p in trainer.model_operator.parameters()]
    with pytest.raises(RuntimeError, match=r"^qca_lowmem: the episode runs the engine's own step now, on OptimizedModule "
                                           r"\(torch.compile of UNetUnitary\): .* checkpoint='none'"):
        run(trainer)
    assert compiled_calls == [] and all(torch.equal(p, w) for p, w in zip(trainer.model_operator.parameters(), weights))


def test_an_operator_on_the_engines_own_step_compiled_after_enable_trains_as_stock_without_recompute():
    stock, trainer = edited(make_trainer()), edited(make_trainer())
    qca_lowmem.enable(trainer, checkpoint="none")
    for each in (stock, trainer):
        each.motor.compile_model()
    assert_runs_as_compiled_stock(trainer, stock)


def block_compiled(trainer):
    """One of the operator's blocks torch.compile'd in place, as a researcher compiles a hot layer."""
    trainer.motor.operator.bot = torch.compile(trainer.motor.operator.bot, backend=counting_backend)
    return trainer


def test_a_compiled_layer_of_the_operator_is_refused_where_the_episode_recomputes():
    """A compiled layer keeps the engine's own step (code not followed), which a recomputing episode
    would not run as stock's compiled graph: refused at enable() and at an episode after a compile."""
    trainer = block_compiled(make_trainer())
    with pytest.raises(TypeError, match=r"^enable\(\): UNetUnitary\.bot \(torch.compile of ConvBlock\) keeps the engine's "
                                        r"own step; set motor\.operator\.bot to the module it wraps "
                                        r"\(motor\.operator\.bot\._orig_mod\)\n"):
        qca_lowmem.enable(trainer, checkpoint="step")
    assert not hasattr(trainer, "_qca_lowmem_state")
    trainer = make_trainer()
    qca_lowmem.enable(trainer, checkpoint="revolve", slots=2)
    block_compiled(trainer)
    with pytest.raises(RuntimeError, match=r"^qca_lowmem: the episode runs the engine's own step now, on UNetUnitary\.bot "
                                           r"\(torch.compile of ConvBlock\): .*\(motor\.operator\.bot\._orig_mod\)$"):
        run(trainer)
    assert compiled_calls == []


def test_a_compiled_layer_of_the_operator_trains_as_stock_without_recompute():
    stock, trainer = block_compiled(make_trainer()), block_compiled(make_trainer())
    qca_lowmem.enable(trainer, checkpoint="none")
    assert_runs_as_compiled_stock(trainer, stock)


@torch.compile(backend=counting_backend)
def compiled_tanh(x):
    return torch.tanh(x)


class GlobalCompiled(stock.UNetUnitary):
    """Their model calling a torch.compile'd function of their module."""

    def forward(self, x):
        return compiled_tanh(stock.UNetUnitary.forward(self, x))


class MethodCompiled(stock.UNetUnitary):
    """Their model whose forward is decorated with torch.compile."""

    @torch.compile(backend=counting_backend)
    def forward(self, x):
        return torch.tanh(stock.UNetUnitary.forward(self, x))


class ModuleCompiled(stock.UNetUnitary):
    """Their model calling a torch.compile'd function through a module of theirs (`config.ACTIVATION`)."""

    def forward(self, x):
        return researcher_config.ACTIVATION(stock.UNetUnitary.forward(self, x))


@pytest.fixture
def compiled_on_their_module(monkeypatch):
    monkeypatch.setattr(researcher_config, "ACTIVATION", compiled_tanh)


@pytest.mark.usefixtures("compiled_on_their_module")
@pytest.mark.parametrize("cls,named", [(GlobalCompiled, r"test_compile_model\.compiled_tanh"),
                                       (MethodCompiled, r"MethodCompiled\.forward"),
                                       (ModuleCompiled, r"fixtures\.researcher_config\.ACTIVATION")])
def test_a_compiled_function_their_code_calls_is_refused_where_the_episode_recomputes(cls, named):
    trainer = make_trainer()
    trainer.motor.operator.__class__ = cls
    with pytest.raises(TypeError, match=rf"^enable\(\): {named} \(a torch.compile'd function {cls.__name__}'s code calls\) "
                                        rf"keeps the engine's own step; call {named} uncompiled"):
        qca_lowmem.enable(trainer, checkpoint="step")
    assert not hasattr(trainer, "_qca_lowmem_state")


@pytest.mark.usefixtures("compiled_on_their_module")
@pytest.mark.parametrize("cls", [GlobalCompiled, MethodCompiled, ModuleCompiled])
def test_a_compiled_function_their_code_calls_trains_as_stock_without_recompute(cls):
    stock_trainer, trainer = make_trainer(), make_trainer()
    for each in (stock_trainer, trainer):
        each.motor.operator.__class__ = cls
    qca_lowmem.enable(trainer, checkpoint="none")
    assert_runs_as_compiled_stock(trainer, stock_trainer)
