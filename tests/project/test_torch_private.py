"""The private torch APIs qca_lowmem calls (python/qca_lowmem/_torch_private.py) exist in this
torch and do what the library relies on; and nothing outside that module calls one."""

import ast
from pathlib import Path

import pytest
import torch

import qca_lowmem
from qca_lowmem import _torch_private as torch_private
from qca_lowmem import stock

PACKAGE = Path(qca_lowmem.__file__).parent


def test_every_private_api_is_there():
    assert torch_private.missing() == [], f"torch {torch.__version__} lacks {torch_private.missing()}"


def test_a_missing_one_is_named(monkeypatch):
    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")
    assert torch_private.missing(with_cuda=False) == ["torch._C._len_torch_dispatch_stack"]


def test_sequence_numbers_grow_and_casts_are_recognised():
    w = torch.ones(2, requires_grad=True)
    first = (w * 2).grad_fn
    cast = w.to(torch.float64).grad_fn
    assert torch_private.sequence_nr(cast) > torch_private.sequence_nr(first)
    assert torch_private.is_dtype_cast(cast) and not torch_private.is_dtype_cast(first)


def test_backward_hooks_are_the_tensors_own():
    w = torch.ones(2, requires_grad=True)
    assert not torch_private.has_hooks(w)
    hooks = torch_private.backward_hooks(w)
    assert hooks == {} and torch_private.backward_hooks(w) is hooks
    seen = []
    w.register_hook(seen.append)
    assert torch_private.has_hooks(w) and len(hooks) == 1
    hooks.clear()  # set aside: the hook no longer runs
    (w * 3).sum().backward()
    assert seen == []
    module = torch.nn.Linear(2, 2)
    assert not torch_private.module_has_hooks(module)
    module.register_forward_pre_hook(lambda m, x: None)
    assert torch_private.module_has_hooks(module)


def test_dispatch_state_queries():
    assert torch_private.dispatch_modes() == [] and not torch_private.functorch_transforms_active()

    class Seeing(torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    seen = []
    with Seeing() as outer, Seeing() as inner:
        assert torch_private.dispatch_modes() == [outer, inner]
        with torch_private.dispatch_disabled():
            torch.ones(2).add(1)
            assert torch_private.dispatch_modes() == [outer, inner]  # hidden from, still active
        assert seen == []
        torch.ones(2).add(1)
    assert torch.ops.aten.add.Tensor in seen and torch_private.dispatch_modes() == []
    seen = []
    torch.func.grad(lambda x: (seen.append((torch_private.functorch_transforms_active(),
                                            torch_private.is_functorch_wrapped(x))), x.sum())[1])(torch.ones(2))
    assert seen == [(True, True)]
    assert torch_private.has_kernel_for("qca_lowmem::qca_update", "CPU")
    schema = torch_private.op_schema(torch.ops.aten.add_.Tensor)
    assert schema.arguments[0].alias_info.is_write


def test_the_modes_walk_finds_what_torchs_pytree_finds():
    """argument_tensors and result_tensors, the one walk of every dispatch mode, against torch's
    pytree on every op of a U-Net's forward and backward and of ops with lists among their
    arguments and results (cat, split, an index with None, histogramdd) or a number as result."""
    from torch.utils._pytree import tree_leaves

    def tensors(tree):
        return [id(x) for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]

    seen = []

    class Compare(torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            seen.append((str(func), [id(x) for x in torch_private.argument_tensors(args, kwargs)],
                         tensors((args, kwargs)), [id(x) for x in torch_private.result_tensors(out)], tensors(out)))
            return out

    unet = stock.UNetUnitary(2, 8)
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    with Compare():
        unet(x).square().sum().backward()
        a = torch.randn(3, 4)
        torch.cat([a, a], 1).split(2, 0)
        a[None, torch.tensor([0, 2])].sum().item()
        torch.histogramdd(a[:, :2], bins=[2, 2])
        torch.add(a, a, alpha=2)
    names = {name for name, *_ in seen}
    assert {"aten.cat.default", "aten.split.Tensor", "aten.index.Tensor", "aten._local_scalar_dense.default",
            "aten._histogramdd_from_bin_cts.default", "aten.convolution_backward.default"} <= names, names
    for name, found_args, pytree_args, found_out, pytree_out in seen:
        assert found_args == pytree_args and found_out == pytree_out, name


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_torch_private.py"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_other_module_calls_a_private_torch_api(path):
    """torch._C, torch's private modules, and the private attributes of torch's objects read by
    _torch_private."""
    private = {"_sequence_nr", "_backward_hooks", "_forward_hooks", "_forward_pre_hooks", "_backward_pre_hooks",
               "_schema"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"line {node.lineno}: import {name}" for name in names
                      if name.split(".")[0] == "torch" and any(part.startswith("_") for part in name.split("."))]
        if isinstance(node, ast.Attribute) and (node.attr in private or (
                node.attr.startswith("_") and isinstance(node.value, ast.Attribute) and node.value.attr == "_C")):
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Constant) and node.value == torch_private.TO_COPY_NODE:
            found.append(f"line {node.lineno}: {node.value!r}")
    assert not found, f"{path.name} calls private torch APIs {found}: go through qca_lowmem._torch_private"
