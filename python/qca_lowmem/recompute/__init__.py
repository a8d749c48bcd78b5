"""recompute: the rollout, an episode that recomputes instead of storing, with exact gradients.

The core of the library, importing nothing of it but ops/ (docs/design.md, "The rollout"). Its
modules, one concern each:

- `api`: `rollout()`, its arguments and their checks, the history rule.
- `probe`: the first steps, run before the schedule is chosen (`EpisodeStart`, `Probe`).
- `policy`: the memory policy (`Policy`): what to keep; the mode names live there.
- `schedule`: the one place that picks an episode's schedule, plain autograd included: which states
  the forward keeps and in which order the reverse visits steps.
- `revolve`: binomial checkpointing's arithmetic and reverse order.
- `episode`: the episode as one autograd Function, its forward loop and what it saves.
- `reverse`: the reverse pass, one step at a time (recomputed, replayed or kept graphs).
- `check`: the check that a recomputed step reproduces its forward (`RecomputeMismatchError`).
- `compiled`: torch.compile'd code a step holds, which the episode would run uncompiled, found before it runs.
- `step_graph`: `StepGraph`, one step as two captured CUDA graphs.
- `lanes`: one copy of a capture's graphs and static tensors, warmed up, checked and captured.
- `cuda_graphs`: the captures' graphs, pool and side stream; a failed capture undone and explained.
- `state`: psi and the carry as the rollout holds them.
- `replay`: what a recompute replays from its forward (autocast, the generators' states),
  `recomputing()`, true in a backward that recomputes, and who is told around each step it recomputes.
- `generators`: the random generators' states, saved and put back in one place.
- `buffers`: the tensors a step writes that outlive it (running statistics, registered buffers).
- `leaves`: which leaves (parameters) a step reaches.
- `watch`: what the forward's unprobed steps read and write besides their state (`StepWatch`).
- `escapes`: tensors that leave a step other than through its state.
- `history_grads`: a loss's requests for gradients of the history that a recomputing episode
  cannot answer (`HistoryGradGuard`).
- `param_grads`: parameter gradients summed over the steps into one buffer each.
- `weight_casts`: half-precision weight copies, once per episode or per optimizer step.
- `intermediates`: whether fused blocks keep their intermediates or recompute them.
- `memory`: what the rollout measures in bytes (`saved_bytes`, `peak_saved_bytes`, the free memory of a device).

The public function is `qca_lowmem.rollout` (this package's `api.rollout`); every module here
imports by its dotted name, `import qca_lowmem.recompute.step_graph`.
"""

from .api import rollout
from .check import RecomputeMismatchError
from .cuda_graphs import CaptureFallbackWarning
from .intermediates import block_keeps_intermediates, keep_block_intermediates
from .memory import peak_saved_bytes, saved_bytes
from .policy import Policy
from .replay import recomputing
from .step_graph import StepGraph
from .weight_casts import shared_weight_casts

__all__ = ["CaptureFallbackWarning", "Policy", "RecomputeMismatchError", "StepGraph", "block_keeps_intermediates",
           "keep_block_intermediates", "peak_saved_bytes", "recomputing", "rollout", "saved_bytes",
           "shared_weight_casts"]
