"""The fake (meta) kernels refuse what the CPU kernels refuse, with the C glue's message.

On the meta device and under torch.compile an op runs its fake kernel alone: a fake that took
arguments the kernels refuse traced calls that can never run, and gave them shapes. The block
ops, defined in Python, refuse in eager (CPU) what their fake refuses, naming the argument.
"""

import re

import pytest
import torch

import qca_lowmem  # noqa: F401  (registers torch.ops.qca_lowmem)

OPS = torch.ops.qca_lowmem


def real(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def cplx(*shape, dtype=torch.complex64):
    return torch.zeros(shape, dtype=dtype)


PSI, DELTA = cplx(1, 2, 2, 2), real(1, 4, 2, 2)
X, W, B = real(1, 2, 2, 2), real(2), real(2)
GOT_FLOAT = r"got Tensor\(dtype=Float"
GOT_INT = r"got Tensor\(dtype=Int"
REAL_DTYPES = "float32, float64, float16 or bfloat16"
KERNEL_DTYPES = "float32, float64, float16, bfloat16, complex64 or complex128"
INT = torch.int32
FINITE = "must be finite and >= 0, got"
RATE = r"rate must be a probability in \[0, 1\], got"
PACK_GRAD = r"qca_pack_backward: grad_x must be a real floating tensor \(B, 2d, H, W\), got Tensor\("


def block_args(x=None, groups1=2, groups2=3, eps1=1e-5, eps2=1e-5, **tensors):
    """The block ops' arguments: x (1, 3, 4, 4), conv1 3 -> 4 channels, conv2 4 -> 6, with
    `tensors` replacing any of the weights."""
    weights = dict(conv1_weight=real(4, 3, 3, 3), norm1_weight=real(4), norm1_bias=real(4),
                   conv2_weight=real(6, 4, 3, 3), norm2_weight=real(6), norm2_bias=real(6))
    weights.update(tensors)
    return (real(1, 3, 4, 4) if x is None else x, *weights.values(), groups1, groups2, eps1, eps2)


# name: (op, arguments, the message's start as a regular expression)
CASES = {
    "qca_pack-real-psi": (OPS.qca_pack, (real(1, 2, 2, 2),),
                          r"qca_pack: psi must be complex64 or complex128 with shape \(B, H, W, d\), " + GOT_FLOAT),
    "qca_pack-3d": (OPS.qca_pack, (cplx(4, 2, 2),), r"qca_pack: psi must have 4 dimensions \(B, H, W, d\), got Tensor\("),
    "qca_pack-d0": (OPS.qca_pack, (cplx(1, 2, 2, 0),),
                    r"qca_pack: psi's last dimension d must be at least 1, got Tensor\(.*shape=\[1, 2, 2, 0\]"),
    "qca_pack-int-dtype": (OPS.qca_pack, (PSI, INT), rf"qca_pack: dtype must be {REAL_DTYPES}, got Int$"),
    "qca_pack_backward-odd-channels": (OPS.qca_pack_backward, (real(1, 3, 2, 2), torch.complex64), PACK_GRAD),
    "qca_pack_backward-no-channels": (OPS.qca_pack_backward, (real(1, 0, 2, 2), torch.complex64), PACK_GRAD),
    "qca_pack_backward-3d": (OPS.qca_pack_backward, (real(4, 2, 2), torch.complex64), PACK_GRAD),
    "qca_pack_backward-int": (OPS.qca_pack_backward, (real(1, 4, 2, 2, dtype=INT), torch.complex64), PACK_GRAD),
    "qca_pack_backward-real-psi_dtype": (OPS.qca_pack_backward, (real(1, 4, 2, 2), torch.float32),
                                         r"qca_pack_backward: psi_dtype must be complex64 or complex128, got Float$"),
    "qca_update-eps-negative": (OPS.qca_update, (PSI, DELTA, 0.0, True, -1.0), rf"qca_update: eps {FINITE} -1$"),
    "qca_update-eps-nan": (OPS.qca_update, (PSI, DELTA, 0.0, True, float("nan")), rf"qca_update: eps {FINITE} nan$"),
    "qca_update-gamma-nan": (OPS.qca_update, (PSI, DELTA, float("nan"), True, 1e-9),
                             r"qca_update: gamma must be finite, got nan$"),
    "qca_update-gamma-inf": (OPS.qca_update, (PSI, DELTA, float("inf"), True, 1e-9),
                             r"qca_update: gamma must be finite, got inf$"),
    "qca_update-float32-delta-complex128-psi": (
        OPS.qca_update, (cplx(1, 2, 2, 2, dtype=torch.complex128), DELTA, 0.0, True, 1e-9),
        r"qca_update: delta must be float64 for a complex128 psi, " + GOT_FLOAT),
    "qca_update-float64-delta-complex64-psi": (
        OPS.qca_update, (PSI, real(1, 4, 2, 2, dtype=torch.float64), 0.0, True, 1e-9),
        r"qca_update: delta must be float32, float16 or bfloat16 for a complex64 psi"),
    "qca_update-real-psi": (OPS.qca_update, (real(1, 2, 2, 2), DELTA, 0.0, True, 1e-9),
                            r"qca_update: psi must be complex64 or complex128"),
    "qca_update_backward-eps-negative": (OPS.qca_update_backward, (PSI, PSI, DELTA, 0.0, True, -1.0),
                                         rf"qca_update_backward: eps {FINITE} -1$"),
    "groupnorm_elu-eps-negative": (OPS.groupnorm_elu, (X, W, B, 1, -1.0), rf"groupnorm_elu: eps {FINITE} -1$"),
    "groupnorm_elu-3d": (OPS.groupnorm_elu, (real(2, 2, 2), W, B, 1, 1e-5),
                         r"groupnorm_elu: x must have 4 dimensions \(N, C, H, W\), got Tensor\("),
    "groupnorm_elu-no-channels": (OPS.groupnorm_elu, (real(1, 0, 2, 2), real(0), real(0), 1, 1e-5),
                                  r"groupnorm_elu: x must have at least one channel"),
    "groupnorm_elu-int-weight": (OPS.groupnorm_elu, (X, real(2, dtype=INT), B, 1, 1e-5),
                                 rf"groupnorm_elu: weight must be {REAL_DTYPES}, {GOT_INT}"),
    "groupnorm_elu-weight-shape": (OPS.groupnorm_elu, (X, real(3), B, 1, 1e-5),
                                   r"groupnorm_elu: weight must have shape \(C,\) with C = 2 \(the channels of x\), "
                                   r"got Tensor\(.*shape=\[3\]"),
    "groupnorm_elu-affine-dtypes-differ": (OPS.groupnorm_elu, (X, W, real(2, dtype=torch.float64), 1, 1e-5),
                                           r"groupnorm_elu: weight and bias must have the same dtype, "
                                           r"got weight Tensor\(dtype=Float.* and bias Tensor\(dtype=Double"),
    "groupnorm_elu_apply-stats-dtype": (OPS.groupnorm_elu_apply,
                                        (X, W, B, real(1, 1, dtype=torch.float64), real(1, 1, dtype=torch.float64)),
                                        r"groupnorm_elu_apply: mean must be Float \(statistics of a Float x\), "
                                        r"got Tensor\(dtype=Double"),
    "groupnorm_elu_apply-stats-batch": (OPS.groupnorm_elu_apply, (X, W, B, real(5, 1), real(5, 1)),
                                        r"groupnorm_elu_apply: mean must have shape \(N, groups\) with N = 1, "
                                        r"got Tensor\(.*shape=\[5, 1\]"),
    "groupnorm_elu_apply-1d-stats": (OPS.groupnorm_elu_apply, (X, W, B, real(1), real(1)),
                                     r"groupnorm_elu_apply: mean must have shape \(N, groups\) with N = 1, "
                                     r"got Tensor\(.*shape=\[1\]"),
    "groupnorm_elu_apply-stats-shapes-differ": (OPS.groupnorm_elu_apply, (X, W, B, real(1, 1), real(1, 2)),
                                                r"groupnorm_elu_apply: mean and rstd must have the same shape"),
    "groupnorm_elu_backward-int-weight": (OPS.groupnorm_elu_backward, (X, X, real(2, dtype=INT), B, real(1, 1), real(1, 1)),
                                          rf"groupnorm_elu_backward: weight must be {REAL_DTYPES}, {GOT_INT}"),
    "phase_flip-rate-2": (OPS.phase_flip, (PSI, 2.0, 0, 0), rf"phase_flip: {RATE} 2$"),
    "phase_flip-rate-nan": (OPS.phase_flip, (PSI, float("nan"), 0, 0), rf"phase_flip: {RATE} nan$"),
    "bit_flip-rate-negative": (OPS.bit_flip, (PSI, -0.5, 0, 0), rf"bit_flip: {RATE} -0.5$"),
    "phase_flip-d0": (OPS.phase_flip, (cplx(1, 2, 2, 0), 0.5, 0, 0), r"phase_flip: psi's last dimension d must be at least 1"),
    "bit_flip-d-too-large": (OPS.bit_flip, (cplx(1, 1, 1, 16380), 0.5, 0, 0),
                             r"bit_flip: psi's last dimension d must be at most 16379, got Tensor\("),
    "phase_flip-real-psi": (OPS.phase_flip, (real(1, 2, 2, 2), 0.5, 0, 0),
                            r"phase_flip: psi must be complex64 or complex128 with shape"),
    "amp_unscale_-int-grads": (OPS.amp_unscale_, ([real(3, dtype=INT)], real(1), real(1)),
                               rf"amp_unscale_: grads must hold {KERNEL_DTYPES} tensors, {GOT_INT}"),
    "amp_unscale_-dtypes-differ": (OPS.amp_unscale_, ([real(3), real(3, dtype=torch.float64)], real(1), real(1)),
                                   r"amp_unscale_: every tensor of grads must have one dtype \(Float, from grads\[0\]\); "
                                   r"grads\[1\] is Tensor\(dtype=Double"),
    "amp_unscale_-int-inv_scale": (OPS.amp_unscale_, ([real(3)], real(1), real(1, dtype=INT)),
                                   rf"amp_unscale_: inv_scale must be a one-element Float tensor, {GOT_INT}"),
    "amp_mul_-int-tensors": (OPS.amp_mul_, ([real(3, dtype=INT)], real(1)),
                             rf"amp_mul_: tensors must hold {KERNEL_DTYPES} tensors, {GOT_INT}"),
    "accumulate_-int-accumulator": (OPS.accumulate_, ([real(3, dtype=INT)], [real(3)]),
                                    rf"accumulate_: accumulators\[0\] must be a {KERNEL_DTYPES} tensor, {GOT_INT}"),
    "accumulate_-int-grad": (OPS.accumulate_, ([real(3)], [real(3, dtype=INT)]),
                             rf"accumulate_: grads\[0\] must be a {KERNEL_DTYPES} tensor, {GOT_INT}"),
    "accumulate_-complex-and-real": (OPS.accumulate_, ([cplx(3)], [real(3)]),
                                     r"accumulate_: accumulators\[0\] and grads\[0\] must be both complex or both real"),
}

# name: (the block ops' arguments, the message's start after "conv_block: ")
BLOCK_CASES = {
    "1x1-conv1": (block_args(conv1_weight=real(4, 3, 1, 1)),
                  r"conv1_weight must have shape \(C1, 3, 3, 3\) with C1 >= 1, 3x3 kernels over the 3 channels of x, "
                  r"got Tensor\(dtype=Float, shape=\[4, 3, 1, 1\]"),
    "1x1-conv2": (block_args(conv2_weight=real(6, 4, 1, 1)),
                  r"conv2_weight must have shape \(C2, 4, 3, 3\) with C2 >= 1, 3x3 kernels over the 4 channels of "
                  r"conv1_weight's output, got Tensor\(dtype=Float, shape=\[6, 4, 1, 1\]"),
    "conv1-in-channels": (block_args(conv1_weight=real(4, 2, 3, 3)), r"conv1_weight must have shape \(C1, 3, 3, 3\)"),
    "conv2-in-channels": (block_args(conv2_weight=real(6, 5, 3, 3)),
                          r"conv2_weight must have shape \(C2, 4, 3, 3\) .*shape=\[6, 5, 3, 3\]"),
    "conv1-no-out-channels": (block_args(conv1_weight=real(0, 3, 3, 3), norm1_weight=real(0), norm1_bias=real(0),
                                         conv2_weight=real(6, 0, 3, 3)),
                              r"conv1_weight must have shape \(C1, 3, 3, 3\) with C1 >= 1"),
    "norm1_weight-shape": (block_args(norm1_weight=real(5)),
                           r"norm1_weight must have shape \(4,\), the output channels of conv1_weight, "
                           r"got Tensor\(.*shape=\[5\]"),
    "norm2_bias-shape": (block_args(norm2_bias=real(4)),
                         r"norm2_bias must have shape \(6,\), the output channels of conv2_weight"),
    "int-norm1_weight": (block_args(norm1_weight=real(4, dtype=INT)), rf"norm1_weight must be {REAL_DTYPES}, {GOT_INT}"),
    "norm2-dtypes-differ": (block_args(norm2_bias=real(6, dtype=torch.float64)),
                            r"norm2_weight and norm2_bias must have the same dtype, "
                            r"got Tensor\(dtype=Float.* and Tensor\(dtype=Double"),
    "groups1": (block_args(groups1=3),
                r"groups1 must be positive and divide the output channels of conv1_weight \(4\), got 3$"),
    "groups2-zero": (block_args(groups2=0),
                     r"groups2 must be positive and divide the output channels of conv2_weight \(6\), got 0$"),
    "eps1-negative": (block_args(eps1=-1.0), rf"eps1 {FINITE} -1$"),
    "eps2-nan": (block_args(eps2=float("nan")), rf"eps2 {FINITE} nan$"),
    "float64-conv1_weight": (block_args(conv1_weight=real(4, 3, 3, 3, dtype=torch.float64)),
                             r"conv1_weight must have the dtype of x \(Float\), got Tensor\(dtype=Double"),
    "bfloat16-conv2_weight": (block_args(conv2_weight=real(6, 4, 3, 3, dtype=torch.bfloat16)),
                              r"conv2_weight must have the dtype of x \(Float\), got Tensor\(dtype=BFloat16"),
    "int-x": (block_args(x=real(1, 3, 4, 4, dtype=INT), conv1_weight=real(4, 3, 3, 3, dtype=INT)),
              rf"x must be {REAL_DTYPES}, {GOT_INT}"),
    "3d-x": (block_args(x=real(3, 4, 4)), r"x must have 4 dimensions \(N, C, H, W\), got Tensor\(.*shape=\[3, 4, 4\]"),
}
for _name, (_args, _expected) in BLOCK_CASES.items():
    CASES[f"conv_block-{_name}"] = (OPS.conv_block, _args, "conv_block: " + _expected)
    CASES[f"conv_block_keep-{_name}"] = (OPS.conv_block_keep, _args, "conv_block: " + _expected)


def on(device, value):
    """`value` (a tensor, a list of them, anything else) with its tensors moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [on(device, v) for v in value]
    return value


@pytest.mark.parametrize("name", CASES)
def test_meta_refuses_what_the_cpu_refuses_with_its_message(name):
    op, args, expected = CASES[name]
    messages = {}
    for device in ("cpu", "meta"):
        with pytest.raises(RuntimeError) as error:
            op(*(on(device, a) for a in args))
        messages[device] = str(error.value).splitlines()[0].replace(f"device={device}", "device=D")
    assert messages["meta"] == messages["cpu"]
    assert re.match(expected, messages["cpu"]), messages["cpu"]


@pytest.mark.parametrize("op", [OPS.conv_block, OPS.conv_block_keep], ids=["conv_block", "conv_block_keep"])
def test_block_op_computes_in_its_arguments_dtypes_under_autocast(op):
    """The op's forward computes as its backward's recompute does, in the dtypes given, whatever
    the caller's autocast (FusedConvBlock casts before it calls): the same output and gradients
    as without autocast, bit for bit (the forward used to cast, and the backward then failed)."""
    torch.manual_seed(0)
    tensors = [torch.randn(t.shape).requires_grad_() for t in block_args()[:7]]
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = op(*tensors, 2, 3, 1e-5, 1e-5)[0]
        results.append((y, *torch.autograd.grad(y.square().sum(), tensors)))
    for without, under in zip(*results):
        torch.testing.assert_close(under, without, rtol=0, atol=0)
