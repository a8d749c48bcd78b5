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


def swapped_and_torchs(name):
    """The layer `name` of LAYERS given the stand-in's class, a copy of it left torch's, an input."""
    torch.manual_seed(0)
    reference = LAYERS[name]()
    return swapped(copy.deepcopy(reference)), reference, torch.randn(1, 6, 4, 4)


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
    layer, reference, x = swapped_and_torchs(name)
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
    layer, reference, x = swapped_and_torchs(name)
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


def real_episode(model, step, psi0, steps=3, **options):
    """A bf16 episode (rollout `options`) of a state (B, C, H, W) through `step(model, psi)`: the
    loss, psi_T and the gradients."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        psi, history = qca_lowmem.rollout(lambda p: step(model, p), psi0, steps, record_every=1, **options)
    loss = sum(h.abs().square().sum() for h in history)
    loss.backward()
    return loss.detach(), psi.detach(), [p.grad.clone() for p in model.parameters()]


def assert_episodes_equal(model, step, psi0, gradients_bitwise=True, **options):
    """The episode with the stand-ins: torch's loss and psi_T, bit for bit, and its gradients (or,
    where autocast sums several steps' gradients of one cached cast in bf16, to that rounding)."""
    ours = copy.deepcopy(model)
    assert convs.cast_convs_in_place(ours)
    got, expected = real_episode(ours, step, psi0, **options), real_episode(model, step, psi0, **options)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for g, e in zip(got[2], expected[2], strict=True):
        # bf16 sums of a few steps' gradients that nearly cancel (the loss is a norm): 1% of the largest
        assert torch.equal(g, e) if gradients_bitwise else (g - e).abs().max() <= 0.05 * e.abs().max()


def residual_step(model, psi):
    y = psi + 0.1 * model(psi).to(psi.dtype)
    return y / y.abs().square().sum().sqrt()


@pytest.mark.parametrize("checkpoint", ["step", "revolve", "auto"])
def test_a_conv_on_the_float32_state_takes_the_copies_and_autocasts_bits(checkpoint):
    """The state itself in float32, a leaf the no-grad forward hands each step: its cast is the
    stand-in's own (autocast's cache would keep it past the step, an escape the rollout refuses).
    "auto" keeps whole steps, where autocast's one cast of a weight sums their gradients in bf16."""
    torch.manual_seed(0)
    options = {"revolve": dict(slots=2), "auto": dict(budget=2**20, gradients_bitwise=False)}.get(checkpoint, {})
    assert_episodes_equal(nn.Conv2d(2, 2, 3, padding=1), residual_step, torch.randn(1, 2, 6, 6),
                          checkpoint=checkpoint, **options)


def test_complex_weights_run_torchs_forward():
    """autocast casts no complex tensor: a complex conv on the complex state is left to torch."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1, dtype=torch.complex64)
    assert_episodes_equal(conv, residual_step, torch.randn(1, 2, 6, 6, dtype=torch.complex64))


def test_half_weights_get_autocasts_gradient_bits():
    """An fp16 weight under bf16 autocast: its gradient rounded to fp16 before it is added, as
    torch's cast does, not added from bf16 in one rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 1).half())
    assert_episodes_equal(model, residual_step, torch.randn(1, 2, 6, 6))


def test_a_parameter_changed_in_place_during_the_episode_is_refused():
    """autocast's cache keeps the first cast for the episode; the copies would follow the change:
    neither computes the other's answer, so the episode stops, saying why."""
    torch.manual_seed(0)
    model = swapped(nn.Conv2d(2, 2, 1))

    def decaying(model, psi):
        out = residual_step(model, psi)
        with torch.no_grad():
            model.weight.mul_(0.5)
        return out

    with pytest.raises(RuntimeError, match=r"a \(2, 2, 1, 1\) float32 parameter changed in place during the episode"):
        real_episode(model, decaying, torch.randn(1, 2, 6, 6), checkpoint="none")


def test_uncast_gives_a_parametrized_conv_torchs_class_too():
    conv = swapped(nn.Conv2d(2, 2, 1))
    torch.nn.utils.parametrizations.weight_norm(conv)
    convs.uncast_convs([conv])
    assert convs.Conv2d not in type(conv).__mro__ and nn.Conv2d in type(conv).__mro__
    torch.nn.utils.parametrize.remove_parametrizations(conv, "weight")
    assert type(conv) is nn.Conv2d


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
