"""What enable() decided, as one frozen value (`EpisodeOptions`): built once from its arguments
and the trainer, read by attribute by the episode and the trainer adapters, and said in
enable()'s one line."""

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .. import precision
from ..precision import parse_amp_dtype
from ..recompute import Policy, StepGraph
from ..recompute import graph as step_graph


@dataclass(frozen=True)
class EpisodeOptions:
    policy: Policy
    amp_dtype: torch.dtype  # the compute dtype the episode's autocast runs
    grid: Optional[Tuple[int, int]]  # psi0's grid, where the stock draw makes psi0
    batch_size: Optional[int]
    d_state: int
    initial_state: Optional[Callable]  # initial_state(trainer) -> psi0, where the trainer's own draw is used
    max_grad_norm: Optional[float]  # None: the trainer version's own clipping
    fused_blocks: bool
    channels_last: bool  # the operator's weights and the fused pack NHWC
    cuda_graph: bool  # resolved: whether the steps run as captured graphs
    cuda_graph_said: str  # what enable()'s line says of it: "cuda_graph", "cuda_graph off", or "" off CUDA
    noise: str  # "trainer" or "fused"
    fused_step_ops: bool
    lowmem_scaler: bool
    assume_stock_episode: bool

    def describe(self) -> str:
        """The policy, the precision and the switches that are on, for enable()'s line."""
        parts = [self.policy.describe(), precision.amp_name(self.amp_dtype)]
        return ", ".join(parts + [name for name, on in (
            ("fused blocks", self.fused_blocks), ("fused step", self.fused_step_ops),
            ("channels_last", self.channels_last),
            (self.cuda_graph_said, bool(self.cuda_graph_said)),
            ("fused noise", self.noise == "fused")) if on])


def checked_flag(value, name: str, expected: str = "True or False") -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"enable(): {name} must be {expected}, got {value!r}")
    return value


def _resolved_cuda_graph(cuda_graph: Optional[bool], policy: Policy, device: torch.device) -> Tuple[bool, str]:
    """(whether the steps run as captured graphs, what enable()'s line says of it: on CUDA either
    way, nothing elsewhere). Unset: on where it can run, off elsewhere without a word; True where
    it cannot run warns why."""
    on, why_not = StepGraph.resolve(cuda_graph, policy, device)
    if cuda_graph and not on:
        warnings.warn(f"enable(): cuda_graph captures CUDA graphs, but {why_not}: its steps run eagerly", stacklevel=5)
    return on, "cuda_graph" if on else "cuda_graph off" if step_graph.on_cuda(device) else ""


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


NOISE_SOURCES = ("trainer", "fused")


def _checked_noise(trainer, version, noise) -> str:
    """enable()'s `noise`, refused where the trainer cannot give it (an episode without noise reads none)."""
    if noise not in NOISE_SOURCES:
        raise ValueError(f"enable(): noise must be one of {NOISE_SOURCES}, got {noise!r}")
    if noise == "trainer" and version.has_noise:
        injector = getattr(trainer, "noise_injector", None)
        missing = [name for name in ("apply_phase_flip", "apply_bit_flip") if not callable(getattr(injector, name, None))]
        if missing:
            raise TypeError(f"enable(): noise='trainer' applies the trainer's own noise_injector, but "
                            f"{type(trainer).__name__}.noise_injector ({type(injector).__name__}) has no {', '.join(missing)}; "
                            "noise='fused' applies qca_lowmem's NoiseSchedule instead")
    return noise


def resolve_options(trainer, version, *, policy: Policy, amp_dtype, grid_size, batch_size, d_state, initial_state,
                    max_grad_norm, fused_blocks: bool, cuda_graph: Optional[bool], noise: str, fused_step_ops: bool,
                    lowmem_scaler: bool, assume_stock_episode: bool, channels_last: bool = False) -> "EpisodeOptions":
    """enable()'s arguments resolved against the trainer, once: what each lowmem episode reads."""
    for name, value in dict(fused_blocks=fused_blocks, fused_step_ops=fused_step_ops, channels_last=channels_last,
                            lowmem_scaler=lowmem_scaler, assume_stock_episode=assume_stock_episode).items():
        checked_flag(value, name)
    if cuda_graph is not None:
        checked_flag(cuda_graph, "cuda_graph", "True, False or None (on where it can run)")
    if amp_dtype is None and getattr(trainer, "use_amp", False):
        compute_dtype = torch.float16
    else:
        compute_dtype = parse_amp_dtype(amp_dtype)
    device = next(trainer.motor.operator.parameters()).device
    try:
        precision.refuse_fp16_on_cpu(compute_dtype, device, "amp_dtype='fp16', or the trainer's use_amp",
                                     "amp_dtype='bf16' (the CPU's half precision) or 'fp32'")
    except ValueError as error:
        raise ValueError(f"enable(): {error}") from None
    compute_dtype, note = precision.native_amp_dtype(compute_dtype, device)
    if note:
        warnings.warn(f"enable(): {note}", stacklevel=4)
    if channels_last and (not fused_step_ops or getattr(trainer.motor, "has_memory", False) is True):
        raise ValueError("enable(): channels_last needs the fused step (fused_step_ops=True) on an engine without "
                         "memory: the engine's own pack, and a ConvLSTM's memory, are NCHW")
    cuda_graph, cuda_graph_said = _resolved_cuda_graph(cuda_graph, policy, device)
    grid, batch_size, initial_state = _psi0_options(trainer, version, grid_size, batch_size, initial_state)
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"enable(): max_grad_norm must be a number > 0 or None (the trainer's own), "
                         f"got {max_grad_norm!r}")
    return EpisodeOptions(
        policy=policy, amp_dtype=compute_dtype, grid=grid, batch_size=batch_size,
        d_state=d_state or _infer_d_state(trainer, trainer.motor.operator), initial_state=initial_state,
        max_grad_norm=max_grad_norm, fused_blocks=fused_blocks, channels_last=channels_last, cuda_graph=cuda_graph,
        cuda_graph_said=cuda_graph_said,
        noise=_checked_noise(trainer, version, noise), fused_step_ops=fused_step_ops, lowmem_scaler=lowmem_scaler,
        assume_stock_episode=assume_stock_episode,
    )


def _psi0_options(trainer, version, grid_size, batch_size, initial_state):
    """(grid, batch_size, initial_state) of the episodes' psi0 draw (TrainerV4/V3.initial_state)."""
    if version.draws_own_psi0:
        if grid_size is not None or batch_size is not None:
            raise ValueError(f"enable(): {type(trainer).__name__} ({version.name}) draws psi0 as "
                             "motor.get_initial_state(trainer.batch_size), so grid_size and batch_size are not read; "
                             "set trainer.batch_size, or pass initial_state=callable")
        return None, None, initial_state
    if isinstance(grid_size, int):
        grid = (grid_size, grid_size)
    elif grid_size is not None:
        grid = (int(grid_size[0]), int(grid_size[1]))
    else:
        if initial_state is None:
            initial_state = own_state_reset(trainer)
        grid = None if initial_state is not None else _infer_grid(trainer)
    batch_size = 1 if batch_size is None else batch_size
    if initial_state is None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"enable(): batch_size must be a positive int, got {batch_size!r}")
    return grid, batch_size, initial_state
