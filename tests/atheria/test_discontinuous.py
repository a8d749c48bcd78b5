"""An operator whose output jumps with its input (spikes, as the users' SNNUNet) on a
QC_Trainer_v3-style trainer in float32: the fused step rounds differently from the engine's own
step by about one unit, which the jumps turn into another episode, so enable() keeps the
engine's own step (and blocks) for it and says so; the episodes are then stock's, bit for bit."""

import pytest
import torch

import qca_lowmem
from helpers import follow
from qca_lowmem.atheria.discontinuity import discontinuity
from qca_lowmem.examples import QC_Trainer_v3, make_config
from qca_lowmem.ops.qca_step import qca_pack

pytestmark = pytest.mark.usefixtures("one_thread")


class Spiking(torch.nn.Module):
    """Spikes where the membrane's fine digits pass a threshold: a rounding of psi moves many."""

    def __init__(self, d_state):
        super().__init__()
        self.conv = torch.nn.Conv2d(2 * d_state, 2 * d_state, 3, padding=1)

    def forward(self, x):
        membrane = self.conv(x)
        spikes = (torch.remainder(membrane * 1e6, 1.0) > 0.5).float()
        return 0.05 * spikes * torch.tanh(membrane)  # the gradient flows through the tanh


def trainer():
    torch.manual_seed(0)
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=6, gamma=0.05)
    return QC_Trainer_v3(cfg, operator=Spiking(2), batch_size=2, lr=1e-2)


def episodes(trainer):
    torch.manual_seed(1)
    losses = [trainer.train_episode(e) for e in range(3)]
    return losses, [p.detach().clone() for p in trainer.motor.operator.parameters()]


def test_a_discontinuous_operator_keeps_the_engines_step_and_trains_as_stock(caplog, monkeypatch):
    follow(monkeypatch, Spiking)  # recorded: enable() may call it to find its ops
    expected = episodes(trainer())
    enabled = trainer()
    with caplog.at_level("INFO", logger="qca_lowmem"):
        qca_lowmem.enable(enabled)
    assert "the engine's own step and blocks: Spiking's output jumps with its input" in caplog.text
    assert "fused step" not in caplog.text.split("the engine's own step")[0]
    assert "evolve_step" not in vars(enabled.motor)
    losses, weights = episodes(enabled)
    assert losses == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(weights, expected[1]))


def test_continuous_operators_are_not_discontinuous():
    torch.manual_seed(0)
    x = qca_pack(torch.randn(1, 8, 8, 2, dtype=torch.complex64))
    leaky = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.LeakyReLU(0.1), torch.nn.Dropout(0.2))
    for operator in (qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8), leaky, torch.nn.Threshold(0.5, 0.5)):
        assert discontinuity(operator, x, memory=False) is None
    # Not shown continuous op by op (an allowlist): a ReLU written as a mask keeps the engine's own step.
    relu_by_mask = type("ReluByMask", (torch.nn.Module,), {"forward": lambda self, x: x.masked_fill(x < 0, 0.0)})()
    assert discontinuity(relu_by_mask, x, memory=False).startswith("aten::lt of a value computed from its input")
    assert "sign" in discontinuity(type("Sign", (torch.nn.Module,), {"forward": lambda self, x: x.sign()})(), x, False)
    assert "threshold" in discontinuity(torch.nn.Threshold(0.5, 0.0), x, memory=False)


class Membrane(torch.nn.Module):
    """Keeps its membrane as a buffer rebound at every call (`self.mem = ...`), as snntorch's
    neurons do: a recompute binds it again, which no op shows."""

    def __init__(self, d_state):
        super().__init__()
        self.conv = torch.nn.Conv2d(2 * d_state, 2 * d_state, 3, padding=1)
        self.register_buffer("mem", torch.zeros(()))

    def forward(self, x):
        self.mem = torch.tanh(self.conv(x))
        return 0.05 * self.mem


@pytest.mark.parametrize("checkpoint", ["step", "revolve", "auto"])
def test_a_buffer_rebound_by_each_step_ends_as_the_forward_left_it(checkpoint):
    """What stock leaves bound is the last forward step's membrane; the recomputes bind earlier
    steps' again, which enable() puts back after the backward."""
    def membrane_trainer():
        torch.manual_seed(0)
        cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=6, gamma=0.05)
        return QC_Trainer_v3(cfg, operator=Membrane(2), batch_size=2, lr=1e-2)

    stock = membrane_trainer()
    expected = episodes(stock)
    enabled = membrane_trainer()
    qca_lowmem.enable(enabled, checkpoint=checkpoint, **({"slots": 2} if checkpoint == "revolve" else {}),
                      **({"budget": 1} if checkpoint == "auto" else {}))
    losses, weights = episodes(enabled)
    assert [x for row in losses for x in row] == pytest.approx([x for row in expected[0] for x in row], rel=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(weights, expected[1]))
    assert torch.allclose(enabled.motor.operator.mem, stock.motor.operator.mem, rtol=1e-5, atol=1e-7)


def test_the_probes_leave_a_rebound_buffer_as_found(monkeypatch):
    """enable()'s probe of the operator's jumps runs it once: a buffer it rebinds is bound back."""
    follow(monkeypatch, Membrane)  # recorded: enable() may call it to find its ops
    torch.manual_seed(0)
    trainer = QC_Trainer_v3(make_config(grid=8, d_state=2, hidden=4, qca_steps=2), operator=Membrane(2))
    before = trainer.motor.operator.mem
    qca_lowmem.enable(trainer)
    assert trainer.motor.operator.mem is before
