"""qca_lowmem.enable() on a QC_Trainer_v4-style trainer: same results as stock, and undoable."""

import copy
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy
import pytest
import torch

import qca_lowmem
from helpers import classes_in_episodes, cuda_only, randomize_affine
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4, make_config
from qca_lowmem.stock import ConvBlock, UNetUnitary

pytestmark = pytest.mark.usefixtures("one_thread")


def make_trainer(scaler=None, grid=8, qca_steps=6, gamma=0.0, **kw):
    torch.manual_seed(1234)
    trainer = QC_Trainer_v4(make_config(grid=grid, qca_steps=qca_steps, gamma=gamma), scaler=scaler, **kw)
    # Non-trivial GroupNorm affines and a visible output layer, so every parameter matters.
    randomize_affine(trainer.motor.operator)
    with torch.no_grad():
        trainer.motor.operator.outc.weight.normal_(0.0, 0.05)
    return trainer


def run_episodes(trainer, episodes, seed=99):
    torch.manual_seed(seed)
    numpy.random.seed(seed)  # the noise's bit-flip coin
    return [trainer.train_episode(e) for e in episodes]


def assert_close(actual, expected, rel=1e-5, what=""):
    """Norm-wise relative error. Adam turns fp32 rounding in near-zero gradient entries into
    updates of up to lr, so an entry-wise bound would test rounding, not the computation."""
    err = (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-30)).item()
    assert err <= rel, f"{what}: relative error {err:.3e} > {rel}"


def assert_same_runs(lowmem_trainer, stock_trainer, lowmem_out, stock_out):
    for (l_loss, l_metrics, l_psi), (s_loss, s_metrics, s_psi) in zip(lowmem_out, stock_out):
        assert l_loss == pytest.approx(s_loss, rel=1e-5, abs=1e-6)
        for key in s_metrics:
            assert l_metrics[key] == pytest.approx(s_metrics[key], rel=1e-5, abs=1e-6), key
        assert l_psi.dtype == s_psi.dtype and l_psi.device.type == "cpu"
        assert_close(l_psi, s_psi, what="final psi")
    lowmem_params = dict(lowmem_trainer.motor.operator.named_parameters())
    for name, p in stock_trainer.motor.operator.named_parameters():
        assert_close(lowmem_params[name].detach(), p.detach(), what=name)


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_three_episodes_match_stock(checkpoint, slots, tmp_path):
    stock = make_trainer(scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    lowmem = make_trainer(scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    params_before = [id(p) for p in lowmem.motor.operator.parameters()]
    qca_lowmem.enable(lowmem, checkpoint=checkpoint, slots=slots)

    assert [id(p) for p in lowmem.motor.operator.parameters()] == params_before
    assert isinstance(lowmem.scaler, qca_lowmem.amp.GradScaler)
    assert lowmem.scaler.get_scale() == 1024.0
    assert list(lowmem.motor.operator.state_dict()) == list(stock.motor.operator.state_dict())

    stock_out = run_episodes(stock, range(3))
    with classes_in_episodes(lowmem) as classes:
        lowmem_out = run_episodes(lowmem, range(3))
    assert_same_runs(lowmem, stock, lowmem_out, stock_out)
    assert len(classes) == 3 and not any(cls is ConvBlock for cls in classes[0])  # fused while they run
    assert [type(m) for m in lowmem.motor.operator.modules()] == [type(m) for m in stock.motor.operator.modules()]
    # The trainer's own checkpointing still works on the converted model.
    lowmem.save_checkpoint(2, lowmem_out[-1][1], lowmem_out[-1][0], path=str(tmp_path / "ckpt.pth"))
    saved = torch.load(tmp_path / "ckpt.pth")
    assert list(saved["model_state_dict"]) == list(stock.motor.operator.state_dict())


@pytest.mark.parametrize("use_amp,amp_dtype", [(False, None), (True, "fp32")])
def test_the_scaler_scales_where_their_episode_does(use_amp, amp_dtype):
    """Their episode scales the loss only `if self.use_amp and self.scaler`. A scaler set with
    use_amp False is left as stock leaves it (its scale and growth tracker; no step skipped on it).
    With use_amp True it steps, here in the fp32 that amp_dtype asked for, and the results are
    stock's unscaled ones within rounding (a power-of-two scale is exact)."""
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    stock, lowmem = make_trainer(scaler=scaler()), make_trainer(scaler=scaler(), use_amp=use_amp)
    untouched = stock.scaler.state_dict()
    qca_lowmem.enable(lowmem, amp_dtype=amp_dtype)
    assert_same_runs(lowmem, stock, run_episodes(lowmem, range(3)), run_episodes(stock, range(3)))
    assert stock.scaler.state_dict() == untouched
    # Three steps at growth_interval 2: the scale doubled once, one step counted towards the next.
    stepped = dict(untouched, scale=2048.0, _growth_tracker=1)
    assert lowmem.scaler.state_dict() == (stepped if use_amp else untouched)


def test_an_operator_set_on_the_engine_is_clipped_only_where_their_episode_clips_it():
    """Their episode puts `model_operator` (the operator it was built with) in train mode and clips
    its parameters: a model loaded into motor.operator later, with an optimizer of its own, trains
    unclipped, under the switch too (its gradient norm is far above the clipping's 1.0)."""
    runs = []
    for lowmem in (False, True):
        torch.manual_seed(4)  # float64: Adam's steps on unclipped gradients amplify float32's rounding
        trainer = QC_Trainer_v4(make_config(dtype=torch.complex128), operator=UNetUnitary(4, 8).double())
        loaded = UNetUnitary(4, 8).double()
        randomize_affine(loaded)
        with torch.no_grad():
            loaded.outc.weight.normal_(0.0, 0.5)
        trainer.motor.operator = loaded
        trainer.optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-4)
        if lowmem:
            qca_lowmem.enable(trainer)
        out = run_episodes(trainer, range(2))
        runs.append((trainer, out, torch.nn.utils.get_total_norm([p.grad for p in loaded.parameters()]).item()))
    (stock, stock_out, stock_norm), (lowmem, lowmem_out, lowmem_norm) = runs
    assert stock_norm > 5.0 and lowmem_norm == pytest.approx(stock_norm, rel=1e-9)  # unclipped on both
    assert_same_runs(lowmem, stock, lowmem_out, stock_out)


def test_a_frozen_layer_s_old_gradients_count_in_the_clipping_as_in_their_episode():
    """Fine-tuning: the first block frozen and the optimizer rebuilt on what still trains, so the
    frozen parameters keep the gradients they had. Their clipping reads every parameter's, so
    those count in the norm and are scaled by it at each episode, under the switch too."""
    runs = []
    for lowmem in (False, True):
        torch.manual_seed(4)  # float64: a different clipping shows far above the rounding
        trainer = QC_Trainer_v4(make_config(dtype=torch.complex128), operator=UNetUnitary(4, 8).double())
        operator = trainer.motor.operator
        with torch.no_grad():
            operator.outc.weight.normal_(0.0, 0.5)  # a gradient norm above the clipping's 1.0
        if lowmem:
            qca_lowmem.enable(trainer)
        out = run_episodes(trainer, range(1))
        operator.inc.requires_grad_(False)
        trainer.optimizer = torch.optim.AdamW([p for p in operator.parameters() if p.requires_grad], lr=1e-4)
        out += run_episodes(trainer, range(1, 3))
        runs.append((trainer, out, [p.grad.clone() for p in operator.inc.parameters()]))
    (stock, stock_out, stock_old), (lowmem, lowmem_out, lowmem_old) = runs
    assert_same_runs(lowmem, stock, lowmem_out, stock_out)
    for grad, stock_grad in zip(lowmem_old, stock_old):
        assert_close(grad, stock_grad, rel=1e-9, what="a frozen parameter's gradient, scaled by the clipping")


def test_additive_operator_and_gamma_match_stock():
    """A non-UNetUnitary operator runs additively (stock rule), gamma decay included."""

    class Additive(torch.nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

        def forward(self, x):
            return 0.1 * torch.tanh(self.conv(x))

    trainers = []
    for _ in range(2):
        trainer = make_trainer(gamma=0.05)
        torch.manual_seed(5)
        op = Additive(8)
        trainer.motor.operator = trainer.model_operator = op
        trainer.optimizer = torch.optim.AdamW(op.parameters(), lr=1e-4, weight_decay=1e-5)
        trainers.append(trainer)
    stock, lowmem = trainers
    qca_lowmem.enable(lowmem, fused_blocks=False)
    assert_same_runs(lowmem, stock, run_episodes(lowmem, range(3)), run_episodes(stock, range(3)))


def test_disable_restores_stock_behaviour():
    stock = make_trainer()
    trainer = make_trainer(scaler=torch.amp.GradScaler("cpu", init_scale=512.0), use_amp=True)
    original_scaler = trainer.scaler
    blocks_before = [type(m) for m in trainer.motor.operator.modules()]
    qca_lowmem.enable(trainer, amp_dtype="fp32")  # scaled (use_amp), in fp32
    run_episodes(trainer, range(1))
    trainer.scaler.update(256.0)
    qca_lowmem.disable(trainer)

    assert [type(m) for m in trainer.motor.operator.modules()] == blocks_before
    assert "train_episode" not in vars(trainer) and "evolve_step" not in vars(trainer.motor)
    assert trainer.scaler is original_scaler and type(trainer.scaler) is torch.amp.GradScaler
    assert trainer.scaler.get_scale() == 256.0  # the state the lowmem scaler reached is carried back
    with pytest.raises(RuntimeError, match="not enabled"):
        qca_lowmem.disable(trainer)
    # Stock again: continuing equals a stock trainer that ran the same episodes.
    trainer.scaler, trainer.use_amp = None, False
    run_episodes(stock, range(1))
    stock_out = run_episodes(stock, range(1, 3), seed=7)
    out = run_episodes(trainer, range(1, 3), seed=7)
    assert_same_runs(trainer, stock, out, stock_out)


def test_trainer_state_reset_draws_psi0():
    """A trainer whose engine resets its own state: enable() draws psi0 through that reset (no grid
    needed), and with the same grid the episodes equal stock's."""
    stock, lowmem = make_trainer(state_object=True), make_trainer(state_object=True)
    resets = []
    original = lowmem.motor.state._reset_state_random
    lowmem.motor.state._reset_state_random = lambda: resets.append(1) or original()
    del lowmem.grid_size, lowmem.cfg.GRID_SIZE_TRAINING  # the reset knows the grid, enable() need not
    qca_lowmem.enable(lowmem)
    lowmem.cfg.GRID_SIZE_TRAINING = stock.cfg.GRID_SIZE_TRAINING  # the state object reads it
    assert_same_runs(lowmem, stock, run_episodes(lowmem, range(3)), run_episodes(stock, range(3)))
    assert len(resets) == 3


def test_enable_twice_and_disable_unenabled_are_errors():
    trainer = make_trainer()
    with pytest.raises(RuntimeError, match="not enabled"):
        qca_lowmem.disable(trainer)
    qca_lowmem.enable(trainer)
    with pytest.raises(RuntimeError, match="already enabled"):
        qca_lowmem.enable(trainer)


def test_bad_options_are_rejected_before_anything_changes():
    trainer = make_trainer()
    before = copy.copy(vars(trainer))
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        qca_lowmem.enable(trainer, checkpoint="sometimes")
    with pytest.raises(ValueError, match=r"enable\(\): checkpoint='revolve' needs slots >= 1"):
        qca_lowmem.enable(trainer, checkpoint="revolve")
    with pytest.raises(ValueError, match=r"enable\(\): slots applies only to checkpoint='revolve'"):
        qca_lowmem.enable(trainer, checkpoint="step", slots=4)
    with pytest.raises(ValueError, match="amp_dtype must be one of"):
        qca_lowmem.enable(trainer, amp_dtype="int8")
    with pytest.raises(TypeError, match=r"^enable\(\): SimpleNamespace lacks motor, motor.operator, .* "
                                        r"\(as QC_Trainer_v4\) and "):
        qca_lowmem.enable(SimpleNamespace(optimizer=None))
    assert vars(trainer) == before


def test_missing_grid_is_a_clear_error():
    trainer = make_trainer()
    del trainer.grid_size
    del trainer.cfg.GRID_SIZE_TRAINING
    with pytest.raises(ValueError, match="grid_size"):
        qca_lowmem.enable(trainer)


def _record_enable(monkeypatch):
    calls = []
    monkeypatch.setattr(qca_lowmem.atheria.config_section, "enable", lambda trainer, **kw: calls.append(kw))
    monkeypatch.setattr(qca_lowmem.atheria.config_section, "stock_on_refusal",
                        lambda trainer: calls.append("stock on refusal"))
    return calls


@pytest.mark.parametrize("style", ["dict", "attributes"])
def test_enable_from_config_reads_the_lowmem_section(monkeypatch, style):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = _record_enable(monkeypatch)
    section = {"enabled": True, "checkpoint": "revolve", "amp_dtype": "bf16", "fused_blocks": False, "slots": 8,
               "noise": "fused"}
    cfg = {"LOWMEM": section} if style == "dict" else SimpleNamespace(LOWMEM=SimpleNamespace(**section))
    assert qca_lowmem.enable_from_config(object(), cfg) is True
    assert calls == [{"checkpoint": "revolve", "amp_dtype": "bf16", "fused_blocks": False, "slots": 8,
                      "noise": "fused"}]


def test_the_config_chooses_the_noise_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    trainer = make_trainer()
    assert qca_lowmem.enable_from_config(trainer, {"LOWMEM": {"enabled": True, "noise": "fused"}})
    assert trainer._qca_lowmem_state.options.given.noise == "fused"
    with pytest.raises(ValueError, match=r"noise must be one of \('trainer', 'fused'\), got 'numpy'"):
        qca_lowmem.enable_from_config(make_trainer(), {"LOWMEM": {"enabled": True, "noise": "numpy"}})


def test_enable_from_config_off_unless_asked(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = _record_enable(monkeypatch)
    assert qca_lowmem.enable_from_config(object(), {}) is False
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": False}}) is False
    assert qca_lowmem.enable_from_config(object(), None) is False
    assert calls == []


def test_environment_flag_overrides_config(monkeypatch):
    calls = _record_enable(monkeypatch)
    monkeypatch.setenv("QCA_LOWMEM", "1")
    assert qca_lowmem.enable_from_config(object(), None) is True
    assert calls == [{}, "stock on refusal"]  # asked by the environment alone
    calls.clear()
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True}}) is True
    assert calls == [{}]
    monkeypatch.setenv("QCA_LOWMEM", "0")
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True}}) is False
    monkeypatch.setenv("QCA_LOWMEM", "maybe")
    with pytest.raises(ValueError, match="QCA_LOWMEM must be"):
        qca_lowmem.enable_from_config(object(), None)


def test_unknown_config_key_is_an_error(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    with pytest.raises(ValueError, match=r"unknown keys \['chekpoint'\]"):
        qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True, "chekpoint": "step"}})


@pytest.mark.parametrize("spelling, expected", [
    (True, True), (False, False), (1, True), (0, False), ("true", True), ("False", False), ("YES", True),
    ("no", False), ("On", True), ("off", False), ("1", True), ("0", False), (" true ", True)])
def test_enabled_takes_the_usual_boolean_spellings(monkeypatch, spelling, expected):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = _record_enable(monkeypatch)
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": spelling}}) is expected
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": spelling}) is expected  # the bare section
    assert calls == [{}, {}] if expected else calls == []


@pytest.mark.parametrize("value", ["maybe", "", 2, -1, 0.0, 1.5, None, [True], {"on": True}])
def test_enabled_refuses_anything_else_by_name(monkeypatch, value):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = _record_enable(monkeypatch)
    with pytest.raises(ValueError, match=r"LOWMEM\.enabled must be a boolean .*got " + re.escape(repr(value))):
        qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": value}})
    assert calls == []


@pytest.mark.parametrize("section", ["maybe", 2, 1.0, [True]])
def test_a_bare_section_must_be_a_boolean(monkeypatch, section):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    with pytest.raises(ValueError, match=r"LOWMEM must be .*got " + re.escape(repr(section))):
        qca_lowmem.enable_from_config(object(), {"LOWMEM": section})


def test_boolean_options_in_the_section_are_parsed_by_name(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = _record_enable(monkeypatch)
    section = {"enabled": "yes", "fused_blocks": "off", "cuda_graph": "false"}
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": section}) is True
    assert calls == [{"fused_blocks": False, "cuda_graph": False}]
    with pytest.raises(ValueError, match=r"LOWMEM\.cuda_graph must be a boolean .*got 'sometimes'"):
        qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True, "cuda_graph": "sometimes"}})


@pytest.mark.parametrize("value, expected", [("TRUE", True), ("on", True), ("Off", False), ("no", False)])
def test_environment_flag_spellings(monkeypatch, value, expected):
    _record_enable(monkeypatch)
    monkeypatch.setenv("QCA_LOWMEM", value)
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": not expected}}) is expected
    monkeypatch.setenv("QCA_LOWMEM", "2")
    with pytest.raises(ValueError, match=r"QCA_LOWMEM must be a boolean .*got '2'"):
        qca_lowmem.enable_from_config(object(), None)


@pytest.mark.parametrize("flag", ["fused_blocks", "fused_step_ops", "lowmem_scaler"])
@pytest.mark.parametrize("value", ["false", 0, None])
def test_enable_refuses_a_non_bool_flag_by_name(flag, value):
    trainer = make_trainer()
    before = copy.copy(vars(trainer))
    with pytest.raises(ValueError, match=rf"enable\(\): {flag} must be True or False, got {re.escape(repr(value))}"):
        qca_lowmem.enable(trainer, **{flag: value})
    assert vars(trainer) == before


def test_noise_curriculum_runs_through_the_rollout():
    """With noise on, the episode's noise comes from the trainer's injector, replayed by the
    rollout: same seed, same result; the noise changes the outcome."""
    outs = []
    for max_noise in (1.0, 1.0, 0.0):
        trainer = make_trainer(max_noise=max_noise)
        qca_lowmem.enable(trainer)
        outs.append(run_episodes(trainer, [1500])[0])
    (loss_a, _, psi_a), (loss_b, _, psi_b), (loss_quiet, _, psi_quiet) = outs
    assert loss_a == loss_b and torch.equal(psi_a, psi_b)
    assert not torch.allclose(psi_a, psi_quiet, atol=1e-3)


@cuda_only
def test_enable_on_cuda_with_the_stock_fp16_setup():
    """The users' CUDA setup: fp16 autocast and torch's GradScaler; enable() keeps fp16 (use_amp)
    and hands the scaler's state to qca_lowmem.amp.GradScaler."""
    trainer = make_trainer(scaler=torch.amp.GradScaler("cuda", init_scale=4096.0), device="cuda", use_amp=True)
    qca_lowmem.enable(trainer)
    assert isinstance(trainer.scaler, qca_lowmem.amp.GradScaler) and trainer.scaler.get_scale() == 4096.0
    for loss, metrics, psi in run_episodes(trainer, range(3)):
        assert loss == loss and psi.device.type == "cpu" and set(metrics) == {"survival", "symmetry", "complexity"}


@cuda_only
def test_fp16_on_cuda_without_a_scaler_gets_one_and_disable_removes_it():
    """fp16 autocast needs loss scaling: enable() adds qca_lowmem.amp.GradScaler when the trainer
    has none, and disable() leaves the trainer without one again."""
    trainer = make_trainer(scaler=None, device="cuda")
    qca_lowmem.enable(trainer, amp_dtype="fp16")
    assert isinstance(trainer.scaler, qca_lowmem.amp.GradScaler) and trainer.scaler.is_enabled()
    for loss, _, _ in run_episodes(trainer, range(2)):
        assert loss == loss
    qca_lowmem.disable(trainer)
    assert trainer.scaler is None


@cuda_only
def test_fp16_from_use_amp_without_a_scaler_runs_unscaled_as_their_episode():
    """use_amp with the scaler set to None: their episode runs fp16 autocast unscaled, and so does
    the lowmem one (enable() adds a scaler only for an fp16 it was asked for)."""
    trainer = make_trainer(scaler=None, device="cuda", use_amp=True)
    qca_lowmem.enable(trainer)
    assert trainer.scaler is None
    for loss, _, _ in run_episodes(trainer, range(2)):
        assert loss == loss


def test_use_amp_changed_after_enable_enables_again_or_says_why_it_cannot(caplog):
    """Their episode reads use_amp at every episode; enable() read it once for the precision, so an
    episode after a change enables it again, reading it anew. fp16 on the CPU is refused there: the
    episode raises before anything trains, naming the change and the refusal, with the trainer
    disabled (stock's episode then trains); with amp_dtype given, use_amp is not read."""
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = make_trainer(qca_steps=2)
    qca_lowmem.enable(trainer)
    run_episodes(trainer, [0])
    trainer.use_amp = True
    weights = [p.detach().clone() for p in trainer.motor.operator.parameters()]
    with pytest.raises(RuntimeError, match=r"^qca_lowmem: trainer\.use_amp is True now \(False at enable\(\)\), and "
                                           r"enable\(\) now refuses the trainer, so it is back on stock \(disabled\): "
                                           r"enable\(\): fp16 on the CPU"):
        trainer.train_episode(1)
    assert all(torch.equal(p, w) for p, w in zip(trainer.motor.operator.parameters(), weights))
    assert not hasattr(trainer, "_qca_lowmem_state") and "train_episode" not in vars(trainer)
    trainer.use_amp = False
    qca_lowmem.enable(trainer)
    trainer.use_amp = 0  # their `if self.use_amp` reads it as False: the same precision, nothing said
    caplog.clear()
    assert math.isfinite(trainer.train_episode(1)[0]) and caplog.records == []

    given = make_trainer(qca_steps=2)
    qca_lowmem.enable(given, amp_dtype="bf16")
    given.use_amp = True
    assert math.isfinite(given.train_episode(0)[0])


def test_a_grid_changed_between_episodes_enables_it_again_there_as_stock_trains(caplog):
    """A grid curriculum: stock's own draw reads trainer.grid_size at every episode; enable() read it
    once and proved the step there, so the next episode enables it again at the new grid, said in
    one line, and trains as stock's does; the engine's state reset reads its config itself, and
    follows it."""
    caplog.set_level("INFO", logger="qca_lowmem")
    stock, lowmem = (make_trainer(grid=8, qca_steps=3, state_object=False) for _ in range(2))
    qca_lowmem.enable(lowmem)
    outs = []
    for trainer in (stock, lowmem):
        torch.manual_seed(5)
        outs.append([trainer.train_episode(0)])
        trainer.grid_size = 16
        outs[-1].append(trainer.train_episode(1))
    assert [r.getMessage() for r in caplog.records][1:] == [
        "the trainer's grid is 16x16 now (8x8 at enable()): on again, checkpoint=step, fp32, fused blocks, fused step"]
    assert outs[1][1][2].shape == (1, 16, 16, 4) and hasattr(lowmem, "_qca_lowmem_state")
    assert_same_runs(lowmem, stock, outs[1], outs[0])
    caplog.clear()
    lowmem.train_episode(2)
    assert caplog.records == []  # proved at 16 now

    with_state = QC_Trainer_v4(make_config(grid=8, qca_steps=2), state_object=True)
    qca_lowmem.enable(with_state)
    with_state.motor.cfg.GRID_SIZE_TRAINING = 16
    assert with_state.train_episode(0)[2].shape == (1, 16, 16, 4)


@pytest.mark.parametrize("version", ["v4", "v3"])
def test_an_autocast_around_train_episode_is_refused_unless_amp_dtype_was_given(version):
    """A loop wrapped in torch.autocast: V3's stock episode (and Atheria's V4 off CUDA, which sets
    CUDA's autocast only) runs its forward in it, where the lowmem episode would run enable()'s
    precision, silently another answer. Refused before anything trains, naming both; with amp_dtype
    given, that decides and the episode trains (bf16 both ways here)."""
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=2)
    make = (lambda: QC_Trainer_v4(cfg)) if version == "v4" else (lambda: QC_Trainer_v3(cfg, batch_size=2))
    trainer = make()
    qca_lowmem.enable(trainer)
    weights = [p.detach().clone() for p in trainer.optimizer.param_groups[0]["params"]]
    name = type(trainer).__name__
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            RuntimeError, match=rf"^qca_lowmem: train_episode was called inside torch\.autocast\('cpu', "
                                rf"dtype=torch\.bfloat16\): {name}'s episode sets .* where enable\(\) runs fp32; give "
                                r"enable\(\) amp_dtype"):
        trainer.train_episode(0)
    assert all(torch.equal(p, w) for p, w in zip(trainer.optimizer.param_groups[0]["params"], weights))
    assert math.isfinite(trainer.train_episode(0)[0])  # outside it, as before
    given = make()
    qca_lowmem.enable(given, amp_dtype="bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert math.isfinite(given.train_episode(0)[0])


@cuda_only
def test_use_amp_turned_off_after_enable_on_cuda_enables_it_again_in_fp32(caplog):
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = make_trainer(scaler=torch.amp.GradScaler("cuda"), device="cuda", use_amp=True)
    qca_lowmem.enable(trainer)
    run_episodes(trainer, [0])
    trainer.use_amp = False
    run_episodes(trainer, [1])
    assert caplog.records[-1].getMessage().startswith("trainer.use_amp is False now (True at enable()): on again, "
                                                      "checkpoint=step, fp32")


DEFAULT_ON_CUDA = """
import warnings
import torch
import qca_lowmem
from qca_lowmem.examples import QC_Trainer_v4, make_config
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    trainer = QC_Trainer_v4(make_config(grid=16, qca_steps=6), device="cuda")
    qca_lowmem.enable(trainer)
    for episode in range(3):
        trainer.train_episode(episode)
    torch.cuda.synchronize()
for w in caught:
    print(f"{w.category.__name__}: {w.message}")
"""


@cuda_only
@pytest.mark.slow
def test_the_default_on_cuda_trains_without_a_warning():
    """enable()'s default on CUDA (captured steps) says nothing through warnings: torch's
    "AccumulateGrad node's stream does not match" among them, which it gives once a process, so
    the episodes run in a fresh one."""
    result = subprocess.run([sys.executable, "-c", DEFAULT_ON_CUDA], capture_output=True, text=True, check=True)
    assert result.stdout == "", result.stdout


@cuda_only
def test_enable_with_cuda_graph_equals_eager_on_cuda():
    results = []
    for cuda_graph in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(device="cuda")
        qca_lowmem.enable(trainer, cuda_graph=cuda_graph)
        results.append([loss for loss, _, _ in run_episodes(trainer, range(3))])
    assert results[1] == pytest.approx(results[0], rel=1e-4)


def test_the_lowmem_episode_trains_in_train_mode_as_stock():
    """A model left in eval mode (a visualisation between episodes) is put back in train mode by
    the episode, stock's and the low-memory one alike."""
    trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=2))
    qca_lowmem.enable(trainer, checkpoint="step")
    trainer.motor.operator.eval()
    trainer.train_episode(0)
    assert all(m.training for m in trainer.motor.operator.modules())


def test_max_noise_above_one_trains_as_stock_does():
    """Stock accepts any max_noise (a rate above 1 flips every cell); so does the low-memory episode."""
    trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=2))
    trainer.max_noise = 1.5
    qca_lowmem.enable(trainer, checkpoint="step")
    loss, _, _ = trainer.train_episode(4000)
    assert math.isfinite(loss)


def test_options_that_cannot_work_on_the_cpu_are_decided_at_enable(recwarn):
    """fp16 on the CPU, a GPU setting, is refused (the trainer's rule too); cuda_graph on the CPU runs eager
    steps: said once, at enable(), not silently at every episode."""
    trainer = make_trainer()
    with pytest.raises(ValueError, match="fp16 on the CPU.*amp_dtype='bf16'"):
        qca_lowmem.enable(trainer, amp_dtype="fp16")
    assert not hasattr(trainer, "_qca_lowmem_state")
    qca_lowmem.enable(trainer, cuda_graph=True)
    said = [str(w.message) for w in recwarn if "cuda_graph" in str(w.message)]
    assert said == ["enable(): cuda_graph captures CUDA graphs, but the operator is on cpu: its steps run eagerly"]
    trainer.train_episode(0)
    assert [str(w.message) for w in recwarn if "cuda_graph" in str(w.message)] == said


def test_enable_says_in_one_line_whether_it_is_on_and_why(caplog, monkeypatch):
    """A user who forgot the flag must not believe the library is training. (pytest's log format
    names the logger, so the line carries no prefix of its own: say.py.)"""
    caplog.set_level("INFO", logger="qca_lowmem")
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    cases = [({}, "off, no LOWMEM in the config and QCA_LOWMEM unset"),
             ({"LOWMEM": {"enabled": False}}, "off, LOWMEM is off in the config"),
             ({"LOWMEM": False}, "off, LOWMEM is off in the config")]
    for config, line in cases:
        caplog.clear()
        assert qca_lowmem.enable_from_config(make_trainer(), config) is False
        assert [r.getMessage() for r in caplog.records] == [line]
    monkeypatch.setenv("QCA_LOWMEM", "0")
    caplog.clear()
    assert qca_lowmem.enable_from_config(make_trainer(), {"LOWMEM": True}) is False
    assert [r.getMessage() for r in caplog.records] == ["off, QCA_LOWMEM=0 in the environment"]
    monkeypatch.delenv("QCA_LOWMEM")
    caplog.clear()
    assert qca_lowmem.enable_from_config(make_trainer(), {"LOWMEM": {"enabled": True, "checkpoint": "revolve", "slots": 3}})
    assert [r.getMessage() for r in caplog.records] == [
        "on, checkpoint=revolve slots=3, fp32, fused blocks, fused step"]


class ScalarLog:
    """A TensorBoard SummaryWriter's add_scalar, recorded."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, float(value), step))


def test_the_episode_keeps_the_stock_tensorboard_scalars():
    """The stock train_episode logs four scalars every 10 episodes; with the library on, the same
    tags at the same episodes, with the same values (noise off: to fp32 rounding)."""
    logs = {}
    for lowmem in (False, True):
        trainer = make_trainer(writer=ScalarLog())
        if lowmem:
            qca_lowmem.enable(trainer)
        run_episodes(trainer, range(11))
        logs[lowmem] = trainer.writer.scalars
    tags = ["Loss/Total", "Metrics/Symmetry", "Metrics/Survival", "Environment/NoiseLevel"]
    assert [(tag, step) for tag, _, step in logs[False]] == [(tag, step) for step in (0, 10) for tag in tags]
    assert [(tag, step) for tag, _, step in logs[True]] == [(tag, step) for tag, _, step in logs[False]]
    for (_, lowmem, _), (_, stock_value, _) in zip(logs[True], logs[False]):
        assert lowmem == pytest.approx(stock_value, rel=1e-4, abs=1e-6)


def test_an_operator_left_off_the_trainers_device_is_refused():
    """Their V4 builds a new model on the CPU whatever its device: stock fails at the first episode
    on CUDA; the library must not quietly train on the CPU instead."""
    trainer = make_trainer()
    trainer.device = torch.device("cuda")
    with pytest.raises(ValueError, match=r"trainer's device is cuda, but its operator's parameters are on cpu.*"
                                         r"trainer.motor.operator.to\('cuda'\)"):
        qca_lowmem.enable(trainer)
    assert not hasattr(trainer, "_qca_lowmem_state")
    trainer.device = "cpu"
    qca_lowmem.enable(trainer)


def test_under_the_environment_switch_the_move_it_needs_is_still_said(monkeypatch, caplog):
    monkeypatch.setenv("QCA_LOWMEM", "1")
    trainer = make_trainer()
    trainer.device = torch.device("cuda")
    with caplog.at_level("WARNING", logger="qca_lowmem"):
        assert qca_lowmem.enable_from_config(trainer, None) is False
    assert [r.getMessage() for r in caplog.records] == [
        "off, QC_Trainer_v4 trains on stock: the trainer's device is cuda, but its operator's parameters are on cpu "
        "(QC_Trainer_v4 does not move a model it builds): move it first with trainer.motor.operator.to('cuda'); "
        "unset QCA_LOWMEM for it to silence this"]
    assert not hasattr(trainer, "_qca_lowmem_state")
