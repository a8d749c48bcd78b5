"""The fused U-Net ConvBlock, on the block ops (ops/conv_block.py).

`FusedConvBlock` computes the stock block, Conv3x3 -> GroupNorm -> ELU -> Conv3x3 -> GroupNorm ->
ELU, with the parameters and state_dict keys of the stock `ConvBlock`. Its forward keeps for
backward only the block input and the per-group statistics; backward recomputes conv1 -> GN+ELU
-> conv2 and runs the fused backward kernels. Inside a step-level recompute
(`qca_lowmem.keep_block_intermediates()`) or with `recompute=False` it keeps its intermediates
instead, so the convolutions never run a third time. At every call it checks that its layers are
still the stock block's, each called as just its forward (no hook, global or its own, and no
`forward` set on the instance), that no mode or saved-tensors hook of the caller's would see
other ops or tensors saved (ops.foreign_context) and that neither a torch.func transform nor
torch.jit tracing runs; otherwise it calls its `conv_block` as the stock block does, as does the
forward `torch.jit.script` compiles.

`fuse_in_place` (the switch) fuses a users' block without replacing it: the very object, its class
swapped for a subclass of FusedConvBlock and of their own, so that it keeps its identity (their
references to it, hooks registered on it later), `isinstance` with their class, their methods and
their class's name. At each call it also checks that a call of their class is still stock's, unless
its caller proved it (`stand_ins_proved`), and runs their forward where it is not.
"""

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn

from . import stock
from .ops import fused_call_stands_for, stock_block_call
from .ops.conv_block import conv_block_forward
from .precision import autocast_dtype
from .recompute.intermediates import block_keeps_intermediates
from .recompute.weight_casts import cast_weight

# While a caller (the switch's episode) has proved a fused-in-place block's class: on the block.
_PROVED = "_stand_in_proved"


@contextlib.contextmanager
def stand_ins_proved(blocks):
    """These blocks fused in place (`fuse_in_place`) skip the check of their own class at each call
    while this is active: the caller (the switch's episode) proved them before entering it."""
    for block in blocks:
        vars(block)[_PROVED] = vars(block).get(_PROVED, 0) + 1
    try:
        yield
    finally:
        for block in blocks:
            count = vars(block).pop(_PROVED, 0)  # gone where the block was unfused meanwhile
            if count > 1:
                vars(block)[_PROVED] = count - 1


class FusedConvBlock(nn.Module):
    """Drop-in for the stock U-Net `ConvBlock(in_channels, out_channels, mid_channels)`.

    Same parameters and state_dict keys (`conv_block.0.weight`, `conv_block.1.weight/bias`,
    `conv_block.3.weight`, `conv_block.4.weight/bias`) and the same GroupNorm group rule; the
    `conv_block` Sequential holds them, but forward runs the fused path (or, while a hook or a
    changed layer makes the stock call differ, the stock one: `conv_block(x)`). With `recompute=True`
    (default) backward recomputes the block from its saved input unless
    `qca_lowmem.keep_block_intermediates()` is active; with `recompute=False` it always keeps
    its intermediates (still with the fused GroupNorm+ELU kernels).
    """

    def __init__(self, in_channels: int, out_channels: int, mid_channels: Optional[int] = None, *,
                 recompute: bool = True):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("mid_channels", mid_channels)):
            if not (value is None and name == "mid_channels") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"FusedConvBlock: {name} must be an int >= 1, got {value!r}")
        # The stock block's own layers: its parameters, keys and initialisation by construction.
        self.conv_block = stock.ConvBlock(in_channels, out_channels, mid_channels).conv_block
        self.recompute = recompute

    @classmethod
    def from_stock(cls, block: nn.Module, *, recompute: bool = True) -> "FusedConvBlock":
        """A fused block around `block.conv_block` itself: the very same layers and Parameters."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.conv_block = block.conv_block
        fused.recompute = recompute
        return fused

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}"

    def forward(self, x: Tensor, keep_intermediates: Optional[bool] = None) -> Tensor:
        """`keep_intermediates` overrides the block's own choice (for callers that recompute
        around the block themselves); None: keep them when `recompute` is False or inside
        `keep_block_intermediates()`."""
        if torch.jit.is_scripting():
            return self.conv_block(x)  # TorchScript compiles the stock block, as a jit trace records it
        return self._eager_forward(x, keep_intermediates)

    @torch.jit.unused
    def _eager_forward(self, x: Tensor, keep_intermediates: Optional[bool]) -> Tensor:
        own = getattr(type(self), "stands_for", None)  # a users' block fused in place: its own class
        if own is not None and not vars(self).get(_PROVED) and stock_block_call(own) is not None:
            return own.forward(self, x)  # their class edited since it was proved: its forward, as written
        if not self.runs_fused():
            return self.conv_block(x)  # the stock block's forward: its hooks run as stock runs them
        conv1, norm1, _, conv2, norm2, _ = self.conv_block
        conv1_weight, conv2_weight = conv1.weight, conv2.weight
        compute_dtype = autocast_dtype(x.device.type)
        if compute_dtype is not None:
            # What autocast does for the stock convolutions: float64 is left alone. The weights
            # come from the episode's copies when a rollout runs the block (recompute/weight_casts.py).
            if x.dtype != torch.float64:
                x = x.to(compute_dtype)
            conv1_weight, conv2_weight = (
                t if t.dtype == torch.float64 else cast_weight(t, compute_dtype) for t in (conv1_weight, conv2_weight))
        if keep_intermediates is None:
            keep_intermediates = not self.recompute or block_keeps_intermediates()
        return conv_block_forward(x, conv1_weight, norm1.weight, norm1.bias, conv2_weight, norm2.weight, norm2.bias,
                                  norm1.num_groups, norm2.num_groups, float(norm1.eps), float(norm2.eps),
                                  keep_intermediates)

    def runs_fused(self) -> bool:
        """Whether the fused path computes what calling `conv_block` computes now: the stock
        layers, each call just its class's forward, no mode or saved-tensors hook of the caller's
        (ops.foreign_context), no torch.func transform or jit trace (ops.stands_for_stock). Asked
        at every call (about 5 us on a CPU; 3 us inside the fused U-Net's call, which has checked
        the calls already)."""
        seq = self._modules.get("conv_block")
        return (type(seq) is nn.Sequential and layers_mismatch(seq) is None
                and fused_call_stands_for((self, seq, *seq._modules.values())))


class _FusedInPlace(FusedConvBlock):
    """The base of the classes `fuse_in_place` gives a users' block: FusedConvBlock's forward,
    then their class (its methods, `isinstance`). Each subclass names their class `stands_for`."""

    stands_for: type
    recompute = True

    def __init__(self, *args, **kwargs):
        # A block made from type(block) (a fresh one in its place) is made as their class makes it.
        type(self).stands_for.__init__(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return type(self).stands_for.extra_repr(self)

    def __prepare_scriptable__(self):
        # torch.jit.script compiles FusedConvBlock.forward's stock call; where their class's call
        # changed since it was fused, their class again, whose forward it compiles.
        if stock_block_call(type(self).stands_for) is not None:
            unfuse(self)
        return self

    def __reduce_ex__(self, protocol):
        # The class is made at run time: a copy or pickle (of an enabled trainer) names theirs.
        return _new_fused_in_place, (type(self).stands_for,), {
            name: value for name, value in vars(self).items() if name != _PROVED}


_IN_PLACE_CLASSES = {}  # their class -> its fused subclass, made once


def _fused_class(own: type) -> type:
    fused = _IN_PLACE_CLASSES.get(own)
    if fused is None:
        fused = type(own.__name__, (_FusedInPlace, own), {"__module__": __name__, "__qualname__": own.__qualname__,
                                                           "stands_for": own})
        _IN_PLACE_CLASSES[own] = fused
    return fused


def _new_fused_in_place(own: type) -> nn.Module:
    return object.__new__(_fused_class(own))


def fuse_in_place(block: nn.Module) -> bool:
    """Fuse the users' `block` (a stock-shaped ConvBlock, `unet.stock_block_mismatch`) without
    replacing it: its class becomes a subclass of FusedConvBlock and of its own, with their class's
    name. False where Python refuses the swap (their class defines __slots__: "object layout
    differs"; its metaclass refuses the subclass), and the block stays theirs, unfused."""
    try:
        block.__class__ = _fused_class(type(block))
    except TypeError:
        return False
    return True


def fused_in_place(cls: type) -> Optional[type]:
    """The users' class of a class `fuse_in_place` made, else None."""
    return cls.__dict__.get("stands_for") if issubclass(cls, _FusedInPlace) else None


def unfuse(block: nn.Module) -> None:
    """A block fused in place given its own class back."""
    own = fused_in_place(type(block))
    if own is not None:
        vars(block).pop(_PROVED, None)
        block.__class__ = own


def _conv_mismatch(layer: nn.Module, index: int) -> Optional[str]:
    if type(layer) is not nn.Conv2d:
        return f"layer {index} is {type(layer).__name__}, expected Conv2d"
    if (layer.kernel_size, layer.stride, layer.padding, layer.dilation, layer.groups) != ((3, 3), (1, 1), (1, 1), (1, 1), 1):
        return (f"layer {index} is Conv2d(kernel_size={layer.kernel_size}, stride={layer.stride}, "
                f"padding={layer.padding}, dilation={layer.dilation}, groups={layer.groups}), expected 3x3, stride 1, padding 1")
    if layer.padding_mode != "zeros":
        return f"layer {index} is a Conv2d with padding_mode={layer.padding_mode!r}, expected 'zeros'"
    if layer.bias is not None:
        return f"layer {index} is a Conv2d with a bias, expected bias=False"
    return None


def _norm_mismatch(layer: nn.Module, index: int, channels: int) -> Optional[str]:
    if type(layer) is not nn.GroupNorm:
        return f"layer {index} is {type(layer).__name__}, expected GroupNorm"
    if not layer.affine:
        return f"layer {index} is a GroupNorm without affine parameters, expected affine=True"
    if layer.weight is None or layer.bias is None:  # set to None after it was made
        return f"layer {index} is a GroupNorm whose {'weight' if layer.weight is None else 'bias'} is None"
    if layer.num_channels != channels:
        return f"layer {index} is GroupNorm over {layer.num_channels} channels after a conv with {channels}"
    return None


def _act_mismatch(layer: nn.Module, index: int) -> Optional[str]:
    if type(layer) is not nn.ELU:
        return f"layer {index} is {type(layer).__name__}, expected ELU"
    if layer.alpha != 1.0:
        return f"layer {index} is ELU(alpha={layer.alpha}), expected alpha=1.0"
    return None


def layers_mismatch(seq: nn.Sequential) -> Optional[str]:
    """None when `seq` is Sequential(Conv2d(3x3, padding 1, no bias), GroupNorm, ELU(alpha=1),
    Conv2d(3x3, padding 1, no bias), GroupNorm, ELU(alpha=1)), the layers the fused block
    computes, else why not."""
    layers = tuple(seq._modules.values())  # (Sequential's len and iter cost more, asked at every call)
    if len(layers) != 6:
        return f"conv_block has {len(layers)} layers, expected 6 (Conv2d, GroupNorm, ELU, Conv2d, GroupNorm, ELU)"
    conv1, norm1, act1, conv2, norm2, act2 = layers
    reason = (_conv_mismatch(conv1, 0) or _norm_mismatch(norm1, 1, conv1.out_channels) or _act_mismatch(act1, 2)
              or _conv_mismatch(conv2, 3))
    if reason is None and conv2.in_channels != conv1.out_channels:
        reason = f"layer 3 takes {conv2.in_channels} channels but layer 0 gives {conv1.out_channels}"
    return reason or _norm_mismatch(norm2, 4, conv2.out_channels) or _act_mismatch(act2, 5)
