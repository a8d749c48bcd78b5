"""recompute: the rollout, an episode that recomputes instead of storing, with exact gradients.

The core of the library, importing nothing of it but ops/ (docs/design.md, "The rollout"):
`api` (rollout()), `policy` (what to keep: the mode names live there), `schedule` (the one
place that picks an episode's schedule, plain autograd included: which states the forward keeps,
in which order the reverse pass visits steps) with `revolve`, `probe` (the first steps, run before
the choice), `episode` (the autograd Function), `reverse` (the reverse pass) with `recompute_check`, `graph` (StepGraph:
captured CUDA graphs, a way of running a step), `state`, `replay` (autocast and RNG),
`param_grads`, `weight_casts`, `intermediates` and `memory` (bytes, counted once).

The public function is `qca_lowmem.rollout` (this package's `api.rollout`); every module here
imports by its dotted name, `import qca_lowmem.recompute.graph`.
"""

from .api import rollout
from .cuda_graphs import CaptureFallbackWarning
from .graph import StepGraph
from .intermediates import block_keeps_intermediates, keep_block_intermediates
from .memory import saved_bytes
from .policy import Policy
from .recompute_check import RecomputeMismatchError
from .weight_casts import shared_weight_casts

__all__ = ["CaptureFallbackWarning", "Policy", "RecomputeMismatchError", "StepGraph", "block_keeps_intermediates",
           "keep_block_intermediates", "rollout", "saved_bytes", "shared_weight_casts"]
