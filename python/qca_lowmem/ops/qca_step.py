"""The QCA step ops (C family `qca_step`): typed wrappers, fake kernels and autograd of
torch.ops.qca_lowmem.qca_pack / qca_update, and the stock step on them (`fused_step`: pack,
operator, update), which the reference trainer, plan, the benchmarks and enable() step with."""

import math
from typing import Callable, Optional

import torch

from .. import stock
from ._checks import REAL_FLOATS, check_eps, check_same_device, check_state, describe, dtype_name, refuse_func_transforms
from ._double_backward import reference_backward, second_order_requested
from .watchers import call_unwatched

_lib = torch.ops.qca_lowmem


def qca_pack(psi: torch.Tensor, dtype: Optional[torch.dtype] = None, *, channels_last: bool = False) -> torch.Tensor:
    """Stock step 1 in one pass: complex (B, H, W, d) -> real (B, 2d, H, W), real parts first.

    `dtype` casts in the same pass (default: the state's real type); `channels_last` picks the
    output layout (stock's torch.cat comes out NHWC: an op of the model drawing element by element
    in memory order, a Dropout, draws stock's numbers only on that layout). Differentiable;
    backward saves nothing.
    """
    refuse_func_transforms("qca_lowmem.qca_pack", psi)
    return call_unwatched(_lib.qca_pack, (psi,), dtype, channels_last)


def qca_update(
    psi: torch.Tensor,
    delta: torch.Tensor,
    gamma: float = 0.0,
    multiplicative: bool = True,
    eps: float = 1e-9,
) -> torch.Tensor:
    """Stock steps 2-5 in one pass: psi' = n / (|n| + eps), n = psi + u - gamma*psi.

    `u = (delta_re + i delta_im) * psi` when `multiplicative` (UNetUnitary operators), else the
    complex delta itself. `delta` (B, 2d, H, W) may be fp32, fp16 or bf16 in any layout; the
    arithmetic and the result are complex64 (complex128 with a float64 delta, for gradcheck).
    Differentiable; backward saves only psi and delta and recomputes the rest.
    """
    refuse_func_transforms("qca_lowmem.qca_update", psi, delta)
    return call_unwatched(_lib.qca_update, (psi, delta), _real("qca_update", "gamma", gamma), bool(multiplicative),
                          _real("qca_update", "eps", eps))


def _real(op: str, name: str, value) -> float:
    """`value` as the float the op takes (a Python or NumPy number, a one-element tensor), else a
    TypeError naming the argument."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be a real number, got {value!r}") from None


class fused_step:  # noqa: N801  (a function to its callers; a class so that it copies and pickles)
    """The stock engine step (`stock.step`: pack, operator, update) on the fused ops, as a
    callable `step(psi)`. With `channels_last` the pack writes NHWC, which the fused blocks and
    torch's convs keep and the update reads as it is: no layout conversions in between (the
    operator's conv weights should be channels_last too). `input_dtype(operator, psi)`, where
    given, names a dtype the pack may write the operator's input in (`unet.input_dtype`: where
    the operator's first act is to cast it so), None for the pack's own."""

    def __init__(self, operator, gamma: float, multiplicative: bool, *, channels_last: bool = False,
                 input_dtype: Optional[Callable] = None):
        self.operator, self.gamma, self.multiplicative = operator, gamma, multiplicative
        self.channels_last = channels_last
        self.input_dtype = input_dtype

    def __call__(self, psi: torch.Tensor) -> torch.Tensor:
        pack_dtype = None if self.input_dtype is None else self.input_dtype(self.operator, psi)
        return fused_step_once(self.operator, psi, self.gamma, self.multiplicative, self.channels_last,
                               pack_dtype=pack_dtype)


def fused_step_once(operator, psi: torch.Tensor, gamma: float, multiplicative: bool,
                    channels_last: bool = False, recorded: Optional[Callable] = None,
                    pack_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """One stock step of `operator` on psi over the fused pack and update; `recorded(delta)`, where
    given, sees the operator's output (an engine's side state); `pack_dtype`, where given, the
    dtype the pack writes (its own, float32 or float64, by default)."""
    delta = operator(qca_pack(psi, pack_dtype, channels_last=channels_last))
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"{type(operator).__name__} returned {type(delta).__name__}, the engine step takes an "
                        "operator returning delta; a model with memory returning (delta, h, c) needs an engine "
                        "with has_memory=True")
    if recorded is not None:
        recorded(delta)
    return qca_update(psi, delta, gamma, multiplicative)


def _real_dtype_of(complex_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if complex_dtype == torch.complex128 else torch.float32


@torch.library.register_fake("qca_lowmem::qca_pack")
def _pack_fake(psi, dtype=None, channels_last=False):
    check_state(psi, "qca_pack")
    b, h, w, d = psi.shape
    out_dtype = dtype if dtype is not None else _real_dtype_of(psi.dtype)
    torch._check(out_dtype in REAL_FLOATS,
                 lambda: f"qca_pack: dtype must be float32, float64, float16 or bfloat16, got {dtype_name(out_dtype)}")
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return psi.new_empty((b, 2 * d, h, w), dtype=out_dtype).contiguous(memory_format=memory_format)


@torch.library.register_fake("qca_lowmem::qca_pack_backward")
def _pack_backward_fake(grad_x, psi_dtype):
    op = "qca_pack_backward"
    torch._check(grad_x.dim() == 4 and grad_x.shape[1] % 2 == 0 and grad_x.shape[1] >= 2 and grad_x.dtype in REAL_FLOATS,
                 lambda: f"{op}: grad_x must be a real floating tensor (B, 2d, H, W), got {describe(grad_x)}")
    torch._check(psi_dtype in (torch.complex64, torch.complex128),
                 lambda: f"{op}: psi_dtype must be complex64 or complex128, got {dtype_name(psi_dtype)}")
    b, c, h, w = grad_x.shape
    return grad_x.new_empty((b, h, w, c // 2), dtype=psi_dtype)


def _check_update_args(psi, delta, gamma, eps, op):
    """The glue's checks and messages (glue.h check_state, qca_step.cpp update_params), so meta
    refuses what the kernels refuse."""
    check_state(psi, op)
    check_same_device(psi, "psi", delta, "delta", op)
    b, h, w, d = psi.shape
    torch._check(delta.dim() == 4 and tuple(delta.shape) == (b, 2 * d, h, w),
                 lambda: f"{op}: delta must have shape (B, 2d, H, W) = {(b, 2 * d, h, w)} for psi {tuple(psi.shape)}, "
                         f"got {describe(delta)}")
    if psi.dtype == torch.complex64:
        torch._check(delta.dtype in (torch.float32, torch.float16, torch.bfloat16),
                     lambda: f"{op}: delta must be float32, float16 or bfloat16 for a complex64 psi, got {describe(delta)}")
    else:
        torch._check(delta.dtype == torch.float64,
                     lambda: f"{op}: delta must be float64 for a complex128 psi, got {describe(delta)}")
    torch._check(math.isfinite(gamma), lambda: f"{op}: gamma must be finite, got {gamma:g}")
    check_eps(eps, "eps", op)


@torch.library.register_fake("qca_lowmem::qca_update")
def _update_fake(psi, delta, gamma=0.0, multiplicative=True, eps=1e-9):
    _check_update_args(psi, delta, gamma, eps, "qca_update")
    return torch.empty_like(psi, memory_format=torch.contiguous_format)


@torch.library.register_fake("qca_lowmem::qca_update_backward")
def _update_backward_fake(grad_out, psi, delta, gamma, multiplicative, eps):
    op = "qca_update_backward"
    _check_update_args(psi, delta, gamma, eps, op)
    torch._check(grad_out.dtype == psi.dtype and grad_out.shape == psi.shape,
                 lambda: f"{op}: grad_out must match psi ({describe(psi)}), got {describe(grad_out)}")
    check_same_device(psi, "psi", grad_out, "grad_out", op)
    return (
        torch.empty_like(psi, memory_format=torch.contiguous_format),
        torch.empty_like(delta, memory_format=torch.contiguous_format),
    )


def _pack_setup_context(ctx, inputs, output):
    psi = inputs[0]
    ctx.psi_dtype = psi.dtype


def _pack_backward(ctx, grad_x):
    if second_order_requested():
        # The same linear map in torch ops, so the gradient stays differentiable in grad_x.
        grad = grad_x.to(_real_dtype_of(ctx.psi_dtype))
        d = grad.shape[1] // 2
        return torch.complex(grad[:, :d], grad[:, d:]).permute(0, 2, 3, 1), None, None
    return _lib.qca_pack_backward(grad_x, ctx.psi_dtype), None, None


def _update_setup_context(ctx, inputs, output):
    psi, delta, gamma, multiplicative, eps = inputs
    ctx.save_for_backward(psi, delta)
    ctx.gamma, ctx.multiplicative, ctx.eps = gamma, multiplicative, eps


def _update_backward(ctx, grad_out):
    psi, delta = ctx.saved_tensors
    if second_order_requested():
        return reference_backward(ctx, stock.update, (psi, delta, ctx.gamma, ctx.multiplicative, ctx.eps), grad_out)
    grad_psi, grad_delta = _lib.qca_update_backward(grad_out, psi, delta, ctx.gamma, ctx.multiplicative, ctx.eps)
    return (
        grad_psi if ctx.needs_input_grad[0] else None,
        grad_delta if ctx.needs_input_grad[1] else None,
        None,
        None,
        None,
    )


torch.library.register_autograd("qca_lowmem::qca_pack", _pack_backward, setup_context=_pack_setup_context)
torch.library.register_autograd("qca_lowmem::qca_update", _update_backward, setup_context=_update_setup_context)
