"""The stock U-Net operator on fused blocks, and `convert()` for models that already exist."""

import dataclasses
import functools
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import _torch_private as torch_private
from . import pools, stock
from .blocks import FusedConvBlock, fused_in_place, layers_mismatch
from .convs import autocast_casts_call, cast_convs_in_place, conv_with_cast_weights
from .ops import (
    calls_are_forwards,
    calls_checked_by_caller,
    plain_torch_layer,
    refuse_foreign_mode_in_backward,
    stands_for_stock,
    stock_block_call,
    stock_forward_call,
    torch_layers_unchanged,
)
from .ops.max_pool import max_pool2x2
from .ops.watchers import call_layer_unwatched, call_unwatched
from .precision import autocast_dtype
from .recompute.intermediates import block_keeps_intermediates
from .recompute.weight_casts import checkpoint_kwargs

RECOMPUTE_MODES = ("unet", "blocks", "none")


class UNetUnitary(nn.Module):
    """The stock `UNetUnitary(d_state, hidden_channels)` built from `FusedConvBlock`s.

    Same modules, parameters, initialisation and state_dict keys as the stock model, so a stock
    checkpoint loads with `strict=True`. `recompute` says what the forward keeps for backward:

    - "unet" (default): only the U-Net's input; backward re-runs the U-Net once, its blocks then
      keeping their intermediates (the fewest saved bytes, one extra forward);
    - "blocks": each block keeps its input and GroupNorm statistics and recomputes itself in
      backward (one extra forward too; the smallest backward peak, for large grids);
    - "none": every intermediate, with the fused GroupNorm+ELU kernels.

    Inside `qca_lowmem.keep_block_intermediates()` (a step-level recompute) it behaves as "none",
    so nothing is recomputed twice.
    """

    def __init__(self, d_state: int, hidden_channels: int, *, recompute: str = "unet"):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"UNetUnitary: recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        for name, value in (("d_state", d_state), ("hidden_channels", hidden_channels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"UNetUnitary: {name} must be an int >= 1, got {value!r}")
        self.recompute = recompute
        # The stock model's own modules (parameters, keys and initialisation as stock), its
        # ConvBlocks then fused in place around the same layers.
        for name, module in stock.UNetUnitary(d_state, hidden_channels).named_children():
            self.add_module(name, module)
        # its wiring runs the pools (_pooled) and casts the other convs' weights (_unfused); StockForward's, torch's
        convert(self, fuse_pools=False, cast_convs=False)

    def extra_repr(self) -> str:
        return f"recompute={self.recompute!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles the stock wiring, as a jit trace records it
            x1 = self.inc(x)
            x2 = self.down1(x1)
            b = self.bot(self.down2(x2))
            c1 = self.conv_up1(torch.cat([self.up1(b), x2], dim=1))
            return self.outc(self.conv_up2(torch.cat([self.up2(c1), x1], dim=1)))
        return self._eager_forward(x)

    @torch.jit.unused
    def _eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"UNetUnitary: recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if not self.runs_fused():
            # Each layer called as stock calls it, once: under the checkpoint below its hooks
            # would run again in backward. Blocks with nothing hooked still run fused.
            return stock.UNetUnitary.forward(self, x)
        return self._fused_forward(x)

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        if block_keeps_intermediates() or self.recompute == "none":
            return self._forward(x, keep_intermediates=True)
        if self.recompute == "blocks" or not torch.is_grad_enabled():
            return self._forward(x, keep_intermediates=False)
        # Blocks keep their intermediates here: the checkpoint's first forward drops them, and
        # its recompute needs them for backward, so no convolution runs a third time.
        return checkpoint(self._recomputable_forward, x, tuple(self.named_parameters()), use_reentrant=False,
                          preserve_rng_state=False, **checkpoint_kwargs())

    def _recomputable_forward(self, x: torch.Tensor, named: tuple) -> torch.Tensor:
        """_forward keeping intermediates on the parameters `named`, those the forward ran on: the
        checkpoint's recompute, in backward, swaps them in again where they are no longer the
        module's (torch.func.functional_call swapped them in for its call alone)."""
        if len(named) == len(now := tuple(self.parameters())) and all(p is q for (_, p), q in zip(named, now)):
            return self._forward(x, True)
        with torch_private.parameters_swapped(self, dict(named)):
            return self._forward(x, True)

    def runs_fused(self) -> bool:
        """Whether the fused wiring (forward_with, the checkpoint) computes what the stock forward
        computes now, calling each module the same number of times: the stock layer types, torch's
        own layer methods, and no module whose call is more than its forward (a hook, global or
        its own; a forward set on the instance); no mode or saved-tensors hook of the caller's,
        which would see other ops or tensors saved (ops.foreign_context), and no torch.func
        transform or jit trace (ops.stands_for_stock). Asked at every call (about 12 us on a CPU)."""
        children = self._modules
        if not (torch_layers_unchanged() and all(type(children.get(name)) is FusedConvBlock for name in _BLOCKS)
                and all(_is_pool_then_block(children.get(name)) for name in ("down1", "down2"))
                and type(children.get("up1")) is nn.ConvTranspose2d and type(children.get("up2")) is nn.ConvTranspose2d
                and type(children.get("outc")) is nn.Conv2d):
            return False
        return calls_are_forwards((self,), with_submodules=True) and stands_for_stock()

    def _forward(self, x: torch.Tensor, keep_intermediates: bool) -> torch.Tensor:
        def run_block(block, h):
            return block(h, keep_intermediates=keep_intermediates)

        if torch.compiler.is_compiling():
            return self.forward_with(x, run_block)
        if torch_private.in_backward():  # the checkpoint's recompute (the forward itself checked, with runs_fused)
            refuse_foreign_mode_in_backward("qca_lowmem.UNetUnitary", "the forward it recomputes")
        # forward's runs_fused() has checked every module the wiring calls; run again by the
        # checkpoint's recompute in backward, it takes the path its forward took (a hook added
        # since is not called, as stock's backward calls none).
        with calls_checked_by_caller():
            return self.forward_with(x, run_block)

    def forward_with(self, x: torch.Tensor, run_block, fused_pools: bool = True) -> torch.Tensor:
        """The stock U-Net forward with `run_block(block, h)` applying each ConvBlock, so that the
        stock computation (`block.conv_block(h)`, torch's pools: `fused_pools=False`) and the fused
        one share the wiring."""
        pool = _pooled if fused_pools else call_layer_unwatched
        x1 = run_block(self.inc, x)
        x2 = run_block(self.down1[1], pool(self.down1[0], x1))
        x3 = run_block(self.down2[1], pool(self.down2[0], x2))
        b = run_block(self.bot, x3)
        c1 = run_block(self.conv_up1, call_unwatched(_cat_channels, (_unfused(self.up1, b), x2)))
        c2 = run_block(self.conv_up2, call_unwatched(_cat_channels, (_unfused(self.up2, c1), x1)))
        return _unfused(self.outc, c2)


def _cat_channels(skip_from: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    return torch.cat([skip_from, skip], dim=1)


_BLOCKS = ("inc", "bot", "conv_up1", "conv_up2")


def _is_pool_then_block(down) -> bool:
    return type(down) is nn.Sequential and len(down) == 2 and type(down[0]) in (nn.MaxPool2d, pools.MaxPool2d) \
        and type(down[1]) is FusedConvBlock


def _pooled(pool: nn.MaxPool2d, x: torch.Tensor) -> torch.Tensor:
    return call_layer_unwatched(pool, x, functools.partial(_pool_run, pool, x))


def _pool_run(pool: nn.MaxPool2d, x: torch.Tensor) -> torch.Tensor:
    """pool(x), through max_pool2x2 (pools.py: torch's values and gradient, no indices kept) where
    the pool is torch's, a plain 2x2 one, and takes it on x; a stand-in decides for itself."""
    if plain_torch_layer(pool) and pools.takes_the_op(pool, x):
        return max_pool2x2(x)
    return pool(x)


def _unfused(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return call_layer_unwatched(layer, x, functools.partial(_unfused_run, layer, x))


def _unfused_run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x), under autocast with its weights from the episode's copies (cast once per episode,
    as the fused blocks' are) instead of autocast's per-call casts: the same values and gradients."""
    compute_dtype = autocast_dtype(x.device.type)
    if compute_dtype is None or type(layer) is nn.MaxPool2d or not plain_torch_layer(layer) \
            or not autocast_casts_call(layer, x):
        return layer(x)
    return conv_with_cast_weights(layer, x, compute_dtype)


def input_dtype(operator: nn.Module, psi: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype the pack can write `operator`'s input in for a step of `psi`: autocast's, where
    calling operator(x) first casts x to it and reads it nowhere else, so that the pack's one
    rounding is the cast's, bit for bit, and the cast's copy and its gradient's are spared. Proved
    for qca_lowmem's UNetUnitary running fused and for a module whose forward is stock
    UNetUnitary's by its code, each with `inc` a FusedConvBlock (or a block fused in place) running
    fused (its first act is the cast) and no hook that could see x. None elsewhere: the pack writes
    its own float32."""
    if psi.dtype != torch.complex64 or torch.compiler.is_compiling():
        return None  # a float64 input is not cast (autocast leaves it), and compiled code is not proved
    compute = autocast_dtype(psi.device.type)
    if compute is None:
        return None
    cls = type(operator)
    if cls is UNetUnitary:
        proved = operator.runs_fused()
    else:
        proved = stock_forward_call(cls, stock.UNetUnitary.forward, ("inc",), "stock UNetUnitary's") is None \
            and _runs_fused_forward(getattr(operator, "inc", None)) \
            and calls_are_forwards((operator,), with_submodules=True)
    return compute if proved else None


def _runs_fused_forward(block) -> bool:
    """A FusedConvBlock, or a users' block fused in place whose class's call is still stock's, that
    runs its fused path now."""
    if not isinstance(block, FusedConvBlock) or type(block).forward is not FusedConvBlock.forward:
        return False
    own = fused_in_place(type(block))
    return (own is None or stock_block_call(own) is None) and block.runs_fused()


@dataclasses.dataclass
class ConversionReport:
    """What `convert` did: qualified names of the blocks it replaced, of the modules with a
    `conv_block` it left alone, each with the reason, of the max pools it gave the fused pool's
    class, and of the convs outside the blocks it gave the episode's weight copies."""

    converted: List[str] = dataclasses.field(default_factory=list)
    skipped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    pools: List[str] = dataclasses.field(default_factory=list)
    convs: List[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} ConvBlock(s) to FusedConvBlock"]
        lines += [f"  {name or '<root>'}" for name in self.converted]
        if self.pools:
            lines.append(f"gave {len(self.pools)} nn.MaxPool2d layer(s) the fused 2x2 pool on CUDA")
            lines += [f"  {name or '<root>'}" for name in self.pools]
        if self.convs:
            lines.append(f"gave {len(self.convs)} conv layer(s) outside the blocks the episode's weight copies")
            lines += [f"  {name or '<root>'}" for name in self.convs]
        if self.skipped:
            lines.append(f"left {len(self.skipped)} alone:")
            lines += [f"  {name or '<root>'}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def stock_block_mismatch(module: nn.Module) -> Optional[str]:
    """None when `module` is a stock-shaped ConvBlock that `convert` can replace, else why not."""
    seq = getattr(module, "conv_block", None)
    if not isinstance(seq, nn.Sequential):
        return f"conv_block is {type(seq).__name__}, expected Sequential"
    reason = layers_mismatch(seq)
    if reason:
        return reason
    others = [name for name, _ in module.named_children() if name != "conv_block"]
    if others or list(module.named_parameters(recurse=False)) or list(module.named_buffers(recurse=False)):
        return "has submodules, parameters or buffers besides conv_block, so its forward may do more"
    if torch_private.any_call_hooked((module,), with_submodules=False):
        return "has hooks or a forward of its own, which the fused block (a new module) would not carry"
    return stock_block_call(type(module))


def convert(module: nn.Module, *, recompute: bool = True,
            fuse_pools: bool = True, cast_convs: bool = True) -> Tuple[nn.Module, ConversionReport]:
    """Replace every stock-shaped ConvBlock inside `module` by a `FusedConvBlock`, in place, give
    its `nn.MaxPool2d` layers the class of `pools.MaxPool2d` (`fuse_pools`), and its other
    `nn.Conv2d` and `nn.ConvTranspose2d` layers those of `convs.Conv2d` and `convs.ConvTranspose2d`
    (`cast_convs`).

    A ConvBlock is any module whose `conv_block` is Sequential(Conv2d(3x3, padding 1, no bias),
    GroupNorm, ELU(alpha=1), Conv2d(3x3, padding 1, no bias), GroupNorm, ELU(alpha=1)), that
    has nothing else, and whose call runs just `self.conv_block(x)`, as stock's, by the code of its
    class's forward (`ops.stock_block_call`; an edited forward is left alone). The fused block
    wraps the very same layers, so Parameter objects (and an optimizer holding them), names and
    state_dict keys are unchanged. Modules with a `conv_block` of another shape (other norms,
    other activations...) are left alone and reported. Returns `(module, report)`; when
    `module` itself is a ConvBlock, the returned module is its fused replacement.

    A pool stays the same object, of torch's class but for its forward, which runs the library's
    2x2 max pool (torch's values and gradient, bit for bit, no indices kept) where it is 2x2 with
    stride 2 and on CUDA, and torch's forward otherwise (pools.py). A conv outside the fused blocks
    stays the same object too; in a rollout's step under autocast it takes its weight and bias from
    the episode's half-precision copies, as the blocks do (cast once an episode, not at every
    step: the same values, its gradient summed in fp32), and torch's forward otherwise (convs.py).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert: module must be a torch.nn.Module, got {type(module).__name__}")
    report = ConversionReport()
    if fuse_pools:
        swapped = {id(pool) for pool in pools.fuse_pools_in_place(module)}
        report.pools = [name for name, child in module.named_modules() if id(child) in swapped]
    result = module
    fused_of = {}  # a block shared by several parents becomes one fused block
    for name, child in list(module.named_modules(remove_duplicate=False)):
        if isinstance(child, FusedConvBlock) or not hasattr(child, "conv_block"):
            continue
        if id(child) not in fused_of:
            reason = stock_block_mismatch(child)
            if reason is not None:
                report.skipped.append((name, reason))
                fused_of[id(child)] = None
                continue
            fused_of[id(child)] = FusedConvBlock.from_stock(child, recompute=recompute)
            fused_of[id(child)].train(child.training)
        fused = fused_of[id(child)]
        if fused is None:
            continue
        if name == "":
            result = fused
        else:
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name), attr, fused)
        report.converted.append(name)
    if cast_convs:
        swapped = {id(conv) for conv in cast_convs_in_place(result)}
        report.convs = [name for name, child in result.named_modules() if id(child) in swapped]
    return result, report
