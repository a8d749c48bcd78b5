"""The rollout: an episode that recomputes instead of storing, with exact gradients.

The core of the library, importing nothing of it but ops/ (docs/design.md, "The rollout"):
`api` (rollout()), `policy` (what to keep: the mode names live there), `schedule` and `revolve`
(which states the forward keeps, in which order the reverse pass visits steps), `episode` (the
autograd Function), `reverse` (the reverse pass) with `recompute_check`, `graph` (StepGraph:
captured CUDA graphs, a way of running a step), `state`, `replay` (autocast and RNG),
`param_grads`, `weight_casts`, `intermediates` and `memory` (bytes, counted once).

`qca_lowmem.rollout` is the function: the package __init__ binds that name after importing this
package, whose modules are reached as `qca_lowmem.rollout.<module>` through `from ... import`.
"""

from .api import rollout
from .graph import CaptureFallbackWarning, StepGraph
from .intermediates import block_keeps_intermediates, keep_block_intermediates
from .memory import saved_bytes
from .policy import Policy
from .recompute_check import RecomputeMismatchError
from .weight_casts import shared_weight_casts

__all__ = ["CaptureFallbackWarning", "Policy", "RecomputeMismatchError", "StepGraph", "block_keeps_intermediates",
           "keep_block_intermediates", "rollout", "saved_bytes", "shared_weight_casts"]
