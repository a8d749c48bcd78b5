"""Memory in bytes: what an autograd graph keeps for backward (a device-independent measure),
and byte sizes written for people and read from them."""

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


def format_bytes(n) -> str:
    """1536 -> '1.50 KiB': binary units up to GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def parse_bytes(text: str, allow_zero: bool = False) -> int:
    """'3.68GiB', '512 MiB', '4GB', '1e9' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "k": 2**10, "m": 2**20, "g": 2**30}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or unit not in units or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"memory size must look like 3.68GiB, 512MiB or 4GB, got {text!r}")
    return int(value * units[unit])
