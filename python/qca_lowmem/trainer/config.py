"""The reference trainer's configuration: TrainConfig, read from YAML (a file or a bundled config
by name) and CLI overrides, every field checked by name; and the model a config builds."""

import dataclasses
import importlib.resources
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch

from .. import configs as bundled
from ..atheria import config_section
from ..ops.qca_step import fused_step
from ..precision import nhwc_faster, parse_amp_dtype
from ..recompute import Policy
from ..recompute.policy import AUTO, STEP
from ..unet import UNetUnitary, input_dtype
from .errors import UsageError, error_text


@dataclass
class TrainConfig:
    """Everything a run needs. The defaults are the embedded small CPU configuration: 30 episodes
    of 48 steps on a 32x32 grid, hidden 16 (its time on a 2-core CPU: the README)."""

    # model
    d_state: int = 4
    hidden: int = 16
    gamma: float = 0.0
    # episode
    grid: int = 32
    qca_steps: int = 48
    batch: int = 1
    max_noise: float = 0.05
    # optimisation
    episodes: int = 30
    accumulate: int = 1
    lr: float = 1e-4
    weight_decay: float = 1e-5
    max_grad_norm: float = 1.0
    # Optimizer steps skipped in a row (non-finite loss or gradient) before the run stops: the
    # loss scaler skips a few while its scale settles; more in a row means the run diverged.
    max_skipped_steps: int = 10
    scheduler: str = "none"
    seed: int = 0
    # low-memory policy
    checkpoint: str = STEP
    slots: Optional[int] = None
    budget: Union[int, str, None] = None  # checkpoint "auto": bytes of saved tensors, a size, or "free"
    amp_dtype: Optional[str] = None
    fused_blocks: bool = True
    # Each recomputed step as replays of captured graphs (StepGraph). None: on where it can run (CUDA
    # with torch's caching allocator, a policy that recomputes); false: eager steps.
    cuda_graph: Optional[bool] = None
    # NHWC from the pack through the U-Net to the update, weights included. None: where it is faster
    # (channels_last_for): a CPU run of a narrow U-Net, a CUDA run whose convolutions use Tensor Cores.
    channels_last: Optional[bool] = None
    # run
    device: str = "auto"
    # CPU threads (None: torch's choice). The small embedded model gains little from a second
    # thread and loses up to 10x when the CPU is shared, as OpenMP threads wait on each other.
    threads: Optional[int] = 1
    out_dir: str = "runs/qca"
    save_every: int = 10

    def validate(self, label: Optional[Callable[[str], str]] = None):
        """Check every field's type and range; `label(field)` names it in the message (the
        config file's key, or the CLI flag that set it)."""
        label = label or (lambda name: f"config {name}")

        def refuse(name, expected):
            value = getattr(self, name)
            kind = f" (a {type(value).__name__})" if isinstance(value, (str, bool, list, dict)) else ""
            raise UsageError(f"{label(name)} must be {expected}, got {value!r}{kind}")

        for name in ("d_state", "hidden", "grid", "qca_steps", "batch", "episodes", "accumulate", "max_skipped_steps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                refuse(name, "a positive integer")
        if self.grid % 4:
            refuse("grid", "a multiple of 4 (the U-Net pools twice)")
        if not _is_int(self.seed) or not -2**63 <= self.seed < 2**64:  # what torch.manual_seed takes
            refuse("seed", "an integer in [-2**63, 2**64)")
        if not _is_int(self.save_every) or self.save_every < 0:
            refuse("save_every", "an integer >= 0 (0: only at the end)")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            refuse("threads", "a positive integer or null")
        for name, low, high, expected in _FLOAT_RANGES:
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                refuse(name, expected)
        if self.max_grad_norm == 0:
            refuse("max_grad_norm", "a finite number > 0 (0 would zero every gradient)")
        if self.scheduler not in ("none", "cosine"):
            refuse("scheduler", "'none' or 'cosine'")
        if not isinstance(self.fused_blocks, bool):
            refuse("fused_blocks", "true or false")
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            refuse("cuda_graph", "true, false or null (on where it can run)")
        if self.channels_last is not None and not isinstance(self.channels_last, bool):
            refuse("channels_last", "true, false or null (on where it measured faster)")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            refuse("device", "auto, cpu, cuda or cuda:N")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            refuse("out_dir", "a folder name")
        if self.slots is not None and (not _is_int(self.slots) or self.slots < 1):
            refuse("slots", "a positive integer (states kept, psi0 included) or null")
        try:
            if self.budget is not None:  # its own flag or key named, whichever policy it is for
                Policy.of(AUTO, budget=self.budget, caller=label("budget"))
            self.policy(label("checkpoint"))
        except ValueError as error:
            raise UsageError(str(error)) from None
        try:
            parse_amp_dtype(self.amp_dtype)
        except ValueError:
            refuse("amp_dtype", "fp32, bf16, fp16 or null")
        return self

    def policy(self, caller: str = "config") -> Policy:
        """The rollout policy of checkpoint, slots and budget (ValueError naming `caller` unless
        they make one), built once for as long as they stay the same."""
        key = (self.checkpoint, self.slots, self.budget)
        made = self.__dict__.get("_policy")
        if made is None or made[0] != key:
            self.__dict__["_policy"] = made = (key, Policy.of(*key, caller))
        return made[1]



def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# (field, lowest, highest, what the message asks for)
_FLOAT_RANGES = (
    ("gamma", -math.inf, math.inf, "a finite number"),
    ("max_noise", 0.0, 1.0, "a probability in [0, 1]"),
    ("lr", 0.0, math.inf, "a finite number >= 0"),
    ("weight_decay", 0.0, math.inf, "a finite number >= 0"),
    ("max_grad_norm", 0.0, math.inf, "a finite number > 0"),
)

# YAML layout: sections of TrainConfig fields; a flat mapping of fields is accepted too.
_SECTIONS = {
    "model": ("d_state", "hidden", "gamma"),
    "training": ("grid", "qca_steps", "batch", "max_noise", "episodes", "accumulate", "lr",
                 "weight_decay", "max_grad_norm", "max_skipped_steps", "scheduler", "seed"),
    "lowmem": config_section.LOWMEM_OPTIONS,
    "output": ("out_dir", "save_every"),
}
_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def config_from_dict(data: dict, base: Optional[TrainConfig] = None, where: str = "config",
                     label: Optional[Callable[[str], str]] = None) -> TrainConfig:
    """`base` with the fields of `data` (sections or flat); `where` names the source in messages,
    `label(field)` a field (default: "<where> <field>")."""
    label = label or (lambda name: f"{where}: {name}")
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping of sections ({', '.join(_SECTIONS)}) or fields, "
                         f"got {_kind(data)}")
    values = dataclasses.asdict(base or TrainConfig())
    for key, value in data.items():
        section = key.lower() if isinstance(key, str) else key
        if section in _SECTIONS and value is None:
            continue  # a section with nothing but comments under it
        if section in _SECTIONS:
            if not isinstance(value, dict):
                raise UsageError(f"{where}: section {key!r} must be a mapping of {list(_SECTIONS[section])}, "
                                 f"got {_kind(value)}")
            for inner, inner_value in value.items():
                if section == "lowmem" and inner == "enabled":
                    continue  # the reference trainer is always low-memory; the flag is for enable_from_config
                if inner not in _SECTIONS[section]:
                    raise UsageError(f"{where} [{key}]: unknown key {inner!r}; known: {list(_SECTIONS[section])}")
                values[inner] = inner_value
        elif key in _FIELDS:
            values[key] = value
        else:
            raise UsageError(f"{where}: unknown key {key!r}; sections are {list(_SECTIONS)} "
                             f"(or top-level fields {sorted(_FIELDS)})")
    for name, *_ in _FLOAT_RANGES:
        values[name] = _as_float(values[name])
    return TrainConfig(**values).validate(label)


def _as_float(value):
    """Integers as floats, and numeric strings: YAML 1.1 reads `1e-4` (no dot) as a string."""
    if _is_int(value):
        try:
            return float(value)
        except OverflowError:
            return math.inf  # refused as not finite
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # refused by name in validate
    return value


def _kind(value) -> str:
    return {list: "a list", str: "a string", type(None): "nothing (an empty document)"}.get(
        type(value), f"{type(value).__name__} {value!r}")


def bundled_configs() -> List[str]:
    """Names of the configs shipped in the package (the repository's configs/*.yaml)."""
    configs = importlib.resources.files(bundled)
    return sorted(f.name.removesuffix(".yaml") for f in configs.iterdir() if f.name.endswith(".yaml"))


def _names_a_file(path: str) -> bool:
    return os.sep in path or path.endswith((".yaml", ".yml")) or os.path.exists(path)


def config_reference(path: str) -> str:
    """`path` as --config reads it from any folder: a file by its absolute path, a bundled config
    by its name."""
    return os.path.abspath(path) if _names_a_file(path) else path


def read_config_file(path: str):
    """The YAML document at `path` (a file, or a bundled config by name); every failure is a
    UsageError naming the file (and the line and column of a syntax error)."""
    import yaml

    if _names_a_file(path):
        if os.path.isdir(path):
            raise UsageError(f"--config {path}: is a folder, not a YAML file")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            stem = os.path.basename(path).removesuffix(".yaml").removesuffix(".yml")
            hint = (f"; the bundled {stem} config is --config {stem} from any folder" if stem in bundled_configs()
                    else f" (bundled configs, by name from any folder: {', '.join(bundled_configs())})")
            raise UsageError(f"--config {path}: no such file in {os.getcwd()}{hint}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"--config {path}: cannot be read as text: {error}") from None
    elif path in bundled_configs():
        text = (importlib.resources.files(bundled) / f"{path}.yaml").read_text()
    else:
        raise UsageError(f"--config {path!r} is neither a YAML file nor a bundled config ({', '.join(bundled_configs())})")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise UsageError(f"--config {path}: YAML syntax error{where}: {' '.join(str(problem).split())}") from None
    except RecursionError:
        raise UsageError(f"--config {path}: nested too deeply to read") from None
    return {} if document is None else document


def load_config(path: Optional[str] = None, *, flags: Optional[dict] = None, unset: Sequence[str] = (),
                **overrides) -> TrainConfig:
    """The embedded default, a YAML file, or a bundled config by name (`small_gpu`), with keyword
    overrides (None values ignored) and the fields in `unset` set to None. `flags` maps an override
    to the CLI flag that set it, for messages."""
    config = TrainConfig()
    if path is not None:
        config = config_from_dict(read_config_file(path), base=TrainConfig(threads=None), where=f"config {path}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    changes.update({name: None for name in unset})
    if not changes:
        return config.validate()
    names = flags or {}
    return config_from_dict(changes, base=config, where="options", label=lambda name: names.get(name, f"config {name}"))



# The widest U-Net (hidden channels) that NHWC made faster on the CPU, fp32 with fused blocks: at
# hidden 16 and 32 a step-recompute episode took 0.89-0.95x its NCHW time, at 64 and 128 1.02-1.08x
# (torch's CPU convolutions; docs/benchmarks.md, "channels_last on the CPU").
CPU_CHANNELS_LAST_MAX_HIDDEN = 32


def channels_last_for(config: TrainConfig, device: torch.device, amp_dtype: Optional[torch.dtype]) -> bool:
    """config.channels_last, or where it is unset whether NHWC is faster for this run, with fused
    blocks: on the CPU in fp32 at most CPU_CHANNELS_LAST_MAX_HIDDEN hidden channels (measured); on
    CUDA where the convolutions run on Tensor Cores (precision.gpu_prefers_nhwc: measured on an H200,
    inferred for other GPUs)."""
    if config.channels_last is not None:
        return config.channels_last
    if not config.fused_blocks:
        return False
    if torch.device(device).type == "cpu":
        return amp_dtype is None and config.hidden <= CPU_CHANNELS_LAST_MAX_HIDDEN
    return nhwc_faster(device, amp_dtype)


def build_model(config: TrainConfig, device, channels_last: bool = False) -> torch.nn.Module:
    torch.manual_seed(config.seed)
    # fused_blocks: the U-Net recomputes its intermediates in backward (outside a step-level
    # recompute, which already does); off, it keeps them as stock autograd does.
    model = UNetUnitary(config.d_state, config.hidden, recompute="unet" if config.fused_blocks else "none").to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def model_step(model: torch.nn.Module, config: TrainConfig, channels_last: bool = False) -> fused_step:
    """The stock engine step of `model` on the fused ops, its pack writing autocast's dtype where the
    model is proved to cast its input to it first (`unet.input_dtype`)."""
    return fused_step(model, config.gamma, multiplicative=True, channels_last=channels_last, input_dtype=input_dtype)


def parameter_count(config: TrainConfig) -> int:
    """The model's parameter count, from a model built on the meta device (no memory used)."""
    try:
        with torch.device("meta"):
            model = UNetUnitary(config.d_state, config.hidden)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as error:
        raise UsageError(f"config: a model with d_state {config.d_state}, hidden {config.hidden} cannot be "
                         f"built: {error_text(error)}") from None
    return sum(p.numel() for p in model.parameters())

