"""Argument checks the fake kernels share with the C glue (csrc/ops/glue.h), with its messages.

A CPU or CUDA tensor mixed with a meta tensor dispatches to the Meta kernel, which is the fake
kernel: without these checks it would hand back uninitialised memory on the other device.
"""

import math

import torch
from torch.autograd import forward_ad

from .. import _torch_private as torch_private

# ATen's ScalarType names, as the C glue's `describe` prints them.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble", torch.int32: "Int",
    torch.int64: "Long", torch.bool: "Bool",
}


# glue.h's is_real_float: the real dtypes the kernels take.
REAL_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the C glue prints an at::ScalarType ("Float")."""
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def describe(t: torch.Tensor) -> str:
    """What was received, as glue.h's describe(): dtype, shape, device, strides."""
    strides = list(t.stride()) if t.layout == torch.strided else "n/a"
    return f"Tensor(dtype={dtype_name(t.dtype)}, shape={list(t.shape)}, device={t.device}, strides={strides})"


def check_state(psi: torch.Tensor, op: str) -> None:
    """glue.h's check_state: psi, the complex (B, H, W, d) state of the QCA step and noise ops."""
    torch._check(psi.is_complex(),
                 lambda: f"{op}: psi must be complex64 or complex128 with shape (B, H, W, d), got {describe(psi)}")
    torch._check(psi.dim() == 4, lambda: f"{op}: psi must have 4 dimensions (B, H, W, d), got {describe(psi)}")
    torch._check(psi.shape[3] >= 1, lambda: f"{op}: psi's last dimension d must be at least 1, got {describe(psi)}")


def check_eps(eps: float, name: str, op: str) -> None:
    """The glue's eps check; `:g` prints a double as its TORCH_CHECK does."""
    if not (math.isfinite(eps) and eps >= 0):
        raise RuntimeError(f"{op}: {name} must be finite and >= 0, got {eps:g}")


def check_same_device(ref: torch.Tensor, ref_name: str, t: torch.Tensor, name: str, op: str) -> None:
    torch._check(t.device == ref.device,
                 lambda: f"{op}: {name} must be on the same device as {ref_name} ({ref.device}), got {describe(t)}")


def check_one_device(tensors, list_name: str, op: str) -> None:
    """Every tensor of a list on the device of its first, as the scaler's glue checks."""
    for i, t in enumerate(tensors):
        torch._check(t.device == tensors[0].device,
                     lambda: f"{op}: every tensor of {list_name} must be on one device ({tensors[0].device}, "
                             f"from {list_name}[0]); {list_name}[{i}] is {describe(t)}")


def refuse_func_transforms(op: str, *tensors: torch.Tensor) -> None:
    """torch.func transforms (grad, vmap, jvp, ...) cannot run our ops' autograd, and torch says so
    without naming the op: say which op and what works instead."""
    if torch.compiler.is_compiling():
        return  # compiled graphs see no functorch wrappers; the call would break fullgraph
    if torch_private.forward_ad_active() and any(
            isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise RuntimeError(
            f"{op}: forward-mode AD (torch.autograd.forward_ad's dual tensors) is not supported through "
            "qca_lowmem's ops; use qca_lowmem.stock's plain-torch step for the tangent")
    if not torch_private.functorch_transforms_active():
        return  # a tensor is wrapped only while its transform runs
    if any(torch_private.is_functorch_wrapped(t) for t in tensors if isinstance(t, torch.Tensor)):
        raise RuntimeError(
            f"{op}: torch.func transforms (grad, vmap, jvp, jacrev, ...) are not supported through qca_lowmem's "
            "ops; differentiate with loss.backward() or torch.autograd.grad, or use qca_lowmem.stock's "
            "plain-torch step inside the transform")
