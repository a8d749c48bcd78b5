"""recompute: the rollout, an episode that recomputes instead of storing, with exact gradients.

The core of the library, importing nothing of it but ops/ (docs/design.md, "The rollout"):
`api` (rollout()), `policy` (what to keep: the mode names live there), `schedule` and `revolve`
(which states the forward keeps, in which order the reverse pass visits steps), `episode` (the
autograd Function), `reverse` (the reverse pass) with `check`, `step_graph` (StepGraph:
captured CUDA graphs, a way of running a step), `state`, `replay` (autocast and RNG),
`param_grads`, `weight_casts`, `intermediates` and `memory` (bytes, counted once).

The public function is `qca_lowmem.rollout` (this package's `api.rollout`); every module here
imports by its dotted name, `import qca_lowmem.recompute.step_graph`.
"""

from .api import rollout
from .check import RecomputeMismatchError
from .cuda_graphs import CaptureFallbackWarning
from .intermediates import block_keeps_intermediates, keep_block_intermediates
from .memory import saved_bytes
from .policy import Policy
from .step_graph import StepGraph
from .weight_casts import shared_weight_casts

__all__ = ["CaptureFallbackWarning", "Policy", "RecomputeMismatchError", "StepGraph", "block_keeps_intermediates",
           "keep_block_intermediates", "rollout", "saved_bytes", "shared_weight_casts"]
