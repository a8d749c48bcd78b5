"""What the reference trainer says to the user: one line on stderr, `qca-lowmem: ` first, from
rank 0 only (every rank runs the same code). metrics.py's progress bar writes its notes above
itself with the same prefix."""

import sys

PREFIX = "qca-lowmem: "


def message(text: str, rank: int = 0):
    if rank == 0:
        print(f"{PREFIX}{text}", file=sys.stderr, flush=True)
