"""enable() gives the operator's convs outside its ConvBlocks (the stock U-Net's transposed convs and
output conv) the stand-ins' classes (convs.py) with its fused blocks while its episodes run, and
torch's between them. Under autocast their weights are cast once an episode, eager and captured, where autocast
cast them at every step's recompute and its gradient: the same run bit for bit."""

import contextlib

import pytest
import torch
from torch import nn

import qca_lowmem
from fixtures import replayed_graphs as stand_in
from fixtures.model_families import assert_same_run, run
from helpers import casts_in, classes_in_episodes
from qca_lowmem import convs
from qca_lowmem.atheria import switch
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(steps=3):
    torch.manual_seed(0)
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=steps, dtype=torch.complex64),
                         state_object=True)


def others_params(t):
    return [p for m in others(t) for p in m.parameters()]


def others(t):
    unet = t.motor.operator
    return [unet.up1, unet.up2, unet.outc]


def test_the_episodes_swap_the_convs_outside_the_blocks_and_give_them_back():
    """The stand-ins' classes while an episode runs; torch's between episodes and after disable()."""
    t = trainer()
    layers = others(t)
    torch_classes = [nn.ConvTranspose2d, nn.ConvTranspose2d, nn.Conv2d]
    qca_lowmem.enable(t, amp_dtype=torch.bfloat16)
    assert others(t) == layers and [type(m) for m in layers] == torch_classes
    modules = list(t.motor.operator.modules())
    with classes_in_episodes(t) as classes:
        t.train_episode(0)
    during = {id(m): cls for m, cls in zip(modules, classes[0], strict=True)}
    assert [during[id(m)] for m in layers] == [convs.ConvTranspose2d, convs.ConvTranspose2d, convs.Conv2d]
    assert all(during[id(m)] is nn.Conv2d for m in t.motor.operator.inc.modules() if isinstance(m, nn.Conv2d))
    assert [type(m) for m in layers] == torch_classes
    qca_lowmem.disable(t)
    assert [type(m) for m in layers] == torch_classes


def test_their_init_by_exact_class_between_episodes_reaches_every_layer():
    """A re-initialisation between episodes that picks layers by `type(m) == nn.Conv2d` (an idiom of
    torch's tutorials): every layer of theirs, as in stock (it once skipped the stand-ins')."""
    runs = {}
    for name in ("stock", "lowmem"):
        t = trainer()
        if name == "lowmem":
            qca_lowmem.enable(t)
        losses = []
        for episode in range(3):
            if episode:
                torch.manual_seed(episode)
                for m in t.motor.operator.modules():
                    if type(m) == nn.Conv2d or type(m) == nn.ConvTranspose2d:  # noqa: E721 (their idiom)
                        nn.init.normal_(m.weight, std=0.05)
            losses.append(t.train_episode(episode)[0])
        runs[name] = losses, [p.detach().clone() for p in t.motor.operator.parameters()]
    assert runs["lowmem"][0] == pytest.approx(runs["stock"][0], rel=1e-5)
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(runs["lowmem"][1], runs["stock"][1])) < 1e-4


def test_without_fused_blocks_the_convs_stay_torchs():
    t = trainer()
    qca_lowmem.enable(t, fused_blocks=False)
    assert [type(m) for m in others(t)] == [nn.ConvTranspose2d, nn.ConvTranspose2d, nn.Conv2d]


def enabled(monkeypatch, cast_convs, steps=3, **options):
    t = trainer(steps)
    if not cast_convs:
        monkeypatch.setattr(switch, "cast_convs_in_place", lambda module: [])
    qca_lowmem.enable(t, amp_dtype=torch.bfloat16, **options)
    monkeypatch.undo()
    return t


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_bf16_run_equals_the_run_with_torchs_convs(monkeypatch, checkpoint, slots, captured):
    def runs():
        options = dict(checkpoint=checkpoint, slots=slots, cuda_graph=captured)
        return [run(enabled(monkeypatch, cast_convs, **options)) for cast_convs in (False, True)]

    if captured:
        with stand_in.installed() as made:
            expected, got = runs()
        assert stand_in.replays(made) > 0
    else:
        expected, got = runs()
    assert_same_run(got, expected, rel=0)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_their_weights_are_cast_once_an_episode(monkeypatch, captured):
    """Autocast casts the three layers' weights and biases at every step's recompute and, in its
    backward, their gradients: 12 casts a step eagerly (the forward sweep runs in one autocast
    context, whose cache casts once), 18 captured (the forward graph's casts replay at each step
    too). Through the copies: one cast each an episode (a capture's made outside its graphs)."""
    casts = {}
    with stand_in.installed() if captured else contextlib.nullcontext():
        for cast_convs in (False, True):
            for steps in (3, 6):
                t = enabled(monkeypatch, cast_convs, steps, cuda_graph=captured)
                t.train_episode(0)
                casts[cast_convs, steps] = casts_in(lambda t=t: t.train_episode(1), others_params(t))
    assert casts[True, 3] == casts[True, 6] == 6
    assert casts[False, 6] - casts[False, 3] == 3 * (18 if captured else 12)
