"""The U-Net's convolutions outside its ConvBlocks (the transposed convs, the 1x1 output conv) on
the episode's half-precision weight copies (recompute/weight_casts.py), as the fused blocks' convs.

Under autocast such a layer's weight and bias are cast at every call outside autocast's cache,
which lives as long as one autocast context: in a recomputing episode, at every step's recompute,
and in a captured step at every replay, each cast a launch and its gradient's cast another (12
copies a step at the stock U-Net). Through the episode's copies a weight is cast once an episode
and its half-precision gradient goes straight to the parameter's fp32 buffer: the same values as
autocast's casts, bit for bit, and gradients summed in fp32, as the fused blocks' are.

`Conv2d` and `ConvTranspose2d` stand in for a users' `nn.Conv2d` and `nn.ConvTranspose2d` (the
switch: `cast_convs_in_place`): the very objects, their class swapped for a subclass of torch's,
named as torch's, so that their references, `isinstance`, hooks and repr keep working. A call
takes the copies inside a rollout's step under autocast, where its call is just its forward (no
hook) and no mode, transform or trace of the caller's would see other ops; else torch's forward
runs, as it would. `uncast_convs` gives the class back.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import fused_call_stands_for
from .precision import autocast_dtype
from .recompute.weight_casts import cast_weight, episode_casts_active


def conv_with_cast_weights(layer: nn.Module, x: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """A torch Conv2d or ConvTranspose2d (called without `output_size`) applied to x with its weight
    and bias cast to `compute_dtype` by cast_weight: from the active episode's copies where there
    are any; x cast as autocast casts it (here, so that autocast's cache keeps no cast of an input
    past the step)."""
    if _autocast_casts(x) and x.dtype != compute_dtype:
        x = x.to(compute_dtype)
    weight = cast_weight(layer.weight, compute_dtype)
    bias = None if layer.bias is None else cast_weight(layer.bias, compute_dtype)
    if isinstance(layer, nn.ConvTranspose2d):
        return F.conv_transpose2d(x, weight, bias, layer.stride, layer.padding, layer.output_padding, layer.groups,
                                  layer.dilation)
    return layer._conv_forward(x, weight, bias)


def _autocast_casts(t: Tensor) -> bool:
    """Whether autocast casts t for a convolution: real floating point, not float64 (it leaves
    complex and double tensors as they are)."""
    return t.is_floating_point() and t.dtype != torch.float64


def autocast_casts_call(layer: nn.Module, x: Tensor) -> bool:
    """Whether autocast casts all that a conv call of `layer` on x reads: x, the weight and the bias
    (what conv_with_cast_weights casts in its place)."""
    return _autocast_casts(x) and all(_autocast_casts(p) for p in (layer.weight, layer.bias) if p is not None)


def _episode_dtype(layer: nn.Module, x: Tensor) -> Optional[torch.dtype]:
    """Autocast's dtype where layer(x) can take the episode's copies: inside a rollout's step, x,
    the weight and the bias all tensors autocast casts (the weight and bias parameters), its call
    plain (no hook, no mode or transform of the caller's); else None."""
    if torch.compiler.is_compiling() or not episode_casts_active() or not isinstance(x, Tensor):
        return None
    dtype = autocast_dtype(x.device.type)
    if dtype is None or not autocast_casts_call(layer, x) or type(layer.weight) is not nn.Parameter \
            or not (layer.bias is None or type(layer.bias) is nn.Parameter):
        return None
    return dtype if fused_call_stands_for((layer,)) else None


class Conv2d(nn.Conv2d):
    """torch's nn.Conv2d whose calls in a rollout's step under autocast take the episode's weight
    copies (module docstring)."""

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles torch's forward
            return self._conv_forward(input, self.weight, self.bias)
        return self._eager_forward(input)

    @torch.jit.unused
    def _eager_forward(self, input: Tensor) -> Tensor:
        dtype = _episode_dtype(self, input)
        if dtype is None:
            return nn.Conv2d.forward(self, input)
        return conv_with_cast_weights(self, input, dtype)


class ConvTranspose2d(nn.ConvTranspose2d):
    """torch's nn.ConvTranspose2d whose calls without `output_size` in a rollout's step under
    autocast take the episode's weight copies (module docstring)."""

    def forward(self, input: Tensor, output_size: Optional[List[int]] = None) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles torch's forward, written out
            if self.padding_mode != "zeros":
                raise ValueError("Only `zeros` padding mode is supported for ConvTranspose2d")
            output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size, 2,
                                                  self.dilation)
            return F.conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                      self.groups, self.dilation)
        return self._eager_forward(input, output_size)

    @torch.jit.unused
    def _eager_forward(self, input: Tensor, output_size: Optional[List[int]]) -> Tensor:
        dtype = None if output_size is not None or self.padding_mode != "zeros" else _episode_dtype(self, input)
        if dtype is None:
            return nn.ConvTranspose2d.forward(self, input, output_size)
        return conv_with_cast_weights(self, input, dtype)


_STAND_INS = {nn.Conv2d: Conv2d, nn.ConvTranspose2d: ConvTranspose2d}


def cast_convs_in_place(module: nn.Module) -> List[nn.Module]:
    """Every `nn.Conv2d` and `nn.ConvTranspose2d` of `module` (the class exactly: a subclass of
    theirs is left alone) outside its ConvBlocks (modules with a `conv_block`: a fused one casts
    its own, one left alone keeps torch's layers) given the stand-in's class; those swapped, for
    uncast_convs()."""
    inside_blocks = {id(m) for block in module.modules() if hasattr(block, "conv_block") for m in block.modules()}
    convs = [m for m in module.modules() if type(m) in _STAND_INS and id(m) not in inside_blocks]
    cast_convs(convs)
    return convs


def cast_convs(convs: List[nn.Module]) -> None:
    """These convs given the stand-ins' classes (those of torch's classes exactly: one given
    another class since, by torch.nn.utils.parametrize say, is left alone)."""
    for conv in convs:
        stand_in = _STAND_INS.get(type(conv))
        if stand_in is not None:
            conv.__class__ = stand_in


def uncast_convs(convs: List[nn.Module]) -> None:
    """The convs of cast_convs_in_place given torch's class back (those still the stand-in's, and
    those that torch.nn.utils.parametrize gave a class of its own on top of it since)."""
    for conv in convs:
        cls = type(conv)
        for torch_class, stand_in in _STAND_INS.items():
            if cls is stand_in:
                conv.__class__ = torch_class
            elif cls.__bases__ == (stand_in,) and getattr(conv, "parametrizations", None) is not None:
                cls.__bases__ = (torch_class,)  # parametrize's class, made for this module alone
