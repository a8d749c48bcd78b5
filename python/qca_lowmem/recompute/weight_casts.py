"""Half-precision copies of the fused blocks' conv weights (and of `UNetUnitary`'s other conv
layers), made once per episode, or once for all the episodes run inside `shared_weight_casts()`
(those of one optimizer step).

Under autocast a fused block casts its conv weights to the compute dtype. Cast at every call,
an episode of T steps reads and writes every weight 2T times (forward and recompute), outside
autocast's own cache, which lives only as long as one autocast context. The rollout keeps one
`WeightCasts` per episode, active around each step: the first call casts a weight and every
later step, recompute and backward reuses the copy. A weight changed in place after a step of
the episode used its copy stops the episode: autocast's cache would go on with the first cast.

With gradient accumulation the weights do not change between the episodes of one optimizer
step either: inside `with qca_lowmem.shared_weight_casts():` every rollout uses the scope's one
`WeightCasts`, so the copies are made once for all of them. A weight changed inside the scope is
cast again at its next use: in place (its version), given new memory (`p.data = ...`, its
address), or by any optimizer's step, fused ones included, which change weights without their
versions (a global optimizer step hook, installed while any scope is open, drops every open
scope's copies). Only an in-place edit through `.data` outside an optimizer goes unseen: leave the
scope first. Leaving the scope drops its copies (a rollout whose backward runs after it casts
again what it needs), so close it before the optimizer step, whose memory then does not hold
them.

Each use gets its own autograd node (`_CachedCast`), whose backward is what the per-call cast's
is (the gradient cast to the weight's dtype), so values and gradients are bitwise the same as
casting per call, and autograd never sums several steps' gradients in half precision. Inside a
recomputing rollout's backward, where each step's weight gradients are summed into an fp32
buffer (param_grads.py), the half-precision gradient is added there directly: the same sum, in
one pass over the weight instead of a cast and then an add on CUDA, whose add reads the half
operand in its kernel (on the CPU torch still casts it to a temporary inside the add).
"""

import contextlib
import threading
from typing import Dict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..ops.watchers import note_read
from .param_grads import deposit

_state = threading.local()
_scopes = set()  # the WeightCasts of open shared_weight_casts() scopes, any thread
_scopes_lock = threading.Lock()
_step_hook = None  # the optimizer step hook that drops their copies, while any is open


class WeightCasts:
    """The copies of one episode, or of a `shared_weight_casts()` scope: weight -> its copy in a
    compute dtype."""

    def __init__(self):
        self._copies: Dict[tuple, tuple] = {}  # (id, dtype) -> (weight, its stamp, copy, the episode that cast it)
        self.episode = 0  # the rollouts that used these copies so far (one, outside a shared scope)

    def active(self) -> "_Active":
        """A context inside which cast_weight uses these copies; it may be entered again, and
        while entered (torch's checkpoint enters its recompute context at each backward through it)."""
        return _Active(self)

    def copies(self):
        """The copies made so far."""
        return [entry[2] for entry in self._copies.values()]

    def copy_of(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(weight), dtype)
        entry = self._copies.get(key)
        stamp = (weight._version, weight.data_ptr())
        if entry is None or entry[0] is not weight or entry[1] != stamp:
            if entry is not None and entry[0] is weight and entry[3] == self.episode:
                # autocast's own cache would keep the first cast for the rest of the episode, and
                # the copy the new values: neither is what the other computes
                raise RuntimeError(
                    f"qca_lowmem: a {tuple(weight.shape)} {str(weight.dtype).removeprefix('torch.')} parameter changed in "
                    f"place during the episode, after a step used its {str(dtype).removeprefix('torch.')} cast: under "
                    "autocast the stock episode goes on with its first cast (autocast's cache), qca_lowmem's would cast "
                    "the new values; change parameters between episodes (or in an optimizer step)")
            with torch.no_grad():
                entry = (weight, stamp, weight.to(dtype), self.episode)
            self._copies[key] = entry
        return entry[2]


class _Active:
    def __init__(self, casts: WeightCasts):
        self.casts = casts
        self.outer = []  # the casts active before each entry not yet left

    def __enter__(self):
        self.outer.append(getattr(_state, "casts", None))
        _state.casts = self.casts

    def __exit__(self, *exc):
        _state.casts = self.outer.pop()
        return False


class StaticCasts(WeightCasts):
    """The copies a captured step reads (step_graph.py): made by its eager warm-up, at addresses the
    graphs then read at every replay, and written again in place (`refresh`) before each
    episode's replays, since the weights may have changed between episodes without a Python
    call in the replays to notice. One cast per weight per episode, as eager steps do."""

    def copy_of(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(weight), dtype)
        entry = self._copies.get(key)
        if entry is None or entry[0] is not weight:
            with torch.no_grad():
                entry = (weight, None, weight.to(dtype), None)
            self._copies[key] = entry
        return entry[2]

    def refresh(self) -> None:
        with torch.no_grad():
            for weight, _, copy, _ in self._copies.values():
                copy.copy_(weight)


@contextlib.contextmanager
def shared_weight_casts():
    """Rollouts run inside share one set of half-precision weight copies (in this thread): each
    fused block's weight is cast once for all their episodes, forward, recompute and backward,
    and again after it changed (in place, given new memory, or by any optimizer's step). Results
    are bitwise those of casting per episode.
    Open it around the episodes of one optimizer step and close it before `optimizer.step()`;
    leaving it drops the copies. Nested scopes are the outermost one."""
    if getattr(_state, "shared", None) is not None:
        yield
        return
    casts = WeightCasts()
    _opened(casts)
    _state.shared = casts
    try:
        yield
    finally:
        _state.shared = None
        _closed(casts)
        casts._copies.clear()  # freed even while an episode's graph, holding `casts`, lives on


def _opened(casts: WeightCasts) -> None:
    global _step_hook
    with _scopes_lock:
        _scopes.add(casts)
        if _step_hook is None:
            _step_hook = register_optimizer_step_post_hook(_drop_shared_copies)


def _closed(casts: WeightCasts) -> None:
    """The hook goes with the last open scope: optimizers run without it when nothing shares copies."""
    global _step_hook
    with _scopes_lock:
        _scopes.discard(casts)
        if not _scopes and _step_hook is not None:
            _step_hook.remove()
            _step_hook = None


def _drop_shared_copies(optimizer, args, kwargs) -> None:
    """After any optimizer step: its weights changed, perhaps without a version bump (fused)."""
    with _scopes_lock:
        for casts in _scopes:
            casts._copies.clear()


def for_episode() -> WeightCasts:
    """The copies a rollout starting now uses: the open scope's, else its own."""
    shared = getattr(_state, "shared", None)
    casts = shared if shared is not None else WeightCasts()
    casts.episode += 1
    return casts


def checkpoint_kwargs() -> dict:
    """Arguments for torch.utils.checkpoint that make its recompute, run later by the backward,
    reuse the copies of the episode active now (none when there is none, or under compile)."""
    casts = _active()
    if casts is None:
        return {}
    return {"context_fn": lambda: (contextlib.nullcontext(), casts.active())}


def _active():
    return None if torch.compiler.is_compiling() else getattr(_state, "casts", None)


def episode_casts_active() -> bool:
    """Whether a rollout's step runs now with its episode's copies (outside compiled code)."""
    return _active() is not None


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight.to(dtype), from the active episode's copies when there are any."""
    casts = _active()
    if casts is None or weight.dtype == dtype:
        return weight.to(dtype)
    copy = casts.copy_of(weight, dtype)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        note_read(weight)  # the step reads it through the copy: the forward's watch must see it
        return copy
    return _CachedCast.apply(weight, copy)


class _CachedCast(torch.autograd.Function):
    """copy as a differentiable function of weight: backward as that of weight.to(copy.dtype)."""

    @staticmethod
    def forward(ctx, weight, copy):
        ctx.weight = weight  # a parameter: it outlives the graph anyway
        return copy.detach()  # a tensor of its own: autograd attaches this node to it, not to the copy

    @staticmethod
    def backward(ctx, grad):
        # Inside a recomputing rollout's backward the weight's per-step gradients are summed into
        # an fp32 buffer: added there straight from half precision, with no cast pass before.
        # (For fp32 and fp64 weights, where the cast of grad is exact: an fp16 weight's is a rounding.)
        if ctx.weight.dtype in (torch.float32, torch.float64) and deposit(ctx.weight, grad):
            return None, None
        return grad.to(ctx.weight.dtype), None
