"""Options where they cannot do what they say: enable()'s line says what runs instead (V3's episode
has no noise for noise="fused"), a limit of torch's is named with the option that met it and the
fix (bf16 autocast reaching an op without a BFloat16 CPU kernel), and a refusal holds only where
its reason does (a compiled operator stepped by the engine itself is refused for the recompute,
not under checkpoint="none", where it trains as stock)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qca_lowmem
from fixtures.model_families import make_operator
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

D_STATE, HIDDEN = 2, 4


def config(dtype=torch.complex128):
    return make_config(grid=8, d_state=D_STATE, hidden=HIDDEN, qca_steps=3, gamma=0.05, dtype=dtype)


def test_v3_with_fused_noise_says_its_episode_has_none(caplog):
    trainer = QC_Trainer_v3(config(), operator=make_operator("unet_groupnorm", D_STATE, HIDDEN))
    with caplog.at_level("INFO", logger="qca_lowmem"):
        qca_lowmem.enable(trainer, noise="fused")
    line = caplog.records[-1].getMessage()
    assert "fused noise" not in line
    assert ", no noise (QC_Trainer_v3's episode has none; noise='fused' unread), " in line


class Resizing(nn.Module):
    """A convolution, then an antialiased resize (as their SNNUNet's skip path): torch has no
    BFloat16 CPU kernel for the resize."""

    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(2 * D_STATE, HIDDEN, 3, padding=1)
        self.outc = nn.Conv2d(HIDDEN, 2 * D_STATE, 1)

    def forward(self, x):
        h = F.interpolate(self.inc(x), size=(5, 5), mode="bilinear", antialias=True, align_corners=False)
        return 0.1 * self.outc(F.interpolate(h, size=x.shape[-2:], mode="bilinear", align_corners=False))


def test_bf16_on_an_op_without_a_cpu_kernel_names_the_option_and_the_fix():
    torch.manual_seed(0)
    trainer = QC_Trainer_v4(config(torch.complex64), operator=Resizing(), state_object=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(NotImplementedError, match="BFloat16"):
        trainer.motor.operator(torch.randn(1, 2 * D_STATE, 8, 8))  # torch's own limit, stock alike
    qca_lowmem.enable(trainer, amp_dtype="bf16")
    with pytest.raises(NotImplementedError, match=r"^qca_lowmem: amp_dtype='bf16': Resizing runs an op torch has no "
                                                  r"BFloat16 kernel for on the cpu \(.*not implemented for 'BFloat16'.*"
                                                  r"\), as stock would under the same autocast; amp_dtype='fp32' "
                                                  r"trains it in fp32$") as error:
        trainer.train_episode(0)
    assert isinstance(error.value.__cause__, NotImplementedError)
    qca_lowmem.disable(trainer)
    qca_lowmem.enable(trainer, amp_dtype="fp32")
    loss, _, _ = trainer.train_episode(0)  # the fix it names trains
    assert loss == loss


def run(trainer, episodes=range(2)):
    torch.manual_seed(99)
    returned = [trainer.train_episode(e) for e in episodes]
    model = trainer.motor.get_model_for_params()
    return returned, [p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # torch.compile runs
@pytest.mark.parametrize("family", ["mlp", "unet_groupnorm"])
def test_a_compiled_operator_on_the_engines_own_step_trains_as_stock_without_recompute(family):
    def make():
        return QC_Trainer_v3(config(), operator=make_operator(family, D_STATE, HIDDEN), compile_operator=True)

    trainer = make()
    with pytest.raises(TypeError, match=r"with fused_step_ops=False; .*\n.* again in the backward"):
        qca_lowmem.enable(trainer, fused_step_ops=False)  # checkpoint="step" recomputes: two graphs
    qca_lowmem.enable(trainer, checkpoint="none", fused_step_ops=False, fused_blocks=False)
    torch._dynamo.reset()
    returned, weights, grads = run(trainer)
    torch._dynamo.reset()
    stock_returned, stock_weights, stock_grads = run(make())
    assert returned == stock_returned
    assert all(torch.equal(a, b) for a, b in zip(weights + grads, stock_weights + stock_grads, strict=True))


@pytest.mark.parametrize("wrap", ["a function", "a module without parameters"])
def test_an_operator_that_is_no_model_with_parameters_is_refused_naming_it(wrap):
    """A callable set on the engine in place of their model (stock calls it alike) gave an
    AttributeError from inside enable(): refused now, naming what it got, the trainer unchanged."""
    trainer = QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=2), state_object=True)
    model = trainer.motor.operator
    trainer.motor.operator = (lambda x: model(x)) if wrap == "a function" else nn.Identity()
    got = "function" if wrap == "a function" else "Identity"
    with pytest.raises(TypeError, match=rf"^enable\(\): motor.operator must be a torch.nn.Module with parameters "
                                        rf"\(the model the episodes train\); got {got}"):
        qca_lowmem.enable(trainer)
    assert not hasattr(trainer, "_qca_lowmem_state")


@pytest.mark.parametrize("option, refused", [
    (dict(grid_size=6), "UNetUnitary cannot take a 6x6 grid of d_state 2"),
    (dict(d_state=3), "UNetUnitary cannot take a 8x8 grid of d_state 3"),
])
def test_a_grid_or_d_state_the_model_cannot_take_is_refused_naming_them(option, refused):
    """Found by enable()'s probe call of the operator, not later from inside torch's ops."""
    trainer = QC_Trainer_v4(config())
    with pytest.raises(ValueError, match=refused):
        qca_lowmem.enable(trainer, **option)
