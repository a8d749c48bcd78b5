"""`qca-lowmem plan`: predict the reserved peak GPU memory of an episode (what must fit the GPU)
and recommend a policy that fits.

Tensors at the peak = model state (fp32 weights 4 B/param, gradients 4 B/param, AdamW moments
8 B/param) + the states the policy keeps across the episode + one step's working set (the step's
graph while it is backpropagated, plus gradients in flight, estimated as twice its largest tensor),
and, with cuda_graph on (a recomputing policy, cuda_graph not false), a StepGraph's private pool,
which holds a second such working set and a set of parameter gradients for its replays. Under
autocast the step's graph holds the half-precision copy of the weights, which the rollout makes
once per episode and keeps to its end, so the copy is counted once, in the working set.
"auto" keeps as many full graphs as the rollout's own schedule puts in its budget (the rollout
measures a step with its weight copies, schedule.budget_split).

The reserved peak adds what the caching allocator rounds those tensors up to (allocator.py: its
segments; the graph pool never expands) and a margin calibrated on an H200 (MARGIN_*: cuDNN's
workspaces, the capture's warm-up on its side stream, AdamW's temporaries, fragmentation), which
plan cannot see from the CPU; docs/benchmarks.md says from which measurements.

A step's graph is measured on the CPU with `saved_bytes` at two small grids of the real model
(activations grow with the grid's area and the batch) and extrapolated tensor by tensor; nothing
runs on the GPU.
"""

import dataclasses
import functools
import json
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .. import stock
from ..pools import as_on_cuda
from ..precision import autocast, native_amp_dtype, parse_amp_dtype
from ..recompute import Policy, keep_block_intermediates
from ..recompute.memory import SAFETY, saved_storage_sizes
from ..recompute.schedule import budget_split
from ..units import format_bytes, parse_bytes
from .allocator import expandable_in_environment, reserved_bytes
from .config import TrainConfig, build_model, model_step, parameter_count
from .errors import UsageError
from .footprint import LOSS_STATES, MODEL_STATE_BYTES_PER_PARAMETER, model_state_bytes, psi_bytes
from .oom import check_cpu_holds_model

_PROBE_GRIDS = (8, 16)
MiB = 2**20
# The margin on the reserved peak, fitted to an H200's measurements of d26e294 (docs/benchmarks.md):
# per parameter (AdamW's foreach temporaries and the capture's warm-up gradients, on their own
# stream, are one fp32 copy of the parameters each); a share of a step's activations where a
# StepGraph captures (its warm-up's activations, cached on the side stream it ran on); and cuDNN's
# workspaces for fp32 (TF32) convolutions, which half precision does not need.
MARGIN_PER_PARAMETER = 8
MARGIN_WARMUP_SHARE = 0.5
MARGIN_FP32_WORKSPACE = 160 * MiB
MARGIN_NOTE = (f"reserved peak: what torch's caching allocator holds at the episode's peak, what must fit the GPU: the "
               f"tensors, the allocator's rounding into its segments, and a margin plan cannot see from the CPU "
               f"(cuDNN's workspaces, the captured step's warm-up, AdamW's temporaries: {MARGIN_PER_PARAMETER} B per "
               f"parameter, {MARGIN_WARMUP_SHARE:g} of a step's activations where cuda_graph runs, "
               f"{MARGIN_FP32_WORKSPACE // MiB} MiB in fp32), fitted on an H200 to within 10% of every measured peak. "
               f"\"fits\" leaves {SAFETY - 1:.0%} more.")


@dataclass
class StepMeasure:
    """What one step's graph keeps at the planned grid and batch (extrapolated)."""

    saved_bytes: int  # the step's own tensors: grow with the grid's area and the batch
    largest_bytes: int
    weight_copy_bytes: int = 0  # autocast's weight copies: made once per episode, not per step
    activation_sizes: Tuple[int, ...] = ()  # each of the step's own tensors (sum: saved_bytes)
    weight_copy_sizes: Tuple[int, ...] = ()  # each weight copy (sum: weight_copy_bytes)


STOCK = "stock (for reference)"


@dataclass
class Estimate:
    name: str
    policy: Optional[Policy]  # None: the users' stock trainer
    amp_dtype: Optional[str]
    model_state_bytes: int
    kept_bytes: int
    working_bytes: int
    from_config: bool = False  # the config's own policy
    full_graph_bytes: int = 0  # one step's full graph with its output state (what "auto" keeps per step)
    graph_pool_bytes: int = 0  # of working_bytes: a StepGraph's private pool, where cuda_graph runs
    rounding_bytes: int = 0  # the caching allocator's segments beyond the tensors' own bytes
    margin_bytes: int = 0  # calibrated (MARGIN_*): workspaces, the capture's warm-up, AdamW's temporaries

    @property
    def tensor_bytes(self) -> int:
        """What the tensors hold at the peak (compare with torch.cuda.max_memory_allocated)."""
        return self.model_state_bytes + self.kept_bytes + self.working_bytes

    @property
    def peak_bytes(self) -> int:
        """The reserved peak (torch.cuda.max_memory_reserved): what must fit the GPU."""
        return self.tensor_bytes + self.rounding_bytes + self.margin_bytes

    def as_dict(self) -> dict:
        # The users' stock trainer is plain autograd (checkpoint "none") on the stock model.
        policy = self.policy if self.policy is not None else Policy.plain()
        return dict(name=self.name, model="stock" if self.policy is None else "lowmem", **policy.options(),
                    amp_dtype=self.amp_dtype, model_state_bytes=self.model_state_bytes,
                    kept_bytes=self.kept_bytes, working_bytes=self.working_bytes, from_config=self.from_config,
                    full_graph_bytes=self.full_graph_bytes, graph_pool_bytes=self.graph_pool_bytes,
                    rounding_bytes=self.rounding_bytes, margin_bytes=self.margin_bytes,
                    tensor_bytes=self.tensor_bytes, peak_bytes=self.peak_bytes)


def _measure_one(model, config: TrainConfig, variant: str, amp_dtype, grid: int):
    """(bytes, largest storage) that one step's graph keeps at this grid, batch 1."""
    generator = torch.Generator().manual_seed(0)
    psi = stock.initial_state(1, grid, config.d_state, "cpu", generator).requires_grad_(True)
    if variant == "stock":
        step = functools.partial(stock.step, operator=stock.StockForward(model), gamma=config.gamma,
                                 multiplicative=True)
    else:
        step = model_step(model, config)

    def run_step():
        # The lowmem step as the rollout recomputes it on a GPU: blocks keep their intermediates,
        # pools take qca_lowmem's op (which keeps no indices; stock's StockForward keeps torch's).
        with autocast("cpu", amp_dtype), keep_block_intermediates(variant != "stock"), as_on_cuda():
            step(psi)

    return saved_storage_sizes(run_step)


def measure_step(config: TrainConfig, variant: str, amp_dtype=None, model=None) -> StepMeasure:
    """One step's graph at config.grid and config.batch, from two small CPU probes, tensor by
    tensor: a tensor that grows with the grid's area is an activation (it grows with the batch
    too), one that does not is a weight copy (autocast's)."""
    model = model if model is not None else build_model(dataclasses.replace(config, device="cpu"), "cpu")
    (g1, g2) = _PROBE_GRIDS
    sizes1 = _measure_one(model, config, variant, amp_dtype, g1)
    sizes2 = _measure_one(model, config, variant, amp_dtype, g2)
    if len(sizes1) != len(sizes2):  # the probes saved different tensors: extrapolate their sums
        sizes1, sizes2 = [sum(sizes1)], [sum(sizes2)]
    scale = config.batch * config.grid**2
    activations, copies = [], []
    for y1, y2 in zip(sizes1, sizes2):
        slope = max(0.0, (y2 - y1) / (g2**2 - g1**2))
        constant = int(round(y1 - slope * g1**2))
        if slope > 0:
            activations.append(int(round(slope * scale)))
        if constant > 0:
            copies.append(constant)
    return StepMeasure(saved_bytes=sum(activations), largest_bytes=max(activations, default=0),
                       weight_copy_bytes=sum(copies), activation_sizes=tuple(activations),
                       weight_copy_sizes=tuple(copies))


def default_half(config: TrainConfig) -> str:
    """The reduced precision plan considers: the config's own when it has one, else bf16."""
    return config.amp_dtype if config.amp_dtype in ("bf16", "fp16") else "bf16"


def _policy_name(policy: Policy, amp: Optional[str]) -> str:
    return f"lowmem {policy.label()} {amp or 'fp32'}"


def candidates(config: TrainConfig, half: str = "bf16"):
    """(name, policy, amp) in order of preference: the config's own policy first, then faithful
    and fast ones. The first, the users' stock trainer (policy None), is shown for reference and
    never recommended."""
    own = (config.policy(), config.amp_dtype)
    others = [(Policy.every_step(), None), (Policy.every_step(), half)]
    others += [(Policy.revolve(slots), half) for slots in (64, 32, 16, 8, 4) if slots < config.qca_steps]
    return [(STOCK, None, None)] + [(_policy_name(*candidate), *candidate)
                                    for candidate in [own] + [c for c in others if c != own]]


def graph_pool_sizes(m: StepMeasure, numels: Sequence[int], amp: Optional[str]) -> List[int]:
    """A StepGraph's private pool (cuda_graph unset plans for a GPU, where it is on): the captured
    forward's saved activations and the backward's gradients in flight, as the eager step's
    working set, and one set of per-step parameter gradients (fp32, and in the compute dtype too
    under autocast, as the weight copies), held apart from the eager allocations for the graphs'
    replays. Weight copies are made outside the graphs (StaticCasts), so not counted again."""
    half_gradients = list(m.weight_copy_sizes) if amp in ("bf16", "fp16") else []
    return [*m.activation_sizes, m.largest_bytes, m.largest_bytes, *(4 * n for n in numels), *half_gradients]


def auto_split(policy: Policy, steps: int, psi: int, m: StepMeasure, captured: bool = True) -> Tuple[int, int]:
    """(full graphs, states) an "auto" episode keeps with a budget in bytes, as the rollout's own
    schedule splits it: its probe counts a step with the weight copies it reaches, the recompute
    check's last state comes out of the budget, and the probed first step keeps no graph; a
    budget below one state per step is revolve's. Without a captured step (`captured`), a budget
    that holds every step's graph runs the episode as plain autograd, the first step's graph kept."""
    step_bytes = m.saved_bytes + m.weight_copy_bytes + psi
    if not captured and policy.byte_budget >= steps * step_bytes:
        return steps, steps
    full, slots = budget_split(steps, psi, step_bytes, max(0, policy.byte_budget - psi), most_graphs=steps - 1)
    return (0, slots) if slots is not None else (full, steps)


def kept_sizes(policy: Optional[Policy], steps: int, psi: int, m: StepMeasure, captured: bool = True) -> Counter:
    """The tensors an episode keeps across its steps, and the loss's states, as how many of each
    size. A full graph step keeps its activations and its output state."""
    def graphs(count: int) -> Counter:
        return Counter({size: n * count for size, n in Counter(m.activation_sizes).items()})

    if policy is None or not policy.recomputes:  # plain autograd keeps every step's graph
        return graphs(steps)
    if policy.byte_budget is not None:
        full, states = auto_split(policy, steps, psi, m, captured)
        return graphs(full) + Counter({psi: states + LOSS_STATES})
    # ("auto" with budget "free" adapts to what is free: at least one state per step)
    return Counter({psi: policy.kept_states(steps) + LOSS_STATES})


def margin_bytes(parameters: int, m: StepMeasure, amp: Optional[str], captured: bool) -> int:
    """What the reserved peak holds that plan cannot see from the CPU, calibrated (MARGIN_*)."""
    margin = MARGIN_PER_PARAMETER * parameters + (MARGIN_FP32_WORKSPACE if amp in (None, "fp32") else 0)
    return margin + (int(MARGIN_WARMUP_SHARE * m.saved_bytes) if captured else 0)


def estimate(config: TrainConfig, name: str, policy: Optional[Policy], amp: Optional[str], m: StepMeasure,
             numels: Sequence[int], expandable: bool = True, from_config: bool = False) -> Estimate:
    """The estimate of one policy. `numels`: every parameter's; `expandable`: whether the caching
    allocator runs with expandable_segments (as `qca-lowmem train` sets it)."""
    psi = psi_bytes(config.batch, config.grid, config.d_state)
    recomputes = policy is not None and policy.recomputes
    working = [*m.weight_copy_sizes, *(m.activation_sizes if recomputes else ()), m.largest_bytes, m.largest_bytes]
    captured = config.cuda_graph is not False  # unset: on, on the GPU planned for
    pool = graph_pool_sizes(m, numels, amp) if captured and recomputes else []
    kept = kept_sizes(policy, config.qca_steps, psi, m, captured)
    parameters = sum(numels)
    model_state = [4 * n for n in numels] * (MODEL_STATE_BYTES_PER_PARAMETER // 4)
    kept_total = sum(size * count for size, count in kept.items())
    tensors = sum(model_state) + kept_total + sum(working) + sum(pool)
    reserved = reserved_bytes(Counter(model_state) + kept + Counter(working), expandable) + reserved_bytes(pool)
    return Estimate(name, policy, amp, model_state_bytes(parameters), kept_total, sum(working) + sum(pool),
                    from_config=from_config, full_graph_bytes=m.saved_bytes + psi, graph_pool_bytes=sum(pool),
                    rounding_bytes=reserved - tensors, margin_bytes=margin_bytes(parameters, m, amp, bool(pool)))


def estimate_all(config: TrainConfig, numels: Sequence[int], measures: dict, half: str = "bf16",
                 expandable: bool = True) -> List[Estimate]:
    """measures[(variant, amp)]: StepMeasure of ("stock", None) and of ("lowmem", amp) for every
    amp among the candidates (None, `half`, the config's)."""
    return [estimate(config, name, policy, amp, measures[("stock" if policy is None else "lowmem", amp)], numels,
                     expandable, from_config=index == 1)
            for index, (name, policy, amp) in enumerate(candidates(config, half))]


def with_auto(estimates: List[Estimate], config: TrainConfig, gpu_mem: int, reserve: int, measures: dict,
              numels: Sequence[int], expandable: bool = True) -> List[Estimate]:
    """After each "step" estimate, checkpoint="auto" with the budget that fills the GPU (full
    graphs instead of recomputes where memory is left), when that budget holds one state per
    step. It needs more than "step", so the recommendation never falls on it first."""
    out = []
    psi = psi_bytes(config.batch, config.grid, config.d_state)
    for e in estimates:
        out.append(e)
        if e.policy is None or not e.policy.keeps_one_state_per_step:
            continue
        usable = (gpu_mem - reserve) / SAFETY
        # What step's reserved peak holds besides its states is there for auto too.
        budget = int(usable - e.peak_bytes + e.kept_bytes) - LOSS_STATES * psi
        auto = None
        for _ in range(4):  # the allocator's rounding of what auto keeps comes out of the budget
            if budget < e.kept_bytes - LOSS_STATES * psi:
                break
            # No more than every step's full graph: what the episode would keep, and all it needs.
            policy = Policy.auto(min(budget, config.qca_steps * e.full_graph_bytes))
            auto = estimate(config, _policy_name(policy, e.amp_dtype), policy, e.amp_dtype,
                            measures[("lowmem", e.amp_dtype)], numels, expandable)
            if auto.peak_bytes <= usable:
                out.append(auto)
                break
            budget -= int(auto.peak_bytes - usable) + 1
    return out


def recommend(estimates: List[Estimate], gpu_mem: int, reserve: int) -> Optional[Estimate]:
    """The first lowmem estimate (in preference order) whose peak, with the safety margin, fits."""
    usable = gpu_mem - reserve
    for estimate in estimates:
        if estimate.policy is None:
            continue
        if estimate.peak_bytes * SAFETY <= usable:
            return estimate
    return None


def plan(config: TrainConfig, gpu_mem: int, reserve: int, half: Optional[str] = None,
         expandable: bool = True) -> dict:
    """Estimates for every candidate policy and the recommendation; `half` is the reduced
    precision to consider (bf16, or fp16 for GPUs without bf16; default: the config's). bf16
    becomes fp16 when this machine's GPU is below compute capability 8.0, as the trainer would,
    with a note. `expandable`: the allocator runs with expandable_segments, as `qca-lowmem train`
    sets it (a benchmark that leaves it unset passes False)."""
    half = default_half(config) if half is None else half
    note = ""
    if half == "bf16" and torch.cuda.is_available():  # planning for this machine's GPU
        native, note = native_amp_dtype(torch.bfloat16, "cuda")
        half = "fp16" if native == torch.float16 else half
    if half not in ("bf16", "fp16"):
        raise ValueError(f"half must be 'bf16' or 'fp16', got {half!r}")
    check_cpu_holds_model(config, parameter_count(config))  # plan measures a step on the CPU
    model = build_model(dataclasses.replace(config, device="cpu"), "cpu")
    numels = [p.numel() for p in model.parameters()]
    parameters = sum(numels)
    measures = {(variant, amp): measure_step(config, variant, parse_amp_dtype(amp), model)
                for variant, amp in (("stock", None), ("lowmem", None), ("lowmem", half), ("lowmem", config.amp_dtype))}
    estimates = with_auto(estimate_all(config, numels, measures, half, expandable), config, gpu_mem, reserve, measures,
                          numels, expandable)
    choice = recommend(estimates, gpu_mem, reserve)
    return {"config": dataclasses.asdict(config), "parameters": parameters, "gpu_mem": gpu_mem, "reserve": reserve,
            "estimates": estimates, "recommendation": choice, "half": half, "note": note}


def advice_when_nothing_fits(config: TrainConfig, estimates: List[Estimate], gpu_mem: int, reserve: int) -> str:
    smallest = min((e for e in estimates if e.policy is not None), key=lambda e: e.peak_bytes)
    return (f"Nothing fits in the {format_bytes(gpu_mem - reserve)} usable. The smallest policy, {smallest.name}, "
            f"needs {format_bytes(smallest.peak_bytes * SAFETY)} with margin. "
            f"{format_bytes(smallest.model_state_bytes)} of that is model state (weights, gradients, AdamW), "
            f"which no policy removes. Use a GPU with more memory, or a smaller model "
            f"(now hidden {config.hidden}, grid {config.grid}, batch {config.batch}).")


def train_command(estimate: Estimate, config_flags: List[str], policy_flags_given: bool = False) -> str:
    """The `train` command line of the recommendation: `config_flags` (the --config and the other
    options plan was given, which train reads the same way), plus the policy, unless it is the
    config file's own (the config's, with no policy flag given to plan)."""
    policy = []
    if policy_flags_given or not estimate.from_config:
        policy = estimate.policy.cli_arguments() + ["--amp-dtype", estimate.amp_dtype or "fp32"]
    return " ".join(["qca-lowmem", "train", *config_flags, *policy])


def usable_memory(gpu_mem_text: str, reserve_text: str):
    """(gpu_mem, reserve) in bytes; a budget that leaves nothing after the reserve is refused."""
    gpu_mem = parse_bytes(gpu_mem_text, name="--gpu-mem")
    reserve = parse_bytes(reserve_text, allow_zero=True, name="--reserve")
    if gpu_mem <= reserve:
        raise UsageError(f"--gpu-mem {gpu_mem_text} is no more than --reserve {reserve_text}, the memory the CUDA "
                         f"context takes. Give the GPU's whole memory (e.g. 3.68GiB). Or, for a budget already inside "
                         f"PyTorch's allocator (set_per_process_memory_fraction), give --reserve 0.")
    return gpu_mem, reserve


def main_plan(config: TrainConfig, gpu_mem_text: str, reserve_text: str, as_json: bool, half: Optional[str] = None,
              config_flags: Optional[List[str]] = None, policy_flags_given: bool = False) -> int:
    """`config_flags`: how the `train` command it prints names this config (e.g. ["--config", "default"])
    and the other options given; `policy_flags_given`: whether the policy came from flags."""
    gpu_mem, reserve = usable_memory(gpu_mem_text, reserve_text)
    # As `train` runs: with expandable_segments unless the environment's allocator settings say otherwise.
    result = plan(config, gpu_mem, reserve, half, expandable=expandable_in_environment(unset=True))
    estimates, choice = result["estimates"], result["recommendation"]
    command = train_command(choice, config_flags or [], policy_flags_given) if choice else None
    if as_json:
        print(json.dumps({
            **{k: v for k, v in result.items() if k not in ("estimates", "recommendation")},
            "estimates": [e.as_dict() for e in estimates],
            "recommendation": choice.name if choice else None,
            "command": command,
        }, indent=2))
        return 0 if choice else 1
    if result["note"]:
        print(f"qca-lowmem plan: {result['note']}")
    print(f"qca-lowmem plan: grid {config.grid}, d {config.d_state}, hidden {config.hidden} "
          f"({result['parameters'] / 1e6:.2f}M parameters), {config.qca_steps} steps, batch {config.batch}; "
          f"GPU {format_bytes(gpu_mem)}, {format_bytes(reserve)} reserved for the CUDA context")
    print(f"{'policy':<32} {'model state':>12} {'kept states':>12} {'step working':>13} {'allocator':>11} "
          f"{'margin':>10} {'reserved peak':>14}  fits")
    for e in estimates:
        fits = "yes" if e.peak_bytes * SAFETY <= gpu_mem - reserve else "no"
        name = e.name + (" (config)" if e.from_config else "")
        print(f"{name:<32} {format_bytes(e.model_state_bytes):>12} {format_bytes(e.kept_bytes):>12} "
              f"{format_bytes(e.working_bytes):>13} {format_bytes(e.rounding_bytes):>11} "
              f"{format_bytes(e.margin_bytes):>10} {format_bytes(e.peak_bytes):>14}  {fits}")
    print(MARGIN_NOTE)
    if choice is None:
        print(advice_when_nothing_fits(config, estimates, gpu_mem, reserve))
        return 1
    print(f"recommended: {choice.name} -> {command}")
    faster = next((e for e in estimates if e.policy is not None and e.policy.byte_budget is not None
                   and e.amp_dtype == choice.amp_dtype), None)
    if choice.policy.keeps_one_state_per_step and faster is not None:
        print(auto_advice(faster, config, config_flags or []))
    return 0


def auto_advice(auto: Estimate, config: TrainConfig, config_flags: List[str]) -> str:
    """What the memory left buys. "auto" runs the steps it keeps whole as plain autograd: with
    cuda_graph, step's captured replays skip the launches those pay for (on an H200 at batch 1 an
    episode of step with cuda_graph took 0.76x stock's time, auto with every step kept 0.99x)."""
    command = train_command(auto, config_flags)
    if config.cuda_graph is not False:  # unset: on, on the GPU planned for
        return ("With the memory left, auto could keep steps whole instead of recomputing them. "
                "Those steps run without cuda_graph's captured replays, so auto is faster only where "
                f"kernels, not their launches, take the time (large batches or grids): {auto.name} -> {command}")
    return ("Faster, with the memory left: auto keeps as many steps whole as fit and recomputes only "
            f"the others: {auto.name} -> {command}")
