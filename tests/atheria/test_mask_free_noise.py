"""The users' boolean-mask noise (stock.NoiseInjector is their QuantumNoiseInjector's code)
replayed without host waits (atheria/mask_free_noise.py): the same draws in the same order, the
generators left where theirs leave them, the same flips, and no op that waits for the device in a
step of enable()'s episode, eager or recomputed (captured: test_step_graph_replayed.py)."""

import os
import subprocess
import sys

import numpy
import pytest
import torch

import qca_lowmem
from helpers import host_waits
from qca_lowmem import stock
from qca_lowmem.atheria import mask_free_noise
from qca_lowmem.atheria.mask_free_noise import MaskFreeInjector, follows, without_host_waits
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(1, 8, 8, 4), (2, 5, 7, 3), (1, 1, 3, 1), (1, 16, 16, 14)]
NOISY_EPISODE = 2000  # the curriculum's full rate


def flipped(injector, method, psi, rate, seed=5):
    torch.manual_seed(seed)
    out = getattr(injector, method)(psi, rate)
    return out, torch.get_rng_state()


def bits(tensor):
    return torch.view_as_real(tensor)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_the_replay_draws_and_flips_as_theirs(shape, dtype, rate):
    """Bit flips bitwise theirs; phase flips on the same cells with the same angles, the product
    within one rounding (the CPU's vectorised loop rounds some elements differently by where they
    lie: bitwise under torch's scalar CPU kernels, the slow test below); the generator after
    either the same."""
    psi = torch.randn(shape, dtype=dtype)
    theirs, ours = stock.NoiseInjector(), MaskFreeInjector("cpu")
    for method in ("apply_bit_flip", "apply_phase_flip"):
        (expected, rng_theirs), (actual, rng_ours) = flipped(theirs, method, psi, rate), flipped(ours, method, psi, rate)
        assert torch.equal(rng_ours, rng_theirs) and actual.dtype == expected.dtype
        assert torch.equal(actual != psi, expected != psi), method
        if method == "apply_bit_flip":
            assert torch.equal(bits(actual), bits(expected))
        else:
            eps = torch.finfo(psi.real.dtype).eps
            assert (actual - expected).abs().max() <= 2 * eps * psi.abs().max()


@pytest.mark.slow
def test_the_replay_is_bitwise_theirs_under_scalar_cpu_kernels():
    """With torch's CPU kernels at their scalar capability every element's product runs the same
    code, as on a GPU: the phase flips too are bitwise theirs."""
    code = (
        "import torch\nfrom qca_lowmem import stock\nfrom qca_lowmem.atheria.mask_free_noise import MaskFreeInjector\n"
        f"for shape in {SHAPES!r}:\n"
        "    for dtype in (torch.complex64, torch.complex128):\n"
        "        psi = torch.randn(shape, dtype=dtype)\n"
        "        torch.manual_seed(1); a = stock.NoiseInjector().apply_phase_flip(psi, 0.4)\n"
        "        torch.manual_seed(1); b = MaskFreeInjector('cpu').apply_phase_flip(psi, 0.4)\n"
        "        assert torch.equal(torch.view_as_real(a), torch.view_as_real(b)), (shape, dtype)\n"
        "print(torch.backends.cpu.get_cpu_capability())\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "DEFAULT"


def test_only_the_followed_injector_is_replayed_and_only_where_an_index_waits(monkeypatch):
    theirs = stock.NoiseInjector()
    assert follows(theirs) and without_host_waits(theirs) is theirs  # on the CPU an index waits for nothing

    class Edited(stock.NoiseInjector):
        def apply_bit_flip(self, psi, rate=0.005):
            return -psi

    over_the_instance = stock.NoiseInjector()
    over_the_instance.apply_phase_flip = lambda psi, rate: psi
    no_device = stock.NoiseInjector()
    del no_device.device
    monkeypatch.setattr(mask_free_noise, "index_waits", lambda device: True)
    assert isinstance(without_host_waits(theirs), MaskFreeInjector) and without_host_waits(theirs).device == "cpu"
    for other in (Edited(), over_the_instance, no_device):
        assert not follows(other) and without_host_waits(other) is other


def noisy_trainer(steps, dtype=torch.complex64):
    torch.manual_seed(3)
    operator = stock.UNetUnitary(2, 4).to(torch.float64 if dtype == torch.complex128 else torch.float32)
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=steps, dtype=dtype), max_noise=0.5,
                         state_object=True, operator=operator)


def episode_waits(steps, **options):
    trainer = noisy_trainer(steps)
    qca_lowmem.enable(trainer, **options)
    numpy.random.seed(0)
    trainer.train_episode(NOISY_EPISODE)  # the first: lazy initialisations
    numpy.random.seed(0)
    return host_waits(lambda: trainer.train_episode(NOISY_EPISODE))


@pytest.mark.parametrize("checkpoint", ["none", "step"])
def test_no_host_wait_in_a_step_of_the_default_episode(monkeypatch, checkpoint):
    """A noisy episode through enable(), its noise the users' injector's: as on CUDA, its steps
    (and their recomputes) wait for nothing; the episode's own reads (the loss, its metrics) do
    not grow with the steps. Their own code, run on the CPU, waits in every step."""
    theirs = [episode_waits(steps, checkpoint=checkpoint) for steps in (3, 6)]
    assert theirs[1] >= theirs[0] + 3 * 2
    monkeypatch.setattr(mask_free_noise, "index_waits", lambda device: True)
    replayed = [episode_waits(steps, checkpoint=checkpoint) for steps in (3, 6)]
    assert replayed[0] == replayed[1] < theirs[0]


@pytest.mark.parametrize("checkpoint,options", [("none", {}), ("step", {}), ("revolve", {"slots": 2})])
def test_episodes_with_the_replay_equal_stocks(monkeypatch, checkpoint, options):
    """Loss, final psi and weights after three noisy episodes against the stand-in's own stock
    episode with the users' masked noise, complex128, every policy."""
    runs = []
    for replay in (False, True):
        monkeypatch.setattr(mask_free_noise, "index_waits", lambda device, replay=replay: replay)
        trainer = noisy_trainer(5, torch.complex128)
        if replay:
            qca_lowmem.enable(trainer, checkpoint=checkpoint, **options)
        torch.manual_seed(7)
        numpy.random.seed(7)
        episodes = [trainer.train_episode(e) for e in (NOISY_EPISODE, NOISY_EPISODE + 1, NOISY_EPISODE + 2)]
        runs.append((episodes, [p.detach().clone() for p in trainer.motor.operator.parameters()],
                     torch.get_rng_state(), numpy.random.get_state()[1].copy()))
    (stock_episodes, stock_weights, stock_rng, stock_np), (episodes, weights, rng, np_state) = runs
    for (loss, _, psi), (stock_loss, _, stock_psi) in zip(episodes, stock_episodes, strict=True):
        assert loss == pytest.approx(stock_loss, rel=1e-10, abs=0)
        assert (psi - stock_psi).abs().max() <= 1e-10 * stock_psi.abs().max()
    assert max(((w - s).abs().max() / s.abs().max()).item() for w, s in zip(weights, stock_weights)) <= 1e-9
    assert torch.equal(rng, stock_rng) and (np_state == stock_np).all()
