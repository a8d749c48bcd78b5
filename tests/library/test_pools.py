"""The max pooling's stand-in (pools.py): a users' nn.MaxPool2d swapped in place computes what
torch's computes, through max_pool2x2 where it may and torch's forward where it may not (a hook,
other settings, a mode of the caller's, compiled code, a device the op does not run on), keeps its
identity, and is given torch's class back; the fused U-Net takes the op for its own pools. The op
runs on CUDA alone (pools.OP_DEVICES): here the CPU is added to its devices, as a GPU has it."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qca_lowmem
from helpers import DEVICES, op_names, pool_specials
from qca_lowmem import pools, stock

OP = "qca_lowmem::max_pool2x2"


pytestmark = pytest.mark.usefixtures("max_pool_op_on_the_cpu")


def fused(pool):
    assert pools.fuse_pools_in_place(nn.Sequential(pool)) == [pool]
    return pool


def assert_pools_alike(pool, reference, x, uses_op):
    """pool(x) and reference(x) on copies of x: the same values, strides and gradient bits; pool
    ran max_pool2x2 exactly when `uses_op`."""
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = {}
    names = op_names(lambda: out.update(y=pool(ours)))
    assert (OP in names) == uses_op, names
    y, expected = out["y"], reference(theirs)
    assert y.stride() == expected.stride() and torch.equal(y.nan_to_num(0.0), expected.nan_to_num(0.0))
    grad = torch.randn(expected.shape).to(x.dtype).to(x.device)
    grad[..., 0] = -0.0
    y.backward(grad)
    expected.backward(grad)
    assert torch.equal(ours.grad, theirs.grad) and torch.equal(ours.grad.signbit(), theirs.grad.signbit())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_stand_in_takes_the_op_and_gives_torchs_bits(dtype, channels_last, device):
    x = pool_specials((2, 8, 6, 7), dtype, channels_last, torch.Generator().manual_seed(4)).to(device)
    assert_pools_alike(fused(nn.MaxPool2d(2)), nn.MaxPool2d(2), x, uses_op=True)


@pytest.mark.parametrize("settings", [dict(kernel_size=3), dict(kernel_size=2, stride=1), dict(kernel_size=2, padding=1),
                                      dict(kernel_size=2, dilation=2), dict(kernel_size=2, ceil_mode=True)],
                         ids=["3x3", "stride1", "padding", "dilation", "ceil"])
def test_other_settings_run_torchs_forward(settings):
    assert_pools_alike(fused(nn.MaxPool2d(**settings)), nn.MaxPool2d(**settings), torch.randn(1, 4, 7, 9),
                       uses_op=False)


def test_settings_changed_after_the_swap_are_read_at_each_call():
    pool = fused(nn.MaxPool2d(2))
    pool.kernel_size, pool.stride = 3, 3
    assert_pools_alike(pool, nn.MaxPool2d(3), torch.randn(1, 4, 9, 9), uses_op=False)
    pool.return_indices = True
    y, indices = pool(torch.randn(1, 2, 6, 6))
    assert indices.dtype == torch.int64


@pytest.mark.parametrize("x", [torch.randn(4, 6, 6), torch.randint(0, 5, (1, 3, 4, 4)).double()],
                         ids=["unbatched", "float64"])
def test_the_op_runs_for_4d_inputs_of_its_dtypes_alone(x):
    assert_pools_alike(fused(nn.MaxPool2d(2)), nn.MaxPool2d(2), x, uses_op=x.dim() == 4)


def test_a_strided_input_runs_torchs_forward():
    """Neither layout dense: the op would answer in NCHW where torch keeps x's strides' order."""
    pool = fused(nn.MaxPool2d(2))
    base = torch.randn(1, 3, 8, 10)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    names = op_names(lambda: pool(ours[..., 1:9]).sum().backward())
    F.max_pool2d(theirs[..., 1:9], 2).sum().backward()
    assert OP not in names and torch.equal(ours.grad, theirs.grad)


def test_an_input_smaller_than_a_window_gets_torchs_error():
    with pytest.raises(RuntimeError) as ours:
        fused(nn.MaxPool2d(2))(torch.randn(1, 3, 1, 6))
    with pytest.raises(RuntimeError) as theirs:
        nn.MaxPool2d(2)(torch.randn(1, 3, 1, 6))
    assert str(ours.value) == str(theirs.value)


def test_a_hooked_pool_runs_torchs_forward_and_its_hooks():
    pool = fused(nn.MaxPool2d(2))
    seen = []
    pool.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert_pools_alike(pool, nn.MaxPool2d(2), torch.randn(1, 4, 6, 6), uses_op=False)
    assert seen == [(1, 4, 3, 3)]


def test_a_mode_of_the_callers_sees_torchs_op():
    class Names(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    pool = fused(nn.MaxPool2d(2))
    with Names() as mode:
        pool(torch.randn(1, 2, 4, 4))
    assert any("max_pool2d" in name for name in mode.names) and not any("max_pool2x2" in n for n in mode.names)


def test_the_swap_keeps_the_object_and_gives_the_class_back():
    class Theirs(nn.MaxPool2d):
        pass

    model = nn.Sequential(nn.MaxPool2d(2), Theirs(2), nn.Sequential(nn.MaxPool2d(kernel_size=3)))
    before = repr(model)
    first, theirs, nested = model[0], model[1], model[2][0]
    swapped = pools.fuse_pools_in_place(model)
    assert swapped == [first, nested] and type(theirs) is Theirs
    assert model[0] is first and isinstance(first, nn.MaxPool2d) and type(first) is pools.MaxPool2d
    assert repr(model) == before
    pools.unfuse_pools(swapped)
    assert type(first) is nn.MaxPool2d and type(nested) is nn.MaxPool2d and repr(model) == before


def test_copies_pickles_script_and_compile():
    pool = fused(nn.MaxPool2d(2))
    x = torch.randn(1, 3, 6, 6)
    expected = F.max_pool2d(x, 2)
    for copied in (copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        assert type(copied) is pools.MaxPool2d and torch.equal(copied(x), expected)
    assert torch.equal(torch.jit.script(pool)(x), expected)
    assert torch.equal(torch.compile(pool, backend="aot_eager", fullgraph=True)(x), expected)


def test_on_the_cpu_torchs_kernels_run_by_default(monkeypatch):
    monkeypatch.setattr(pools, "OP_DEVICES", frozenset({"cuda"}))
    assert_pools_alike(fused(nn.MaxPool2d(2)), nn.MaxPool2d(2), torch.randn(1, 4, 6, 6), uses_op=False)


@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_unet_takes_the_op_for_its_pools(device):
    torch.manual_seed(0)
    model = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8).to(device)
    x = torch.randn(1, 4, 8, 8, device=device)
    names = op_names(lambda: model(x).sum().backward())
    assert OP in names and "aten::max_pool2d_with_indices" not in names


@pytest.mark.parametrize("device", DEVICES)
def test_convert_gives_a_stock_unets_pools_the_op(device):
    """convert() fuses a stock U-Net's pools with its blocks: the same objects, named in its
    report, the values and gradients of the model with torch's pools bit for bit."""
    torch.manual_seed(0)
    model = stock.UNetUnitary(2, 8).to(device)
    reference, reference_report = qca_lowmem.convert(copy.deepcopy(model), fuse_pools=False)
    assert reference_report.pools == [] and type(reference.down1[0]) is nn.MaxPool2d
    down_pools = [model.down1[0], model.down2[0]]
    _, report = qca_lowmem.convert(model)
    assert report.pools == ["down1.0", "down2.0"] and "gave 2 nn.MaxPool2d" in str(report)
    assert [model.down1[0], model.down2[0]] == down_pools and all(type(p) is pools.MaxPool2d for p in down_pools)
    x = torch.randn(1, 4, 8, 8, device=device)
    names = op_names(lambda: model(x).sum().backward())
    assert OP in names and "aten::max_pool2d_with_indices" not in names
    reference(x).sum().backward()
    assert torch.equal(model(x), reference(x))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert qca_lowmem.convert(model)[1].pools == []  # already fused


def test_the_fused_unet_keeps_torchs_pool_class():
    """Its wiring takes the op itself, so StockForward over it can run torch's pools."""
    model = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)
    assert type(model.down1[0]) is nn.MaxPool2d and type(model.down2[0]) is nn.MaxPool2d


def test_under_vmap_torchs_forward_runs():
    """A torch.func transform: the stand-in asks the caller's context first (x's layout cannot be
    asked under vmap) and runs torch's forward."""
    pool = fused(nn.MaxPool2d(2))
    x = torch.randn(3, 2, 4, 6, 6)
    assert torch.equal(torch.func.vmap(pool)(x), torch.func.vmap(nn.MaxPool2d(2))(x))


def test_the_stock_baseline_runs_torchs_pools():
    """StockForward (bench's and plan's stock) keeps what stock keeps: torch's pools, indices and all."""
    model = qca_lowmem.UNetUnitary(d_state=2, hidden_channels=8)
    x = torch.randn(1, 4, 8, 8)
    names = op_names(lambda: stock.StockForward(model)(x).sum().backward())
    assert OP not in names and "aten::max_pool2d_with_indices" in names


def test_as_on_cuda_takes_the_op_on_the_cpu(monkeypatch):
    """What plan measures a GPU's step with."""
    monkeypatch.setattr(pools, "OP_DEVICES", frozenset({"cuda"}))
    pool = fused(nn.MaxPool2d(2))
    x = torch.randn(1, 4, 6, 6)
    with pools.as_on_cuda():
        assert_pools_alike(pool, nn.MaxPool2d(2), x, uses_op=True)
    assert_pools_alike(pool, nn.MaxPool2d(2), x, uses_op=False)
