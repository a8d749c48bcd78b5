"""One-flag switch for a QC_Trainer_v4- or v3-style trainer (the attributes it relies on: docs/design.md).

`enable(trainer)` converts the operator's ConvBlocks in place (same Parameters), swaps the engine
step for the fused pack/update, replaces `train_episode` by a rollout with recompute that keeps the
stock episode semantics, and swaps the GradScaler for `qca_lowmem.amp.GradScaler` with its state.
An engine with memory (`motor.has_memory`, a ConvLSTM) has its memory carried by the rollout
(engine_step.py). `disable(trainer)` puts everything back.
"""

import copyreg
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..precision import autocast
from ..recompute import Policy, StepGraph, rollout
from ..recompute.policy import NONE, STEP
from ..unet import convert
from .code_identity import not_recorded
from .engine_probe import buffer_bindings, compiled_module, rebind
from .engine_step import (
    EngineIdentity,
    EngineMemoryStep,
    fused_of,
    live_gamma,
    lowmem_steps,
    memory_of,
    put_side_state,
    side_state_of,
)
from .options import OPTION_NAMES, EpisodeOptions, check_options, resolve_options
from .say import say
from .scaler_swap import clip_scaled, lowmem_scaler_for
from .stock_guard import EpisodeIdentity, check_stock_episode
from .trainers import adapter_for

_STATE_ATTR = "_qca_lowmem_state"


@dataclass
class _Saved:
    """What enable() changed, so disable() can put it back."""

    options: EpisodeOptions
    version: Any = None  # the trainer version's adapter (trainers.py)
    blocks: List[Tuple[torch.nn.Module, str, torch.nn.Module]] = field(default_factory=list)
    evolve_step: Any = None
    had_evolve_step_attr: bool = False
    train_episode: Any = None
    had_train_episode_attr: bool = False
    scaler: Any = None
    had_scaler_attr: bool = True
    step_graph: Any = None  # a StepGraph of the motor's step, made at the first CUDA episode
    memory_step: Any = None  # step(psi, (h, c)) -> (psi, (h, c)) for an engine with memory
    edited_episode: Optional[str] = None  # why the episode is not stock, run anyway (assume_stock_episode)
    compiled_said: bool = False  # the one line for an operator compiled after enable()
    own_step: Optional[str] = None  # why the engine's own step and blocks run although fused ones were asked for
    motor: Any = None  # the engine enable() changed, which every trainer sharing this state must still hold
    live: bool = True  # False once disable() put the engine back, for a shallow copy still holding this state
    episode_identity: Any = None  # the stock train_episode recognised, checked at each episode (stock_guard.py)
    engine_identity: Any = None  # the engine step recognised, checked at each episode (engine_step.py)
    fused: Any = None  # the fused step reading GAMMA_DECAY live, None with the engine's own step
    graph_reads: Any = None  # what the step_graph's capture read once: GAMMA_DECAY, the operator

    def __getstate__(self):
        # A copy (deepcopy, pickle) captures its own CUDA graphs at its first CUDA episode.
        return {**vars(self), "step_graph": None, "graph_reads": None}


class LowmemEpisode:
    """trainer.train_episode while enabled: a value holding the trainer, not a bound function;
    every copy of the trainer gets its own (_CopyHook)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __call__(self, episode_num):
        state: _Saved = getattr(self.trainer, _STATE_ATTR)
        theirs = state.episode_identity.changed(self.trainer, self) if state.episode_identity else None
        if theirs is not None:  # their train_episode is no longer the one recognised: it runs as written
            return theirs(episode_num)
        try:
            return _lowmem_train_episode(self.trainer, episode_num)
        finally:  # an episode that raised leaves the step as their code and inference call it
            if state.fused is not None:
                state.fused.end_episode()


def _episode_step(trainer, state: _Saved, opts):
    """The step the episode rolls out: the one enable() installed while the engine's code is the
    one it recognised, else the engine's own (eager); GAMMA_DECAY pinned for an episode that recomputes."""
    own = state.engine_identity.own_step(trainer.motor) if state.engine_identity is not None else None
    if own is not None:
        return EngineMemoryStep(trainer.motor, own) if state.memory_step is not None else own
    if state.fused is not None:
        state.fused.start_episode(live_gamma(trainer.motor) if opts.policy.checkpoint != NONE else None)
    step = state.memory_step or trainer.motor.evolve_step
    if opts.cuda_graph:  # off CUDA a StepGraph is the plain step
        # A capture keeps the values its step read as constants: captured again when they change.
        reads = (live_gamma(trainer.motor), trainer.motor.operator)
        if state.step_graph is None or state.graph_reads is None or state.graph_reads[0] != reads[0] \
                or state.graph_reads[1] is not reads[1]:
            state.step_graph, state.graph_reads = StepGraph(step), reads
        step = state.step_graph
    return step


_COPY_HOOK = "__reduce_ex__"  # copy.copy, copy.deepcopy and pickle read it off the instance


class _CopyHook:
    """trainer.__reduce_ex__ while enabled: the class's own reduction of the trainer, whose copy
    (shallow, deep, or loaded) is made by _enabled_copy, so that its train_episode and this hook
    hold the copy, not the original. The rest of the copy is what the class's copy would be: a
    shallow copy shares the engine, optimizer and scaler, and the state that enable() left on them."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __call__(self, protocol):
        trainer = self.trainer
        func, args, state, *rest = type(trainer).__reduce_ex__(trainer, max(protocol, 2))
        if func is not copyreg.__newobj__ or not isinstance(state, dict):
            raise TypeError(f"qca_lowmem: {type(trainer).__name__} has its own __reduce__ (or __getstate__ without "
                            "a dict, or __slots__), so a copy of the enabled trainer cannot be bound to itself (its "
                            "episodes would train this trainer): qca_lowmem.disable(trainer) before copying it, "
                            "then enable() each")
        state = {key: value for key, value in state.items() if key != _COPY_HOOK
                 and not (isinstance(value, LowmemEpisode) and value.trainer is trainer)}
        return (_enabled_copy, args, state, *rest)


def _enabled_copy(cls, *args):
    """copyreg.__newobj__ with the enabled trainer's episode and copy hook bound to the new object."""
    new = cls.__new__(cls, *args)
    vars(new).update({"train_episode": LowmemEpisode(new), _COPY_HOOK: _CopyHook(new)})
    return new


def _children(root: torch.nn.Module):
    """(parent, attribute name, child) of every submodule edge under root."""
    return [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()]


def _lowmem_train_episode(trainer, episode_num):
    """train_episode with the stock semantics of the trainer's version (trainers.py),
    running the episode through qca_lowmem.rollout."""
    state: _Saved = getattr(trainer, _STATE_ATTR)
    _check_engine(trainer, state)
    opts, version = state.options, state.version
    operator = trainer.motor.operator
    device = next(operator.parameters()).device

    if opts.fused_step_ops and not state.compiled_said and compiled_module(operator) is not operator:
        state.compiled_said = True
        say(logging.WARNING, f"motor.operator is compiled ({type(operator).__name__}); the fused step runs the "
                             "module it wraps, uncompiled")
    model = version.model(trainer)
    model.train()  # as the stock episode: a model left in eval mode (by a visualisation) trains in train mode
    trainer.optimizer.zero_grad()
    psi0 = version.initial_state(trainer, opts, device)
    noise = version.noise(trainer, episode_num, opts.noise)
    step = _episode_step(trainer, state, opts)
    # The memory the episode starts from: what the engine holds (zeroed by V4's state reset, None after V3's episodes).
    memory = {} if state.memory_step is None else dict(carry=memory_of(trainer.motor))
    with autocast(device.type, opts.amp_dtype):
        psi, history, *memory_T = rollout(step, psi0, trainer.qca_steps, checkpoint=opts.policy, noise=noise,
                                          record_every=version.record_every(trainer), **memory)
        loss, details = version.loss(trainer, psi0, psi, history)
    bound = buffer_bindings(compiled_module(operator))  # as the forward left them
    if state.fused is not None:
        state.fused.flush()
    side_state = side_state_of(trainer.motor, copy=opts.cuda_graph)  # the forward's last step's, as stock leaves it

    parameters = [p for p in model.parameters() if p.requires_grad]
    scaler = getattr(trainer, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()
        scaler.unscale_(trainer.optimizer)
        max_norm = _max_norm(trainer, opts, version)
        if max_norm is not None:
            clip_scaled(scaler, parameters, max_norm)
        scaler.step(trainer.optimizer)
        scaler.update()
    else:
        loss.backward()
        max_norm = _max_norm(trainer, opts, version)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        trainer.optimizer.step()
    # After the backward, whose recomputes ran the steps again.
    rebind(bound)  # a buffer each recompute bound again (snntorch's membrane): as the forward left it
    put_side_state(trainer.motor, side_state)
    version.after_backward(trainer, memory_T[0] if memory_T else None)
    return version.result(trainer, episode_num, loss, details, psi)


def _check_engine(trainer, state: _Saved):
    """The episode runs on the engine enable() changed, still enabled: a shallow copy of the trainer
    shares it, and may be given another, or see it disabled through the original (or the other way)."""
    if not state.live:
        raise RuntimeError("qca_lowmem: disable() was called on a trainer sharing this one's engine (a copy.copy "
                           "of it, or the trainer it was copied from) and put the engine back to stock; "
                           "call qca_lowmem.disable() on this trainer too, then enable() to train it low-memory")
    if trainer.motor is not state.motor:
        raise RuntimeError(f"qca_lowmem: trainer.motor ({type(trainer.motor).__name__}) is not the engine enable() "
                           "changed (set after enable(), or after copying the trainer): qca_lowmem.disable(trainer), "
                           "then enable(trainer) again")


def _max_norm(trainer, opts, version):
    """The clipping norm, read after the backward as their episodes read it (V3's gradient_clip)."""
    return opts.max_grad_norm if opts.max_grad_norm is not None else version.max_grad_norm(trainer)


def _check_placement(trainer):
    """The episode runs where the operator's parameters are: on another device than the trainer's
    it would train there, silently (stock fails at its first episode instead)."""
    wanted = getattr(trainer, "device", None)
    if wanted is None:
        return
    wanted = torch.device(wanted)
    device = next(trainer.motor.operator.parameters()).device
    if wanted.type != device.type or None not in (wanted.index, device.index) and wanted.index != device.index:
        raise ValueError(f"enable(): the trainer's device is {wanted}, but its operator's parameters are on {device} "
                         f"(QC_Trainer_v4 does not move a model it builds): move it first with "
                         f"trainer.motor.operator.to({str(wanted)!r})")


def enable(
    trainer,
    checkpoint: str = STEP,
    amp_dtype=None,
    fused_blocks: bool = True,
    slots: Optional[int] = None,
    cuda_graph: Optional[bool] = None,
    *,
    fused_step_ops: bool = True,
    lowmem_scaler: bool = True,
    grid_size=None,
    batch_size: Optional[int] = None,
    d_state: Optional[int] = None,
    initial_state: Optional[Callable] = None,
    max_grad_norm: Optional[float] = None,
    budget=None,
    noise: str = "trainer",
    assume_stock_episode: bool = False,
    channels_last: Optional[bool] = None,
):
    """Switch a QC_Trainer_v4- or QC_Trainer_v3-style trainer to the low-memory path, in place;
    returns the trainer. Which version it is, is read off its attributes (trainers.py);
    train_episode then keeps that version's episode, return values and bookkeeping. The enabled
    trainer copies and pickles (where the stock one does): a deep copy, or the trainer loaded, trains
    its own model, enabled, and disable() works on it; a CUDA capture is made again by its first episode.
    A shallow copy (copy.copy) runs its own episodes on the engine, optimizer and scaler it shares
    with the original, as the stock copy does; disable() on one of them puts that shared engine
    back, and the other then refuses to train until disable() is called on it too.

    checkpoint: "step" (keep one psi per step, recompute in backward), "revolve" (binomial
      checkpointing with `slots` stored states), "auto" (full graphs of as many steps as `budget`
      bytes allow, the others recomputed; see rollout) or "none" (stock autograd).
    amp_dtype: None follows the trainer (fp16 autocast when `trainer.use_amp`), else "fp32",
      "bf16" or "fp16"; the state and its normalisation stay complex64 either way. bf16 on a GPU
      below compute capability 8.0 (emulated there) becomes fp16 with the loss scaler, with a warning.
    fused_blocks: convert the operator's ConvBlocks to FusedConvBlock in place (same Parameters).
    cuda_graph: run each recomputed step as replays of captured CUDA graphs (qca_lowmem.StepGraph):
      the same kernels without launch overhead. None (the default): on where it can run (CUDA with
      torch's caching allocator, a checkpoint other than "none"), off elsewhere; True where it
      cannot run warns why, once; False: eager steps. enable()'s line says which on CUDA.
    fused_step_ops: replace `motor.evolve_step` by the fused pack/update ops. Only where that is
      exact: an engine whose state psi is not a complex tensor is refused naming its class; one
      whose evolve_step is not, by the identity of its code, a Cartesian step qca_lowmem follows
      (checked again at each episode), or whose operator runs an op not known continuous (spikes,
      quantising: the ops of one probe call tell), keeps the engine's own step and stock blocks,
      which round as stock does, and enable()'s line says so. False rolls out the engine's own
      step, which needs only the complex tensor state.
    An engine with `motor.has_memory` True (operator(x, h, c) -> (delta, h, c), the memory on
      motor.state.h_state / c_state, detached) has its memory carried through the rollout, so
      each recompute sees the memory its forward step saw; after each episode motor.state holds
      the memory the last step left, as stock. An operator that cannot be called as the engine
      calls it is refused here, naming its class.
    lowmem_scaler: replace `trainer.scaler` by qca_lowmem.amp.GradScaler carrying its state.
    noise: where a noisy episode's noise comes from. "trainer": the trainer's own
      `noise_injector`, applied as stock applies it (a phase flip, and a bit flip when NumPy's
      coin says so): the same random draws in the same order as stock, replayed in recomputes,
      so episodes equal stock's and leave the generators as stock leaves them. "fused":
      qca_lowmem's NoiseSchedule (fused kernels keyed by (seed, step); the same distribution,
      other numbers than stock's).
    grid_size / batch_size / d_state / initial_state: how a V4 trainer's psi0 is drawn. By default
      the trainer's own state reset when its engine has one (`motor.state._reset_state_random()`,
      then `motor.state.psi`; grid_size and batch_size, which would replace it, are refused), else
      the stock draw (batch_size, default 1) on the global torch RNG with the grid from
      trainer.grid_size or motor.cfg.GRID_SIZE_TRAINING. A V3 trainer draws
      its own, `motor.get_initial_state(trainer.batch_size)`, and refuses grid_size and batch_size.
      `initial_state(trainer) -> psi0` overrides both for trainers that draw psi0 differently.
    max_grad_norm: None clips as the trainer does (V4 at 1.0; V3 at its gradient_clip, when > 0).
    channels_last: the operator's weights (in place, the same Parameters) and the fused pack in
      NHWC, so cuDNN's convolutions need no layout conversion; the same function (float64 within
      rounding of NCHW). None (the default): on for a CUDA operator whose convolutions run on
      Tensor Cores (precision.gpu_prefers_nhwc; measured faster on an H200, docs/benchmarks.md) when
      it gets the fused step on an engine without memory, off elsewhere (the CPU included);
      enable()'s line names it when on. True needs the fused step on an engine without memory.
      disable() puts the weights back in NCHW.
    assume_stock_episode: run qca_lowmem's stock episode in place of a train_episode that is not
      one it follows (edited, overridden), at your own risk: what yours does differently is
      dropped. enable()'s line says so. False (the default) refuses such a trainer.
    """
    arguments = locals()
    check_options({name: arguments[name] for name in OPTION_NAMES}, lambda name: f"enable(): {name}")
    version = adapter_for(trainer)
    if hasattr(trainer, _STATE_ATTR):
        raise RuntimeError("enable(): qca_lowmem is already enabled on this trainer; call disable(trainer) first")
    if _COPY_HOOK in vars(trainer):
        raise TypeError(f"enable(): the trainer has its own {_COPY_HOOK} ({vars(trainer)[_COPY_HOOK]!r}), where enable() "
                        "binds the trainer's copies to themselves; remove it first")
    unrecorded = not_recorded()  # no digests for this Python: their own episode runs, said in the line
    edited_episode = None if unrecorded else check_stock_episode(trainer, version.name, assume_stock_episode)
    policy = checkpoint if isinstance(checkpoint, Policy) else Policy.of(checkpoint, slots, budget, "enable()")
    _check_placement(trainer)
    policy.check_device(next(trainer.motor.operator.parameters()).device, "enable()")
    state = _Saved(version=version, edited_episode=edited_episode, options=resolve_options(
        trainer, version, policy=policy, amp_dtype=amp_dtype, grid_size=grid_size, batch_size=batch_size,
        d_state=d_state, initial_state=initial_state, max_grad_norm=max_grad_norm, fused_blocks=fused_blocks,
        cuda_graph=cuda_graph, noise=noise, fused_step_ops=fused_step_ops, lowmem_scaler=lowmem_scaler,
        assume_stock_episode=assume_stock_episode, channels_last=channels_last,
    ))
    # Everything that can fail is decided before the trainer changes.
    new_scaler = lowmem_scaler_for(trainer, state.options.amp_dtype) if lowmem_scaler else None
    evolve_step, state.memory_step, state.own_step = lowmem_steps(trainer.motor, fused_step_ops, state.options.grid,
                                                                  state.options.d_state, state.options.channels_last)
    if state.own_step is not None:  # the fused blocks round differently too
        if channels_last:  # NHWC convolutions round differently as well
            raise ValueError(f"enable(): channels_last=True needs the fused step, which this operator does not get.\n"
                             f"{state.own_step}; leave channels_last off")
        # channels_last unset: off with the engine's own step, which the line says
        state.options = dataclasses.replace(state.options, fused_step_ops=False, fused_blocks=False,
                                            channels_last=False)
    if state.options.fused_blocks:
        _convert_blocks(trainer.motor.operator, state)
    if state.options.channels_last:
        trainer.motor.operator.to(memory_format=torch.channels_last)
    state.motor = trainer.motor
    _swap_step(trainer, state, evolve_step)
    state.fused = fused_of(evolve_step, state.memory_step)
    state.engine_identity = EngineIdentity(trainer.motor, evolve_step, state.memory_step is not None)
    if state.fused is not None:  # outside episodes (their code, inference) the step checks at each call
        state.fused.identity = state.engine_identity
    state.episode_identity = EpisodeIdentity(trainer, unrecorded) if edited_episode is None else None
    _swap_episode(trainer, state)
    _swap_scaler(trainer, state, new_scaler)
    state.compiled_said = compiled_module(trainer.motor.operator) is not trainer.motor.operator
    setattr(trainer, _STATE_ATTR, state)
    say(logging.INFO, f"on, {_summary(state)}")
    return trainer


def _summary(state: _Saved) -> str:
    """What the episodes run, in one line: checkpoint=step, fp32, fused blocks, fused step (and,
    where it applies, the QC_Trainer_v3 episode and a compiled operator run uncompiled)."""
    options = state.options
    parts = [options.describe()] + [name for name, on in (
        ("the compiled operator's module uncompiled", options.fused_step_ops and state.compiled_said),
        (f"{state.version.name} episode", state.version.named_on_enable),
        (f"the engine's own step and blocks: {state.own_step}", state.own_step is not None),
        (f"the stock episode assumed: {state.edited_episode}", state.edited_episode is not None),
        (f"their own train_episode: {getattr(state.episode_identity, 'own', None)}",
         getattr(state.episode_identity, "own", None) is not None)) if on]
    return ", ".join(parts)


def _convert_blocks(operator, state: _Saved):
    """Stock ConvBlocks -> FusedConvBlock in place, remembering what was swapped for disable()."""
    params_before = [id(p) for p in operator.parameters()]
    edges = _children(operator)
    convert(operator)
    # What convert() swapped, so disable() can put the very same stock modules back.
    state.blocks = [(parent, name, child) for parent, name, child in edges if getattr(parent, name) is not child]
    if [id(p) for p in operator.parameters()] != params_before:
        _restore_blocks(state.blocks)
        raise RuntimeError("enable(): convert() did not keep the operator's Parameter objects; nothing was changed")


def _swap_step(trainer, state: _Saved, evolve_step):
    """motor.evolve_step -> `evolve_step` (the fused pack/update, engine_step.lowmem_steps) unless
    None; an original set on the engine is kept (the class's needs no keeping: a copy of a bound
    method would bind the original engine, and a pickled one is looked up again at loading)."""
    motor = trainer.motor
    state.had_evolve_step_attr = "evolve_step" in vars(motor)
    state.evolve_step = vars(motor).get("evolve_step")
    if evolve_step is not None:
        motor.evolve_step = evolve_step


def _swap_episode(trainer, state: _Saved):
    state.had_train_episode_attr = "train_episode" in vars(trainer)
    state.train_episode = vars(trainer).get("train_episode")
    trainer.train_episode = LowmemEpisode(trainer)
    vars(trainer)[_COPY_HOOK] = _CopyHook(trainer)


def _swap_scaler(trainer, state: _Saved, new_scaler):
    state.had_scaler_attr = hasattr(trainer, "scaler")  # a V3 trainer has none
    state.scaler = getattr(trainer, "scaler", None)
    if new_scaler is not None:
        trainer.scaler = new_scaler


def _restore_blocks(blocks):
    for parent, name, module in blocks:
        setattr(parent, name, module)


def disable(trainer):
    """Undo enable(): stock blocks, step, train_episode and scaler (keeping the scaler's state). On
    a shallow copy sharing an engine another trainer's disable() already put back: its own
    train_episode and scaler."""
    state: Optional[_Saved] = getattr(trainer, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("disable(): qca_lowmem is not enabled on this trainer")
    if state.live:
        _restore_engine(state)
        state.live = False
    vars(trainer).pop(_COPY_HOOK, None)
    if state.had_train_episode_attr:
        trainer.train_episode = state.train_episode
    else:
        del trainer.train_episode
    if getattr(trainer, "scaler", None) is not state.scaler:
        if state.scaler is not None:
            state.scaler.load_state_dict(trainer.scaler.state_dict())
        trainer.scaler = state.scaler
    if not state.had_scaler_attr and hasattr(trainer, "scaler"):
        del trainer.scaler
    delattr(trainer, _STATE_ATTR)
    return trainer


def _restore_engine(state: _Saved):
    """The engine's stock blocks, layout and step."""
    _restore_blocks(state.blocks)
    if state.options.channels_last:
        state.motor.operator.to(memory_format=torch.contiguous_format)
    motor = state.motor
    if state.had_evolve_step_attr:
        motor.evolve_step = state.evolve_step
    elif "evolve_step" in vars(motor):
        del motor.evolve_step
