"""What enable() decided (`EpisodeOptions`, one frozen value): its options (options.py) resolved
against the trainer once, the engine's verdict (its own step or the fused one) included, then read
by attribute by the episode and the trainer versions and said in enable()'s one line; and what
each episode reads again of the trainer (`check_reads`)."""

import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .. import precision
from ..ops import foreign_context
from ..precision import autocast_dtype, parse_amp_dtype
from ..recompute import Policy, StepGraph, step_graph
from ..recompute.policy import NONE
from .engine_step import engine_kind, has_memory, own_step_verdict, unknown_engine
from .episode_refusals import EpisodeRefused, ProofStale
from .operator_code import operator_unfollowed
from .options import Options
from .trainers import TrainerVersion
from .user_modules import compiled_module


@dataclass(frozen=True)
class EpisodeOptions:
    given: Options  # as enable() was given them; what needs resolving is resolved below
    policy: Policy
    amp_dtype: torch.dtype  # the compute dtype the episode's autocast runs
    weights_dtype: torch.dtype  # the operator's parameters' dtype when enable() read them
    # trainer.use_amp as enable() read it for amp_dtype (None where amp_dtype was given, or there is
    # none): their episode reads it at every episode, so an episode refuses another value
    use_amp: Optional[bool]
    grid: Optional[Tuple[int, int]]  # psi0's grid, where the stock draw makes psi0
    batch_size: Optional[int]
    d_state: int
    initial_state: Optional[Callable]  # initial_state(trainer) -> psi0, where the trainer's own draw is used
    fused_step_ops: bool  # the fused step installed: asked for, and the engine's verdict
    own_step: Optional[str]  # why the engine's own step and blocks run although fused ones were asked for
    fused_blocks: bool
    channels_last: bool  # the operator's weights NHWC
    cuda_graph: bool  # whether the steps run as captured graphs
    cuda_graph_said: str  # what enable()'s line says of it: "cuda_graph", "cuda_graph off", or "" off CUDA
    noise_said: str  # what enable()'s line says of noise="fused" ("" for the trainer's own noise)

    @property
    def computes_in(self) -> str:
        """What the episodes compute in, in words: fp32, fp64, bf16 or fp16."""
        return precision.compute_name(self.amp_dtype, self.weights_dtype)

    def describe(self) -> str:
        """The policy, the precision and the switches that are on, for enable()'s line."""
        parts = [self.policy.describe(), self.computes_in]
        return ", ".join(parts + [name for name, on in (
            ("fused blocks", self.fused_blocks), ("fused step", self.fused_step_ops),
            ("channels_last", self.channels_last),
            (self.cuda_graph_said, bool(self.cuda_graph_said)),
            (self.noise_said, bool(self.noise_said))) if on])


    def no_kernel_said(self, operator, error: NotImplementedError) -> Optional[NotImplementedError]:
        """torch's "... not implemented for 'BFloat16'" raised under the episode's autocast (an
        antialiased resize on the CPU, for one), as the option that asked for it and the fix; else None."""
        kernel = {torch.bfloat16: "BFloat16", torch.float16: "Half"}.get(self.amp_dtype)
        if kernel is None or f"not implemented for '{kernel}'" not in str(error):
            return None
        device = next(operator.parameters()).device.type
        return NotImplementedError(
            f"qca_lowmem: amp_dtype={precision.amp_name(self.amp_dtype)!r}: {type(compiled_module(operator)).__name__} "
            f"runs an op torch has no {kernel} kernel for on the {device} ({error}), as stock would under the same "
            "autocast; amp_dtype='fp32' trains it in fp32")


def _resolved_channels_last(channels_last: Optional[bool], fused_step_ops: bool, memory: bool,
                            own_step: Optional[str], device, compute_dtype) -> bool:
    """Unset: on where the fused step runs and NHWC is faster (precision.nhwc_faster); True where the
    fused step does not run (`fused_step_ops` as asked False, an engine with memory, the engine's
    verdict `own_step`) is refused."""
    if channels_last and (not fused_step_ops or memory):
        raise ValueError("enable(): channels_last needs the fused step (fused_step_ops=True) on an engine without "
                         "memory, the step whose layouts it sets")
    if channels_last and own_step is not None:  # NHWC convolutions round differently as well
        raise ValueError(f"enable(): channels_last=True needs the fused step, which this operator does not get.\n"
                         f"{own_step}; leave channels_last off")
    if channels_last is None:
        return fused_step_ops and own_step is None and not memory and precision.nhwc_faster(device, compute_dtype)
    return channels_last


def _resolved_cuda_graph(cuda_graph: Optional[bool], policy: Policy, device: torch.device,
                         unfollowed: Optional[str]) -> Tuple[bool, str]:
    """(whether the steps run as captured graphs, what enable()'s line says of it: on CUDA either
    way, nothing elsewhere). Unset: on where it can run, off elsewhere without a word; True where
    it cannot run warns why. `unfollowed`: why the engine's step or the operator is not code qca_lowmem follows.
    A replay repeats the kernels one call recorded, so only a step whose code it follows can be
    known to do the same at every call (not one keeping a call counter on the engine): an engine
    it does not recognise is not captured, and True there is refused."""
    on, why_not = StepGraph.resolve(cuda_graph, policy, device)
    if on and unfollowed is not None:
        if cuda_graph:
            raise ValueError(f"enable(): cuda_graph=True, but {unfollowed}: a capture would replay what one call of "
                             "it did at every step, and qca_lowmem cannot know that each call does the same; leave "
                             "cuda_graph unset (eager steps, each recompute checked against its forward)")
        on = False
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


def check_reads(trainer, opts: EpisodeOptions, version: TrainerVersion, device: torch.device) -> None:
    """What enable() read once, read again at each episode as their episode would read it now:
    the precision (use_amp, the caller's autocast), the caller's modes and saved-tensors hooks, and
    psi0's grid and d_state. A value changed raises ProofStale (enable() runs again, reading it
    anew); a caller's context the episode cannot run under, EpisodeRefused."""
    _check_precision(trainer, opts)
    _check_psi0_read(trainer, opts)
    _check_caller_autocast(trainer, opts, version, device)  # after the values read anew: in their precision
    _check_caller_context()


def _check_precision(trainer, opts):
    """The precision enable() read off trainer.use_amp is the one their episode would read now
    (given amp_dtype, enable() read none)."""
    if opts.use_amp is None or bool(getattr(trainer, "use_amp", False)) == opts.use_amp:
        return
    changed = f"trainer.use_amp is {getattr(trainer, 'use_amp', None)!r} now ({opts.use_amp!r} at enable())"
    raise ProofStale(f"qca_lowmem: {changed}, where enable() read it once and runs every episode {opts.computes_in}",
                     changed)


def _check_caller_autocast(trainer, opts, version, device):
    """An autocast the caller entered around train_episode: their episode runs its forward under it
    where it sets none of its own (V3; V4 off CUDA), the lowmem episode in the precision enable()
    resolved. Refused unless enable() was given amp_dtype, which then decides."""
    caller = autocast_dtype(device.type)
    if caller is None or opts.given.amp_dtype is not None or device.type in version.own_autocast:
        return
    own = (f"{version.name}'s episode sets only {' and '.join(version.own_autocast).upper()}'s autocast, so its forward "
           "may run in it" if version.own_autocast else f"{version.name}'s episode sets none, so its forward runs in it")
    raise EpisodeRefused(f"qca_lowmem: train_episode was called inside torch.autocast({device.type!r}, dtype={caller}): "
                       f"{own}, where enable() runs {opts.computes_in}; give enable() amp_dtype (the LOWMEM "
                       "section's amp_dtype) to train in the precision you choose, or call train_episode outside the "
                       "autocast")


def _check_caller_context():
    """A mode or saved-tensors hook the caller entered around train_episode: their episode runs its
    ops and saves its tensors under it, the lowmem episode others (its fused ops, its recomputes,
    one psi a step), so one that changes values would give another result than theirs."""
    if torch.is_inference_mode_enabled():
        raise EpisodeRefused("qca_lowmem: train_episode was called under torch.inference_mode(), under which no "
                             "gradient can be taken (your episode's backward fails there too): call it outside")
    what = foreign_context()
    if what is not None:
        raise EpisodeRefused(f"qca_lowmem: train_episode was called under the {what}, which may change values (a "
                           "perturbation, a cast, a compression): your episode would run its ops and save its "
                           "tensors under it, qca_lowmem's runs and saves others, so the result would differ. Call "
                           "train_episode outside it (qca_lowmem keeps about one psi a step already), or "
                           "qca_lowmem.disable(trainer) to train under it on your own code; torch's own modes and "
                           "hooks (a default device, save_on_cpu, checkpoint) are kept. To measure what autograd "
                           "keeps: qca_lowmem.saved_bytes or qca_lowmem.peak_saved_bytes")


def _check_psi0_read(trainer, opts: EpisodeOptions) -> None:
    """The grid and d_state enable() read off the trainer (not given) are the ones the stock draw
    would read now: a grid changed between episodes (a curriculum) makes the proof stale, since the
    engine's probe and the fused step were proved at the grid read."""
    read = [(name, value, now(trainer)) for name, value, given, now in (
        ("grid", opts.grid, opts.given.grid_size, _infer_grid),
        ("d_state", opts.d_state, opts.given.d_state, lambda t: _infer_d_state(t, t.motor.operator)))
        if value is not None and given is None]
    changed = [f"{name} is {_shape_said(value_now)} now ({_shape_said(value)} at enable())"
               for name, value, value_now in read if value_now != value]
    if changed:
        it, said = "it" if len(changed) == 1 else "them", f"the trainer's {' and '.join(changed)}"
        raise ProofStale(f"qca_lowmem: {said}, where enable() read {it} for every episode's psi0 and proved the step",
                         said)


def _shape_said(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


class OwnStateReset:
    """initial_state(trainer) -> psi0 as the stand-in's V4 episode draws it where its engine keeps a
    state object: `trainer.motor.state._reset_state_random()`, then its psi. It reads the trainer
    it is handed, so a copy of an enabled trainer resets its own engine."""

    name = "motor.state._reset_state_random()"

    def __call__(self, trainer):
        state = trainer.motor.state
        state._reset_state_random()
        return state.psi


class TheirPsi0:
    """initial_state(trainer) -> psi0 as their V4 episode (Atheria at 4df21e7) draws it, read at each
    episode: `motor.state._reset_state_random()` where the state has one (else
    `motor._initialize_links()` where the engine has that), then `motor.state.psi`, or, where the
    engine keeps none, `motor.get_initial_state(trainer.batch_size)`."""

    name = "motor.state._reset_state_random() (or motor.get_initial_state(batch_size))"

    def __call__(self, trainer):
        motor = trainer.motor
        if hasattr(motor, "state") and hasattr(motor.state, "_reset_state_random"):
            motor.state._reset_state_random()
        elif hasattr(motor, "_initialize_links"):
            motor.links = motor._initialize_links()
        if hasattr(motor, "state") and hasattr(motor.state, "psi"):
            return motor.state.psi
        return motor.get_initial_state(trainer.batch_size)


def _their_draw(trainer, theirs: bool) -> Optional[Callable]:
    """The trainer's own psi0 draw, read off its engine: their V4's always (`theirs`: the running
    episode is Atheria's), the stand-in's where its engine keeps a state object; None where the
    stand-in draws psi0 itself (the stock draw). Refused where that episode would fail on stock."""
    motor = trainer.motor
    if theirs:
        if not (hasattr(motor, "state") and hasattr(motor.state, "psi")) and not hasattr(motor, "get_initial_state"):
            raise TypeError(f"enable(): {type(trainer).__name__}'s episode draws psi0 from motor.state.psi or "
                            f"motor.get_initial_state(batch_size), and {type(motor).__name__} has neither: it fails "
                            "on stock too; give the engine one, or pass initial_state=callable")
        return TheirPsi0()
    if not hasattr(motor, "state"):
        return None
    if not callable(getattr(motor.state, "_reset_state_random", None)):
        raise TypeError(f"enable(): {type(trainer).__name__}'s episode starts with motor.state._reset_state_random(), "
                        f"which {type(motor.state).__name__} lacks: it fails on stock too; give the state one, or "
                        "pass initial_state=callable")
    return OwnStateReset()


def _check_noise(trainer, version, noise) -> None:
    """enable()'s `noise`, refused where the trainer cannot give it (an episode without noise reads none)."""
    if noise == "trainer" and version.has_noise:
        injector = getattr(trainer, "noise_injector", None)
        missing = [name for name in ("apply_phase_flip", "apply_bit_flip") if not callable(getattr(injector, name, None))]
        if missing:
            raise TypeError(f"enable(): noise='trainer' applies the trainer's own noise_injector, but "
                            f"{type(trainer).__name__}.noise_injector ({type(injector).__name__}) has no {', '.join(missing)}; "
                            "noise='fused' applies qca_lowmem's NoiseSchedule instead")


def _check_placement(trainer, device):
    """The episode runs where the operator's parameters are: on another device than the trainer's
    it would train there, silently (stock fails at its first episode instead)."""
    wanted = getattr(trainer, "device", None)
    if wanted is None:
        return
    wanted = torch.device(wanted)
    if wanted.type != device.type or None not in (wanted.index, device.index) and wanted.index != device.index:
        raise ValueError(f"enable(): the trainer's device is {wanted}, but its operator's parameters are on {device} "
                         f"(QC_Trainer_v4 does not move a model it builds): move it first with "
                         f"trainer.motor.operator.to({str(wanted)!r})")


def resolve_options(trainer, version: TrainerVersion, given: Options, theirs: bool) -> EpisodeOptions:
    """enable()'s options resolved against the trainer, once, the engine's verdict included: what
    each lowmem episode reads. `theirs`: the episode enable() replaces is their own V4 (Atheria's),
    not the stand-in's. Everything here refuses before the trainer changes."""
    policy = given.checkpoint if isinstance(given.checkpoint, Policy) else Policy.of(
        given.checkpoint, given.slots, given.budget, "enable()")
    operator = trainer.motor.operator
    weights = next(operator.parameters(), None) if isinstance(operator, torch.nn.Module) else None
    if weights is None:  # a callable wrapping their model, say: nothing to place, train or fuse
        raise TypeError(f"enable(): motor.operator must be a torch.nn.Module with parameters (the model the episodes "
                        f"train); got {type(operator).__name__}: set the model itself on the engine")
    device = weights.device
    _check_placement(trainer, device)
    policy.check_device(device, "enable()")
    use_amp = bool(trainer.use_amp) if given.amp_dtype is None and hasattr(trainer, "use_amp") else None
    compute_dtype = torch.float16 if use_amp else parse_amp_dtype(given.amp_dtype)
    try:
        precision.refuse_fp16_on_cpu(compute_dtype, device, "amp_dtype='fp16', or the trainer's use_amp",
                                     "amp_dtype='bf16' (the CPU's half precision) or 'fp32'")
    except ValueError as error:
        raise ValueError(f"enable(): {error}") from None
    compute_dtype, note = precision.native_amp_dtype(compute_dtype, device)
    if note:
        warnings.warn(f"enable(): {note}", stacklevel=4)
    grid, batch_size, initial_state = _psi0_options(trainer, version, given.grid_size, given.batch_size,
                                                    given.initial_state, theirs)
    d_state = given.d_state or _infer_d_state(trainer, trainer.motor.operator)
    own_step = own_step_verdict(trainer.motor, given.fused_step_ops, grid, d_state, policy.checkpoint != NONE)
    unfollowed = unknown_engine(trainer.motor) if engine_kind(trainer.motor) is None else \
        operator_unfollowed(compiled_module(trainer.motor.operator))
    cuda_graph, cuda_graph_said = _resolved_cuda_graph(given.cuda_graph, policy, device, unfollowed)
    channels_last = _resolved_channels_last(given.channels_last, given.fused_step_ops, has_memory(trainer.motor),
                                            own_step, device, compute_dtype or weights.dtype)
    _check_noise(trainer, version, given.noise)
    noise_said = "" if given.noise != "fused" else "fused noise" if version.has_noise else (
        f"no noise ({version.name}'s episode has none; noise='fused' unread)")
    return EpisodeOptions(
        given=given, policy=policy, amp_dtype=compute_dtype, weights_dtype=weights.dtype, use_amp=use_amp, grid=grid,
        batch_size=batch_size, d_state=d_state, initial_state=initial_state,
        fused_step_ops=given.fused_step_ops and own_step is None, own_step=own_step,
        fused_blocks=given.fused_blocks and own_step is None,  # the fused blocks round differently too
        channels_last=channels_last, cuda_graph=cuda_graph, cuda_graph_said=cuda_graph_said, noise_said=noise_said)


def _psi0_options(trainer, version, grid_size, batch_size, initial_state, theirs: bool):
    """(grid, batch_size, initial_state) of the episodes' psi0 draw (TrainerV4/V3.initial_state);
    `theirs`: the episode running is their V4's (_their_draw)."""
    if version.draws_own_psi0:
        if grid_size is not None or batch_size is not None:
            raise ValueError(f"enable(): {type(trainer).__name__} ({version.name}) draws psi0 as "
                             "motor.get_initial_state(trainer.batch_size), so grid_size and batch_size are not read; "
                             "set trainer.batch_size, or pass initial_state=callable")
        return None, None, initial_state
    reset = _their_draw(trainer, theirs) if initial_state is None else None
    if reset is not None and (grid_size is not None or batch_size is not None):
        # their episode draws psi0 from the engine: another draw would train on other states
        raise ValueError(f"enable(): {type(trainer).__name__}'s episode draws psi0 by its engine's "
                         f"{reset.name}, so grid_size and batch_size would replace the users' draw; "
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
