"""Byte sizes written for people ('1.50 KiB') and read from them ('3.68GiB', '4GB'): the
rollout's budget, `qca-lowmem plan` and the trainer's messages say sizes the same way."""

import math


def format_bytes(n) -> str:
    """1536 -> '1.50 KiB': binary units up to GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def parse_bytes(text: str, allow_zero: bool = False, name: str = "memory size") -> int:
    """'3.68GiB', '512 MiB', '4GB', '1e9' -> bytes; `name` says what was given in the error."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "k": 2**10, "m": 2**20, "g": 2**30}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or unit not in units or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must look like 3.68GiB, 512MiB or 4GB, got {text!r}")
    return int(value * units[unit])


def size_text(n: int) -> str:
    """Bytes as a size parse_bytes reads back: exact in the largest unit that divides them
    ('1MiB'), else to two decimals of the largest unit below them ('3.07GiB': a size typed as
    such is said back as typed)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            if n % size == 0:
                return f"{n // size}{unit}"
            return f"{n / size:.2f}{unit}"
    return str(n)
