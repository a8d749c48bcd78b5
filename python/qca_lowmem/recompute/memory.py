"""What the rollout measures in bytes, for its "auto" schedule and for `qca-lowmem plan`, so they
agree: what an autograd graph keeps for backward (a device-independent measure) and the memory a
CUDA device can still give. Byte sizes written for people and read from them are units.py's;
the trainer's own planning figures (model state, a state's size, the loss's states) are in
trainer/footprint.py."""

import weakref
from typing import List

import torch

from .. import _torch_private as torch_private

# What `qca-lowmem plan` leaves beyond its predicted reserved peak (which counts the allocator's
# rounding and a calibrated margin, within 10% of the peaks measured), and what budget="free"
# leaves unused.
SAFETY = 1.10

def saved_bytes(fn, *args, **kwargs) -> int:
    """Run `fn(*args, **kwargs)` and return the unique bytes its autograd graph saves for backward.

    Every tensor saved for backward (by autograd, custom Functions or `save_for_backward`) is
    counted by its storage, once however many views of it are saved; nn.Parameters are excluded,
    since they live whether or not a graph exists.
    """
    return sum(saved_storage_sizes(fn, *args, **kwargs))


def _check_callable(fn, caller: str) -> None:
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable (it is run, its graph measured), got {type(fn).__name__}")


def counted_storages(tensor: torch.Tensor) -> list:
    """(key, storage) of each storage of a saved tensor as saved_bytes counts them, the key telling
    the storage apart while it lives: its own, or a sparse tensor's indices' and values'; none for a
    Parameter (it lives whether or not a graph exists) and a meta tensor (no data)."""
    if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta":
        return []
    parts = (tensor,) if tensor.layout == torch.strided else torch_private.sparse_parts(tensor)
    return [((part.device, part.untyped_storage().data_ptr()), part.untyped_storage()) for part in parts]


def peak_saved_bytes(fn, *args, **kwargs) -> int:
    """Run `fn(*args, **kwargs)` and return the most bytes autograd held for backward at once
    while it ran: each saved storage counted once (as `saved_bytes` counts them, parameters
    excluded) from when a graph saves it until the graph lets it go. For a training step that runs
    its backward (`train_episode`), the peak of its episode: the forward's graphs and, in the
    backward, what recomputes hold."""
    _check_callable(fn, "peak_saved_bytes")
    live = {}  # (device, address) -> [references held, bytes]
    held, peak = [0], [0]

    def release(key):
        entry = live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del live[key]
            held[0] -= entry[1]

    def pack(tensor):
        holder = _Held(tensor)  # holds the storage alive, so its address stays its key
        for key, storage in counted_storages(tensor):
            entry = live.get(key)
            if entry is None:
                live[key] = entry = [0, storage.nbytes()]
                held[0] += entry[1]
                peak[0] = max(peak[0], held[0])
            entry[0] += 1
            weakref.finalize(holder, release, key)
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, _Held.unpack):
        fn(*args, **kwargs)
    return peak[0]


class _Held:
    """A saved tensor as peak_saved_bytes packs it: gone when its graph lets it go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor

    def unpack(self):
        return self.tensor


def saved_storage_sizes(fn, *args, **kwargs) -> List[int]:
    """Run `fn(*args, **kwargs)` and return the size in bytes of each distinct storage its autograd
    graph saves for backward (parameters excluded), as `saved_bytes` counts them.

    Storages are held until `fn` returns so that a freed address reused by a later allocation
    cannot be mistaken for the same storage.
    """
    _check_callable(fn, "saved_bytes")
    storages = {}

    def pack(tensor):
        for key, storage in counted_storages(tensor):
            if storage.nbytes() > 0:
                storages[key] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args, **kwargs)
    return [storage.nbytes() for storage in storages.values()]


def free_bytes(device: torch.device) -> int:
    """What new tensors on this CUDA device can still get: the device's free memory, within this
    process's cap (set_per_process_memory_fraction: the small-GPU emulation on a large card), plus
    what the caching allocator holds reserved but unused outside private pools (a captured
    graph's pool keeps its free blocks for the graph's replays)."""
    device = torch.device(device)
    if device.index is None:  # the per-process fraction is asked for by index
        device = torch.device("cuda", torch.cuda.current_device())
    device_free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cap = torch.cuda.get_per_process_memory_fraction(device) * total
    unused = reserved - torch.cuda.memory_allocated(device) - private_pool_free_bytes(device)
    return max(0, int(min(device_free, cap - reserved))) + max(0, unused)


def private_pool_free_bytes(device: torch.device) -> int:
    """Reserved bytes of private pools (CUDA graphs') on this device that no tensor holds: the
    pool keeps them for its graphs, so other allocations cannot get them."""
    return sum(segment["total_size"] - segment["active_size"] for segment in torch.cuda.memory_snapshot()
               if segment.get("device") == device.index and tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))


def free_budget(device: torch.device, step_bytes: int) -> int:
    """budget="free": the device's free memory after plan's margin and one step's working set."""
    return max(0, int(free_bytes(device) / SAFETY) - step_bytes)
