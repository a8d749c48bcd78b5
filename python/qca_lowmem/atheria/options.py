"""What enable() decided, as one frozen value (`EpisodeOptions`): built once from its arguments
and the trainer, read by attribute by the episode and the trainer adapters, and said in
enable()'s one line."""

import math
import numbers
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .. import precision
from ..precision import parse_amp_dtype
from ..recompute import Policy, StepGraph
from ..recompute import graph as step_graph
from ..recompute.policy import MODES


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _is_amp_dtype(value) -> bool:
    try:
        parse_amp_dtype(value)
    except ValueError:
        return False
    return True


NOISE_SOURCES = ("trainer", "fused")


@dataclass(frozen=True)
class Option:
    """One of enable()'s settings: one row, read by enable(), the LOWMEM section and its key check."""

    name: str
    expected: str  # what a message says it takes
    accepts: Callable[[Any], bool]  # whether a value is of that type (None, where it is allowed, included)
    flag: bool = False  # a boolean: the LOWMEM section takes parse_flag's spellings
    lowmem_key: bool = False  # a key of the reference trainer's lowmem section too


_FLAG = "True or False"
OPTIONS = (
    Option("checkpoint", f"one of {MODES} or a Policy",
           lambda v: isinstance(v, Policy) or isinstance(v, str) and v in MODES, lowmem_key=True),
    Option("amp_dtype", "one of None, 'fp32', 'bf16', 'fp16' (or a torch dtype)", _is_amp_dtype, lowmem_key=True),
    Option("fused_blocks", _FLAG, lambda v: isinstance(v, bool), flag=True, lowmem_key=True),
    # slots and budget: their ranges, and which checkpoint reads them, are Policy.of's
    Option("slots", "an int >= 1 or None", lambda v: v is None or _positive_int(v), lowmem_key=True),
    Option("cuda_graph", "True, False or None (on where it can run)", lambda v: v is None or isinstance(v, bool),
           flag=True, lowmem_key=True),
    Option("budget", "an int >= 0 (bytes), a size such as '2GiB', 'free' or None",
           lambda v: v is None or isinstance(v, str) or isinstance(v, int) and not isinstance(v, bool),
           lowmem_key=True),
    Option("channels_last", "True, False or None (on where it measured faster)",
           lambda v: v is None or isinstance(v, bool), flag=True, lowmem_key=True),
    Option("noise", f"one of {NOISE_SOURCES}", lambda v: isinstance(v, str) and v in NOISE_SOURCES),
    Option("fused_step_ops", _FLAG, lambda v: isinstance(v, bool), flag=True),
    Option("assume_stock_episode", _FLAG, lambda v: isinstance(v, bool), flag=True),
    Option("lowmem_scaler", _FLAG, lambda v: isinstance(v, bool), flag=True),
    Option("max_grad_norm", "a finite number > 0 or None (the trainer's own)",
           lambda v: v is None or isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0),
    Option("grid_size", "an int >= 1, a pair of ints >= 1 or None",
           lambda v: v is None or _positive_int(v) or isinstance(v, (tuple, list)) and len(v) == 2
           and all(_positive_int(side) for side in v)),
    Option("batch_size", "an int >= 1 or None", lambda v: v is None or _positive_int(v)),
    Option("d_state", "an int >= 1 or None", lambda v: v is None or _positive_int(v)),
    Option("initial_state", "a callable initial_state(trainer) -> psi0, or None", lambda v: v is None or callable(v)),
)
OPTION_NAMES = tuple(option.name for option in OPTIONS)


_YAML_WORDS = {"None": "null", "True": "true", "False": "false"}


def check_options(values: Dict[str, Any], label: Callable[[str], str], yaml: bool = False) -> None:
    """Refuse a value not of its option's type, naming it as `label(name)` does and the value
    (what it takes in YAML's words where `yaml`)."""
    for option in OPTIONS:
        if option.name in values and not option.accepts(values[option.name]):
            value = values[option.name]
            expected = re.sub(r"\b(None|True|False)\b", lambda word: _YAML_WORDS[word.group()], option.expected) \
                if yaml else option.expected
            kind = f" (a {type(value).__name__})" if isinstance(value, (str, bool, float, list, tuple, dict)) else ""
            raise ValueError(f"{label(option.name)} must be {expected}, got {value!r}{kind}")


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


def _resolved_channels_last(channels_last: Optional[bool], fused_step_ops: bool, memory: bool, device,
                            compute_dtype) -> bool:
    """Unset: on where the fused step can take it and NHWC is faster (precision.nhwc_faster); True where it
    cannot apply is refused."""
    if channels_last and (not fused_step_ops or memory):
        raise ValueError("enable(): channels_last needs the fused step (fused_step_ops=True) on an engine without "
                         "memory: the engine's own pack, and a ConvLSTM's memory, are NCHW")
    if channels_last is None:
        return fused_step_ops and not memory and precision.nhwc_faster(device, compute_dtype)
    return channels_last


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


class OwnStateReset:
    """initial_state(trainer) -> psi0: `trainer.motor.state.<name>()`, then its psi. It reads the
    trainer it is handed, so a copy of an enabled trainer resets its own engine."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, trainer):
        state = trainer.motor.state
        getattr(state, self.name)()
        return state.psi


def own_state_reset(trainer) -> Optional[Callable]:
    """The trainer's own psi0 draw, when its engine keeps a state object that resets itself
    (`motor.state.<reset>()` then `motor.state.psi`): psi0 then comes from exactly the code, and
    the RNG use, stock runs."""
    state = getattr(trainer.motor, "state", None)
    if state is None or not hasattr(state, "psi"):
        return None
    return next((OwnStateReset(name) for name in _STATE_RESETS if callable(getattr(state, name, None))), None)


def _checked_noise(trainer, version, noise) -> str:
    """enable()'s `noise`, refused where the trainer cannot give it (an episode without noise reads none)."""
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
                    lowmem_scaler: bool, assume_stock_episode: bool,
                    channels_last: Optional[bool] = None) -> "EpisodeOptions":
    """enable()'s arguments (their types checked by check_options) resolved against the trainer,
    once: what each lowmem episode reads."""
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
    channels_last = _resolved_channels_last(channels_last, fused_step_ops,
                                            getattr(trainer.motor, "has_memory", False) is True, device, compute_dtype)
    cuda_graph, cuda_graph_said = _resolved_cuda_graph(cuda_graph, policy, device)
    grid, batch_size, initial_state = _psi0_options(trainer, version, grid_size, batch_size, initial_state)
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
    reset = own_state_reset(trainer) if initial_state is None else None
    if reset is not None and (grid_size is not None or batch_size is not None):
        # their episode draws psi0 by the engine's state reset: another draw would train on other states
        raise ValueError(f"enable(): {type(trainer).__name__}'s episode draws psi0 by its engine's "
                         f"motor.state.{reset.name}(), so grid_size and batch_size would replace the users' draw; "
                         "leave them unset, or pass initial_state=callable to draw psi0 otherwise")
    if isinstance(grid_size, numbers.Integral):
        grid = (int(grid_size), int(grid_size))
    elif grid_size is not None:
        grid = (int(grid_size[0]), int(grid_size[1]))  # checked: a pair of ints
    else:
        initial_state = initial_state or reset
        grid = None if initial_state is not None else _infer_grid(trainer)
    batch_size = 1 if batch_size is None else int(batch_size)
    return grid, batch_size, initial_state
