"""Whether an operator may get the fused step: only where its output is continuous in its input,
shown op by op against an allowlist.

The fused pack/update rounds differently from the engine's own plain-torch step (by about one
unit of the last place); a continuous operator carries that on as a rounding, a discontinuous one
(a spiking model: SNNUNet's Leaky neurons, `(membrane - threshold > 0).float()`; a sign, a
rounding, a quantisation) turns it into other spikes, and the episode into another. So enable()
keeps the engine's own step for any operator it cannot show continuous (engine_step.lowmem_steps),
and says so, naming the op.

Read off the ops, not off values: a random input seldom puts a neuron within a rounding of its
threshold, and a model at its initialisation may not spike at all. The operator runs once, under
no_grad, on the probe's psi, in a dispatch mode that follows what is computed from its input:
every op that reads such a value must be one known smooth or piecewise smooth and continuous
(`SMOOTH`: convolutions, norms, elementwise arithmetic, relu/elu/leaky_relu, max pooling, views
and copies) and give floating results, integer ones only where named (max pooling's indices,
never read in the forward). Anything else (a comparison, `where`, `masked_fill`, an integer cast,
`floor_divide`, `remainder`, `argmax`, `one_hot`, `fake_quantize_*`, an op not listed) keeps
the engine's own step. The tensors computed from the input are held until the probe ends, so
their identities are never reused. The operator's buffers and every random generator are left
as found.
"""

import contextlib
from typing import Optional

import torch

from .. import _torch_private as torch_private
from ..recompute import generators
from .user_modules import buffer_bindings, rebind

_ATEN_SMOOTH = """
    view _unsafe_view reshape permute transpose t expand expand_as slice select unsqueeze squeeze clone contiguous
    alias detach cat stack split split_with_sizes chunk unbind narrow flatten unflatten as_strided copy_ copy
    _to_copy to view_as_real view_as_complex complex real imag constant_pad_nd reflection_pad1d reflection_pad2d
    replication_pad1d replication_pad2d pad repeat roll flip index_select lift_fresh fill_ fill
    add add_ sub sub_ rsub mul mul_ div div_ neg pow sqrt rsqrt exp log log1p expm1 reciprocal abs square
    addcmul addcdiv lerp sum mean var std var_mean std_mean linalg_vector_norm norm mm bmm addmm matmul linear
    baddbmm convolution _convolution conv1d conv2d conv3d mkldnn_convolution native_group_norm native_batch_norm
    _native_batch_norm_legit _native_batch_norm_legit_no_training _native_batch_norm_legit_functional
    native_layer_norm group_norm batch_norm layer_norm instance_norm _fused_rms_norm rms_norm
    relu relu_ elu elu_ gelu silu silu_ sigmoid sigmoid_ tanh tanh_ softplus leaky_relu leaky_relu_ hardtanh
    hardtanh_ clamp clamp_ clamp_min clamp_max hardswish hardsigmoid mish logsigmoid _softmax softmax _log_softmax
    log_softmax sin cos erf maximum minimum amax amin
    max_pool2d_with_indices max_pool2d max_pool1d avg_pool2d avg_pool1d adaptive_avg_pool2d _adaptive_avg_pool2d
    upsample_nearest2d upsample_bilinear2d _upsample_nearest_exact2d pixel_shuffle pixel_unshuffle native_dropout
"""
# qca_lowmem's own fused blocks and step, the same functions as the stock ops they fuse.
_OWN_SMOOTH = "conv_block conv_block_keep groupnorm_elu groupnorm_elu_apply qca_pack qca_update max_pool2x2"
SMOOTH = frozenset([f"aten::{name}" for name in _ATEN_SMOOTH.split()] +
                   [f"qca_lowmem::{name}" for name in _OWN_SMOOTH.split()])
# Ops that read only the shape of what they are given: their results are not computed from it (dropout's mask).
SHAPE_ONLY = frozenset(f"aten::{name}" for name in """empty_like zeros_like ones_like full_like rand_like randn_like
    new_empty new_zeros new_ones new_full""".split())
# Ops that may give an integer or boolean result beside their floating one (never read in a forward).
INDEX_RESULTS = frozenset({"aten::max_pool2d_with_indices", "aten::native_dropout"})


class _Follow(torch_private.TorchDispatchMode):
    def __init__(self, source: torch.Tensor):
        super().__init__()
        self.derived = {id(source): source}  # the tensors computed from the input, held: their ids stay theirs
        self.found: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [x for x in torch_private.argument_tensors(args, kwargs) if id(x) in self.derived]
        out = func(*args, **kwargs)
        if not inputs:
            return out
        name = func.overloadpacket._qualified_op_name
        if name in SHAPE_ONLY:
            return out
        outputs = torch_private.result_tensors(out)
        if self.found is None:
            self.found = _why_not_smooth(name, args, inputs, outputs)
        for x in outputs:
            self.derived[id(x)] = x
        return out


def _why_not_smooth(name, args, inputs, outputs) -> Optional[str]:
    """Why this op, reading a value computed from the operator's input, may jump, or None."""
    if name == "aten::threshold":  # threshold(x, t, v) is continuous where it replaces by its threshold (ReLU)
        return None if args[1] == args[2] else "threshold of a value computed from its input"
    if name not in SMOOTH:
        return f"{name} of a value computed from its input, not an op known continuous"
    if any(not (x.is_floating_point() or x.is_complex()) for x in inputs):
        return f"{name} of an integer or boolean value computed from its input"
    if name not in INDEX_RESULTS and any(not (x.is_floating_point() or x.is_complex()) for x in outputs):
        return f"{name} to {outputs[0].dtype} of a value computed from its input (an integer or boolean cast)"
    return None


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module, device):
    bound = buffer_bindings(module)
    saved = [(b, b.detach().clone()) for _, _, b in bound]
    with generators.left_as_found(generators.every_cuda(device)):
        try:
            yield
        finally:
            rebind(bound)
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)


def discontinuity(operator: torch.nn.Module, x: torch.Tensor, memory: bool) -> Optional[str]:
    """Why the operator's output may jump with its input `x` (the packed probe psi), or None. An
    operator that cannot take `x` (a grid or d_state the model cannot run) is refused naming them."""
    follow = _Follow(x)
    try:
        with torch.no_grad(), _buffers_kept(operator, x.device), follow:
            operator(x, None, None) if memory else operator(x)
    except RuntimeError as error:
        _, channels, height, width = x.shape
        raise ValueError(f"enable(): {type(operator).__name__} cannot take a {height}x{width} grid of d_state "
                         f"{channels // 2} (the grid_size and d_state its episodes run at): "
                         f"{str(error).splitlines()[0]}") from None
    return follow.found
