"""enable(channels_last=True): the operator's weights (the same Parameters) and the fused pack in
NHWC, episodes equal to NCHW's within rounding (float64), disable() back to NCHW; refused where
the step it needs is not the fused one. Off by default until a GPU measurement decides."""

import numpy
import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_operator
from qca_lowmem import stock
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")


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
    layouts = []
    nhwc.motor.operator.register_forward_pre_hook(
        lambda module, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last)
                                            and not args[0].is_contiguous()))
    (expected, expected_weights), (actual, actual_weights) = episodes(nchw), episodes(nhwc)
    assert layouts and all(layouts)  # the fused pack writes NHWC
    for (loss, _, psi), (loss_cl, _, psi_cl) in zip(expected, actual, strict=True):
        assert loss_cl == pytest.approx(loss, rel=1e-10, abs=0)
        assert (psi_cl - psi).abs().max() <= 1e-10
    assert max(((a - e).abs().max() / e.abs().max()).item() for a, e in zip(actual_weights, expected_weights)) <= 1e-9
    qca_lowmem.disable(nhwc)
    assert all(w.is_contiguous() for w in nhwc.motor.operator.parameters())


def test_channels_last_is_off_by_default_and_refused_without_the_fused_step():
    trainer = trainer_of()
    qca_lowmem.enable(trainer)
    assert not trainer._qca_lowmem_state.options.channels_last
    assert all(p.is_contiguous() for p in trainer.motor.operator.parameters())
    other = trainer_of()
    with pytest.raises(ValueError, match=r"channels_last needs the fused step \(fused_step_ops=True\)"):
        qca_lowmem.enable(other, channels_last=True, fused_step_ops=False)
    with_memory = QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=2), state_object=True,
                                operator=make_operator("convlstm", 2, 4), memory=True)
    with pytest.raises(ValueError, match=r"on an engine without memory: .* a ConvLSTM's memory, are NCHW"):
        qca_lowmem.enable(with_memory, channels_last=True)
    with pytest.raises(ValueError, match=r"channels_last must be True or False, got 'yes'"):
        qca_lowmem.enable(other, channels_last="yes")
    assert not hasattr(other, "_qca_lowmem_state") and all(p.is_contiguous() for p in other.motor.operator.parameters())


def test_the_config_section_reads_channels_last(monkeypatch):
    calls = []
    monkeypatch.setattr("qca_lowmem.atheria.config_section.enable", lambda trainer, **options: calls.append(options))
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True, "channels_last": "on"}})
    assert calls == [{"channels_last": True}]
