"""One-flag switch for a QC_Trainer_v4- or v3-style trainer (the attributes it relies on: docs/design.md).

`enable(trainer)` converts the operator's ConvBlocks in place (same Parameters), swaps the engine
step for the fused pack/update, replaces `train_episode` by a rollout with recompute that keeps the
stock episode semantics, and swaps the GradScaler for `qca_lowmem.amp.GradScaler` with its state.
An engine with memory (`motor.has_memory`, a ConvLSTM) has its memory carried by the rollout
(engine_step.py). `disable(trainer)` puts everything back.
"""

import copyreg
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..precision import autocast
from ..recompute import rollout
from ..recompute.history_grads import history_grads_guarded
from ..recompute.policy import NONE
from .captures import StepCaptures
from .code_identity import ATHERIA, not_recorded
from .engine_state import memory_of, put_side_state, side_state_of
from .engine_step import (
    EngineIdentity,
    EngineMemoryStep,
    engine_code,
    fused_of,
    live_gamma,
    lowmem_steps,
)
from .episode_options import EpisodeOptions, check_reads, resolve_options
from .fused_blocks import Swapped, proved_for_the_episode, put_back, swap_in
from .mask_free_noise import injector_code
from .operator_code import backward_hook_code, refuse_compiled_own_step, unfollowed_code
from .options import Options, enable_signature, options_doc
from .say import say
from .scaler_swap import clip_scaled, lowmem_scaler_for, scales_for_fp16
from .state_drift import episode_drift
from .stock_guard import EpisodeIdentity, check_stock_episode, stock_origin
from .trainers import TrainerVersion, adapter_for
from .user_modules import buffer_bindings, compiled_module, rebind
from .weight_layouts import Made, layouts_put_back, to_channels_last

_STATE_ATTR = "_qca_lowmem_state"


@dataclass
class _Undo:
    """What enable() changed on the trainer and its engine, for disable() to put back."""

    motor: Any  # the engine enable() changed, which every trainer sharing this state must still hold
    blocks: Swapped = field(default_factory=list)  # the users' blocks fused blocks stand in for
    evolve_step: Any = None
    had_evolve_step_attr: bool = False
    train_episode: Any = None
    had_train_episode_attr: bool = False
    scaler: Any = None
    had_scaler_attr: bool = True
    live: bool = True  # False once disable() put the engine back, for a shallow copy still holding this state
    made_channels_last: Made = field(default_factory=list)  # the weights channels_last=True made NHWC


@dataclass
class _Said:
    """What the switch already said once, not to say again."""

    compiled: bool = False  # the one line for an operator compiled after enable()


@dataclass
class _Saved:
    """What enable() decided and the episodes run, with what disable() undoes, the episode's cache
    and what was said."""

    options: EpisodeOptions
    version: TrainerVersion
    undo: _Undo
    memory_step: Any = None  # step(psi, (h, c)) -> (psi, (h, c)) for an engine with memory
    fused: Any = None  # the fused step reading GAMMA_DECAY live, None with the engine's own step
    engine_identity: Any = None  # the engine step recognised, checked at each episode (engine_step.py)
    episode_identity: Any = None  # the stock train_episode recognised, checked at each episode (stock_guard.py)
    edited_episode: Optional[str] = None  # why the episode is not stock, run anyway (assume_stock_episode)
    captures: StepCaptures = field(default_factory=StepCaptures)
    said: _Said = field(default_factory=_Said)

    def __getstate__(self):
        # A copy (deepcopy, pickle) captures its own CUDA graphs at its first CUDA episode.
        return {**vars(self), "captures": StepCaptures()}


class LowmemEpisode:
    """trainer.train_episode while enabled: a value holding the trainer, not a bound function;
    every copy of the trainer gets its own (_CopyHook)."""

    def __init__(self, trainer):
        self.trainer = trainer

    # Eager inside torch.compile(trainer.train_episode): the rollout, its checks and its reverse
    # pass keep Python state (hooks set aside, generators, buffers) that a trace would lose.
    @torch.compiler.disable
    def __call__(self, episode_num):
        state: _Saved = getattr(self.trainer, _STATE_ATTR)
        theirs = state.episode_identity.changed(self.trainer, self) if state.episode_identity else None
        if theirs is not None:  # their train_episode is no longer the one recognised: it runs as written
            return theirs(episode_num)
        try:
            with proved_for_the_episode(state.undo):
                return _lowmem_train_episode(self.trainer, episode_num)
        except NotImplementedError as error:
            said = state.options.no_kernel_said(self.trainer.motor.operator, error)
            if said is None:
                raise
            raise said from error
        finally:  # an episode that raised leaves the step as their code and inference call it
            if state.fused is not None:
                state.fused.end_episode()


def _episode_step(trainer, state: _Saved, opts):
    """The step the episode rolls out: the one enable() installed while the engine's code is the
    one it recognised, else the engine's own (eager); GAMMA_DECAY pinned for an episode that recomputes."""
    own = state.engine_identity.own_step(trainer.motor) if state.engine_identity is not None else None
    if own is not None or state.fused is None:  # the engine's own step: a fallback, or what enable() kept
        refuse_compiled_own_step(trainer.motor.operator, opts.policy.checkpoint != NONE)
    if own is not None:
        return EngineMemoryStep(trainer.motor, own) if state.memory_step is not None else own
    if state.fused is not None:
        state.fused.start_episode(live_gamma(trainer.motor) if opts.policy.checkpoint != NONE else None)
    step = state.memory_step or trainer.motor.evolve_step
    if opts.cuda_graph:  # off CUDA a StepGraph is the plain step
        step = state.captures.step(trainer.motor, step)
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


def _lowmem_train_episode(trainer, episode_num):
    """train_episode with the stock semantics of the trainer's version (trainers.py),
    running the episode through qca_lowmem.rollout."""
    state: _Saved = getattr(trainer, _STATE_ATTR)
    _check_engine(trainer, state)
    opts, version = state.options, state.version
    operator = trainer.motor.operator
    device = next(operator.parameters()).device
    check_reads(trainer, opts, version, device)  # what enable() read once, as their episode would read it now

    if opts.fused_step_ops and not state.said.compiled and compiled_module(operator) is not operator:
        state.said.compiled = True
        say(logging.WARNING, f"motor.operator is compiled ({type(operator).__name__}); the fused step runs the "
                             "module it wraps, uncompiled")
    model = version.model(trainer)
    if model is not None:  # as the stock episode: a model left in eval mode (by a visualisation) trains in train mode
        model.train()
    trainer.optimizer.zero_grad()
    psi0 = version.initial_state(trainer, opts, device)
    noise = version.noise(trainer, episode_num, opts.given.noise)
    step = _episode_step(trainer, state, opts)
    # The memory the episode starts from: what the engine holds (zeroed by V4's state reset, None after V3's episodes).
    memory = {} if state.memory_step is None else dict(carry=memory_of(trainer.motor))
    with autocast(device.type, opts.amp_dtype):
        psi, history, *carry_T = rollout(step, psi0, trainer.qca_steps, checkpoint=opts.policy, noise=noise,
                                         record_every=version.record_every(trainer), **memory)
        # The engine as the forward's steps leave it, for the loss to read: the memory, the side state.
        memory_T = carry_T[0] if carry_T else None
        version.leave_memory(trainer, memory_T)
        side_state_read = state.fused.flush() if state.fused is not None else None
        with history_grads_guarded(history, "qca_lowmem", opts.policy.checkpoint):
            loss, details = version.loss(trainer, psi0, psi, history)
    bound = buffer_bindings(compiled_module(operator))  # as the forward left them
    side_state = side_state_of(trainer.motor, copy=opts.cuda_graph)  # the forward's last step's, as stock leaves it

    # The state the steps' unfollowed code keeps, as the forward left it (the recomputes run it again).
    drift = _step_drift(trainer, state, noise) if opts.policy.checkpoint != NONE else None

    # All of them, as their clipping reads them: a frozen one's gradient left from before counts in the norm.
    parameters = [] if model is None else list(model.parameters())
    scaler = getattr(trainer, "scaler", None)
    scaled = scaler is not None and scaler.is_enabled() and (version.scales(trainer) or scales_for_fp16(opts))
    (scaler.scale(loss) if scaled else loss).backward()
    # After the backward, whose recomputes ran the steps again.
    rebind(bound)  # a buffer each recompute bound again (snntorch's membrane): as the forward left it
    put_side_state(trainer.motor, side_state)
    if side_state_read is not None:
        side_state_read.check()
    if drift is not None:
        drift.check()  # the rest of the steps' state as the forward left it, or the episode refused
    max_norm = _max_norm(trainer, opts, version) if model is not None else None
    if scaled:
        scaler.unscale_(trainer.optimizer)
        if max_norm is not None:
            clip_scaled(scaler, parameters, max_norm)
        scaler.step(trainer.optimizer)
        scaler.update()
    else:
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        trainer.optimizer.step()
    version.leave_memory(trainer, memory_T)
    return version.result(trainer, episode_num, loss, details, psi)


def _step_drift(trainer, state: _Saved, noise):
    """A StateDrift of what the episode's steps run that qca_lowmem does not follow: the operator,
    the engine's own step, the trainer's noise injector (episode noise from it), or None."""
    module, motor = compiled_module(trainer.motor.operator), trainer.motor
    installed = state.engine_identity.installed if state.engine_identity is not None else None
    injector = trainer.noise_injector if noise is not None and state.options.given.noise == "trainer" else None
    return episode_drift([
        ("the operator (and its hooks)", *unfollowed_code(module)),
        ("the engine's step", [(type(motor).__name__, motor)], engine_code(motor, installed)),
        ("the noise injector", [(f"{type(trainer).__name__}.noise_injector", injector)],
         injector_code(injector) if injector is not None else None)], backward_hook_code(module))


def _check_engine(trainer, state: _Saved):
    """The episode runs on the engine enable() changed, still enabled: a shallow copy of the trainer
    shares it, and may be given another, or see it disabled through the original (or the other way)."""
    if not state.undo.live:
        raise RuntimeError("qca_lowmem: disable() was called on a trainer sharing this one's engine (a copy.copy "
                           "of it, or the trainer it was copied from) and put the engine back to stock; "
                           "call qca_lowmem.disable() on this trainer too, then enable() to train it low-memory")
    if trainer.motor is not state.undo.motor:
        raise RuntimeError(f"qca_lowmem: trainer.motor ({type(trainer.motor).__name__}) is not the engine enable() "
                           "changed (set after enable(), or after copying the trainer): qca_lowmem.disable(trainer), "
                           "then enable(trainer) again")


def _max_norm(trainer, opts, version):
    """The clipping norm, read after the backward as their episodes read it (V3's gradient_clip)."""
    return opts.given.max_grad_norm if opts.given.max_grad_norm is not None else version.max_grad_norm(trainer)


def enable(trainer, *args, **kwargs):
    """Switch a QC_Trainer_v4- or QC_Trainer_v3-style trainer to the low-memory path, in place;
    returns the trainer. Which version it is, is read off its attributes (trainers.py);
    train_episode then keeps that version's episode, return values and bookkeeping. The enabled
    trainer copies and pickles (where the stock one does): a deep copy, or the trainer loaded, trains
    its own model, enabled, and disable() works on it; a CUDA capture is made again by its first episode.
    A shallow copy (copy.copy) runs its own episodes on the engine, optimizer and scaler it shares
    with the original, as the stock copy does; disable() on one of them puts that shared engine
    back, and the other then refuses to train until disable() is called on it too.

    An engine with `motor.has_memory` True (operator(x, h, c) -> (delta, h, c), the memory on
    motor.state.h_state / c_state, detached) has its memory carried through the rollout, so each
    recompute sees the memory its forward step saw; after each episode motor.state holds the memory
    the last step left, as stock. An operator that cannot be called as the engine calls it is
    refused here, naming its class.

    The options (atheria/options.py; each is also a key of the LOWMEM section):
    """
    try:
        arguments = _SIGNATURE.bind(trainer, *args, **kwargs).arguments
    except TypeError as error:
        raise TypeError(f"enable(): {error}") from None
    given = Options(**{name: value for name, value in arguments.items() if name != "trainer"})
    version = adapter_for(trainer)
    if hasattr(trainer, _STATE_ATTR):
        raise RuntimeError("enable(): qca_lowmem is already enabled on this trainer; call disable(trainer) first")
    if _COPY_HOOK in vars(trainer):
        raise TypeError(f"enable(): the trainer has its own {_COPY_HOOK} ({vars(trainer)[_COPY_HOOK]!r}), where enable() "
                        "binds the trainer's copies to themselves; remove it first")
    unrecorded = not_recorded()  # no digests for this Python: their own episode runs, said in the line
    origin = stock_origin(trainer, version.name)
    edited_episode = None if unrecorded else check_stock_episode(trainer, origin, given.assume_stock_episode)
    options = resolve_options(trainer, version, given, theirs=origin is not None and origin.startswith(ATHERIA))
    # Everything that can fail is decided before the trainer changes.
    new_scaler = lowmem_scaler_for(trainer, scales_for_fp16(options)) if given.lowmem_scaler else None
    evolve_step, memory_step = lowmem_steps(trainer.motor, options.fused_step_ops, options.grid, options.d_state)
    undo = _Undo(motor=trainer.motor)
    if options.fused_blocks:
        undo.blocks = swap_in(trainer.motor.operator)
    if options.channels_last:
        undo.made_channels_last = to_channels_last(trainer.motor.operator)
    _swap_step(trainer, undo, evolve_step)
    state = _Saved(options, version, undo, memory_step=memory_step, fused=fused_of(evolve_step, memory_step),
                   engine_identity=EngineIdentity(trainer.motor, evolve_step, memory_step is not None),
                   edited_episode=edited_episode)
    if state.fused is not None:  # outside episodes (their code, inference) the step checks at each call
        state.fused.identity, state.fused.undo = state.engine_identity, undo
    state.episode_identity = EpisodeIdentity(trainer, unrecorded) if edited_episode is None else None
    _swap_episode(trainer, undo)
    _swap_scaler(trainer, undo, new_scaler)
    state.said.compiled = compiled_module(trainer.motor.operator) is not trainer.motor.operator
    setattr(trainer, _STATE_ATTR, state)
    say(logging.INFO, f"on, {_summary(state)}")
    return trainer


# enable()'s signature and the docs of its options, read off Options.
_SIGNATURE = enable.__signature__ = enable_signature()
if enable.__doc__:  # None under python -OO
    enable.__doc__ = enable.__doc__.rstrip() + "\n" + options_doc() + "\n"


def _summary(state: _Saved) -> str:
    """What the episodes run, in one line: checkpoint=step, fp32, fused blocks, fused step (and,
    where it applies, the QC_Trainer_v3 episode and a compiled operator run uncompiled)."""
    options = state.options
    parts = [options.describe()] + [name for name, on in (
        ("the compiled operator's module uncompiled", options.fused_step_ops and state.said.compiled),
        (f"{state.version.name} episode", state.version.named_on_enable),
        (f"the engine's own step and blocks: {options.own_step}", options.own_step is not None),
        (f"the stock episode assumed: {state.edited_episode}", state.edited_episode is not None),
        (f"their own train_episode: {getattr(state.episode_identity, 'own', None)}",
         getattr(state.episode_identity, "own", None) is not None)) if on]
    return ", ".join(parts)


def _swap_step(trainer, undo: _Undo, evolve_step):
    """motor.evolve_step -> `evolve_step` (the fused pack/update, engine_step.lowmem_steps) unless
    None; an original set on the engine is kept (the class's needs no keeping: a copy of a bound
    method would bind the original engine, and a pickled one is looked up again at loading)."""
    motor = trainer.motor
    undo.had_evolve_step_attr = "evolve_step" in vars(motor)
    undo.evolve_step = vars(motor).get("evolve_step")
    if evolve_step is not None:
        motor.evolve_step = evolve_step


def _swap_episode(trainer, undo: _Undo):
    undo.had_train_episode_attr = "train_episode" in vars(trainer)
    undo.train_episode = vars(trainer).get("train_episode")
    trainer.train_episode = LowmemEpisode(trainer)
    vars(trainer)[_COPY_HOOK] = _CopyHook(trainer)


def _swap_scaler(trainer, undo: _Undo, new_scaler):
    undo.had_scaler_attr = hasattr(trainer, "scaler")  # a V3 trainer has none
    undo.scaler = getattr(trainer, "scaler", None)
    if new_scaler is not None:
        trainer.scaler = new_scaler


def disable(trainer):
    """Undo enable(): stock blocks, step, train_episode and scaler (keeping the scaler's state). On
    a shallow copy sharing an engine another trainer's disable() already put back: its own
    train_episode and scaler."""
    state: Optional[_Saved] = getattr(trainer, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("disable(): qca_lowmem is not enabled on this trainer")
    undo = state.undo
    if undo.live:
        _restore_engine(undo)
        undo.live = False
    vars(trainer).pop(_COPY_HOOK, None)
    if undo.had_train_episode_attr:
        trainer.train_episode = undo.train_episode
    else:
        del trainer.train_episode
    if getattr(trainer, "scaler", None) is not undo.scaler:
        if undo.scaler is not None:
            undo.scaler.load_state_dict(trainer.scaler.state_dict())
        trainer.scaler = undo.scaler
    if not undo.had_scaler_attr and hasattr(trainer, "scaler"):
        del trainer.scaler
    delattr(trainer, _STATE_ATTR)
    return trainer


def _restore_engine(undo: _Undo):
    """The engine's stock blocks, layouts and step."""
    put_back(undo.blocks)
    motor = undo.motor
    layouts_put_back(undo.made_channels_last)
    if undo.had_evolve_step_attr:
        motor.evolve_step = undo.evolve_step
    elif "evolve_step" in vars(motor):
        del motor.evolve_step
