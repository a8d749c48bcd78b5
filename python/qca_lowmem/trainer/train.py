"""Reference trainer: QC_Trainer_v4's episode semantics (qca_lowmem.stock) on qca_lowmem's parts.

One episode: psi0 = complex(randn, randn) normalised per cell; `qca_steps` engine steps with the
stock noise curriculum; the evolutionary loss on the final and initial states; AdamW(1e-4, 1e-5);
clipping at 1.0. Randomness is keyed by (seed, episode) rather than drawn from a running stream,
so an episode is the same whichever process runs it and whenever: `--resume` continues exactly
and DDP ranks can split episodes among themselves.

Episodes per optimizer step: `accumulate` per process, times the DDP world size. With one
process and accumulate=1 this is the stock loop (one episode, one step). A DDP run with W ranks
equals a single process with accumulate=W: the same episodes, gradients summed then divided by W.
"""

import dataclasses
import importlib.resources
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch

from .. import amp, integration, stock
from . import checkpoint as train_state, oom
from ..amp import autocast, parse_amp_dtype
from .distributed import Distributed, resolve_device
from ..memory import saved_bytes
from ..ops.noise import episode_noise
from .oom import Policy
from ..ops.qca_step import fused_step
from ..episode import check_checkpoint, rollout
from ..step_graph import StepGraph
from .metrics import METRIC_KEYS, EpisodeLog, message, record_of
from ..unet import UNetUnitary


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
    scheduler: str = "none"
    seed: int = 0
    # low-memory policy
    checkpoint: str = "step"
    slots: Optional[int] = None
    amp_dtype: Optional[str] = None
    fused_blocks: bool = True
    cuda_graph: bool = False  # on CUDA: each step as replays of captured graphs (StepGraph)
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

        for name in ("d_state", "hidden", "grid", "qca_steps", "batch", "episodes", "accumulate"):
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
        if self.scheduler not in ("none", "cosine"):
            refuse("scheduler", "'none' or 'cosine'")
        for name in ("fused_blocks", "cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                refuse(name, "true or false")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            refuse("device", "auto, cpu, cuda or cuda:N")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            refuse("out_dir", "a folder name")
        try:
            check_checkpoint(self.checkpoint, self.slots, label("checkpoint"))
        except ValueError as error:
            raise UsageError(str(error)) from None
        try:
            parse_amp_dtype(self.amp_dtype)
        except ValueError:
            refuse("amp_dtype", "fp32, bf16, fp16 or null")
        return self


class UsageError(ValueError):
    """A bad config, argument, output folder or checkpoint: found before training starts; the
    CLI exits with status 2."""


def error_text(error: BaseException) -> str:
    """An exception's message on one line, without the C++ stack torch appends to some."""
    return " ".join(str(error).split("Exception raised from ")[0].split()) or type(error).__name__


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
    ("max_grad_norm", 0.0, math.inf, "a finite number >= 0"),
)

# YAML layout: sections of TrainConfig fields; a flat mapping of fields is accepted too.
_SECTIONS = {
    "model": ("d_state", "hidden", "gamma"),
    "training": ("grid", "qca_steps", "batch", "max_noise", "episodes", "accumulate", "lr",
                 "weight_decay", "max_grad_norm", "scheduler", "seed"),
    "lowmem": integration.LOWMEM_OPTIONS,
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
    configs = importlib.resources.files(f"{__package__.rpartition('.')[0]}.configs")
    return sorted(f.name.removesuffix(".yaml") for f in configs.iterdir() if f.name.endswith(".yaml"))


def read_config_file(path: str):
    """The YAML document at `path` (a file, or a bundled config by name); every failure is a
    UsageError naming the file (and the line and column of a syntax error)."""
    import yaml

    if os.sep in path or path.endswith((".yaml", ".yml")) or os.path.exists(path):
        if os.path.isdir(path):
            raise UsageError(f"--config {path}: is a folder, not a YAML file")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise UsageError(f"--config {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"--config {path}: cannot be read as text: {error}") from None
    elif path in bundled_configs():
        text = (importlib.resources.files(f"{__package__.rpartition('.')[0]}.configs") / f"{path}.yaml").read_text()
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


def load_config(path: Optional[str] = None, *, flags: Optional[dict] = None, **overrides) -> TrainConfig:
    """The embedded default, a YAML file, or a bundled config by name (`small_gpu`), with keyword
    overrides (None values ignored). `flags` maps an override to the CLI flag that set it, for
    messages."""
    config = TrainConfig()
    if path is not None:
        config = config_from_dict(read_config_file(path), base=TrainConfig(threads=None), where=f"config {path}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    if not changes:
        return config.validate()
    names = flags or {}
    return config_from_dict(changes, base=config, where="options", label=lambda name: names.get(name, f"config {name}"))


def set_allocator_defaults():
    """expandable_segments cuts fragmentation on small GPUs; only effective before CUDA starts."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    if torch.cuda.is_initialized():  # (is_available() is not asked: it may touch the driver)
        print("qca-lowmem: CUDA already initialised; PYTORCH_CUDA_ALLOC_CONF left unset", file=sys.stderr)
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def episode_key(seed: int, episode: int, stream: int) -> int:
    """A 63-bit key for (seed, episode, stream), well mixed (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + episode * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x >> 1


def build_model(config: TrainConfig, device) -> torch.nn.Module:
    torch.manual_seed(config.seed)
    # fused_blocks: the U-Net recomputes its intermediates in backward (outside a step-level
    # recompute, which already does); off, it keeps them as stock autograd does.
    return UNetUnitary(config.d_state, config.hidden, recompute="unet" if config.fused_blocks else "none").to(device)


class Trainer:
    """The reference trainer used by `qca-lowmem train`, `bench` and the cap benchmark."""

    def __init__(self, config: TrainConfig, distributed: Optional[Distributed] = None, progress: bool = True):
        self.config = config.validate()
        self.dist = distributed or Distributed(False)
        self.device = resolve_device(config.device, self.dist.local_rank)
        self.amp_dtype = parse_amp_dtype(config.amp_dtype)
        self.model = build_model(config, self.device)
        self.step_fn = fused_step(self.model, config.gamma, multiplicative=True)
        if config.cuda_graph and self.device.type == "cuda":
            self.step_fn = StepGraph(self.step_fn)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = None
        if config.scheduler == "cosine":
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.optimizer_steps())
        self.scaler = None
        if self.amp_dtype == torch.float16:
            self.scaler = amp.GradScaler(self.device.type)
        self.policy = Policy(config.checkpoint, config.slots, config.batch)
        self.next_episode = 0
        self.saved_episode = None  # the episode of the last checkpoint written or read
        self.progress = progress and self.dist.rank == 0
        self.out_dir = Path(config.out_dir)
        self._saved_bytes_cache = {}

    # -- episodes ---------------------------------------------------------------------------
    def episodes_per_step(self) -> int:
        return self.config.accumulate * self.dist.world_size

    def optimizer_steps(self) -> int:
        return math.ceil(self.config.episodes / self.episodes_per_step())

    def initial_state(self, episode: int, batch: int):
        generator = torch.Generator().manual_seed(episode_key(self.config.seed, episode, 0))
        return stock.initial_state(batch, self.config.grid, self.config.d_state, self.device, generator)

    def noise_for(self, episode: int):
        return episode_noise(self.config.max_noise, episode, episode_key(self.config.seed, episode, 1))

    def forward_episode(self, episode: int, policy: Policy):
        """psi0 -> rollout -> loss for one episode; returns (loss, metrics, psi_T)."""
        psi0 = self.initial_state(episode, policy.batch)
        with autocast(self.device.type, self.amp_dtype):
            psi, history = rollout(
                self.step_fn, psi0, self.config.qca_steps, checkpoint=policy.checkpoint,
                slots=policy.slots if policy.checkpoint == "revolve" else None,
                noise=self.noise_for(episode),
            )
            loss, metrics = stock.evolutionary_loss(history, psi0)
        return loss, metrics, psi

    def _run_local_episodes(self, episodes: List[int], policy: Policy):
        """Forward and backward of this rank's episodes, gradients accumulated; one row each."""
        rows = []
        for episode in episodes:
            start = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            loss, metrics, _ = self.forward_episode(episode, policy)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_value = loss.item()  # waits for the device, so the time below is the episode's
            seconds = time.perf_counter() - start
            del loss
            if self.device.type == "cuda":
                memory = torch.cuda.max_memory_allocated(self.device)
            else:
                memory = self._saved_bytes(episode, policy)
            rows.append([episode, loss_value] + [metrics[k] for k in METRIC_KEYS] + [memory, seconds])
        return rows

    def _saved_bytes(self, episode: int, policy: Policy) -> int:
        """What an episode's graph keeps for backward (CPU memory column), measured by a separate
        forward whose graph is dropped, once per policy and noise state: the training forward runs
        without saved-tensor hooks, which can change how a custom Function's saved leaves unpack."""
        key = (policy.checkpoint, policy.slots, policy.batch, self.noise_for(episode) is not None)
        if key not in self._saved_bytes_cache:
            self._saved_bytes_cache[key] = saved_bytes(self.forward_episode, episode, policy)
        return self._saved_bytes_cache[key]

    def _average_gradients(self, count: int):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dist.world_size > 1:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            self.dist.all_reduce_(flat)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n
        for p in params:
            if p.grad is not None:
                p.grad.div_(count)
        return params

    def train_step(self, first: int, count: int):
        """Episodes first..first+count-1 (split across ranks), then one optimizer step.

        Returns the rows of all episodes in the group (every rank gets them all).
        """
        return self._finish_step(first, count, self._run_episodes(first, count))

    def _run_episodes(self, first: int, count: int):
        """This rank's share of episodes first..first+count-1, gradients accumulated."""
        per_rank = self.config.accumulate
        mine = [first + i for i in range(self.dist.rank * per_rank, min(count, (self.dist.rank + 1) * per_rank))]
        return self._run_lowering_on_oom(first, mine)

    def _finish_step(self, first: int, count: int, rows):
        self._optimizer_step(first + count - 1, count)
        if self.scheduler is not None:
            self.scheduler.step()
        return self._gather_rows(rows, self.config.accumulate)

    def _run_lowering_on_oom(self, first: int, episodes: List[int]):
        """This rank's episodes; when any rank runs out of memory, all retry them with the next
        lower policy, and stop (progress saved) when none is left."""
        while True:
            self.optimizer.zero_grad(set_to_none=True)
            rows = None
            try:
                rows = self._run_local_episodes(episodes, self.policy)
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                if not oom.is_out_of_memory(error):
                    raise
                # handled below, together with the other ranks
            failed = torch.tensor([0.0 if rows is not None else 1.0], device=self._gather_device())
            if self.dist.all_reduce_(failed, op="max").item() == 0:
                return rows
            self.optimizer.zero_grad(set_to_none=True)
            oom.release_cached_memory()
            lower = self.policy.lowered(self.config.qca_steps)
            if lower is None:
                path = self.save_checkpoint()
                advice = oom.fitting_advice(self.amp_dtype, self.policy, self.config.grid, self.config.hidden)
                raise oom.no_policy_left(first, self.device, self.policy, self.next_episode, path, advice)
            self._log(f"out of memory at episode {first} with {self.policy.describe()}; retrying with {lower.describe()}")
            self.policy = lower

    def _optimizer_step(self, last_episode: int, count: int):
        try:
            params = self._average_gradients(count)
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
                self.scaler.clip_grad_norm_(params, self.config.max_grad_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
                self.optimizer.step()
        except RuntimeError as error:
            if not oom.is_out_of_memory(error):
                raise
            parameters = sum(p.numel() for p in self.model.parameters())
            raise oom.optimizer_step_failed(last_episode, self.device, parameters, self.out_dir) from None

    def _gather_rows(self, rows, per_rank: int):
        """Every rank's rows, on every rank (NaN rows pad ranks with fewer episodes)."""
        width = 2 + len(METRIC_KEYS) + 2
        local = torch.full((per_rank, width), float("nan"), dtype=torch.float64)
        for i, row in enumerate(rows):
            local[i] = torch.tensor(row, dtype=torch.float64)
        gathered = torch.cat(self.dist.all_gather_rows(local.to(self._gather_device()))).cpu()
        return [row.tolist() for row in gathered if not math.isnan(row[0].item())]

    def _gather_device(self):
        return self.device if (self.dist.world_size > 1 and self.device.type == "cuda") else torch.device("cpu")

    # -- checkpoints (train_state.py) --------------------------------------------------------
    def save_checkpoint(self, path=None):
        path = Path(path) if path is not None else self.out_dir / train_state.CHECKPOINT_NAME
        if self.dist.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            train_state.atomic_save(train_state.state_of(self), path, keep_previous=True)
        self.saved_episode = self.next_episode
        return path

    def load_checkpoint(self, path):
        return train_state.restore(self, path)

    def _log(self, text):
        message(text, self.dist.rank)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self, callback: Optional[Callable[[dict], None]] = None, stop_after: Optional[int] = None) -> List[dict]:
        """Run episodes next_episode..episodes-1 (at most `stop_after` of them, rounded up to whole
        optimizer steps, then checkpoint: a long run split into jobs); one dict per episode run."""
        config = self.config
        if stop_after is not None and stop_after < 1:
            raise UsageError(f"--stop-after must be a positive number of episodes, got {stop_after}")
        total = config.episodes if stop_after is None else min(config.episodes, self.next_episode + stop_after)
        results = []
        group = self.episodes_per_step()
        with EpisodeLog(self.out_dir, self.device, self.next_episode, config.episodes, self.dist.rank,
                        self.progress) as log:
            try:
                while self.next_episode < total:
                    first = self.next_episode
                    count = min(group, config.episodes - first)
                    local_rows = self._run_episodes(first, count)
                    with train_state.interrupts_deferred():  # the step and its bookkeeping: all or nothing
                        rows = self._finish_step(first, count, local_rows)
                        self.next_episode = first + count
                        for row in rows:
                            record = record_of(row, self.device, self.policy.describe())
                            results.append(record)
                            log.write(record)
                            if callback is not None:
                                callback(record)
                        if config.save_every and (self.next_episode // config.save_every) > (first // config.save_every):
                            self.save_checkpoint()
                if self.saved_episode != self.next_episode:
                    with train_state.interrupts_deferred():
                        self.save_checkpoint()
            except KeyboardInterrupt:
                raise self._interrupted() from None
        return results

    def _interrupted(self) -> "Interrupted":
        """Ctrl-C between optimizer steps: the progress since the last checkpoint saved, then stop."""
        if self.saved_episode != self.next_episode:
            with train_state.interrupts_deferred():
                self.save_checkpoint()
        path = self.out_dir / train_state.CHECKPOINT_NAME
        done = (f"progress up to episode {self.next_episode} is in {path}; continue with --resume {path}"
                if self.next_episode else "no episode finished, nothing saved")
        return Interrupted(f"interrupted at episode {self.next_episode}; {done}")

    def replica_difference(self) -> float:
        """Largest |parameter difference| between this rank and rank 0 over all ranks (DDP check)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        reference = self.dist.broadcast_(flat.clone())
        diff = torch.tensor([(flat - reference).abs().max().item()], device=self._gather_device())
        return self.dist.all_reduce_(diff, op="max").item()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped training; the message says where the progress is."""


def check_run(config: TrainConfig, resume: Optional[str] = None, create: bool = True, rank: int = 0,
              world_size: int = 1):
    """Everything that can be refused before the first episode (UsageError, or OutOfMemoryStop for
    a config far over this machine's memory): the device, the output folder (made and stale
    temporaries removed when `create`), the checkpoint to resume from and whether it is of the
    same run. Returns the checkpoint's state, or None."""
    try:
        device = resolve_device(config.device)
    except RuntimeError as error:
        raise UsageError(f"--device {config.device}: {error}") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {config.device}: only {torch.cuda.device_count()} CUDA devices are visible")
    if rank == 0:
        train_state.check_out_dir(config.out_dir, create)
    state = train_state.read_checkpoint(resume) if resume else None
    parameters = _parameter_count(config)
    if state is not None:
        train_state.check_resumable(state, resume, config, config.accumulate * world_size)
    elif device.type == "cpu":  # (a resumed run has fit already)
        oom.check_cpu_memory(config, parameters)
    return state


def _parameter_count(config: TrainConfig) -> int:
    try:
        with torch.device("meta"):
            model = UNetUnitary(config.d_state, config.hidden)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as error:
        raise UsageError(f"config: a model with d_state {config.d_state}, hidden {config.hidden} cannot be "
                         f"built: {error_text(error)}") from None
    return sum(p.numel() for p in model.parameters())


def train(config: TrainConfig, resume: Optional[str] = None, ddp: bool = False, progress: bool = True,
          stop_after: Optional[int] = None) -> List[dict]:
    """Run the reference trainer as `qca-lowmem train` does: check_run's checks, then episodes
    up to config.episodes (nothing when a resumed checkpoint is there already)."""
    set_allocator_defaults()
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    distributed = Distributed(ddp, config.device)
    try:
        state = check_run(config, resume, rank=distributed.rank, world_size=distributed.world_size)
        if state is not None and state["episode"] >= config.episodes:
            message(f"{resume} is at episode {state['episode']}, --episodes is {config.episodes}: nothing to do",
                    distributed.rank)
            return []
        trainer = Trainer(config, distributed, progress=progress)
        if state is not None:
            train_state.restore(trainer, resume, state)
        results = trainer.fit(stop_after=stop_after)
        if distributed.world_size > 1:
            difference = trainer.replica_difference()
            if distributed.rank == 0:
                with open(trainer.out_dir / "ddp_check.json", "w") as f:
                    json.dump({"world_size": distributed.world_size, "max_param_difference": difference}, f)
            if difference != 0.0:
                trainer._log(f"warning: parameters differ across ranks by up to {difference:.3e}")
            # Every rank past its last collective before any tears its connections down: a rank
            # leaving early can abort a peer still inside gloo's teardown. Only on success: after
            # a failure the peers are elsewhere, and torchrun stops them.
            distributed.barrier()
        return results
    finally:
        distributed.close()
        torch.set_num_threads(threads)
