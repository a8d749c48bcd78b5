"""enable()'s cuda_graph is three-valued: unset is on where a capture can run (CUDA, torch's caching
allocator, a policy that recomputes) and off elsewhere without a word; True where it cannot run
says why, once; False opts out. The device and allocator queries are replaced, so each case is
decided here as on a GPU (the episodes themselves: test_step_graph_replayed.py)."""

import pytest

import qca_lowmem
from qca_lowmem.examples import QC_Trainer_v4, make_config
from qca_lowmem.recompute import Policy, step_graph
from qca_lowmem.trainer import config as config_mod
from qca_lowmem.trainer.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

ALLOCATOR_OFF = "PYTORCH_NO_CUDA_MEMORY_CACHING"


@pytest.fixture
def as_on_cuda(monkeypatch):
    """Capture decisions taken as for a CUDA device, the caching allocator on unless told."""
    monkeypatch.setattr(step_graph, "on_cuda", lambda device: True)
    monkeypatch.delenv(ALLOCATOR_OFF, raising=False)
    return monkeypatch


def enabled(caplog, recwarn, **options):
    """(enable()'s resolved cuda_graph, its line, the cuda_graph warnings) for a fresh trainer."""
    caplog.set_level("INFO", logger="qca_lowmem")
    caplog.clear()
    trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=2))
    qca_lowmem.enable(trainer, **options)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("on, ")]
    warned = [str(w.message) for w in recwarn if "cuda_graph" in str(w.message)]
    recwarn.clear()
    return getattr(trainer, "_qca_lowmem_state").options.cuda_graph, line, warned


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_unset_is_on_where_a_capture_can_run(as_on_cuda, caplog, recwarn, checkpoint, slots):
    on, line, warned = enabled(caplog, recwarn, checkpoint=checkpoint, slots=slots)
    assert on and warned == []
    assert line == [f"on, {Policy.of(checkpoint, slots).describe()}, fp32, fused blocks, "
                    "fused step, cuda_graph"]


def test_auto_recomputes_so_unset_is_on_there_too(as_on_cuda, caplog, recwarn):
    on, _, warned = enabled(caplog, recwarn, checkpoint="auto", budget=2**20)
    assert on and warned == []


@pytest.mark.parametrize("checkpoint,allocator_off,cuda_graph", [
    ("none", False, None), ("none", False, False), ("step", False, False), ("step", True, None),
    ("step", True, False)])
def test_off_without_a_word_where_it_is_not_asked_for(as_on_cuda, caplog, recwarn, checkpoint, allocator_off,
                                                      cuda_graph):
    """Plain autograd has no recomputed step to capture; the allocator without a cache cannot
    capture; False opts out where it could run. None of them warns; the line says it is off."""
    if allocator_off:
        as_on_cuda.setenv(ALLOCATOR_OFF, "1")
    on, line, warned = enabled(caplog, recwarn, checkpoint=checkpoint, cuda_graph=cuda_graph)
    assert not on and warned == []
    assert line[0].endswith(", fused step, cuda_graph off")


@pytest.mark.parametrize("checkpoint,allocator_off,why", [
    ("none", False, "checkpoint=none runs plain autograd, with no recomputed step to capture"),
    ("step", True, "PYTORCH_NO_CUDA_MEMORY_CACHING is set")])
def test_true_where_it_cannot_run_says_why_once(as_on_cuda, caplog, recwarn, checkpoint, allocator_off, why):
    if allocator_off:
        as_on_cuda.setenv(ALLOCATOR_OFF, "1")
    on, line, warned = enabled(caplog, recwarn, checkpoint=checkpoint, cuda_graph=True)
    assert not on and len(warned) == 1 and why in warned[0] and warned[0].endswith("its steps run eagerly")
    assert line[0].endswith("cuda_graph off")


def test_on_the_cpu_unset_is_off_silently_and_the_line_does_not_name_it(caplog, recwarn):
    on, line, warned = enabled(caplog, recwarn)
    assert not on and warned == []
    assert line == ["on, checkpoint=step, fp32, fused blocks, fused step"]


@pytest.mark.parametrize("value", ["yes", 0, 1])
def test_a_cuda_graph_that_is_not_a_bool_or_none_is_refused(value):
    with pytest.raises(ValueError, match=r"cuda_graph must be True, False or None \(on where it can run\), got "):
        qca_lowmem.enable(QC_Trainer_v4(make_config(grid=8, qca_steps=2)), cuda_graph=value)


def test_enable_from_config_leaves_a_null_cuda_graph_unset(monkeypatch):
    calls = []
    monkeypatch.setattr("qca_lowmem.atheria.config_section.enable", lambda trainer, **options: calls.append(options))
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    for value in (None, "off", True):
        qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True, "cuda_graph": value}})
    assert calls == [{}, {"cuda_graph": False}, {"cuda_graph": True}]


@pytest.mark.parametrize("name", config_mod.bundled_configs())
def test_the_bundled_configs_leave_cuda_graph_unset(name):
    assert config_mod.load_config(name).cuda_graph is None


@pytest.mark.parametrize("cuda_graph,allocator_off,captured", [
    (None, False, True), (True, False, True), (False, False, False), (None, True, False), (True, True, False)])
def test_the_trainer_resolves_cuda_graph_as_enable_does(as_on_cuda, capsys, cuda_graph, allocator_off, captured):
    if allocator_off:
        as_on_cuda.setenv(ALLOCATOR_OFF, "1")
    config = config_mod.config_from_dict({"grid": 8, "qca_steps": 2, "episodes": 1, "cuda_graph": cuda_graph,
                                          "device": "cpu"})
    trainer = Trainer(config, progress=False)
    assert isinstance(trainer.step_fn, qca_lowmem.StepGraph) == captured
    said = [line for line in capsys.readouterr().err.splitlines() if "cuda_graph" in line]
    assert said == (["qca-lowmem: cuda_graph: PYTORCH_NO_CUDA_MEMORY_CACHING is set, and a capture allocates from "
                     "torch's caching allocator (cudaMalloc is not allowed while capturing); the steps run eagerly"]
                    if cuda_graph and allocator_off else [])


def test_the_trainer_config_refuses_a_cuda_graph_it_cannot_read():
    with pytest.raises(config_mod.UsageError, match=r"cuda_graph must be true, false or null"):
        config_mod.config_from_dict({"cuda_graph": "sometimes"})
    assert config_mod.TrainConfig().cuda_graph is None


def counting_engine_trainer():
    """A trainer whose engine's step changes with the calls made of it (every third call another
    gamma): an engine enable() does not recognise, so its own step runs."""
    trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=2))
    motor = trainer.motor
    base = type(motor)

    def evolve_step(self, psi):
        self.calls = getattr(self, "calls", 0) + 1
        return base.evolve_step(self, psi) * (1.0 if self.calls % 3 else 1.5)

    motor.__class__ = type(base.__name__, (base,), {"evolve_step": evolve_step})
    return trainer


def test_an_engine_step_qca_lowmem_does_not_follow_is_not_captured(as_on_cuda, caplog):
    """A replay repeats the kernels of the call captured: only a step whose code qca_lowmem follows
    can be known to do the same at every call. For an engine it does not recognise, unset is off,
    said in the line, and True is refused naming the cause; the engine it follows is captured
    whichever step runs (fused_step_ops=False: the engine's own)."""
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = counting_engine_trainer()
    qca_lowmem.enable(trainer)
    assert not getattr(trainer, "_qca_lowmem_state").options.cuda_graph
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("on, ")]
    assert line == ["on, checkpoint=step, fp32, cuda_graph off, the engine's own step and blocks: Motor.evolve_step is "
                    "not, by its code, a Cartesian engine step qca_lowmem follows"]
    with pytest.raises(ValueError, match=r"cuda_graph=True, but Motor.evolve_step is not, by its code, a Cartesian "
                                         r"engine step qca_lowmem follows: a capture would replay what one call of it "
                                         r"did at every step"):
        qca_lowmem.enable(counting_engine_trainer(), cuda_graph=True)
    followed = QC_Trainer_v4(make_config(grid=8, qca_steps=2))
    qca_lowmem.enable(followed, cuda_graph=True, fused_step_ops=False)
    assert getattr(followed, "_qca_lowmem_state").options.cuda_graph
