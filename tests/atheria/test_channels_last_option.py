"""enable(channels_last=True): the operator's weights in NHWC (the same Parameters; the fused pack
is NHWC either way), episodes equal to NCHW weights' within rounding (float64), disable() back to
NCHW; refused where the step it needs is not the fused one. Unset: on where
precision.gpu_prefers_nhwc says (GPUs faked here: the rule reads the compute capability, the name
and the compute dtype) and the operator gets the fused step, off elsewhere (the CPU included)."""

import numpy
import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_operator
from helpers import follow
from qca_lowmem import precision, stock
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")


def small_trainer(**kw):
    torch.manual_seed(3)
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=2), **kw)


def trainer_of(**kw):
    torch.manual_seed(3)
    operator = stock.UNetUnitary(2, 8).double()
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=8, qca_steps=4, dtype=torch.complex128),
                         max_noise=0.5, operator=operator, state_object=True, **kw)


def episodes(trainer):
    torch.manual_seed(5)
    numpy.random.seed(5)
    results = [trainer.train_episode(e) for e in (2000, 2001)]
    return results, [p.detach().clone() for p in trainer.motor.operator.parameters()]


def test_channels_last_episodes_equal_nchw_and_disable_puts_the_layout_back(caplog):
    caplog.set_level("INFO", logger="qca_lowmem")
    nchw = trainer_of()
    qca_lowmem.enable(nchw)
    nhwc = trainer_of()
    params = list(nhwc.motor.operator.parameters())
    qca_lowmem.enable(nhwc, channels_last=True)
    assert caplog.records[-1].getMessage().endswith(", fused step, channels_last")
    weights = [p for p in nhwc.motor.operator.parameters() if p.dim() == 4]
    assert list(nhwc.motor.operator.parameters()) == params  # the same Parameter objects
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert any(not w.is_contiguous() for w in weights)  # a 1x1 kernel's layouts coincide; a 3x3's do not
    (expected, expected_weights), (actual, actual_weights) = episodes(nchw), episodes(nhwc)
    assert nhwc._qca_lowmem_state.fused is not None  # the fused step ran (test_operator_layouts.py: its pack)
    for (loss, _, psi), (loss_cl, _, psi_cl) in zip(expected, actual, strict=True):
        assert loss_cl == pytest.approx(loss, rel=1e-10, abs=0)
        assert (psi_cl - psi).abs().max() <= 1e-10
    assert max(((a - e).abs().max() / e.abs().max()).item() for a, e in zip(actual_weights, expected_weights)) <= 1e-9
    qca_lowmem.disable(nhwc)
    assert all(w.is_contiguous() for w in nhwc.motor.operator.parameters())



def test_disable_gives_back_the_layout_only_of_the_weights_enable_made_nhwc():
    """A researcher's own NHWC weights stay NHWC after disable(); those enable() changed are NCHW
    again, each the same Parameter."""
    trainer = trainer_of()
    theirs = trainer.motor.operator.inc.conv_block[0].weight
    theirs.data = theirs.data.contiguous(memory_format=torch.channels_last)
    params = list(trainer.motor.operator.parameters())
    qca_lowmem.enable(trainer, channels_last=True)
    qca_lowmem.disable(trainer)
    assert list(trainer.motor.operator.parameters()) == params
    assert not theirs.is_contiguous() and theirs.is_contiguous(memory_format=torch.channels_last)
    assert all(p.is_contiguous() for p in params if p is not theirs)

def test_channels_last_is_off_by_default_on_the_cpu_and_refused_without_the_fused_step():
    trainer = trainer_of()
    qca_lowmem.enable(trainer)
    assert not trainer._qca_lowmem_state.options.channels_last
    assert all(p.is_contiguous() for p in trainer.motor.operator.parameters())
    other = trainer_of()
    with pytest.raises(ValueError, match=r"channels_last needs the fused step \(fused_step_ops=True\)"):
        qca_lowmem.enable(other, channels_last=True, fused_step_ops=False)
    with_memory = QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=2), state_object=True,
                                operator=make_operator("convlstm", 2, 4), memory=True)
    with pytest.raises(ValueError, match=r"on an engine without memory, the step whose layouts it sets"):
        qca_lowmem.enable(with_memory, channels_last=True)
    with pytest.raises(ValueError, match=r"channels_last must be True, False or None \(on where it measured faster\), got 'yes'"):
        qca_lowmem.enable(other, channels_last="yes")
    assert not hasattr(other, "_qca_lowmem_state") and all(p.is_contiguous() for p in other.motor.operator.parameters())


def test_the_config_section_reads_channels_last(monkeypatch):
    calls = []
    monkeypatch.setattr("qca_lowmem.atheria.config_section.enable", lambda trainer, **options: calls.append(options))
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True, "channels_last": "on"}})
    assert calls == [{"channels_last": True}]


@pytest.mark.parametrize("capability, name, amp_dtype, tf32, expected", [
    ((9, 0), "NVIDIA H200", None, True, True),  # measured: fp32 (TF32), bf16 and fp16 faster NHWC
    ((9, 0), "NVIDIA H200", torch.bfloat16, True, True),
    ((9, 0), "NVIDIA H200", torch.float16, True, True),
    ((8, 6), "NVIDIA GeForce RTX 3050 Laptop GPU", None, True, True),  # inferred from here on
    ((8, 6), "NVIDIA GeForce RTX 3050 Laptop GPU", None, False, False),  # fp32 without TF32
    ((7, 5), "NVIDIA GeForce RTX 2060", torch.float16, True, True),
    ((7, 5), "NVIDIA GeForce RTX 2060", None, True, False),  # Turing has no TF32
    ((7, 5), "NVIDIA GeForce GTX 1650", torch.float16, True, False),  # Turing without Tensor Cores
    ((7, 0), "Tesla V100-SXM2-16GB", torch.float16, True, True),
    ((6, 1), "NVIDIA GeForce GTX 1050 Ti", torch.float16, True, False),
    ((9, 0), "NVIDIA H200", torch.float32, True, True),  # a float32 model without autocast
    ((9, 0), "NVIDIA H200", torch.float64, True, False),  # a float64 model: no TF32, never measured
])
def test_the_gpu_rule_is_tensor_core_convolutions(capability, name, amp_dtype, tf32, expected):
    assert precision.gpu_prefers_nhwc(capability, name, amp_dtype, tf32) is expected


@pytest.fixture
def gpu(monkeypatch):
    """A visible GPU of this compute capability and name, as torch.cuda reports it."""

    def install(capability, name):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return install


def test_nhwc_faster_reads_the_device(gpu, monkeypatch):
    gpu((9, 0), "NVIDIA H200")
    assert precision.nhwc_faster("cuda", None) and precision.nhwc_faster(torch.device("cuda:0"), torch.float16)
    assert not precision.nhwc_faster("cpu", torch.float16)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert not precision.nhwc_faster("cuda", None) and precision.nhwc_faster("cuda", torch.bfloat16)
    gpu((7, 5), "NVIDIA GeForce GTX 1650")
    assert not precision.nhwc_faster("cuda", torch.float16)


def test_enable_unset_is_off_on_the_cpu_as_before(caplog):
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = qca_lowmem.enable(small_trainer(state_object=True))
    assert trainer._qca_lowmem_state.options.channels_last is False
    assert "channels_last" not in caplog.records[-1].getMessage()
    assert all(p.is_contiguous() for p in trainer.motor.operator.parameters())


class Rounding(torch.nn.Module):
    """An operator whose output jumps with its input: it keeps the engine's own step."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return 0.05 * torch.round(self.conv(x) * 1e3) / 1e3


def test_enable_unset_follows_the_rule_and_the_engines_verdict(monkeypatch, caplog):
    """Where the rule says NHWC (faked here on the CPU), unset turns it on with the fused step and
    says so; for an operator that keeps the engine's own step, unset is off without an error."""
    caplog.set_level("INFO", logger="qca_lowmem")
    follow(monkeypatch, Rounding)  # recorded: enable() may call it to find its ops
    asked = []
    monkeypatch.setattr(precision, "nhwc_faster", lambda device, amp_dtype: asked.append(amp_dtype) or True)
    trainer = qca_lowmem.enable(small_trainer(state_object=True))
    assert asked == [torch.float32] and trainer._qca_lowmem_state.options.channels_last
    assert caplog.records[-1].getMessage().endswith(", fused step, channels_last")
    assert any(not p.is_contiguous() for p in trainer.motor.operator.parameters())
    trainer.train_episode(0)
    kept = qca_lowmem.enable(small_trainer(state_object=True, operator=Rounding()))
    assert not kept._qca_lowmem_state.options.channels_last and "evolve_step" not in vars(kept.motor)
    # the engine's verdict, taken before the options froze: its own step, said, and no fused step or blocks
    assert "output jumps" in kept._qca_lowmem_state.options.own_step
    assert not kept._qca_lowmem_state.options.fused_step_ops and not kept._qca_lowmem_state.options.fused_blocks
    assert "channels_last" not in caplog.records[-1].getMessage()
    assert all(p.is_contiguous() for p in kept.motor.operator.parameters())
    with pytest.raises(ValueError, match=r"channels_last=True needs the fused step"):
        qca_lowmem.enable(small_trainer(state_object=True, operator=Rounding()), channels_last=True)
    unfused = qca_lowmem.enable(small_trainer(state_object=True), fused_step_ops=False)
    assert not unfused._qca_lowmem_state.options.channels_last
