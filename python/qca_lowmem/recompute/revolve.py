"""Binomial checkpointing (Griewank & Walther, "Algorithm 799: revolve", ACM TOMS 2000): the
arithmetic and the reverse order of the `Revolve` schedule (schedule.py).

Reversing `length` steps whose first state is kept, with `slots` kept states in all (that one
included), costs at least cost(length, slots) forward step evaluations without grad,
plus one evaluation with grad per step.
"""

import functools
import math
from typing import List


@functools.lru_cache(maxsize=None)
def cost(length: int, slots: int) -> int:
    if length <= 1:
        return 0
    if slots == 1:
        return length * (length - 1) // 2
    # r: the number of times the busiest step is advanced; beta(s, r) = C(s + r, s) steps fit.
    r = 0
    while math.comb(slots + r, slots) < length:
        r += 1
    return r * length - math.comb(slots + r, slots + 1)


@functools.lru_cache(maxsize=None)
def split(length: int, slots: int) -> int:
    """Where to place the next kept state (as an offset) in an optimal schedule; the smallest
    optimal offset, which keeps the slots busy as early as possible."""
    best, best_cost = 1, None
    for m in range(1, length):
        total = m + cost(length - m, slots - 1) + cost(m, slots)
        if best_cost is None or total < best_cost:
            best, best_cost = m, total
    return best


def first_sweep(steps: int, slots: int) -> List[int]:
    """The states the forward keeps: the kept states of the schedule's first sweep."""
    positions, start, free = [], 0, slots
    while steps - start > 1 and free > 1:
        start += split(steps - start, free)
        free -= 1
        positions.append(start)
    return positions


def reverse(steps: int, slots: int, held: dict, reverser) -> None:
    """Reverse the episode with at most `slots` kept states (held: step -> state, the first
    sweep's), optimally (binomial schedule)."""
    tasks = [("reverse", 0, steps, slots)]
    while tasks:
        task = tasks.pop()
        if task[0] == "free":
            del held[task[1]]
            continue
        _, start, stop, slots = task
        if stop - start == 1:
            reverser.backprop(start, held[start])
        elif slots == 1:
            for t in reversed(range(start, stop)):
                reverser.backprop(t, reverser.advance(held[start], start, t))
        else:
            middle = start + split(stop - start, slots)
            if middle not in held:
                held[middle] = reverser.advance(held[start], start, middle)
            # Later steps first (they are reversed first), then free the middle, then the rest.
            tasks.append(("reverse", start, middle, slots))
            tasks.append(("free", middle))
            tasks.append(("reverse", middle, stop, slots - 1))
