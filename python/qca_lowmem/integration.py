"""One-flag switch for a QC_Trainer_v4-style trainer (DESIGN.md §2 attribute contract).

`enable(trainer)` converts the operator's ConvBlocks in place (same Parameters), swaps the engine
step for the fused pack/update, replaces `train_episode` by a rollout with recompute that keeps the
stock episode semantics, and swaps the GradScaler for `qca_lowmem.amp.GradScaler` with its state.
`disable(trainer)` puts everything back.
"""

import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import amp
from .noise import NoiseSchedule
from .ops import qca_pack, qca_update
from ._rollout import check_checkpoint, rollout
from ._step_graph import StepGraph
from .unet import convert

_AMP_DTYPES = {
    None: None, "none": None, "fp32": None, "float32": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
_STATE_ATTR = "_qca_lowmem_state"
_ENV_FLAG = "QCA_LOWMEM"


def parse_amp_dtype(value):
    """'bf16' / 'fp16' / 'fp32' / None / a torch dtype -> torch dtype or None (full precision)."""
    if isinstance(value, torch.dtype):
        if value == torch.float32:
            return None
        if value in (torch.bfloat16, torch.float16):
            return value
    elif value is None or isinstance(value, str):
        key = value.lower() if isinstance(value, str) else value
        if key in _AMP_DTYPES:
            return _AMP_DTYPES[key]
    raise ValueError(f"amp_dtype must be one of None, 'fp32', 'bf16', 'fp16' (or a torch dtype), got {value!r}")


def autocast(device_type: str, amp_dtype):
    """Autocast to `amp_dtype` (a torch dtype from parse_amp_dtype), or off when it is None."""
    return torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)


def is_multiplicative(operator) -> bool:
    """The stock rule: UNetUnitary operators act multiplicatively, any other additively."""
    return type(operator).__name__ == "UNetUnitary"


def fused_step(operator, gamma: float, multiplicative: bool) -> Callable:
    """The stock engine step (DESIGN §2, steps 1-5) on the fused pack/update ops."""

    def evolve_step(psi):
        return qca_update(psi, operator(qca_pack(psi)), gamma, multiplicative)

    return evolve_step


def noise_schedule(max_noise: float, episode: int, seed: int):
    """The rollout's replayable stock noise for `episode` (curriculum included), keyed by `seed`;
    None when the episode's rate leaves it off, as stock does."""
    schedule = NoiseSchedule(max_noise, episode, seed)
    return schedule if schedule.active else None


def lowmem_scaler_from(scaler):
    """A qca_lowmem.amp.GradScaler with the same settings and state as `scaler`."""
    new = amp.GradScaler(
        getattr(scaler, "_device", "cuda"),
        init_scale=getattr(scaler, "_init_scale", 2.0**16),
        growth_factor=getattr(scaler, "_growth_factor", 2.0),
        backoff_factor=getattr(scaler, "_backoff_factor", 0.5),
        growth_interval=getattr(scaler, "_growth_interval", 2000),
        enabled=scaler.is_enabled(),
    )
    state = scaler.state_dict()
    if state:
        new.load_state_dict(state)
    return new


@dataclass
class _Saved:
    """What enable() changed, so disable() can put it back."""

    options: dict
    blocks: List[Tuple[torch.nn.Module, str, torch.nn.Module]] = field(default_factory=list)
    evolve_step: Any = None
    had_evolve_step_attr: bool = False
    train_episode: Any = None
    had_train_episode_attr: bool = False
    scaler: Any = None
    convert_report: Any = None
    step_graph: Any = None  # a StepGraph of the motor's step, made at the first CUDA episode


def _children(root: torch.nn.Module):
    """(parent, attribute name, child) of every submodule edge under root."""
    return [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()]


def _infer_d_state(trainer, operator) -> int:
    cfg = getattr(trainer.motor, "cfg", None)
    for owner, attr in ((trainer, "d_state"), (trainer.motor, "d_state"), (cfg, "D_STATE"), (cfg, "d_state")):
        value = getattr(owner, attr, None) if owner is not None else None
        if isinstance(value, int):
            return value
    for module in operator.modules():
        if isinstance(module, torch.nn.Conv2d):
            return module.in_channels // 2
    raise ValueError("enable(): cannot tell d_state from the trainer; pass d_state=...")


def _infer_grid(trainer) -> Tuple[int, int]:
    cfg = getattr(trainer.motor, "cfg", None)
    candidates = (
        (trainer, "grid_size"), (trainer.motor, "grid_size"),
        (cfg, "GRID_SIZE_TRAINING"), (cfg, "GRID_SIZE"), (cfg, "grid_size"),
    )
    for owner, attr in candidates:
        value = getattr(owner, attr, None) if owner is not None else None
        if isinstance(value, int):
            return value, value
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return int(value[0]), int(value[1])
    raise ValueError(
        "enable(): cannot tell the training grid size from the trainer (looked for trainer.grid_size, "
        "motor.grid_size, motor.cfg.GRID_SIZE_TRAINING); pass grid_size=... or initial_state=callable"
    )


_STATE_RESETS = ("_reset_state_random", "reset_state_random", "reset_state")


def own_state_reset(trainer) -> Optional[Callable]:
    """The trainer's own psi0 draw, when its engine keeps a state object that resets itself
    (`motor.state.<reset>()` then `motor.state.psi`): psi0 then comes from exactly the code, and
    the RNG use, stock runs."""
    state = getattr(trainer.motor, "state", None)
    if state is None or not hasattr(state, "psi"):
        return None
    for name in _STATE_RESETS:
        reset = getattr(state, name, None)
        if callable(reset):
            def initial_state(_trainer, reset=reset, state=state):
                reset()
                return state.psi
            return initial_state
    return None


def stock_initial_state(batch, height, width, d_state, device, generator=None):
    """psi0 as stock draws it: complex(randn, randn) per component, normalised per cell."""
    shape = (batch, height, width, d_state)
    psi = torch.complex(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)).to(device)
    return psi / torch.sqrt(torch.sum(torch.abs(psi) ** 2, dim=-1, keepdim=True))


def _checked_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"enable(): {name} must be True or False, got {value!r}")
    return value


def _lowmem_train_episode(trainer, episode_num):
    """train_episode with the stock semantics, running the episode through qca_lowmem.rollout."""
    state: _Saved = getattr(trainer, _STATE_ATTR)
    opts = state.options
    operator = trainer.motor.operator
    device = next(operator.parameters()).device

    trainer.optimizer.zero_grad()
    psi0 = opts["initial_state"](trainer) if opts["initial_state"] is not None else stock_initial_state(
        opts["batch_size"], *opts["grid"], opts["d_state"], device
    )
    noise = None
    if NoiseSchedule.rate_at(trainer.max_noise, episode_num) > NoiseSchedule.RATE_THRESHOLD:
        # One draw from the trainer's RNG keys the whole episode's noise, so recompute replays it.
        seed = int(torch.randint(0, 2**62, (1,)).item())
        noise = NoiseSchedule(trainer.max_noise, episode_num, seed)
    step = trainer.motor.evolve_step
    if opts["cuda_graph"] and device.type == "cuda":
        if state.step_graph is None:
            state.step_graph = StepGraph(step)
        step = state.step_graph
    with autocast(device.type, opts["amp_dtype"]):
        # rollout's default history is the stock one: t == 0, T-1 and every max(1, T // 10) steps.
        psi, history = rollout(step, psi0, trainer.qca_steps, checkpoint=opts["checkpoint"],
                               slots=opts["slots"], noise=noise)
        loss, metrics = trainer.loss_fn(history, psi0)

    parameters = [p for p in operator.parameters() if p.requires_grad]
    scaler = trainer.scaler
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()
        scaler.unscale_(trainer.optimizer)
        _clip(scaler, parameters, opts["max_grad_norm"])
        scaler.step(trainer.optimizer)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, opts["max_grad_norm"])
        trainer.optimizer.step()
    return loss.item(), metrics, psi.detach().cpu()


def _clip(scaler, parameters, max_norm):
    clip = getattr(scaler, "clip_grad_norm_", None)
    if clip is not None:
        return clip(parameters, max_norm)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def _check_contract(trainer):
    missing = []
    for path in ("motor", "motor.operator", "motor.evolve_step", "optimizer", "qca_steps", "max_noise",
                 "loss_fn", "train_episode"):
        owner = trainer
        for part in path.split("."):
            if not hasattr(owner, part):
                missing.append(path)
                break
            owner = getattr(owner, part)
    if not hasattr(trainer, "scaler"):
        missing.append("scaler")
    if missing:
        raise TypeError(
            f"enable(): {type(trainer).__name__} lacks the QC_Trainer_v4 attributes {missing} "
            "(DESIGN.md §2 lists what the switch relies on)"
        )


def enable(
    trainer,
    checkpoint: str = "step",
    amp_dtype=None,
    fused_blocks: bool = True,
    slots: Optional[int] = None,
    cuda_graph: bool = False,
    *,
    fused_step_ops: bool = True,
    lowmem_scaler: bool = True,
    grid_size=None,
    batch_size: int = 1,
    d_state: Optional[int] = None,
    initial_state: Optional[Callable] = None,
    max_grad_norm: float = 1.0,
):
    """Switch a QC_Trainer_v4-style trainer to the low-memory path, in place; returns the trainer.

    checkpoint: "step" (keep one psi per step, recompute in backward), "revolve" (binomial
      checkpointing with `slots` stored states) or "none" (stock autograd).
    amp_dtype: None follows the trainer (fp16 autocast when `trainer.use_amp`), else "fp32",
      "bf16" or "fp16"; the state and its normalisation stay complex64 either way.
    fused_blocks: convert the operator's ConvBlocks to FusedConvBlock in place (same Parameters).
    cuda_graph: on CUDA, with checkpoint "step" or "revolve", run each step as replays of
      captured CUDA graphs (qca_lowmem.StepGraph): the same kernels without launch overhead.
    fused_step_ops: replace `motor.evolve_step` by the fused pack/update ops.
    lowmem_scaler: replace `trainer.scaler` by qca_lowmem.amp.GradScaler carrying its state.
    grid_size / batch_size / d_state / initial_state: how psi0 is drawn. By default the trainer's
      own state reset when its engine has one (`motor.state._reset_state_random()`, then
      `motor.state.psi`), else the stock draw on the global torch RNG with the grid from
      trainer.grid_size or motor.cfg.GRID_SIZE_TRAINING. `initial_state(trainer) -> psi0`
      overrides both for trainers that draw psi0 differently.
    """
    _check_contract(trainer)
    if hasattr(trainer, _STATE_ATTR):
        raise RuntimeError("enable(): qca_lowmem is already enabled on this trainer; call disable(trainer) first")
    check_checkpoint(checkpoint, slots, "enable()")
    if amp_dtype is None and getattr(trainer, "use_amp", False):
        compute_dtype = torch.float16
    else:
        compute_dtype = parse_amp_dtype(amp_dtype)
    if isinstance(grid_size, int):
        grid = (grid_size, grid_size)
    elif grid_size is not None:
        grid = (int(grid_size[0]), int(grid_size[1]))
    else:
        if initial_state is None:
            initial_state = own_state_reset(trainer)
        grid = None if initial_state is not None else _infer_grid(trainer)
    if initial_state is None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"enable(): batch_size must be a positive int, got {batch_size!r}")
    operator = trainer.motor.operator
    scaler = getattr(trainer, "scaler", None)
    new_scaler = None
    if lowmem_scaler and scaler is not None:
        new_scaler = lowmem_scaler_from(scaler)
    elif lowmem_scaler and compute_dtype == torch.float16 and next(operator.parameters()).device.type == "cuda":
        new_scaler = amp.GradScaler("cuda")

    state = _Saved(options=dict(
        checkpoint=checkpoint, slots=slots, amp_dtype=compute_dtype, grid=grid, batch_size=batch_size,
        d_state=d_state or _infer_d_state(trainer, operator), initial_state=initial_state,
        max_grad_norm=max_grad_norm, fused_blocks=fused_blocks, cuda_graph=_checked_flag(cuda_graph, "cuda_graph"),
    ))
    multiplicative = is_multiplicative(operator)
    gamma = float(getattr(trainer.motor.cfg, "GAMMA_DECAY", 0.0) or 0.0) if hasattr(trainer.motor, "cfg") else 0.0

    if fused_blocks:
        params_before = [id(p) for p in operator.parameters()]
        edges = _children(operator)
        _, state.convert_report = convert(operator)
        # What convert() swapped, so disable() can put the very same stock modules back.
        state.blocks = [(parent, name, child) for parent, name, child in edges if getattr(parent, name) is not child]
        if [id(p) for p in operator.parameters()] != params_before:
            _restore_blocks(state.blocks)
            raise RuntimeError("enable(): convert() did not keep the operator's Parameter objects; nothing was changed")

    motor = trainer.motor
    state.had_evolve_step_attr = "evolve_step" in vars(motor)
    state.evolve_step = motor.evolve_step
    if fused_step_ops:
        motor.evolve_step = fused_step(operator, gamma, multiplicative)

    state.had_train_episode_attr = "train_episode" in vars(trainer)
    state.train_episode = trainer.train_episode
    trainer.train_episode = types.MethodType(_lowmem_train_episode, trainer)

    state.scaler = scaler
    if new_scaler is not None:
        trainer.scaler = new_scaler
    setattr(trainer, _STATE_ATTR, state)
    return trainer


def _restore_blocks(blocks):
    for parent, name, module in blocks:
        setattr(parent, name, module)


def disable(trainer):
    """Undo enable(): stock blocks, step, train_episode and scaler (keeping the scaler's state)."""
    state: Optional[_Saved] = getattr(trainer, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("disable(): qca_lowmem is not enabled on this trainer")
    _restore_blocks(state.blocks)
    motor = trainer.motor
    if state.had_evolve_step_attr:
        motor.evolve_step = state.evolve_step
    elif "evolve_step" in vars(motor):
        del motor.evolve_step
    if state.had_train_episode_attr:
        trainer.train_episode = state.train_episode
    else:
        del trainer.train_episode
    if trainer.scaler is not state.scaler:
        if state.scaler is not None:
            state.scaler.load_state_dict(trainer.scaler.state_dict())
        trainer.scaler = state.scaler
    delattr(trainer, _STATE_ATTR)
    return trainer


def is_enabled(trainer) -> bool:
    return hasattr(trainer, _STATE_ATTR)


def _section(cfg, name):
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        for key in (name, name.lower()):
            if key in cfg:
                return cfg[key]
        return None
    for key in (name, name.lower()):
        if hasattr(cfg, key):
            return getattr(cfg, key)
    return None


def _get(section, key, default):
    if isinstance(section, dict):
        return section.get(key, default)
    return getattr(section, key, default)


# The LOWMEM section's settings (enable()'s keyword arguments); the trainer's config shares them.
LOWMEM_OPTIONS = ("checkpoint", "amp_dtype", "fused_blocks", "slots", "cuda_graph")
_CONFIG_KEYS = ("enabled", *LOWMEM_OPTIONS)


def _env_enabled() -> Optional[bool]:
    value = os.environ.get(_ENV_FLAG)
    if value is None or value.strip() == "":
        return None
    flag = value.strip().lower()
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{_ENV_FLAG} must be 1/0 (or true/false), got {value!r}")


def enable_from_config(trainer, cfg=None, **overrides):
    """enable(trainer, ...) as the config's `LOWMEM` section (dict or attributes) says.

    `LOWMEM: {enabled: true, checkpoint: step, amp_dtype: bf16, fused_blocks: true, slots: null}`.
    `QCA_LOWMEM=1` in the environment switches it on (with the section's other settings, or the
    defaults) and `QCA_LOWMEM=0` off, whatever the config says. Returns True when enabled.
    """
    section = _section(cfg, "LOWMEM")
    if isinstance(section, dict):
        unknown = sorted(set(section) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"LOWMEM section: unknown keys {unknown}; known keys are {list(_CONFIG_KEYS)}")
    enabled = bool(_get(section, "enabled", False)) if section is not None else False
    env = _env_enabled()
    if env is not None:
        enabled = env
    if not enabled:
        return False
    options = {}
    if section is not None:
        for key in LOWMEM_OPTIONS:
            value = _get(section, key, None)
            if value is not None:
                options[key] = value
    options.update(overrides)
    enable(trainer, **options)
    return True
