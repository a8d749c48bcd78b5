"""Device-independent memory measure: the bytes an autograd graph keeps for backward."""

from typing import List

import torch


def saved_bytes(fn, *args, **kwargs) -> int:
    """Run `fn(*args, **kwargs)` and return the unique bytes its autograd graph saves for backward.

    Every tensor saved for backward (by autograd, custom Functions or `save_for_backward`) is
    counted by its storage, once however many views of it are saved; nn.Parameters are excluded,
    since they live whether or not a graph exists.
    """
    return sum(saved_storage_sizes(fn, *args, **kwargs))


def saved_storage_sizes(fn, *args, **kwargs) -> List[int]:
    """Run `fn(*args, **kwargs)` and return the size in bytes of each distinct storage its autograd
    graph saves for backward (parameters excluded), as `saved_bytes` counts them.

    Storages are held until `fn` returns so that a freed address reused by a later allocation
    cannot be mistaken for the same storage.
    """
    storages = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                storages[(tensor.device, storage.data_ptr())] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args, **kwargs)
    return [storage.nbytes() for storage in storages.values()]
