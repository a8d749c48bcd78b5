"""The switch replaces the users' code only where it has proved the replacement identical, and
proves it again wherever what it rests on can change: the code that runs (not its source text),
values their code reads at every step, a step that changes from call to call, the ops of an
operator, the generators its probes touch, the side state their plots read. Each case as a
researcher writes it, against their own code's run (or a clear refusal naming the cause)."""

import functools
import importlib
import inspect
import random
import sys

import numpy
import pytest
import torch

import qca_lowmem
import qca_lowmem.atheria.code_identity
from fixtures.model_families import make_operator
from helpers import follow
from qca_lowmem.atheria.discontinuity import discontinuity
from qca_lowmem.atheria.engine_step import FusedEngineStep
from qca_lowmem.atheria.mask_free_noise import follows
from qca_lowmem.examples import qc_trainer_v4 as stand_in
from qca_lowmem.examples.qc_trainer_v4 import Motor, QC_Trainer_v4, make_config
from qca_lowmem.ops.qca_step import qca_pack
from qca_lowmem.recompute.check import RecomputeMismatchError
from qca_lowmem.stock import NoiseInjector, pack, update

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer_of(cls=QC_Trainer_v4, engine=None, gamma=0.05, steps=4, **options):
    torch.manual_seed(0)
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=steps, gamma=gamma, dtype=torch.complex128)
    trainer = cls(cfg, operator=qca_lowmem.stock.UNetUnitary(2, 4).double(), state_object=True, **options)
    if engine is not None:
        trainer.motor = engine(trainer.motor.operator, cfg, trainer.motor.state)
    trainer.motor.state._reset_state_random()
    return trainer


def run(trainer, episodes=range(2), between=None):
    """Episodes from one seed; `between(trainer, episode)` before each."""
    torch.manual_seed(5)
    results = []
    for episode in episodes:
        if between is not None:
            between(trainer, episode)
        loss, _, psi = trainer.train_episode(episode)
        results.append((loss, psi, [p.detach().clone() for p in trainer.motor.operator.parameters()]))
    return results


def assert_same(actual, expected, rel=1e-10):
    for (loss, psi, weights), (stock_loss, stock_psi, stock_weights) in zip(actual, expected, strict=True):
        assert loss == pytest.approx(stock_loss, rel=rel, abs=0)
        assert ((psi - stock_psi).abs().max() / stock_psi.abs().max()).item() <= rel
        for w, s in zip(weights, stock_weights, strict=True):
            assert ((w - s).abs().max() / s.abs().max().clamp_min(1e-30)).item() <= rel


def enabled(trainer, caplog=None, **options):
    if caplog is None:
        return qca_lowmem.enable(trainer, **options)
    with caplog.at_level("INFO", logger="qca_lowmem"):
        return qca_lowmem.enable(trainer, **options)


# 1. The code that runs, not its source text.

class WarmedUp(QC_Trainer_v4):
    """A learning-rate warm-up around the stock episode, in a wrapper that keeps its name."""

    @functools.wraps(QC_Trainer_v4.train_episode)
    def train_episode(self, episode_num):
        for group in self.optimizer.param_groups:
            group["lr"] = 1e-4 * min(1.0, (episode_num + 1) / 10)
        return super().train_episode(episode_num)


def warm_up(function):
    @functools.wraps(function)
    def wrapper(self, episode_num):
        self.warmed = episode_num
        return function(self, episode_num)
    return wrapper


def test_a_wrapped_episode_is_refused_naming_the_wrapper():
    """functools.wraps copies the name and __wrapped__ (which inspect.getsource follows): the code differs."""
    with pytest.raises(TypeError, match=r"WarmedUp.train_episode is .*QC_Trainer_v4.train_episode \(its class's, a "
                                        r"wrapper \(it has __wrapped__\)\), not a stock episode qca_lowmem follows"):
        qca_lowmem.enable(trainer_of(WarmedUp))
    on_class = type("OnClass", (QC_Trainer_v4,), {"train_episode": warm_up(QC_Trainer_v4.train_episode)})
    with pytest.raises(TypeError, match=r"OnClass.train_episode .*a wrapper"):
        qca_lowmem.enable(trainer_of(on_class))


def test_an_episode_wrapped_after_enable_runs_as_written(caplog):
    """Checked at every episode: a wrapper set on the class after enable() runs, with one line."""
    cls = type("Later", (QC_Trainer_v4,), {})
    trainer = trainer_of(cls)
    enabled(trainer)
    cls.train_episode = warm_up(QC_Trainer_v4.train_episode)
    with caplog.at_level("WARNING", logger="qca_lowmem"):
        trainer.train_episode(0)
        trainer.train_episode(1)
    assert trainer.warmed == 1
    assert caplog.text.count("Later.train_episode now runs") == 1


def module_from(tmp_path, name, text):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        return importlib.import_module(name), path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_an_edit_imported_then_restored_on_disk_is_refused(tmp_path):
    """The module runs the edited code; its file, restored (git checkout), reads as stock."""
    source = inspect.getsource(stand_in)
    same, _ = module_from(tmp_path, "copied_trainer", source)
    enabled(trainer_of(same.QC_Trainer_v4))  # the same code from another file is the same code
    edit = "torch.nn.utils.clip_grad_norm_(self.model_operator.parameters(), 1.0)"
    assert source.count(edit) == 1
    edited, path = module_from(tmp_path, "edited_trainer", source.replace(edit, edit.replace("1.0", "0.01")))
    path.write_text(source)
    assert "1.0)" in inspect.getsource(edited.QC_Trainer_v4.train_episode)  # what a source digest reads
    with pytest.raises(TypeError, match=r"QC_Trainer_v4.train_episode is edited_trainer.QC_Trainer_v4.train_episode "
                                        r"\(its class's\), not a stock episode"):
        qca_lowmem.enable(trainer_of(edited.QC_Trainer_v4))


def test_a_global_the_episode_calls_rebound_is_another_episode(monkeypatch):
    monkeypatch.setattr(stand_in, "noise_step", lambda injector, psi, rate: psi)
    with pytest.raises(TypeError, match="not a stock episode qca_lowmem follows"):
        qca_lowmem.enable(trainer_of())


class WrappedInjector(NoiseInjector):
    @functools.wraps(NoiseInjector.apply_phase_flip)
    def apply_phase_flip(self, psi, rate=0.01):
        return NoiseInjector.apply_phase_flip(self, psi, 2 * rate)


def test_the_mask_free_noise_decides_by_the_same_identity():
    assert follows(NoiseInjector("cpu"))
    assert not follows(WrappedInjector("cpu"))
    changed = NoiseInjector("cpu")
    changed.apply_bit_flip = functools.partial(NoiseInjector.apply_bit_flip, changed)
    assert not follows(changed)


TORCH_PATCHES = {  # a researcher's edit of a torch function their step or their blocks call
    "torch.complex": (torch, "complex", lambda own: lambda real, imag, **kw: own(real, -imag, **kw)),
    "Tensor.permute": (torch.Tensor, "permute", lambda own: lambda self, *dims: own(self, *dims) * 1.1),
    "Tensor.__getitem__": (torch.Tensor, "__getitem__", lambda own: lambda self, index: own(self, index) * 1.1),
    "torch.group_norm": (torch, "group_norm", lambda own: lambda *args, **kw: own(*args, **kw) * 1.1),
}


@pytest.mark.parametrize("patched", TORCH_PATCHES)
def test_a_torch_function_replaced_between_episodes_runs_their_code(patched, monkeypatch, caplog):
    """The fused step and blocks compute what torch's functions compute: one replaced after
    enable() (`torch.complex = ...`) changes stock's episodes, so theirs run, said in one line."""
    owner, name, patch = TORCH_PATCHES[patched]
    own = getattr(owner, name)

    def between(trainer, episode):
        if episode == 1:
            monkeypatch.setattr(owner, name, patch(own))
    results = []
    for enable in (False, True):
        trainer = trainer_of()
        if enable:
            enabled(trainer, checkpoint="step")
        with caplog.at_level("WARNING", logger="qca_lowmem"):
            results.append(run(trainer, range(3), between))
        monkeypatch.undo()
    assert_same(results[1], results[0])
    assert results[0][2][0] != pytest.approx(run(trainer_of(), range(3))[2][0], rel=1e-9)  # the patch tells
    if name != "group_norm":
        assert f"{patched} is not torch's since qca_lowmem was imported" in caplog.text


# 2. Values their engine reads at every step.

def set_gamma(value):
    def between(trainer, episode):
        trainer.cfg.GAMMA_DECAY = value if episode > 0 else 0.05
    return between


def test_gamma_decay_changed_between_episodes_is_read_as_the_engine_reads_it():
    trainer, stock = trainer_of(), trainer_of()
    enabled(trainer)
    assert_same(run(trainer, range(3), set_gamma(0.3)), run(stock, range(3), set_gamma(0.3)))


class GammaAtStep(torch.nn.Module):
    """A forward hook that changes GAMMA_DECAY after the operator's second call of an episode."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.calls = cfg, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == 2:
            self.cfg.GAMMA_DECAY = 0.4


def calling_after_forward(operator, after):
    """`operator` of a class of its own whose forward calls `after` (a hook would keep the engine's own step)."""
    class UNetUnitary(type(operator)):
        def forward(self, x):
            out = super().forward(x)
            after(self, (x,), out)
            return out
    operator.__class__ = UNetUnitary
    return UNetUnitary


@pytest.mark.parametrize("checkpoint", ["none", "step"])
def test_gamma_decay_changed_during_an_episode(checkpoint, monkeypatch):
    """checkpoint="none" steps as the engine does; a recomputing episode refuses, naming it."""
    trainer, stock = trainer_of(), trainer_of()
    enabled(trainer, checkpoint=checkpoint, fused_blocks=False)
    for t in (trainer, stock):  # after enable(), whose probe would call it; recorded, so the fused step runs it
        follow(monkeypatch, calling_after_forward(t.motor.operator, GammaAtStep(t.cfg)))
    if checkpoint == "none":
        assert_same(run(trainer, range(1)), run(stock, range(1)))
    else:
        with pytest.raises(RuntimeError, match=r"GAMMA_DECAY changed during the episode, from 0.05 to 0.4"):
            trainer.train_episode(0)
        trainer.motor.evolve_step(trainer.motor.state.psi)  # outside an episode the step reads it live again


# 3. A step decided by its code, not by one probe call.

class EveryThirdCall(Motor):
    """The Cartesian step, but every third call skips the decay."""

    calls = 0

    def evolve_step(self, psi):
        self.calls += 1
        return update(psi, self.operator(pack(psi)), 0.0 if self.calls % 3 == 0 else self.cfg.GAMMA_DECAY)


def test_a_step_that_differs_every_third_call_runs_as_the_engines_own(caplog):
    trainer, stock = trainer_of(engine=EveryThirdCall), trainer_of(engine=EveryThirdCall)
    enabled(trainer, caplog, checkpoint="none")
    assert "EveryThirdCall.evolve_step is not, by its code, a Cartesian engine step" in caplog.text
    assert_same(run(trainer), run(stock))
    recomputed = trainer_of(engine=EveryThirdCall, steps=5)
    enabled(recomputed)  # its own step, recomputed, steps otherwise (step 4 is call 6): refused at the backward
    with pytest.raises(RecomputeMismatchError):
        recomputed.train_episode(0)


def test_an_engine_step_changed_after_enable_runs_as_the_engines_own(caplog):
    engine = type("Later", (Motor,), {})
    trainer, stock = trainer_of(engine=engine, steps=5), trainer_of(engine=engine, steps=5)
    enabled(trainer)
    engine.evolve_step = EveryThirdCall.evolve_step
    engine.calls = 0
    with caplog.at_level("WARNING", logger="qca_lowmem"):
        with pytest.raises(RecomputeMismatchError):
            trainer.train_episode(0)
    assert "Later's step changed since enable()" in caplog.text
    engine.evolve_step = lambda self, psi: update(psi, self.operator(pack(psi)), 0.1)
    assert_same(run(trainer), run(stock))



def test_a_wrapper_set_on_the_engine_after_enable_runs_their_step_named(caplog):
    """Between episodes the engine holds its own step, so a wrapper set then wraps theirs: the
    episodes run it (the fused step is not put over it), said naming it, stock's results."""
    trainer, stock = trainer_of(steps=5), trainer_of(steps=5)
    enabled(trainer)
    for wrapped in (trainer, stock):
        own = wrapped.motor.evolve_step
        wrapped.motor.evolve_step = functools.wraps(own)(lambda psi, own=own: own(psi))
    with caplog.at_level("WARNING", logger="qca_lowmem"):
        assert_same(run(trainer), run(stock))
    assert "motor.evolve_step set to Motor.evolve_step" in caplog.text
    assert not isinstance(vars(trainer.motor)["evolve_step"], FusedEngineStep)

# 4. An allowlist of ops, generators left as found.

def operator_of(forward):
    class Quantised(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return forward(self.conv(x))
    return Quantised()


QUANTISING = {
    "where": (lambda y: torch.where(y > 0, y, 0.5 * y), "aten::gt"),
    "masked_fill": (lambda y: y.masked_fill(y.abs() < 0.1, 0.0), "aten::lt"),
    "int cast": (lambda y: (y * 8).to(torch.int32).to(y.dtype) / 8, "aten::_to_copy to torch.int32"),
    "floor_divide": (lambda y: torch.floor_divide(y, 0.125) * 0.125, "aten::floor_divide"),
    "remainder": (lambda y: y - torch.remainder(y, 0.125), "aten::remainder"),
    "argmax one_hot": (lambda y: torch.nn.functional.one_hot(y.argmax(1), 4).permute(0, 3, 1, 2).to(y.dtype) * y,
                       "aten::argmax"),
    "fake_quantize": (lambda y: torch.fake_quantize_per_tensor_affine(y, 0.1, 0, -128, 127),
                      "aten::fake_quantize_per_tensor_affine"),
}


@pytest.mark.parametrize("name", sorted(QUANTISING))
def test_an_operator_not_shown_continuous_keeps_the_engines_step(name, caplog, monkeypatch):
    forward, op = QUANTISING[name]
    x = qca_pack(torch.randn(1, 8, 8, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    found = [discontinuity(operator_of(forward), x, memory=False) for _ in range(2)]
    assert found[0] == found[1] and found[0].startswith(op), found
    torch.manual_seed(0)
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=3)
    trainer = QC_Trainer_v4(cfg, operator=operator_of(forward))
    follow(monkeypatch, type(trainer.motor.operator))  # recorded: enable() may call it to find its ops
    enabled(trainer, caplog)
    assert f"the engine's own step and blocks: Quantised's output jumps with its input ({op}" in caplog.text
    assert "evolve_step" not in vars(trainer.motor)


def test_the_probes_leave_every_generator_as_found():
    def drawing(y):
        return y * (1 + 0 * (random.random() + numpy.random.random() + torch.rand(()).item()))
    operator = operator_of(drawing)
    x = qca_pack(torch.randn(1, 8, 8, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)))
    states = (random.getstate(), numpy.random.get_state()[1].copy(), torch.get_rng_state())
    discontinuity(operator, x, memory=False)
    assert random.getstate() == states[0]
    assert (numpy.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


# 9. Side state their plots read.

class Recording(Motor):
    """An engine that keeps its last step's input and delta, as their CartesianEngine does."""

    def evolve_step(self, psi):
        delta = self.operator(pack(psi))
        self.last_psi_input = psi
        self.last_delta_psi = delta.clone()
        return update(psi, delta, self.cfg.GAMMA_DECAY)


@pytest.mark.parametrize("checkpoint", ["step", "revolve"])
def test_side_state_is_left_as_the_forwards_last_step_left_it(checkpoint):
    """Not as the backward's recomputes (which end at step 0) leave it."""
    trainer, stock = trainer_of(engine=Recording), trainer_of(engine=Recording)
    enabled(trainer, checkpoint=checkpoint, **({"slots": 2} if checkpoint == "revolve" else {}))
    run(trainer, range(1)), run(stock, range(1))
    for name in ("last_psi_input", "last_delta_psi"):
        mine, theirs = getattr(trainer.motor, name), getattr(stock.motor, name)
        assert torch.allclose(mine, theirs.detach(), rtol=1e-10, atol=1e-12), name


def interrupt_at_the_gradient_of(parameter):
    """A KeyboardInterrupt from a hook on `parameter`'s gradient, once: in the backward, after the
    recomputes ran the steps again."""
    handle = []

    def hook(grad):
        handle.pop().remove()
        raise KeyboardInterrupt("stopped in the backward")
    handle.append(parameter.register_hook(hook))


@pytest.mark.parametrize("checkpoint", ["step", "revolve"])
def test_a_backward_that_raises_leaves_the_forwards_side_state(checkpoint):
    """Stock's backward writes no side state: an interrupted one leaves the forward's last step's,
    not what the recomputes wrote."""
    trainer, stock = trainer_of(engine=Recording), trainer_of(engine=Recording)
    enabled(trainer, checkpoint=checkpoint, **({"slots": 2} if checkpoint == "revolve" else {}))
    for each in (trainer, stock):
        interrupt_at_the_gradient_of(next(each.motor.operator.parameters()))
        with pytest.raises(KeyboardInterrupt):
            run(each, range(1))
    for name in ("last_psi_input", "last_delta_psi"):
        mine, theirs = getattr(trainer.motor, name), getattr(stock.motor, name)
        assert torch.allclose(mine, theirs.detach(), rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("multiplicative", [True, False])
def test_the_fused_step_writes_the_side_state_as_their_engine_step(multiplicative):
    """What their CartesianEngine._evolve_logic keeps: its input, the unitary part of the update
    (A * psi for UNetUnitary, else A) and the decay term."""
    trainer = trainer_of()
    if not multiplicative:
        trainer.motor.operator.__class__ = type("Additive", (type(trainer.motor.operator),), {})
    psi = qca_lowmem.stock.initial_state(1, 8, 2, dtype=torch.complex128)
    step = FusedEngineStep(trainer.motor, side_state=True)
    with torch.no_grad():
        out = step(psi)
        delta = trainer.motor.operator(pack(psi))
    a = torch.complex(delta[:, :2], delta[:, 2:]).permute(0, 2, 3, 1)
    expected = a * psi if multiplicative else a
    assert torch.equal(trainer.motor.last_psi_input, psi)
    assert torch.allclose(trainer.motor.last_delta_psi, expected, rtol=1e-12, atol=1e-14)
    assert torch.allclose(trainer.motor.last_delta_psi_decay, -0.05 * psi, rtol=1e-12, atol=1e-14)
    assert torch.allclose(out, update(psi, delta, 0.05, multiplicative), rtol=1e-12, atol=1e-14)


def test_a_python_with_no_recorded_digests_runs_their_own_code(monkeypatch, caplog):
    """Bytecode differs between Python versions: without digests nothing is recognised, and
    their own episode and step run, said in enable()'s line."""
    monkeypatch.setattr(qca_lowmem.atheria.code_identity, "PYTHON", "3.99")
    trainer, stock = trainer_of(), trainer_of()
    enabled(trainer, caplog)
    assert "their own train_episode: no digest of the code qca_lowmem follows is recorded for Python 3.99" \
        in caplog.text
    assert "Motor.evolve_step is not, by its code, a Cartesian engine step qca_lowmem follows (no digest" in caplog.text
    assert_same(run(trainer), run(stock), rel=0)


class CartesianLike(Motor):
    """The stand-in's step keeping what their CartesianEngine keeps, as it computes it."""

    def evolve_step(self, psi):
        delta = self.operator(pack(psi))
        a = torch.complex(delta[:, :2], delta[:, 2:]).permute(0, 2, 3, 1)
        self.last_psi_input, self.last_delta_psi = psi, (a * psi).clone()
        self.last_delta_psi_decay = (-self.cfg.GAMMA_DECAY * psi).clone()
        return update(psi, delta, self.cfg.GAMMA_DECAY)


@pytest.mark.parametrize("checkpoint", ["step", "none"])
def test_an_episode_on_the_fused_step_leaves_their_engines_side_state(monkeypatch, checkpoint):
    """The fused step on an engine recognised as their CartesianEngine keeps references at each
    step of an episode and writes the forward's last step's side state once."""
    monkeypatch.setattr(qca_lowmem.atheria.engine_step, "engine_kind", lambda motor, installed=None: "CartesianEngine")
    trainer, stock = trainer_of(), trainer_of(engine=CartesianLike)
    enabled(trainer, checkpoint=checkpoint)
    assert trainer._qca_lowmem_state.fused.side_state
    run(trainer, range(1)), run(stock, range(1))
    for name in ("last_psi_input", "last_delta_psi", "last_delta_psi_decay"):
        mine, theirs = getattr(trainer.motor, name), getattr(stock.motor, name).detach()
        assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12), name


def loss_reading(motor, name, detached):
    """Their loss with a term read off the engine after the episode's steps, as a researcher adds one."""
    def loss_fn(history, psi0):
        loss, metrics = stand_in.evolutionary_loss(history, psi0)
        value = getattr(motor, name)
        return loss + 0.5 * (value.detach() if detached else value).real.mean(), metrics
    return loss_fn


@pytest.mark.parametrize("checkpoint", ["step", "none"])
@pytest.mark.parametrize("name", ["last_psi_input", "last_delta_psi", "last_delta_psi_decay"])
def test_a_loss_reading_the_side_state_reads_the_forwards_last_step(monkeypatch, checkpoint, name):
    """Read detached, the values stock's loss reads (the fused step writes them before the loss,
    not the previous episode's, or none at the first)."""
    monkeypatch.setattr(qca_lowmem.atheria.engine_step, "engine_kind", lambda motor, installed=None: "CartesianEngine")
    trainer, stock = trainer_of(), trainer_of(engine=CartesianLike)
    for t in (trainer, stock):
        t.loss_fn = loss_reading(t.motor, name, detached=True)
    enabled(trainer, checkpoint=checkpoint)
    assert_same(run(trainer), run(stock))


@pytest.mark.parametrize("checkpoint", ["step", "none"])
@pytest.mark.parametrize("name", ["last_psi_input", "last_delta_psi", "last_delta_psi_decay"])
def test_a_loss_differentiating_through_the_side_state_is_refused(monkeypatch, checkpoint, name):
    """Stock's side state is in the last step's graph; the fused step keeps none: the episode is
    refused, naming the attribute, before the optimizer steps."""
    monkeypatch.setattr(qca_lowmem.atheria.engine_step, "engine_kind", lambda motor, installed=None: "CartesianEngine")
    trainer = trainer_of()
    trainer.loss_fn = loss_reading(trainer.motor, name, detached=False)
    enabled(trainer, checkpoint=checkpoint)
    before = [p.detach().clone() for p in trainer.motor.operator.parameters()]
    with pytest.raises(RuntimeError, match=rf"the loss differentiates through Motor\.{name}, .*\.detach\(\)"):
        trainer.train_episode(0)
    assert all(torch.equal(p, b) for p, b in zip(trainer.motor.operator.parameters(), before, strict=True))


@pytest.mark.parametrize("fused_step_ops", [True, False])
@pytest.mark.parametrize("checkpoint", ["step", "none"])
def test_a_loss_reading_the_memory_reads_the_last_steps(checkpoint, fused_step_ops):
    """An engine with memory: stock's steps leave the last step's h and c on motor.state before the
    loss, not the memory the episode started from; on the fused memory step, which carries the
    memory off motor.state, and on the engine's own."""
    def memory_trainer():
        trainer = trainer_of()
        trainer.motor = stand_in.MemoryMotor(make_operator("convlstm", 2, 4).double(), trainer.cfg, trainer.motor.state)
        trainer.model_operator = trainer.motor.operator
        trainer.optimizer = torch.optim.AdamW(trainer.motor.operator.parameters(), lr=1e-4, weight_decay=1e-5)
        trainer.motor.state._reset_state_random()
        trainer.loss_fn = loss_reading(trainer.motor.state, "h_state", detached=True)
        return trainer
    trainer, stock = memory_trainer(), memory_trainer()
    enabled(trainer, checkpoint=checkpoint, fused_step_ops=fused_step_ops)
    assert (trainer._qca_lowmem_state.fused is not None) == fused_step_ops
    assert_same(run(trainer), run(stock))


RECOMPUTING = {"step": {}, "revolve": {"slots": 1}, "auto": {"budget": 0}}
PLAIN = {"none": {}, "auto-1GiB": {"budget": 2**30}}  # auto with every step's graph kept: plain autograd


def loss_asking_history_grads(ask, seen):
    """Their loss with a term on the gradient of history[0] (`ask`: "sensitivity", taking in the steps
    after it; "direct", of history[0] alone) or hooks recording each entry's gradient ("hooks"),
    as a researcher diagnoses gradients through time; what the term or hooks saw goes to `seen`."""
    def loss_fn(history, psi0):
        loss, metrics = stand_in.evolutionary_loss(history, psi0)
        if ask == "hooks":
            for h in history[:-1]:
                h.register_hook(lambda g: seen.append(g.abs().sum().item()))
            return loss, metrics
        of = history[-1] if ask == "sensitivity" else history[0]
        grad, = torch.autograd.grad(of.abs().pow(2).sum(), history[0], retain_graph=True, allow_unused=True)
        if grad is not None:
            seen.append(grad.abs().sum().item())
            loss = loss + 0.1 * grad.abs().pow(2).mean()
        return loss, metrics
    return loss_fn


@pytest.mark.parametrize("ask", ["sensitivity", "direct", "hooks"])
@pytest.mark.parametrize("checkpoint", [*PLAIN, *RECOMPUTING])
def test_a_loss_asking_the_gradient_of_a_history_entry(checkpoint, ask):
    """A recomputing episode keeps no graph between its outputs: a gradient of history[0] that
    takes in the later steps (or a hook waiting for one) is refused, naming it, before the
    optimizer steps (plain autograd's answer else: torch's own error, or none with allow_unused);
    one of history[0] alone is plain autograd's, as under checkpoint='none' and an auto keeping
    every step's graph."""
    trainer, stock = trainer_of(), trainer_of()
    seen, stock_seen = [], []
    trainer.loss_fn = loss_asking_history_grads(ask, seen)
    stock.loss_fn = loss_asking_history_grads(ask, stock_seen)
    enabled(trainer, checkpoint=checkpoint.split("-")[0], **{**PLAIN, **RECOMPUTING}[checkpoint])
    if checkpoint in RECOMPUTING and ask != "direct":
        before = [p.detach().clone() for p in trainer.motor.operator.parameters()]
        with pytest.raises(RuntimeError, match=rf"the loss asks the gradient of history\[0\] .*checkpoint={checkpoint!r}"):
            trainer.train_episode(0)
        assert all(torch.equal(p, b) for p, b in zip(trainer.motor.operator.parameters(), before, strict=True))
        return
    assert_same(run(trainer), run(stock))
    assert stock_seen and seen == pytest.approx(stock_seen, rel=1e-10)


def test_the_installed_step_called_outside_an_episode_runs_a_changed_engines_own():
    """Their inference or their own train_episode call motor.evolve_step: checked at each call."""
    engine = type("Edited", (Motor,), {})
    trainer = trainer_of(engine=engine)
    enabled(trainer)
    psi = trainer.motor.state.psi
    engine.evolve_step = lambda self, psi: update(psi, self.operator(pack(psi)), 0.3)
    with torch.no_grad():
        assert torch.equal(trainer.motor.evolve_step(psi), update(psi, trainer.motor.operator(pack(psi)), 0.3))


def test_the_side_state_held_in_an_episode_keeps_no_graph(monkeypatch):
    """What the fused step holds for the side state during an episode is detached: the probed step
    leaves no graph alive, so the forward's steps run without grad (a graph would also hold the
    parameters' gradient accumulators, made on the stream a CUDA capture then cannot depend on)."""
    monkeypatch.setattr(qca_lowmem.atheria.engine_step, "engine_kind", lambda motor, installed=None: "CartesianEngine")
    forwards_with_grad = []

    class Spy(qca_lowmem.recompute.api.Episode):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            forwards_with_grad.append(self.grad_forward)

    monkeypatch.setattr(qca_lowmem.recompute.api, "Episode", Spy)
    trainer = trainer_of()
    enabled(trainer, checkpoint="step")
    run(trainer, range(2))
    assert forwards_with_grad == [False, False]
