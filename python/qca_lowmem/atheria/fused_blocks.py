"""The operator's ConvBlocks fused in place, and given their class back.

A block is fused where its call runs just `self.conv_block(x)` (`ops.stock_block_call`, by its
class's code) and its `conv_block` holds the stock layers (`unet.stock_block_mismatch`). It stays the
same object (`blocks.fuse_in_place`): their references to it, hooks they register on it later, a
walk of the model by their class (`isinstance`) and their methods all keep working. Each episode
proves it again, since their class can change after enable() (a forward edited in a notebook, a
method set on the class): a block whose call is no longer stock's gets its class back, said once,
and runs as written.
"""

import contextlib
import logging
from typing import List

import torch

from ..blocks import FusedConvBlock, fuse_in_place, fused_in_place, stand_ins_proved, unfuse
from ..ops import stock_block_call
from ..unet import stock_block_mismatch
from .say import say

# The users' blocks fused in place
Swapped = List[torch.nn.Module]


def swap_in(operator: torch.nn.Module) -> Swapped:
    """Every stock-called ConvBlock of the operator fused in place; those fused, for put_back()."""
    blocks = [module for module in operator.modules()
              if not isinstance(module, FusedConvBlock) and hasattr(module, "conv_block")]
    return [block for block in blocks if stock_block_mismatch(block) is None and fuse_in_place(block)]


@contextlib.contextmanager
def proved_for_the_episode(undo):
    """`undo.blocks` proved again (still_stock), and those still stock's spared the check of their
    class at each call while the episode runs."""
    undo.blocks = still_stock(undo.blocks)
    with stand_ins_proved(undo.blocks):
        yield


def fuse_again(swapped: Swapped) -> None:
    """The blocks swap_in() fused, given back their class, fused in place again (proved again by
    still_stock at the episode)."""
    for block in swapped:
        if fused_in_place(type(block)) is None:
            fuse_in_place(block)


def put_back(swapped: Swapped) -> None:
    for block in swapped:
        unfuse(block)


def still_stock(swapped: Swapped) -> Swapped:
    """The blocks of `swapped` still fused whose class's call is still stock's; the others get
    their class back, said once: their class changed since they were fused, so their own forward
    runs. (A block no longer fused, a copy pickled as their class, is left as it is.)"""
    owns = {block: fused_in_place(type(block)) for block in swapped}
    verdicts = {own: stock_block_call(own) for own in set(owns.values()) if own is not None}  # a few classes
    changed = [(block, verdicts[own]) for block, own in owns.items() if own is not None and verdicts[own] is not None]
    if changed:
        names = sorted({owns[block].__qualname__ for block, _ in changed})
        put_back([block for block, _ in changed])
        say(logging.WARNING, f"the call of {', '.join(names)} changed since enable() ({changed[0][1]}): the episodes "
                             f"run {'that block' if len(changed) == 1 else f'those {len(changed)} blocks'} as "
                             "written, unfused")
    return [block for block, own in owns.items() if own is not None and verdicts[own] is None]
