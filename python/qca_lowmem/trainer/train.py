"""Reference trainer: QC_Trainer_v4's episode semantics (qca_lowmem.stock) on qca_lowmem's parts.

One episode: psi0 = complex(randn, randn) normalised per cell; `qca_steps` engine steps with the
stock noise curriculum; the evolutionary loss on the final and initial states; AdamW(1e-4, 1e-5);
clipping at 1.0. Randomness is keyed by (seed, episode) rather than drawn from a running stream,
so an episode is the same whichever process runs it and whenever: `--resume` continues exactly
and DDP ranks can split episodes among themselves.

Episodes per optimizer step: `accumulate` per process, times the DDP world size. With one
process and accumulate=1 this is the stock loop (one episode, one step). A DDP run with W ranks
equals a single process with accumulate=W: the same episodes, gradients summed then divided by W.
Under autocast a step's episodes share one half-precision copy of the weights (shared_weight_casts).
"""

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch

from .. import amp, precision, stock
from ..ops.noise import episode_noise
from ..precision import amp_name, autocast, parse_amp_dtype
from ..recompute import StepGraph, rollout, saved_bytes, shared_weight_casts
from . import checkpoint, divergence, oom
from .config import TrainConfig, build_model, channels_last_for, model_step
from .distributed import Distributed, resolve_device
from .errors import Interrupted, TrainingStopped, UsageError, error_text
from .metrics import METRIC_KEYS, EpisodeLog, duration_text, record_of
from .oom import RunPolicy
from .run_checks import check_run, device_note
from .runlock import FolderLock
from .say import message
from .signals import Stop, interrupts_deferred


def set_allocator_defaults():
    """expandable_segments cuts fragmentation on small GPUs; only effective before CUDA starts."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    if torch.cuda.is_initialized():  # (is_available() is not asked: it may touch the driver)
        message("CUDA already initialised; PYTORCH_CUDA_ALLOC_CONF left unset")
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



class Trainer:
    """The reference trainer used by `qca-lowmem train`, `bench` and the cap benchmark."""

    def __init__(self, config: TrainConfig, distributed: Optional[Distributed] = None, progress: bool = True):
        self.config = config.validate()
        self.dist = distributed or Distributed(False)
        self.device = resolve_device(config.device, self.dist.local_rank)
        self.amp_dtype, note = precision.native_amp_dtype(parse_amp_dtype(config.amp_dtype), self.device)
        if note:
            message(note, self.dist.rank)
        self.channels_last = channels_last_for(config, self.device, self.amp_dtype)
        self.model = build_model(config, self.device, self.channels_last)
        self.step_fn = model_step(self.model, config, self.channels_last)
        captured, why_not = StepGraph.resolve(config.cuda_graph, config.policy(), self.device)
        if captured:
            self.step_fn = StepGraph(self.step_fn)
        elif config.cuda_graph:
            message(f"cuda_graph: {why_not}; the steps run eagerly", self.dist.rank)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = None
        if config.scheduler == "cosine":
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.optimizer_steps())
        self.scaler = None
        if self.amp_dtype == torch.float16:
            self.scaler = amp.GradScaler(self.device.type)
        self.policy = RunPolicy(config.policy(), config.batch)
        self.next_episode = 0
        self.saved_episode = None  # the episode of the last checkpoint written or read
        self.skipped_in_row = 0  # optimizer steps skipped in a row for non-finite values
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

    def forward_episode(self, episode: int, policy: RunPolicy):
        """psi0 -> rollout -> loss for one episode; returns (loss, metrics, psi_T)."""
        psi0 = self.initial_state(episode, policy.batch)
        with autocast(self.device.type, self.amp_dtype):
            psi, history = rollout(self.step_fn, psi0, self.config.qca_steps, checkpoint=policy.policy,
                                   noise=self.noise_for(episode))
            loss, metrics = stock.evolutionary_loss(history, psi0)
        return loss, metrics, psi

    def _run_local_episodes(self, episodes: List[int], policy: RunPolicy):
        """Forward and backward of this rank's episodes, gradients accumulated; one row each."""
        rows = []
        # The weights do not change until the optimizer step: under autocast their half-precision
        # copies are made once for all these episodes, and dropped before the step.
        with shared_weight_casts():
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

    def _saved_bytes(self, episode: int, policy: RunPolicy) -> int:
        """What an episode's graph keeps for backward (CPU memory column), measured by a separate
        forward whose graph is dropped, once per policy and noise state: the training forward runs
        without saved-tensor hooks, which can change how a custom Function's saved leaves unpack."""
        key = (policy, self.noise_for(episode) is not None)
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
        # Every rank gets every loss, so all agree on skipping a step whichever rank's loss is bad.
        rows = self._gather_rows(rows, self.config.accumulate)
        bad_loss = next((row[1] for row in rows if not math.isfinite(row[1])), None)
        skipped = self._optimizer_step(first + count - 1, count, bad_loss)
        if self.scheduler is not None:  # (the schedule follows episodes, stepped or not)
            self.scheduler.step()
        divergence.count_skipped(self, first, count, skipped)
        return rows

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
                advice = oom.fitting_advice(self.amp_dtype, self.policy, self.config.grid, self.config.hidden,
                                           self.device)
                raise oom.no_policy_left(first, self.device, self.policy, self.next_episode, path, advice)
            self._log(f"out of memory at episode {first} with {self.policy.describe()}; retrying with {lower.describe()}")
            self.policy = lower

    def _optimizer_step(self, last_episode: int, count: int, bad_loss: Optional[float]) -> Optional[str]:
        """The optimizer step, unless a loss or gradient is not finite; returns why it was skipped
        (None: taken). Averaged gradients are the same on every rank, and so is the decision."""
        try:
            params = self._average_gradients(count)
            if bad_loss is not None:
                return f"loss {bad_loss}"
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
                self.scaler.clip_grad_norm_(params, self.config.max_grad_norm, reuse_unscale_norm=True)
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                if self.scaler.get_scale() < scale:  # the scaler backs off exactly when it skipped
                    return f"non-finite gradients at loss scale {scale:g}"
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
                if not torch.isfinite(norm):
                    return f"gradient norm {norm.item()}"
                self.optimizer.step()
        except RuntimeError as error:
            if not oom.is_out_of_memory(error):
                raise
            parameters = sum(p.numel() for p in self.model.parameters())
            raise oom.optimizer_step_failed(last_episode, self.device, parameters, self.out_dir) from None
        divergence.check_weights(self, last_episode)
        return None

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

    # -- checkpoints (checkpoint.py) --------------------------------------------------------
    def save_checkpoint(self, path=None):
        path = Path(path) if path is not None else self.out_dir / checkpoint.CHECKPOINT_NAME
        if self.dist.rank == 0:
            state = checkpoint.state_of(self)
            problem = checkpoint.tensor_problem(state)
            if problem is not None:
                raise TrainingStopped(f"not writing {path} at episode {self.next_episode}: its {problem}; "
                                      f"{divergence.last_checkpoint_text(self)}")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                checkpoint.atomic_save(state, path, keep_previous=True)
            except OSError as error:
                raise TrainingStopped(f"cannot write {path} at episode {self.next_episode}: "
                                      f"{error.strerror or error_text(error)}; {divergence.last_checkpoint_text(self)}; "
                                      f"free space there (or use another --out), then --resume") from None
        self.saved_episode = self.next_episode
        return path

    def load_checkpoint(self, path):
        return checkpoint.restore(self, path)

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
        start = self.next_episode
        results = []
        group = self.episodes_per_step()
        with EpisodeLog(self.out_dir, self.device, self.next_episode, config.episodes, self.dist.rank,
                        self.progress) as log:
            try:
                while self.next_episode < total:
                    first = self.next_episode
                    count = min(group, config.episodes - first)
                    local_rows = self._run_episodes(first, count)
                    with interrupts_deferred():  # the step and its bookkeeping: all or nothing
                        rows = self._finish_step(first, count, local_rows)
                        self.next_episode = first + count
                        for row in rows:
                            record = record_of(row, self.device, self.policy_label())
                            results.append(record)
                            log.write(record)
                            if callback is not None:
                                callback(record)
                        if first == start and self.next_episode < total:
                            log.note(self._time_estimate(rows, total - self.next_episode))
                        if config.save_every and (self.next_episode // config.save_every) > (first // config.save_every):
                            self.save_checkpoint()
                if self.saved_episode != self.next_episode:
                    with interrupts_deferred():
                        self.save_checkpoint()
            except KeyboardInterrupt as stop:
                raise self._interrupted(stop) from None
        return results

    def _interrupted(self, stop: KeyboardInterrupt) -> "Interrupted":
        """A stop signal between optimizer steps: the progress since the last checkpoint saved (a
        new run stopped before its first episode saves nothing: the same command starts it again)."""
        if self.saved_episode != self.next_episode and self.next_episode > 0:
            with interrupts_deferred():
                self.save_checkpoint()
        path = self.out_dir / checkpoint.CHECKPOINT_NAME
        done = (f"episodes 0-{self.next_episode - 1} are in {path}; --resume {path} continues at episode "
                f"{self.next_episode}"
                if self.next_episode else "no episode finished, nothing saved")
        if self.dist.rank != 0:  # it writes nothing: rank 0, stopped or not, holds the run's last checkpoint
            done = f"rank {self.dist.rank}; rank 0 writes {path}, --resume {path} continues from its last episode"
        by = f" by {stop.args[0]}" if isinstance(stop, Stop) and stop.signum != signal.SIGINT else ""
        return Interrupted(f"interrupted{by} at episode {self.next_episode}; {done}", getattr(stop, "status", 130),
                           saved=self.next_episode > 0)

    def policy_label(self) -> str:
        """How the episodes run now, as metrics.csv's policy column says: the policy, the batch, the
        precision the U-Net computes in, and channels_last when on."""
        return f"{self.policy.describe()} {amp_name(self.amp_dtype)}" + " channels_last" * self.channels_last

    def _time_estimate(self, rows, left: int) -> str:
        """After the first optimizer step: its time per episode and per step, and the time left."""
        seconds = max(row[-1] for row in rows)
        per_step = seconds / self.config.qca_steps
        return (f"first episode {duration_text(seconds)} ({duration_text(per_step)} a step, warm-up included); "
                f"about {duration_text(seconds * left / len(rows))} for the {left} episode{'s' * (left != 1)} left")

    def replica_difference(self) -> float:
        """Largest |parameter difference| between this rank and rank 0 over all ranks (DDP check)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        reference = self.dist.broadcast_(flat.clone())
        diff = torch.tensor([(flat - reference).abs().max().item()], device=self._gather_device())
        return self.dist.all_reduce_(diff, op="max").item()



def train(config: TrainConfig, resume: Optional[str] = None, ddp: bool = False, progress: bool = True,
          stop_after: Optional[int] = None, overwrite: bool = False) -> List[dict]:
    """Run the reference trainer as `qca-lowmem train` does: check_run's checks, then episodes
    up to config.episodes (nothing when a resumed checkpoint is there already)."""
    set_allocator_defaults()
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    distributed = Distributed(ddp, config.device)
    lock = FolderLock(config.out_dir)  # (rank 0's)
    try:
        per_rank = ("device", "threads")
        distributed.refuse_other_settings({**{k: v for k, v in vars(config).items() if k not in per_rank},
                                           "resume": resume, "stop_after": stop_after, "overwrite": overwrite})
        state = check_run(config, resume, rank=distributed.rank, world_size=distributed.world_size, lock=lock,
                          overwrite=overwrite)
        if state is not None and state["episode"] >= config.episodes:
            message(f"{resume} is at episode {state['episode']}, --episodes is {config.episodes}: nothing to do",
                    distributed.rank)
            return []
        first = state["episode"] if state is not None else 0
        last = config.episodes if stop_after is None else min(config.episodes, first + stop_after)
        message(f"training episodes {first}-{last - 1} of {config.qca_steps} steps {device_note(config)}",
                distributed.rank)
        trainer = Trainer(config, distributed, progress=progress)
        if state is not None:
            checkpoint.restore(trainer, resume, state)
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
        lock.release()
        distributed.close()
        torch.set_num_threads(threads)
