"""The pack writes the operator's input in autocast's dtype where the operator is proved to cast it
so first and read it nowhere else (`unet.input_dtype`): qca_lowmem's UNetUnitary running fused, and
a module whose forward is stock UNetUnitary's by its code, `inc` a fused block, no hook. Then the
step is bit for bit the one packing float32 and casting in the block, with that cast's copy and its
gradient's gone; anywhere it is not proved the pack writes float32."""

import numpy
import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import follow
from qca_lowmem import stock
from qca_lowmem.atheria import engine_step
from qca_lowmem.examples import QC_Trainer_v4, make_config
from qca_lowmem.ops.qca_step import fused_step
from qca_lowmem.unet import input_dtype

pytestmark = pytest.mark.usefixtures("one_thread")
PSI = stock.initial_state(1, 8, 2)


def converted_stock_unet():
    return qca_lowmem.convert(stock.UNetUnitary(2, 8))[0]


class TheirUNetUnitary(stock.UNetUnitary):
    """The users' UNetUnitary.forward as their file writes it (its own local names)."""

    def forward(self, x_cat):
        x1 = self.inc(x_cat)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        b = self.bot(x3)
        u1 = self.up1(b)
        s1 = torch.cat([u1, x2], dim=1)
        c1 = self.conv_up1(s1)
        u2 = self.up2(c1)
        s2 = torch.cat([u2, x1], dim=1)
        c2 = self.conv_up2(s2)
        delta_psi = self.outc(c2)
        return delta_psi


class EditedForward(stock.UNetUnitary):
    def forward(self, x_cat):
        return super().forward(x_cat) + 0 * x_cat.sum()  # reads x outside inc


class IncOnTheClass(stock.UNetUnitary):
    inc = None


def dtype_under_bf16(operator, psi=PSI):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return input_dtype(operator, psi)


def test_autocast_s_dtype_only_where_proved():
    ours, theirs = qca_lowmem.UNetUnitary(2, 8), converted_stock_unet()
    assert dtype_under_bf16(ours) == dtype_under_bf16(theirs) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert input_dtype(ours, PSI) == torch.float16
    assert input_dtype(ours, PSI) is None  # no autocast
    assert dtype_under_bf16(ours, PSI.to(torch.complex128)) is None  # a float64 input is not cast
    assert dtype_under_bf16(qca_lowmem.convert(TheirUNetUnitary(2, 8))[0]) == torch.bfloat16
    assert dtype_under_bf16(stock.UNetUnitary(2, 8)) is None  # inc not fused
    assert dtype_under_bf16(qca_lowmem.convert(EditedForward(2, 8))[0]) is None
    assert dtype_under_bf16(qca_lowmem.convert(IncOnTheClass(2, 8))[0]) is None
    assert dtype_under_bf16(qca_lowmem.UNetUnitary(2, 8, recompute="none")) == torch.bfloat16
    for make in (lambda: qca_lowmem.UNetUnitary(2, 8), converted_stock_unet):
        hooked = make()
        handle = hooked.inc.register_forward_pre_hook(lambda module, args: None)  # would see x's dtype
        assert dtype_under_bf16(hooked) is None
        handle.remove()
        assert dtype_under_bf16(hooked) == torch.bfloat16
        hooked.inc.conv_block[0].forward = lambda x: x  # a forward set on the instance
        assert dtype_under_bf16(hooked) is None
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert dtype_under_bf16(qca_lowmem.UNetUnitary(2, 8)) is None
    finally:
        handle.remove()


def episode(make_operator, proved, dtype, checkpoint):
    """psi_T, psi_0's gradient and the parameters' of an autocast episode of the fused step, the
    pack writing the proved dtype or float32; and the float32 input casts it ran."""
    torch.manual_seed(0)
    operator = make_operator()
    step = fused_step(operator, 0.01, True, input_dtype=input_dtype if proved else None)
    psi0 = stock.initial_state(1, 8, 2).requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=dtype):
            psi_T, history = qca_lowmem.rollout(step, psi0, 3, checkpoint=checkpoint)
            loss, _ = stock.evolutionary_loss(history, psi0)
        loss.backward()
    input_casts = sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                      and e.input_shapes[0] == [1, 4, 8, 8])
    return [psi_T.detach(), psi0.grad] + [p.grad for p in operator.parameters()], input_casts


@pytest.mark.parametrize("checkpoint", ["step", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("make_operator", [lambda: qca_lowmem.UNetUnitary(2, 8), converted_stock_unet],
                         ids=["ours", "stock_converted"])
def test_a_half_pack_gives_the_float_pack_s_bits_without_its_casts(make_operator, dtype, checkpoint):
    (floats, casts), (halves, no_casts) = (episode(make_operator, proved, dtype, checkpoint) for proved in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(floats, halves, strict=True))
    assert casts > 0 and no_casts == 0  # the block's cast of the input and its gradient's, at every step


def trainer(**kw):
    torch.manual_seed(3)
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=8, qca_steps=3), max_noise=0.5, **kw)


def test_enable_s_step_packs_the_proved_dtype_with_the_same_bits(monkeypatch):
    follow(monkeypatch)

    def episodes(decide):
        packed = []
        monkeypatch.setattr(engine_step, "input_dtype", lambda operator, psi: packed.append(decide(operator, psi))
                            or packed[-1])
        t = trainer()
        qca_lowmem.enable(t, amp_dtype="bf16", channels_last=False)
        torch.manual_seed(5)
        numpy.random.seed(5)
        losses = [t.train_episode(e) for e in (2000, 2001)]
        return losses, [p.detach().clone() for p in t.motor.operator.parameters()], set(packed)

    proved, floats = episodes(input_dtype), episodes(lambda operator, psi: None)
    assert torch.bfloat16 in proved[2] and floats[2] == {None}  # (None: calls outside autocast, the probe's)
    assert repr(proved[0]) == repr(floats[0]) and all(torch.equal(a, b) for a, b in zip(proved[1], floats[1]))
