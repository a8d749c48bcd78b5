"""What torch's CUDA caching allocator reserves for a set of tensors alive at once, for `qca-lowmem
plan`'s reserved peak (what a GPU's memory must hold, where the allocated peak is what tensors
use). The rules are those of torch's CUDACachingAllocator (its C++ source):

- every block is rounded up to 512 bytes;
- blocks of at most 1 MiB come from the small pool, in segments of 2 MiB;
- larger blocks come from the large pool: those under 10 MiB in segments of 20 MiB, the others
  in segments of their own size rounded up to 2 MiB;
- with expandable_segments (what `qca-lowmem train` sets), a pool's blocks lie end to end in one
  segment that grows by 2 MiB (small) or 20 MiB (large) pages; a CUDA graph's private pool never
  expands (torch keeps its segments apart), so its rounding is always the first kind.

Blocks of one size share a segment as far as they fit whole (four 0.44 MiB states per 2 MiB
segment, two 8 MiB activations per 20 MiB one); blocks of different sizes are assumed to pack as
well, which makes this a floor: what fragmentation adds on top is part of plan's calibrated margin.
"""

import math
import os
from typing import Iterable, Mapping, Union

MiB = 2**20
BLOCK = 512
SMALL_BLOCK = 1 * MiB
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
OWN_SEGMENT = 10 * MiB
ROUND_LARGE = 2 * MiB


def block_bytes(size: int) -> int:
    """A request of `size` bytes as the block the allocator hands out."""
    return max(BLOCK, -(-int(size) // BLOCK) * BLOCK)


def _share(block: int, segment: int) -> float:
    """The part of a `segment` one block takes when blocks of its size fill segments whole."""
    return segment / (segment // block)


def reserved_bytes(sizes: Union[Iterable[int], Mapping[int, int]], expandable: bool = False) -> int:
    """Bytes reserved to hold tensors of these sizes (bytes; or a mapping of size to how many, for
    an episode's thousands of states) at once, from empty pools."""
    small = medium = large = 0.0
    for size, count in (sizes.items() if isinstance(sizes, Mapping) else ((size, 1) for size in sizes)):
        if size <= 0:
            continue
        block = block_bytes(size)
        if block <= SMALL_BLOCK:
            small += count * (block if expandable else _share(block, SMALL_SEGMENT))
        elif expandable or block < OWN_SEGMENT:
            medium += count * (block if expandable else _share(block, LARGE_SEGMENT))
        else:
            large += count * (-(-block // ROUND_LARGE) * ROUND_LARGE)
    return int(_whole(small, SMALL_SEGMENT) + _whole(medium, LARGE_SEGMENT) + large)


def _whole(total: float, segment: int) -> int:
    return math.ceil(total / segment) * segment


def expandable_in_environment(unset: bool = False) -> bool:
    """Whether this process's allocator runs with expandable_segments, as its settings say;
    `unset` where there are none (`qca-lowmem train` then sets it: True)."""
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if settings is None:
        return unset
    return "expandable_segments:True" in settings.replace(" ", "")
