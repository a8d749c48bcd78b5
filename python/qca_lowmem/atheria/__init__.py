"""The switch for the users' Atheria trainers (`QC_Trainer_v4`, `QC_Trainer_v3`): `enable()`
puts the recomputing rollout under their `train_episode` and `disable()` takes it out.

`switch` (enable, disable, the episode they run), `options` (enable()'s options, each declared
once), `episode_options` (what enable() decided, one frozen value), `config_section` (the
`LOWMEM` section of their config and the `QCA_LOWMEM` switch), `trainers` (one adapter per
trainer version: what differs between their episodes), `engine_step` (the steps installed on
their engine), `engine_probe` (the check that their engine steps as the fused step does),
`user_modules` (helpers on their torch modules), `discontinuity` (the allowlist of continuous ops),
`code_identity` (the identity of the code that runs), `stock_guard` (recognising their stock
episode by it), `mask_free_noise` (their injector's draws without host waits), `scaler_swap` (their
GradScaler as qca_lowmem's) and `say` (the switch's one line).
"""

from .config_section import enable_from_config
from .switch import disable, enable

__all__ = ["disable", "enable", "enable_from_config"]
