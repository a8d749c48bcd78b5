"""The operator's ConvBlocks swapped for fused blocks around the same layers, and put back.

A fused block stands in for a block whose call runs just `self.conv_block(x)` (`ops.stock_block_call`,
by its class's code), proved when `convert()` swaps it; each episode proves it again, since their
class can change after enable() (a forward edited in a notebook, a method set on the class): a
block whose call is no longer stock's is put back in place, said once, and runs as written.
"""

import contextlib
import logging
from typing import List, Tuple

import torch

from ..blocks import FusedConvBlock, stand_in_for, stand_ins_proved
from ..ops import stock_block_call
from ..unet import convert
from .say import say

# (parent, attribute, the users' block) for every block swapped
Swapped = List[Tuple[torch.nn.Module, str, torch.nn.Module]]


def _children(root: torch.nn.Module):
    """(parent, attribute name, child) of every submodule edge under root."""
    return [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()]


def swap_in(operator: torch.nn.Module) -> Swapped:
    """Stock-called ConvBlocks -> FusedConvBlock in place; what was swapped, for put_back(). The
    operator keeps its very Parameter objects, or nothing is changed."""
    params_before = [id(p) for p in operator.parameters()]
    edges = _children(operator)
    convert(operator)
    swapped = [(parent, name, child) for parent, name, child in edges if getattr(parent, name) is not child]
    if [id(p) for p in operator.parameters()] != params_before:
        put_back(swapped)
        raise RuntimeError("enable(): convert() did not keep the operator's Parameter objects; nothing was changed")
    for parent, name, block in swapped:  # outside episodes (their inference) each call proves the block
        stand_in_for(getattr(parent, name), block)
    return swapped


@contextlib.contextmanager
def proved_for_the_episode(undo):
    """`undo.blocks` proved again (still_stock), and the fused blocks of those still stock's
    spared the check of their block's class at each call while the episode runs."""
    undo.blocks = still_stock(undo.blocks)
    fused = [f for parent, name, _ in undo.blocks if isinstance(f := getattr(parent, name), FusedConvBlock)]
    with stand_ins_proved(fused):
        yield


def put_back(swapped: Swapped) -> None:
    for parent, name, module in swapped:
        fused = getattr(parent, name)
        if isinstance(fused, FusedConvBlock):
            stand_in_for(fused, None)
        setattr(parent, name, module)


def still_stock(swapped: Swapped) -> Swapped:
    """The blocks of `swapped` whose call is still stock's; the others are put back in place, said
    once: their class changed since they were swapped, so their own forward runs."""
    verdicts = {cls: stock_block_call(cls) for cls in {type(entry[2]) for entry in swapped}}  # a few classes, many blocks
    changed = [(entry, verdicts[type(entry[2])]) for entry in swapped if verdicts[type(entry[2])] is not None]
    if not changed:
        return swapped
    put_back([entry for entry, _ in changed])
    names = sorted({type(entry[2]).__qualname__ for entry, _ in changed})
    say(logging.WARNING, f"the call of {', '.join(names)} changed since enable() ({changed[0][1]}): the episodes run "
                         f"{'that block' if len(changed) == 1 else f'those {len(changed)} blocks'} as written, unfused")
    gone = {id(entry[2]) for entry, _ in changed}
    return [entry for entry in swapped if id(entry[2]) not in gone]
