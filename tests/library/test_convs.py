"""The convolutions' stand-ins (convs.py): a users' nn.Conv2d or nn.ConvTranspose2d swapped in place
takes its weight and bias from the episode's half-precision copies inside a rollout's step under
autocast, with autocast's values and gradients bit for bit and one cast an episode; torch's forward
runs where it may not (no autocast, outside an episode, a hook, `output_size`, float64 weights),
it keeps its identity and is given torch's class back; convert() gives them to a stock U-Net's
convs outside its blocks."""

import copy
import pickle

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import casts_in
from qca_lowmem import convs, stock
from qca_lowmem.recompute.weight_casts import WeightCasts

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = {
    "conv1x1": lambda: nn.Conv2d(6, 4, 1),
    "conv3x3_no_bias": lambda: nn.Conv2d(6, 4, 3, padding=1, bias=False),
    "transposed": lambda: nn.ConvTranspose2d(6, 4, 2, stride=2),
}


def swapped(layer):
    assert convs.cast_convs_in_place(nn.Sequential(layer)) == [layer]
    return layer


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", LAYERS)
def test_in_an_episode_autocasts_bits_with_one_cast(name, channels_last):
    """Two calls under one episode's copies: each autocast's values and weight gradients, bit for
    bit, of a fresh autocast context each (as each step's recompute has); the weights cast once."""
    torch.manual_seed(0)
    reference = LAYERS[name]()
    layer = swapped(copy.deepcopy(reference))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    xs = [torch.randn(1, 6, 5, 7).contiguous(memory_format=fmt) for _ in range(2)]
    casts = WeightCasts()

    def forwards():
        for x in xs:
            with casts.active(), torch.autocast("cpu", dtype=torch.bfloat16):
                outputs.append(layer(x))

    outputs = []
    params = list(layer.parameters())
    assert casts_in(forwards, params) == len(params)  # a weight's copy made at its first use
    for y in outputs:
        y.float().square().sum().backward()
    for x, y in zip(xs, outputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(x)
        expected.float().square().sum().backward()
        assert y.dtype == expected.dtype == torch.bfloat16 and y.stride() == expected.stride()
        assert torch.equal(y, expected)
    for p, q in zip(layer.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name", LAYERS)
def test_outside_an_episode_or_autocast_torchs_forward_runs(name):
    torch.manual_seed(0)
    reference = LAYERS[name]()
    layer = swapped(copy.deepcopy(reference))
    x = torch.randn(1, 6, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        params = list(layer.parameters())
        assert casts_in(lambda: layer(x), params) == casts_in(lambda: reference(x), params) == len(params)
        assert torch.equal(layer(x), reference(x))
    casts = WeightCasts()
    with casts.active():
        assert torch.equal(layer(x), reference(x)) and casts.copies() == []


def double_the_weight(module, args):
    module.weight.data.mul_(2.0)


def test_a_hooked_call_runs_torchs_forward():
    """A hook may edit the weight without a version bump (through .data), which the copies would
    not see: the hooked call runs torch's forward and reads the weight as it is."""
    torch.manual_seed(0)
    layer = swapped(nn.Conv2d(6, 4, 1))
    x = torch.randn(1, 6, 4, 4)
    casts = WeightCasts()
    with casts.active(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)  # the copy made
        handle = layer.register_forward_pre_hook(double_the_weight)
        y = layer(x)
        handle.remove()
        expected = nn.Conv2d.forward(layer, x)
    assert torch.equal(y, expected)


def test_output_size_and_float64_run_torchs_forward():
    torch.manual_seed(0)
    reference = nn.ConvTranspose2d(6, 4, 3, stride=2)
    layer = swapped(copy.deepcopy(reference))
    x = torch.randn(1, 6, 4, 4)
    casts = WeightCasts()
    with casts.active(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x, output_size=[10, 10]), reference(x, output_size=[10, 10]))
        assert casts.copies() == []
        double = swapped(nn.Conv2d(6, 4, 1).double())
        assert double(x.double()).dtype == torch.float64 and casts.copies() == []


def test_the_swap_keeps_the_object_leaves_blocks_and_gives_the_class_back():
    class Theirs(nn.Conv2d):
        pass

    block = stock.ConvBlock(4, 4)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), Theirs(4, 4, 1), block, nn.Sequential(nn.ConvTranspose2d(4, 2, 2)))
    before = repr(model)
    first, theirs, nested = model[0], model[1], model[3][0]
    done = convs.cast_convs_in_place(model)
    assert done == [first, nested] and type(theirs) is Theirs
    assert all(type(m) is nn.Conv2d for m in block.modules() if isinstance(m, nn.Conv2d))
    assert type(first) is convs.Conv2d and type(nested) is convs.ConvTranspose2d and model[0] is first
    assert isinstance(first, nn.Conv2d) and isinstance(nested, nn.ConvTranspose2d) and repr(model) == before
    convs.uncast_convs(done)
    assert type(first) is nn.Conv2d and type(nested) is nn.ConvTranspose2d and repr(model) == before


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
@pytest.mark.parametrize("name", LAYERS)
def test_copies_pickles_script_and_compile(name):
    torch.manual_seed(0)
    reference = LAYERS[name]()
    layer = swapped(copy.deepcopy(reference))
    x = torch.randn(1, 6, 4, 4)
    expected = reference(x)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(copied) is type(layer) and torch.equal(copied(x), expected)
    assert torch.equal(torch.jit.script(layer)(x), expected)
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), expected)


def episode(model, steps):
    """A bf16 episode of the step recompute on `model`: the loss, then the parameters' gradients."""
    def step(psi):
        return qca_lowmem.qca_update(psi, model(qca_lowmem.qca_pack(psi, torch.bfloat16)), 0.0, multiplicative=True)

    psi0 = stock.initial_state(1, 8, 2, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, history = qca_lowmem.rollout(step, psi0, steps, checkpoint="step", record_every=steps)
    loss, _ = stock.evolutionary_loss(history, psi0)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_convert_gives_a_stock_unets_other_convs_the_copies():
    """convert() casts the transposed convs and the output conv from the episode's copies: a bf16
    episode of the step recompute casts their weights once (not at every step's recompute and
    gradient), with the loss and gradients of the model converted without them, bit for bit."""
    torch.manual_seed(0)
    model = stock.UNetUnitary(2, 8)
    reference, reference_report = qca_lowmem.convert(copy.deepcopy(model), cast_convs=False)
    assert reference_report.convs == [] and type(reference.outc) is nn.Conv2d
    _, report = qca_lowmem.convert(model)
    assert report.convs == ["up1", "up2", "outc"] and "gave 3 conv layer(s)" in str(report)
    assert type(model.up1) is convs.ConvTranspose2d and type(model.outc) is convs.Conv2d
    loss, grads = episode(model, 4)
    expected_loss, expected_grads = episode(reference, 4)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    others = [p for m in (model.up1, model.up2, model.outc) for p in m.parameters()]
    casts = [casts_in(lambda m=m, n=n: episode(m, n), others) for m in (model, reference) for n in (4, 8)]
    assert casts[1] == casts[0] and casts[3] - casts[2] == 4 * 12  # 6 casts a recompute, 6 of their gradients
    assert qca_lowmem.convert(model)[1].convs == []  # already cast


def test_the_fused_unet_keeps_torchs_conv_classes():
    """Its wiring casts them itself, so StockForward over it runs torch's layers."""
    model = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)
    assert type(model.up1) is nn.ConvTranspose2d and type(model.outc) is nn.Conv2d
