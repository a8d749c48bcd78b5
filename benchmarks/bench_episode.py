"""One training episode, stock vs qca_lowmem, all in one process (issue 4).

An episode is the stock `train_episode`: psi0, `qca_steps` steps with the stock noise, the
evolutionary loss (docs/design.md), backward, clip_grad_norm_(1.0), AdamW(1e-4, wd 1e-5) step.
Runs: stock_fp32, stock_fp16_autocast (with a GradScaler), stock_fp16_checkpoint (autocast and
one torch.utils.checkpoint per step, the users' proposed fix), lowmem_fp32_step,
lowmem_bf16_step, lowmem_fp16_step (with qca_lowmem.amp.GradScaler), lowmem_bf16_revolve32, and
lowmem_{fp32,bf16,fp16}_step_graph (each step as replays of captured CUDA graphs, StepGraph)
(the lowmem runs: qca_lowmem.UNetUnitary with fused blocks, fused pack/update,
qca_lowmem.rollout with the replayable NoiseSchedule). By name, the strongest peer,
stock_compiled_checkpoint: stock's U-Net through torch.compile, checkpointed per step, bf16
autocast, channels_last; on CUDA each compile mode tried and the fastest kept (--compile-modes,
episode_peer.py). Three more, run only when named, take a lowmem_fp32_step episode's time
apart: stock_fp32_checkpoint (stock with that per-step recompute in fp32: what recomputing costs
stock), lowmem_fp32_keep (the fused
kernels under plain autograd, blocks keeping their intermediates: nothing recomputed) and
lowmem_fp32_forward (lowmem_fp32_step's forward and loss under no_grad, no backward: the pass a
step recompute runs again); lowmem_fp32_step_unchecked (lowmem_fp32_step with check_recompute=False:
against lowmem_fp32_step, what the check that each recompute reproduces the forward costs);
lowmem_fp32_step_by_hand (the same step recompute written out by hand: the forward under no_grad
keeping each step's state, then from the last step back each step run again with grad and
torch.autograd.grad for its input and the parameters, summed: no watch, check or generator replay,
so the least a per-step recompute on these kernels and autograd costs). Two more,
also by name, are checkpoint="auto": lowmem_fp32_auto with a budget that holds every step's full
graph, lowmem_fp32_auto_half with half of it, lowmem_fp32_auto_free with budget="free" (what the
device has left). Each run gets a fresh copy of the same initial weights and its own optimizer; it
reports the peaks of torch.cuda.max_memory_allocated and max_memory_reserved over the measured
episodes (after a warm-up episode, so AdamW's state exists) and the median episode time; a
StepGraph run also the captures it made and whether it fell back to eager steps. By name,
lowmem_{fp32,bf16}_step_graph_overlap_cl: StepGraph(overlap=True), each step's recompute run
ahead on a second stream while the step after it runs its backward. The _cl runs
are their runs with the model's weights and the pack channels_last (NHWC end to end); by name,
the runs that take the episode apart have them too (lowmem_fp32_step_cl, ...). stock_v4
and lowmem_enable_default are the users' trainer, stock and through enable()'s defaults
(episode_trainer.py). --profile adds one profiled episode per run: kernels and host-waiting ops
per step, the GPU's busy fraction, kernel time and launches per step by family (episode_profile.py).
The fp32 gradients of stock and lowmem_fp32_step are compared on the same weights, psi0 and
noise. A run that runs out of memory is reported with an "error" and no numbers.

On the CPU the runs are set up side by side and their episodes timed in turn (there is no peak
to keep apart), so that other processes' load falls on all of them alike.

Writes benchmarks/results/episode_<device>.json. Usage (on a CUDA machine):
    python benchmarks/bench_episode.py                  # default config: grid 64, d 14, hidden 128, 500 steps
    python benchmarks/bench_episode.py --steps 50 --runs lowmem_fp32_step stock_fp32
    python benchmarks/bench_episode.py --grid 256 --runs stock_fp16_checkpoint lowmem_enable_default  # GPU-bound
On the CPU, the embedded `qca-lowmem train` config at one thread:
    python benchmarks/bench_episode.py --device cpu --threads 1 --grid 32 --d-state 4 --hidden 16 --steps 48 \
        --runs stock_fp32 lowmem_fp32_step
"""

import argparse
import contextlib
import copy
import math
import statistics
import sys
import time

import torch
import torch.utils.checkpoint

import common
import episode_peer
import episode_profile
import qca_lowmem
from episode_peer import PEER_RUNS
from episode_trainer import OVERLAP_TRAINER_RUNS, TRAINER_RUNS, TrainerRun
from qca_lowmem import stock as reference

# channels_last: the model's weights and the pack NHWC, as the trainer's channels_last setting
CHANNELS_LAST_RUNS = ["lowmem_fp32_step_graph_cl", "lowmem_bf16_step_graph_cl", "lowmem_bf16_step_cl"]
RUNS = ["lowmem_fp32_step_graph", "lowmem_bf16_step_graph", "lowmem_fp16_step_graph", "stock_fp32",
        "stock_fp16_autocast", "stock_fp16_checkpoint", "lowmem_fp32_step", "lowmem_bf16_step", "lowmem_fp16_step",
        "lowmem_bf16_revolve32", *CHANNELS_LAST_RUNS, *TRAINER_RUNS]
# Asked for by name: they take the CPU episode's time apart (what the recompute costs stock, the
# fused kernels without any recompute, the forward pass a recompute repeats).
TAKEN_APART_RUNS = ["lowmem_fp32_step", "lowmem_fp32_keep", "lowmem_fp32_forward", "lowmem_fp32_step_unchecked",
                    "lowmem_fp32_step_by_hand"]
# The compiled peer by name too: its compiles take minutes on a GPU (gpu_checks.sh's peer phase).
EXTRA_RUNS = [*PEER_RUNS, "stock_fp32_checkpoint", *TAKEN_APART_RUNS[1:], "lowmem_fp32_auto", "lowmem_fp32_auto_half",
              "lowmem_fp32_auto_free", *(name + "_cl" for name in TAKEN_APART_RUNS)]
# StepGraph(overlap=True): each step's recompute runs ahead on a second lane (issue 50); by name
# until a GPU run shows it pays.
OVERLAP_RUNS = ["lowmem_fp32_step_graph_overlap_cl", "lowmem_bf16_step_graph_overlap_cl"]
EXTRA_RUNS += OVERLAP_RUNS + OVERLAP_TRAINER_RUNS
CUDA_ONLY_RUNS = ["lowmem_fp32_auto_free"]  # budget="free" reads a GPU's free memory
AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--grid", type=int, default=64)
    p.add_argument("--d-state", type=int, default=14)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=500, help="qca_steps per episode")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gamma", type=float, default=0.0, help="GAMMA_DECAY")
    p.add_argument("--max-noise", type=float, default=0.1)
    p.add_argument("--episode", type=int, default=1000,
                   help="episode number: sets the noise rate min(max_noise, max_noise*episode/2000)")
    p.add_argument("--episodes", type=int, default=3, help="measured episodes per run (after one warm-up)")
    p.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS + EXTRA_RUNS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile-modes", nargs="+", choices=episode_peer.MODES, default=None,
                   help="torch.compile modes of stock_compiled_checkpoint, the fastest kept (default: "
                        f"{' '.join(episode_peer.CUDA_MODES)} on CUDA, default elsewhere)")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark on for every run, as the users' CartesianEngine turns it on "
                        "(their src/optimization/gpu_optimizer.py; CUDA only)")
    p.add_argument("--skip-grad-check", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="profile one more episode per run: kernels and host waits per step, GPU busy fraction")
    p.add_argument("--profile-steps", type=int, default=None, help="steps of the profiled episode (default --steps)")
    p.add_argument("--out", default=None, help="output JSON (default benchmarks/results/<name>_<device>.json)")
    p.add_argument("--name", default="episode", help="the result file's name before the device (default episode)")
    args = p.parse_args(argv)
    if args.cudnn_benchmark and not args.device.startswith("cuda"):
        p.error(f"--cudnn-benchmark sets cuDNN's algorithm search, which only a CUDA device has, got --device {args.device}")
    cuda_only = [name for name in args.runs if name in CUDA_ONLY_RUNS]
    if cuda_only and not args.device.startswith("cuda"):
        p.error(f"{', '.join(cuda_only)} need a CUDA device (budget='free' reads its free memory), got --device {args.device}")
    try:
        args.compile_modes = episode_peer.compile_modes(args.compile_modes, torch.device(args.device))
    except ValueError as e:
        p.error(str(e))
    return args


def lowmem_model(stock_model, args):
    """qca_lowmem.UNetUnitary (fused blocks) holding the stock model's weights."""
    model = qca_lowmem.UNetUnitary(args.d_state, args.hidden)
    model.load_state_dict(stock_model.state_dict())
    return model


def stock_forward(model, psi0, args, rate, autocast_dtype=None, checkpoint_steps=False, step=None):
    """Stock train_episode's forward (with `checkpoint_steps`, each step through
    torch.utils.checkpoint; `step`, where given, in place of the stock step of `model`): returns
    the history."""
    injector = reference.NoiseInjector(psi0.device)  # the users' injector: boolean masks
    step = step or (lambda psi: reference.step(psi, model, args.gamma))
    with torch.autocast(psi0.device.type, dtype=autocast_dtype or torch.float16, enabled=autocast_dtype is not None):
        if not checkpoint_steps:
            return reference.rollout(psi0, model, args.steps, args.gamma, injector, rate)[1]
        psi, history = psi0, []
        record_every = max(1, args.steps // 10)
        for t in range(args.steps):
            psi = torch.utils.checkpoint.checkpoint(step, psi, use_reentrant=False)
            if rate > 0.001:
                psi = reference.noise_step(injector, psi, rate)
            if t == 0 or t == args.steps - 1 or t % record_every == 0:
                history.append(psi)
        return history


def lowmem_step_fn(model, gamma, pack_dtype, channels_last=False):
    def step(psi):
        x = qca_lowmem.qca_pack(psi, pack_dtype, channels_last=channels_last)
        return qca_lowmem.qca_update(psi, model(x), gamma, multiplicative=True)

    return step


def lowmem_forward(model, psi0, args, schedule, autocast_dtype=None, checkpoint="step", slots=None, step=None,
                   check_recompute=True, budget=None):
    step = step or lowmem_step_fn(model, args.gamma, autocast_dtype)
    with torch.autocast(psi0.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        return qca_lowmem.rollout(step, psi0, args.steps, checkpoint=checkpoint, slots=slots, budget=budget,
                                  noise=schedule, check_recompute=check_recompute)[1]


def run_forward(name, model, psi0, args, episode_seed, step=None, budget=None):
    name = unlayered(name)
    rate = reference.noise_rate(args.episode, args.max_noise)
    schedule = qca_lowmem.NoiseSchedule(args.max_noise, args.episode, seed=episode_seed)
    if name == "stock_fp32":
        return stock_forward(model, psi0, args, rate)
    if name == "stock_fp16_autocast":
        return stock_forward(model, psi0, args, rate, torch.float16)
    if name == "stock_fp16_checkpoint":
        return stock_forward(model, psi0, args, rate, torch.float16, checkpoint_steps=True)
    if name == "stock_fp32_checkpoint":
        return stock_forward(model, psi0, args, rate, checkpoint_steps=True)
    if name == "stock_compiled_checkpoint":
        episode_peer.begin_episode(args.compile_modes[0])
        return stock_forward(model, psi0, args, rate, torch.bfloat16, checkpoint_steps=True, step=step)
    if name == "lowmem_fp32_keep":
        with qca_lowmem.keep_block_intermediates():
            return lowmem_forward(model, psi0, args, schedule, checkpoint="none", step=step)
    if name == "lowmem_fp32_step":
        return lowmem_forward(model, psi0, args, schedule, step=step)
    if name == "lowmem_fp32_step_unchecked":
        return lowmem_forward(model, psi0, args, schedule, check_recompute=False, step=step)
    if name == "lowmem_bf16_step":
        return lowmem_forward(model, psi0, args, schedule, torch.bfloat16, step=step)
    if name == "lowmem_fp16_step":
        return lowmem_forward(model, psi0, args, schedule, torch.float16)
    if name.startswith("lowmem_fp32_auto"):
        return lowmem_forward(model, psi0, args, schedule, checkpoint="auto", step=step, budget=budget)
    if name == "lowmem_bf16_revolve32":
        return lowmem_forward(model, psi0, args, schedule, torch.bfloat16, "revolve", 32)
    if name.endswith("_step_graph"):
        return lowmem_forward(model, psi0, args, schedule, AMP[name.split("_")[1]], step=step)
    raise ValueError(name)


def unlayered(name: str) -> str:
    """The run whose episode `name` runs: its channels_last model and step and its StepGraph's
    overlap are set up by Run."""
    return name.removesuffix("_cl").removesuffix("_overlap")


def initial_state(args, device, seed):
    generator = torch.Generator().manual_seed(seed)
    return reference.initial_state(args.batch, args.grid, args.d_state, device, generator)


def step_back_by_hand(model, psi0, args, schedule, step):
    """lowmem_fp32_step_by_hand's forward, loss and backward: returns the loss, the parameters'
    .grad set."""
    step = step or lowmem_step_fn(model, args.gamma, None)
    params = list(model.parameters())
    states, psi = [], psi0
    with torch.no_grad():
        for t in range(args.steps):
            states.append(psi)
            psi = schedule(step(psi), t)
    psi = psi.requires_grad_()
    loss, _ = reference.evolutionary_loss([psi], psi0)
    grad, = torch.autograd.grad(loss, psi)
    sums = [None] * len(params)
    for t in reversed(range(args.steps)):
        x = states[t].requires_grad_()
        with torch.enable_grad(), qca_lowmem.keep_block_intermediates():
            out = schedule(step(x), t)
        grad, *grads = torch.autograd.grad(out, [x, *params], grad)
        sums = [g if s is None else s.add_(g) for s, g in zip(sums, grads)]
    for p, g in zip(params, sums):
        p.grad = g
    return loss


def train_episode(name, model, optimizer, scaler, args, device, episode_seed, step=None, budget=None):
    optimizer.zero_grad(set_to_none=True)
    psi0 = initial_state(args, device, episode_seed)
    name = unlayered(name)
    if name == "lowmem_fp32_forward":
        with torch.no_grad():
            history = run_forward("lowmem_fp32_step", model, psi0, args, episode_seed, step)
            return reference.evolutionary_loss(history, psi0)[0].item()
    if name == "lowmem_fp32_step_by_hand":
        schedule = qca_lowmem.NoiseSchedule(args.max_noise, args.episode, seed=episode_seed)
        loss = step_back_by_hand(model, psi0, args, schedule, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()
    history = run_forward(name, model, psi0, args, episode_seed, step, budget)
    loss, _ = reference.evolutionary_loss(history, psi0)
    del history
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return loss.item()


class Run:
    """One run's model, optimizer, scaler and step, warmed up by one episode (and, for a
    StepGraph, its capture)."""

    def __init__(self, name, stock_model, args, device):
        self.name, self.args, self.device = name, args, device
        self.model = (lowmem_model(stock_model, args) if name.startswith("lowmem") else copy.deepcopy(stock_model)).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=1e-5)
        self.scaler = None
        if "fp16" in name:
            self.scaler = (qca_lowmem.amp.GradScaler if name.startswith("lowmem") else torch.amp.GradScaler)(device.type)
        self.step = None
        if name.endswith("_cl") or name in PEER_RUNS:
            self.model = self.model.to(memory_format=torch.channels_last)
        if name in PEER_RUNS:
            self.step = episode_peer.peer_step_fn(self.model, args.gamma, args.compile_modes[0])
        elif name.endswith("_cl"):
            self.step = lowmem_step_fn(self.model, args.gamma, AMP[name.split("_")[1]], channels_last=True)
        if unlayered(name).endswith("_step_graph"):
            self.step = qca_lowmem.StepGraph(self.step or lowmem_step_fn(self.model, args.gamma, AMP[name.split("_")[1]]),
                                             overlap=name in OVERLAP_RUNS)
        self.budget = None
        if name == "lowmem_fp32_auto_free":
            self.budget = "free"
        elif name.startswith("lowmem_fp32_auto"):
            self.step = lowmem_step_fn(self.model, args.gamma, None)
            psi = initial_state(args, device, 0)
            with torch.enable_grad(), qca_lowmem.keep_block_intermediates():  # every step's full graph and output
                whole = args.steps * (qca_lowmem.saved_bytes(self.step, psi.requires_grad_(True)) + psi.nbytes)
            self.budget = whole // 2 if name.endswith("_half") else whole
        self.times = []
        for _ in range(episode_peer.WARMUP_EPISODES if name in PEER_RUNS else 1):
            self.episode(seed=0)

    def episode(self, seed):
        common.synchronize(self.device)
        start = time.perf_counter()
        train_episode(self.name, self.model, self.optimizer, self.scaler, self.args, self.device,
                      episode_seed=seed, step=self.step, budget=self.budget)
        common.synchronize(self.device)
        return time.perf_counter() - start

    @contextlib.contextmanager
    def steps_set(self, steps):
        saved, self.args.steps = self.args.steps, steps  # read at each episode
        try:
            yield
        finally:
            self.args.steps = saved

    def capture_record(self):
        """A StepGraph run's captures and whether it fell back (then it is no captured row); the
        compiled peer's mode."""
        if self.name in PEER_RUNS:
            return {"compile_mode": self.args.compile_modes[0]}
        if not isinstance(self.step, qca_lowmem.StepGraph):
            return {}
        return {"captures_made": self.step.captures_made, "fell_back": bool(self.step.failed_keys)}

    def release(self):
        del self.model, self.optimizer, self.step
        if self.name in PEER_RUNS:
            torch._dynamo.reset()  # its compiled graphs and CUDA graph pool, before the next run's peak
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def failed(name, e):
    if isinstance(e, torch.OutOfMemoryError):
        return {"name": name, "peak_bytes": None, "episode_s": None, "error": f"out of memory: {str(e).splitlines()[0]}"}
    # e.g. a StepGraph that could not capture: reported, the other runs go on
    return {"name": name, "peak_bytes": None, "episode_s": None, "error": str(e).splitlines()[0]}


def make_run(name, stock_model, args, device):
    return (TrainerRun if name in TRAINER_RUNS + OVERLAP_TRAINER_RUNS else Run)(name, stock_model, args, device)


def measure_run(name, stock_model, args, device):
    """A run on its own: on CUDA each run's peak memory needs the device to itself."""
    run = None
    try:
        run = make_run(name, stock_model, args, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = [run.episode(seed=1 + episode) for episode in range(args.episodes)]
        result = {"name": name, "peak_bytes": None, "episode_s": statistics.median(times)}
        if device.type == "cuda":
            result.update(peak_bytes=torch.cuda.max_memory_allocated(device),
                          peak_reserved_bytes=torch.cuda.max_memory_reserved(device))
        if args.profile:  # after the peaks: the profiler's buffers are not the run's
            result.update(episode_profile.episode_counts(run, args.profile_steps))
        return {**result, **run.capture_record()}
    except (torch.OutOfMemoryError, RuntimeError) as e:
        return failed(name, e)
    finally:
        if run is not None:
            run.release()


def measure_interleaved(names, stock_model, args, device):
    """Runs set up side by side, their episodes timed in turn (CPU: no peak to keep apart), so
    that load from other processes falls on every run alike and the ratios stay fair."""
    runs, results = {}, {}
    for name in names:
        try:
            runs[name] = make_run(name, stock_model, args, device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            results[name] = failed(name, e)
    times = {name: [] for name in runs}
    for episode in range(args.episodes):
        for name, run in runs.items():
            times[name].append(run.episode(seed=1 + episode))
    for name, run in runs.items():
        results[name] = {"name": name, "peak_bytes": None, "episode_s": statistics.median(times[name]),
                         "episodes_s": times[name], **run.capture_record()}
        if args.profile:
            results[name].update(episode_profile.episode_counts(run, args.profile_steps))
        run.release()
    return [results[name] for name in names]


def fp32_gradient_errors(stock_model, args, device):
    """{kind: max over parameters of max|g_kind - g_stock| / max|g_stock|} for the lowmem step,
    eager and (on CUDA) as captured graphs; same weights, psi0 and noise."""
    kinds = ("stock", "lowmem", "lowmem_graph") if device.type == "cuda" else ("stock", "lowmem")
    # fp32 convolutions: with TF32 (cuDNN's default) stock and fused layers may pick kernels of
    # different 10-bit-mantissa rounding, 7.9e-4 apart on an H100, which says nothing of our maths.
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _gradient_errors(stock_model, args, device, kinds)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _gradient_errors(stock_model, args, device, kinds):
    schedule = qca_lowmem.NoiseSchedule(args.max_noise, args.episode, seed=123)
    grads = {}
    for kind in kinds:
        model = (copy.deepcopy(stock_model) if kind == "stock" else lowmem_model(stock_model, args)).to(device)
        psi0 = initial_state(args, device, 123)
        if kind == "stock":
            # model bound as a default: the loop deletes it at the end of each kind
            history = qca_lowmem.rollout(lambda psi, model=model: reference.step(psi, model, args.gamma), psi0, args.steps,
                                         checkpoint="none", noise=schedule)[1]
        else:
            step = lowmem_step_fn(model, args.gamma, None)
            history = lowmem_forward(model, psi0, args, schedule,
                                     step=qca_lowmem.StepGraph(step) if kind == "lowmem_graph" else step)
        loss, _ = reference.evolutionary_loss(history, psi0)
        del history
        loss.backward()
        grads[kind] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        del model, loss
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {kind: max(((grads[kind][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                      for n, g in grads["stock"].items()) for kind in kinds[1:]}


def _modes(result):
    """The compiled peer's mode, and on CUDA every mode's episode or error."""
    if "compile_mode" not in result:
        return ""
    modes = result.get("compile_modes", {})
    times = [f"{mode} {m['error'] or format(m['episode_s'], '.3f') + ' s'}" for mode, m in modes.items()]
    return f"   mode {result['compile_mode']}" + (f" (of {'; '.join(times)})" if times else "")


def peer_mode_done(args, device, runs, name, mode, per_mode):
    """Says how the peer's compile mode ended and writes the rows so far with the peer's modes."""
    summary = per_mode[mode]
    ended = summary["error"] or f"{summary['episode_s']:.3f} s"
    print(f"{name} in {mode}: {ended} ({summary['wall_s']:.0f} s with its compile)", flush=True)
    unfinished = {"name": name, "episode_s": None, "peak_bytes": None, "error": "its compile modes still running",
                  "compile_modes": per_mode}
    write_report(args, device, [*runs, unfinished])


def write_report(args, device, runs, grad_errors=None):
    """The result file; `complete` false (and no gradient check) while runs are still to come."""
    payload = {
        "config": {"grid": args.grid, "d_state": args.d_state, "hidden": args.hidden, "qca_steps": args.steps,
                   "batch": args.batch},
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "timing": "medians of episodes timed in turn across runs" if device.type == "cpu" else "medians, one run at a time",
        "complete": grad_errors is not None,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,  # cuDNN's algorithm search, as the runs had it
        "runs": runs,
        "max_grad_rel_err_fp32": (grad_errors or {}).get("lowmem"),
        "max_grad_rel_err_fp32_graph": (grad_errors or {}).get("lowmem_graph"),
        "noise": {"max_noise": args.max_noise, "episode": args.episode,
                  "rate": reference.noise_rate(args.episode, args.max_noise)},
    }
    out = args.out or common.RESULTS / f"{args.name}_{common.slug(common.device_name(device))}.json"
    return common.write_result("episode", device, payload, out)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    stock_model = reference.UNetUnitary(args.d_state, args.hidden)
    print(f"device {common.device_name(device)}, torch {torch.__version__}")
    if device.type == "cuda":
        runs = []
        for name in args.runs:
            if name in PEER_RUNS:
                runs.append(episode_peer.fastest_mode(
                    lambda name, mode_args: measure_run(name, stock_model, mode_args, device), name, args, args.compile_modes,
                    mode_done=lambda mode, per_mode, name=name: peer_mode_done(args, device, runs, name, mode, per_mode)))
            else:
                runs.append(measure_run(name, stock_model, args, device))
            write_report(args, device, runs)  # what finished, should the command be stopped
    else:
        runs = measure_interleaved(args.runs, stock_model, args, device)
    stock_s = next((r["episode_s"] for r in runs if r["name"] == "stock_fp32" and r["episode_s"]), None)
    for result in runs:
        name = result["name"]
        if stock_s and result["episode_s"]:
            result["vs_stock_fp32"] = result["episode_s"] / stock_s
        if "error" in result:
            print(f"{name:26s} {result['error']}")
        else:
            peak = "n/a" if result["peak_bytes"] is None else f"{result['peak_bytes'] / 2**30:.3f} GiB"
            if result.get("peak_reserved_bytes") is not None:
                peak += f" (reserved {result['peak_reserved_bytes'] / 2**30:.3f})"
            ratio = f"   {result['vs_stock_fp32']:.2f}x stock fp32" if "vs_stock_fp32" in result else ""
            graph = ""
            if "captures_made" in result:
                graph = f"   captures {result['captures_made']}" + (", FELL BACK to eager" if result["fell_back"] else "")
            print(f"{name:26s} peak {peak:>12s}   episode {result['episode_s']:.3f} s{ratio}{graph}"
                  f"{episode_profile.summary(result)}{_modes(result)}")
            if families := episode_profile.family_table(result):
                print(families)
    grad_errors = {}
    if not args.skip_grad_check:
        try:
            grad_errors = fp32_gradient_errors(stock_model, args, device)
            for kind, error in grad_errors.items():
                print(f"max fp32 gradient relative error ({kind} vs stock): {error:.3e}")
        except torch.OutOfMemoryError as e:
            print(f"fp32 gradient check ran out of memory: {str(e).splitlines()[0]}")
    print(f"wrote {write_report(args, device, runs, grad_errors)}")
    if not all(math.isfinite(e) for e in grad_errors.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
