"""The fused U-Net ConvBlock, on the block ops (ops/conv_block.py).

`FusedConvBlock` computes the stock block, Conv3x3 -> GroupNorm -> ELU -> Conv3x3 -> GroupNorm ->
ELU, with the parameters and state_dict keys of the stock `ConvBlock`. Its forward keeps for
backward only the block input and the per-group statistics; backward recomputes conv1 -> GN+ELU
-> conv2 and runs the fused backward kernels. Inside a step-level recompute
(`qca_lowmem.keep_block_intermediates()`) or with `recompute=False` it keeps its intermediates
instead, so the convolutions never run a third time.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from . import stock
from .precision import autocast_dtype
from .ops import refuse_func_transforms
from .ops.conv_block import conv_block_forward
from .recompute.intermediates import block_keeps_intermediates
from .recompute.weight_casts import cast_weight


class FusedConvBlock(nn.Module):
    """Drop-in for the stock U-Net `ConvBlock(in_channels, out_channels, mid_channels)`.

    Same parameters and state_dict keys (`conv_block.0.weight`, `conv_block.1.weight/bias`,
    `conv_block.3.weight`, `conv_block.4.weight/bias`) and the same GroupNorm group rule; the
    `conv_block` Sequential holds them, but forward runs the fused path. With `recompute=True`
    (default) backward recomputes the block from its saved input unless
    `qca_lowmem.keep_block_intermediates()` is active; with `recompute=False` it always keeps
    its intermediates (still with the fused GroupNorm+ELU kernels).
    """

    def __init__(self, in_channels: int, out_channels: int, mid_channels: Optional[int] = None, *,
                 recompute: bool = True):
        super().__init__()
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

    def forward(self, x: Tensor, *, keep_intermediates: Optional[bool] = None) -> Tensor:
        """`keep_intermediates` overrides the block's own choice (for callers that recompute
        around the block themselves); None: keep them when `recompute` is False or inside
        `keep_block_intermediates()`."""
        refuse_func_transforms("qca_lowmem.FusedConvBlock", x, module=self)
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
