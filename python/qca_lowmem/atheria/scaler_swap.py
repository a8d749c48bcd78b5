"""The trainer's GradScaler as qca_lowmem.amp.GradScaler (enable() swaps it, keeping its
settings and state), and clipping the gradients it unscaled."""

import torch

from .. import amp


def lowmem_scaler_from(scaler):
    """A qca_lowmem.amp.GradScaler with the same settings and state as `scaler` (carry_state)."""
    new = amp.GradScaler(
        getattr(scaler, "_device", "cuda"),
        init_scale=getattr(scaler, "_init_scale", 2.0**16),
        growth_factor=getattr(scaler, "_growth_factor", 2.0),
        backoff_factor=getattr(scaler, "_backoff_factor", 0.5),
        growth_interval=getattr(scaler, "_growth_interval", 2000),
        enabled=scaler.is_enabled(),
        allow_fp16_grads=getattr(scaler, "_allow_fp16_grads", False),
    )
    carry_state(scaler, new)
    return new


def carry_state(source, target) -> None:
    """Give GradScaler `target` the state of `source` at any point of an iteration: its state_dict,
    the scale scale() made and each optimizer's stage and inf flags, so step and update go on as
    `source`'s would (no second unscale). Our scaler's kept sums stay behind: a clip after a
    swap measures the norm again."""
    state = source.state_dict()
    if not state:  # disabled
        return
    target.load_state_dict(state)
    if getattr(source, "_scale", None) is not None:
        target._scale, target._growth_tracker = source._scale.clone(), source._growth_tracker.clone()
    target._per_optimizer_states.clear()
    for optimizer_id, progress in getattr(source, "_per_optimizer_states", {}).items():
        found_inf = {device: flag.clone() for device, flag in progress["found_inf_per_device"].items()}
        target._per_optimizer_states[optimizer_id] = {"stage": progress["stage"], "found_inf_per_device": found_inf}


def scales_for_fp16(opts) -> bool:
    """Whether the episode scales its loss for a precision enable() was asked for: fp16 where
    `amp_dtype` was given (or bf16 became it). Otherwise it scales where their episode would
    (TrainerVersion.scales), fp16 from their use_amp included."""
    return opts.given.amp_dtype is not None and opts.amp_dtype == torch.float16


_SWAPPED = (torch.amp.GradScaler, torch.cuda.amp.GradScaler, amp.GradScaler)  # torch's own, and ours


def lowmem_scaler_for(trainer, for_fp16: bool):
    """The trainer's scaler (torch's class exactly) as a qca_lowmem.amp.GradScaler with its state;
    a new one when the trainer has none but fp16 on CUDA asked of enable() needs one (`for_fp16`,
    scales_for_fp16); else None (nothing to swap)."""
    scaler = getattr(trainer, "scaler", None)
    if scaler is not None:  # a class of their own (a subclass changing update(), say) is kept
        return lowmem_scaler_from(scaler) if type(scaler) in _SWAPPED else None
    if for_fp16 and next(trainer.motor.operator.parameters()).device.type == "cuda":
        return amp.GradScaler("cuda")
    return None


def clip_scaled(scaler, parameters, max_norm):
    """clip_grad_norm_ of the unscaled gradients, through the scaler where it can reuse its norm."""
    clip = getattr(scaler, "clip_grad_norm_", None)
    if clip is not None:  # right after unscale_: the gradients are as it measured them
        return clip(parameters, max_norm, reuse_unscale_norm=True)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
