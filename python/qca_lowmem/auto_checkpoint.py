"""checkpoint="auto": recompute only where memory requires it.

Given a budget of bytes for what the episode keeps for backward, the rollout keeps the full graph
(block intermediates included, nothing recomputed) of as many of the last steps as fit, and
rolls out the steps before them with checkpoint="step" (one state each, recomputed once in
backward). A budget too small even for one state per step becomes checkpoint="revolve" with as
many slots as fit. The last steps are the ones kept because their graph is the first the
backward needs and frees; the recomputed part then holds one step's graph at a time.

A step's graph is measured once per step function and configuration (a forward with grad whose
saved tensors are counted, then dropped); the measure counts the autocast weight copies in
every step, so it errs towards keeping fewer steps.
"""

import weakref
from typing import Callable, Optional

import torch

from .memory import parse_bytes, saved_bytes
from .episode_reverse import differentiable
from .recompute import keep_block_intermediates
from .step_graph import carry_signature

# Allocator rounding, fragmentation and library workspaces: what `qca-lowmem plan` adds to a
# predicted peak, and what budget="free" leaves unused.
SAFETY = 1.10

_step_graph_bytes = weakref.WeakKeyDictionary()  # step_fn -> {configuration: bytes}


def check_budget(checkpoint, budget, caller: str = "rollout") -> None:
    """Raise ValueError, prefixed by `caller`, unless budget goes with checkpoint."""
    if checkpoint != "auto":
        if budget is not None:
            raise ValueError(f"{caller}: budget applies only to checkpoint='auto', got budget={budget!r} "
                             f"with checkpoint={checkpoint!r}")
        return
    if budget is None:
        raise ValueError(f"{caller}: checkpoint='auto' needs budget: the bytes the episode may keep for backward "
                         "(an int, a size such as '2GiB', or 'free' on CUDA)")
    if budget == "free":
        return
    if isinstance(budget, str):
        try:
            parse_bytes(budget, allow_zero=True)
        except ValueError:
            raise ValueError(f"{caller}: budget must be a number of bytes, a size such as '2GiB' or 'free', "
                             f"got {budget!r}") from None
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"{caller}: budget must be an int >= 0 (bytes), a size such as '2GiB' or 'free', "
                         f"got {budget!r}")


def resolve_budget(budget, psi: torch.Tensor, step_bytes: int) -> int:
    """The budget in bytes; "free" is the device's free memory after the plan's margin and one
    step's working set."""
    if budget != "free":
        return parse_bytes(budget, allow_zero=True) if isinstance(budget, str) else budget
    if not psi.is_cuda:
        raise ValueError(f"rollout: budget='free' reads the free memory of a CUDA device, but psi0 is on "
                         f"{psi.device}: give the budget in bytes")
    return max(0, int(free_bytes(psi.device) / SAFETY) - step_bytes)


def free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def _nbytes(state) -> int:
    psi, carry = state
    return psi.nbytes + sum(c.nbytes for c in carry if c is not None)


def step_graph_bytes(step_fn: Callable, psi: torch.Tensor, carry: Optional[tuple] = None):
    """(bytes one step's full graph keeps (blocks keeping their intermediates) plus its output
    state, bytes of that state); measured once per step_fn, psi and carry type and autocast state.
    A carry not made yet (None entries) is measured as the first step leaves it."""
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in sorted({"cpu", psi.device.type}))
    key = (tuple(psi.shape), psi.dtype, psi.device, carry_signature(carry), autocast)
    try:
        known = _step_graph_bytes.setdefault(step_fn, {})
    except TypeError:  # not weakly referenceable: measured every time
        known = {}
    if key not in known:
        with torch.enable_grad(), keep_block_intermediates():
            if carry is None:
                known[key] = saved_bytes(step_fn, psi.detach().requires_grad_(True)) + psi.nbytes, psi.nbytes
            else:
                if any(c is None for c in carry):
                    with torch.no_grad():
                        carry = step_fn(psi, carry)[1]
                probe = (psi.detach().requires_grad_(True),
                         tuple(c.detach().requires_grad_(True) if differentiable(c) else c for c in carry))
                state = _nbytes(probe)
                known[key] = saved_bytes(step_fn, *probe) + state, state
    return known[key]


def policy_for_budget(steps: int, state_bytes: int, step_bytes: int, budget: int):
    """(kept_steps, slots): the full graphs of the last `kept_steps` steps and checkpoint="step"
    before them; or, when one state per step does not fit, revolve with `slots` (kept_steps 0)."""
    if budget < steps * state_bytes:
        return 0, max(1, budget // state_bytes)
    if step_bytes <= state_bytes:
        return steps, None
    return min(steps, (budget - steps * state_bytes) // (step_bytes - state_bytes)), None


def rollout_with_budget(rollout: Callable, step_fn, psi0: torch.Tensor, steps: int, budget, *,
                        noise: Optional[Callable], record_every: int, preserve_rng_state: bool,
                        check_recompute: bool, carry: Optional[tuple] = None):
    """rollout(..., checkpoint="auto", budget=budget) in terms of the other modes (`rollout` is
    episode.rollout, passed in to keep the modules' imports one way)."""
    options = dict(noise=noise, record_every=record_every, preserve_rng_state=preserve_rng_state,
                   check_recompute=check_recompute)
    if carry is not None:
        options["carry"] = carry
    if not torch.is_grad_enabled():
        return rollout(step_fn, psi0, steps, checkpoint="none", **options)
    step_bytes, state_bytes = step_graph_bytes(step_fn, psi0, carry)
    usable = resolve_budget(budget, psi0, step_bytes)
    if check_recompute:  # the check keeps the final state besides the recomputed part's states
        usable = max(0, usable - state_bytes)
    kept, slots = policy_for_budget(steps, state_bytes, step_bytes, usable)
    if slots is not None:
        return rollout(step_fn, psi0, steps, checkpoint="revolve", slots=slots, **options)
    recomputed = steps - kept
    if kept == 0:
        return rollout(step_fn, psi0, steps, checkpoint="step", **options)
    wanted = {t for t in range(steps) if t == 0 or t % record_every == 0}
    history, psi = [], psi0
    if recomputed:
        psi, first, *carry_mid = rollout(step_fn, psi0, recomputed, checkpoint="step", **options)
        if carry_mid:
            options["carry"] = carry_mid[0]
        first_steps = [t for t in range(recomputed) if t == 0 or t == recomputed - 1 or t % record_every == 0]
        history += [h for t, h in zip(first_steps, first) if t in wanted]
    options.update(record_every=1, noise=None if noise is None else (lambda state, t: noise(state, t + recomputed)))
    with keep_block_intermediates():
        psi, last, *carry_T = rollout(step_fn, psi, kept, checkpoint="none", **options)
    history += [h for t, h in zip(range(recomputed, steps), last) if t in wanted and t != steps - 1]
    history.append(psi)
    return (psi, history, *carry_T)
