"""The switch for the users' Atheria trainers (`QC_Trainer_v4`, `QC_Trainer_v3`): `enable()`
puts the recomputing rollout under their `train_episode` and `disable()` takes it out.

Its modules, one concern each:

- `switch`: enable, disable, what enable() keeps on the trainer, and what an episode's checks then do.
- `episode`: the episode enable() puts under train_episode, and its checks before anything runs.
- `episode_refusals`: those checks' outcomes: a value enable() proved at changed, or a refusal.
- `options`: enable()'s options, each declared once (type, default, check, doc).
- `episode_options`: what enable() decided from them, one frozen value (`EpisodeOptions`).
- `config_section`: the `LOWMEM` section of their config and the `QCA_LOWMEM` variable.
- `trainers`: one adapter per trainer version, what differs between their episodes.
- `engine_step`: the engine's verdict and the steps installed on their engine.
- `engine_state`: what the engine keeps across steps and episodes (its memory, their side state).
- `captures`: the episode's captured step (a StepGraph), kept between episodes.
- `engine_probe`: the one-time probe that their engine steps as the fused step does.
- `user_modules`: helpers on their torch modules (a compiled operator's module, buffer bindings).
- `fused_blocks`: their ConvBlocks swapped for fused blocks, proved again at each episode, and put back.
- `weight_layouts`: the operator's weights made NHWC for channels_last=True, and given their layout back.
- `operator_code`: whether a call of their operator runs only code qca_lowmem follows, with no hook.
- `state_drift`: the state the steps' unfollowed code keeps, checked across the backward.
- `code_reads`: what that code reads besides its arguments (cells, defaults, globals), where it may keep state.
- `fingerprints`: what of a value a call could change, read as simple values, and where its tensors are bound.
- `discontinuity`: whether every op of their operator is allowlisted continuous.
- `code_identity`: the digests of the code that runs (functions, and their model classes), per Python version.
- `stock_guard`: which `train_episode` enable() may replace (their stock one).
- `mask_free_noise`: a copy of their noise injector writing its flips without a boolean mask.
- `scaler_swap`: their GradScaler as qca_lowmem's, and the clipping of scaled gradients.
- `say`: enable()'s lines where the user sees them, once.
"""

from .config_section import enable_from_config
from .switch import disable, enable

__all__ = ["disable", "enable", "enable_from_config"]
