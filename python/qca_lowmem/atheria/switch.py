"""One-flag switch for a QC_Trainer_v4- or v3-style trainer (the attributes it relies on: docs/design.md).

`enable(trainer)` converts the operator's ConvBlocks in place (same Parameters), swaps the engine
step for the fused pack/update, replaces `train_episode` by a rollout with recompute that keeps the
stock episode semantics, and swaps the GradScaler for `qca_lowmem.amp.GradScaler` with its state.
An engine with memory (`motor.has_memory`, a ConvLSTM) has its memory carried by the rollout
(engine_step.py). `disable(trainer)` puts everything back.
"""

import contextlib
import copyreg
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..convs import cast_convs, cast_convs_in_place, uncast_convs
from ..pools import fuse_pools, fuse_pools_in_place, unfuse_pools
from .captures import StepCaptures
from .code_identity import ATHERIA, not_recorded
from .engine_step import EngineIdentity, fused_of, lowmem_steps
from .episode import checked_before, train_episode
from .episode_options import EpisodeOptions, resolve_options
from .episode_refusals import EpisodeRefused, ProofStale
from .fused_blocks import Swapped, fuse_again, proved_for_the_episode, put_back, swap_in
from .options import Options, enable_signature, options_doc
from .say import say
from .scaler_swap import carry_state, lowmem_scaler_for, scales_for_fp16
from .stock_guard import EpisodeIdentity, check_stock_episode, stock_origin
from .trainers import TrainerVersion, adapter_for
from .user_modules import compiled_module
from .weight_layouts import Made, layouts_put_back, to_channels_last

_STATE_ATTR = "_qca_lowmem_state"


@dataclass
class _Undo:
    """What enable() changed on the trainer and its engine, for disable() to put back."""

    motor: Any  # the engine enable() changed, which every trainer sharing this state must still hold
    blocks: Swapped = field(default_factory=list)  # the users' blocks fused in place while an episode runs
    pools: list = field(default_factory=list)  # their nn.MaxPool2d given the stand-in's class (pools.py)
    convs: list = field(default_factory=list)  # their convs outside ConvBlocks given the stand-ins' (convs.py)
    installed_step: Any = None  # the fused step on the engine while an episode runs, else None (the engine's own)
    train_episode: Any = None
    had_train_episode_attr: bool = False
    scaler: Any = None
    had_scaler_attr: bool = True
    live: bool = True  # False once disable() put the engine back, for a shallow copy still holding this state
    installed_scaler: Any = None  # the qca_lowmem.amp.GradScaler enable() set as trainer.scaler, if any
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
    stock_on_refusal: bool = False  # QCA_LOWMEM=1 alone: an episode the library cannot run trains on stock
    enabled_again: bool = False  # by an episode whose checks found a value changed, for the call it then makes
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
        trainer = self.trainer
        state: Optional[_Saved] = getattr(trainer, _STATE_ATTR, None)
        installed = vars(trainer).get("train_episode")
        # Held from before an episode enabled it again (installing another) or put it on stock: what the trainer runs now.
        if state is None or isinstance(installed, LowmemEpisode) and installed is not self and installed.trainer is trainer:
            return trainer.train_episode(episode_num)
        if id(trainer.motor) in _TRAINING:
            raise RuntimeError(f"qca_lowmem: an episode on this engine ({type(trainer.motor).__name__}) is training, "
                               "and this one was called from it (its loss or a hook): its backward would recompute "
                               "the steps on the engine this one leaves; run the episodes one after the other")
        theirs = state.episode_identity.changed(trainer, self) if state.episode_identity else None
        with _stand_ins_for_the_episode(state.undo):
            if theirs is not None:  # their train_episode is no longer the one recognised: it runs as written
                return theirs(episode_num)
            return self._run(trainer, state, episode_num)

    @staticmethod
    def _run(trainer, state: "_Saved", episode_num):
        again, state.enabled_again = state.enabled_again, False  # set by _enable_again for the call it makes
        try:
            model, own = checked_before(trainer, state)
        except ProofStale as stale:
            if again:  # enable() read it otherwise than the episode does: never loop on it
                raise RuntimeError(f"qca_lowmem: enabled again for this episode, yet {stale.changed}; "
                                   "qca_lowmem.disable(trainer) trains it on stock") from stale
            return _enable_again(trainer, state, stale, episode_num)
        except EpisodeRefused as refused:
            if not state.stock_on_refusal:
                raise
            return _on_stock(trainer, episode_num, str(refused).removeprefix("qca_lowmem: "))
        engine = id(trainer.motor)
        try:
            _TRAINING.add(engine)
            with proved_for_the_episode(state.undo):
                return train_episode(trainer, state, episode_num, model, own)
        except NotImplementedError as error:
            said = state.options.no_kernel_said(trainer.motor.operator, error)
            if said is None:
                raise
            raise said from error
        finally:  # an episode that raised leaves the step as their code and inference call it
            _TRAINING.discard(engine)
            if state.fused is not None:
                state.fused.end_episode()


@contextlib.contextmanager
def _stand_ins_for_the_episode(undo: _Undo):
    """The stand-ins' classes (fused blocks, pools, convs) on the users' modules and the fused step
    on the engine while an episode runs, theirs between episodes: their code there (an init loop
    testing `type(m) is nn.Conv2d`, a pickle of the model or the engine, a deepcopy, a print,
    inference) sees their model and engine as they built them."""
    try:
        held = vars(undo.motor)
        if undo.installed_step is not None and undo.live and "evolve_step" not in held:
            held["evolve_step"] = undo.installed_step  # a step their code set there since runs instead
        fuse_again(undo.blocks)
        fuse_pools(undo.pools)
        cast_convs(undo.convs)
        yield
    finally:
        _park(undo)


def _park(undo: _Undo) -> None:
    """The users' modules given their classes back and the engine its own step (the stand-ins are
    kept on `undo` for the next episode); each part whatever interrupts another (a Ctrl-C)."""
    try:
        held = vars(undo.motor)
        if undo.installed_step is not None and held.get("evolve_step") is undo.installed_step:
            del held["evolve_step"]
    finally:
        try:
            put_back(undo.blocks)
        finally:
            try:
                unfuse_pools(undo.pools)
            finally:
                uncast_convs(undo.convs)


def _enable_again(trainer, state: _Saved, stale: ProofStale, episode_num):
    """The episode after a value enable() proved it at changed: enable() again, with the options
    given, reads it anew and proves the episode there; it then runs. Where enable() now refuses,
    the trainer is left on stock: said (QCA_LOWMEM=1 alone), or raised."""
    disable(trainer)
    try:
        again = _enabled(trainer, state.options.given)
    except (TypeError, ValueError, RuntimeError) as error:
        if not state.stock_on_refusal:
            raise RuntimeError(f"qca_lowmem: {stale.changed}, and enable() now refuses the trainer, so it is back on "
                               f"stock (disabled): {error}") from error
        return _on_stock(trainer, episode_num, f"{stale.changed}, and {str(error).splitlines()[0]}")
    again.stock_on_refusal, again.enabled_again = state.stock_on_refusal, True
    say(logging.INFO, f"{stale.changed}: on again, {_summary(again)}")
    return trainer.train_episode(episode_num)


def _on_stock(trainer, episode_num, why: str):
    """QCA_LOWMEM=1 alone asked for the library where it can run: where an episode cannot, the
    trainer is disabled (if it still is enabled), said once, and trains on stock from this episode on."""
    if hasattr(trainer, _STATE_ATTR):
        disable(trainer)
    say(logging.WARNING, f"off from episode {episode_num}, {type(trainer).__name__} trains on stock: {why}; "
                         "unset QCA_LOWMEM for it to silence this")
    return trainer.train_episode(episode_num)


_COPY_HOOK = "__reduce_ex__"  # copy.copy, copy.deepcopy and pickle read it off the instance
_TRAINING: set = set()  # id() of the engines an episode of the switch is training on (its forward to its optimizer step)


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


def enable(trainer, *args, **kwargs):
    """Switch a QC_Trainer_v4- or QC_Trainer_v3-style trainer to the low-memory path, in place;
    returns the trainer. Which version it is, is read off its attributes (trainers.py);
    train_episode then keeps that version's episode, return values and bookkeeping. The enabled
    trainer copies and pickles (where the stock one does): a deep copy, or the trainer loaded, trains
    its own model, enabled, and disable() works on it; a CUDA capture is made again by its first episode.
    A shallow copy (copy.copy) runs its own episodes on the engine, optimizer and scaler it shares
    with the original, as the stock copy does; disable() on one of them puts that shared engine
    back, and the other then refuses to train until disable() is called on it too. A value enable()
    reads once (the grid, d_state, use_amp, the engine's memory) changed between episodes: the
    next episode enables it again with the same options, proving the episode anew, said in one line.

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
    state = _enabled(trainer, Options(**{name: value for name, value in arguments.items() if name != "trainer"}))
    say(logging.INFO, f"on, {_summary(state)}")
    return trainer


def _enabled(trainer, given: Options) -> _Saved:
    """enable() with its options bound: the trainer enabled, or refused unchanged; its state."""
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
        undo.pools = fuse_pools_in_place(trainer.motor.operator)
        undo.convs = cast_convs_in_place(trainer.motor.operator)
    if options.channels_last:
        undo.made_channels_last = to_channels_last(trainer.motor.operator)
    undo.installed_step = evolve_step
    state = _Saved(options, version, undo, memory_step=memory_step, fused=fused_of(evolve_step, memory_step),
                   engine_identity=EngineIdentity(trainer.motor, evolve_step, memory_step is not None),
                   edited_episode=edited_episode)
    if state.fused is not None:  # called outside an episode (held from one), the step checks at each call
        state.fused.identity = state.engine_identity
    state.episode_identity = EpisodeIdentity(trainer, unrecorded) if edited_episode is None else None
    _swap_episode(trainer, undo)
    _swap_scaler(trainer, undo, new_scaler)
    state.said.compiled = compiled_module(trainer.motor.operator) is not trainer.motor.operator
    setattr(trainer, _STATE_ATTR, state)
    _park(undo)  # the stand-ins come in at each episode
    return state


def stock_on_refusal(trainer) -> None:
    """The enabled trainer, asked for by QCA_LOWMEM=1 alone, trains on stock from an episode the
    library cannot run (said once) rather than stop."""
    getattr(trainer, _STATE_ATTR).stock_on_refusal = True


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


def _swap_episode(trainer, undo: _Undo):
    undo.had_train_episode_attr = "train_episode" in vars(trainer)
    undo.train_episode = vars(trainer).get("train_episode")
    trainer.train_episode = LowmemEpisode(trainer)
    vars(trainer)[_COPY_HOOK] = _CopyHook(trainer)


def _swap_scaler(trainer, undo: _Undo, new_scaler):
    undo.had_scaler_attr = hasattr(trainer, "scaler")  # a V3 trainer has none
    undo.scaler = getattr(trainer, "scaler", None)
    if new_scaler is not None:
        trainer.scaler = undo.installed_scaler = new_scaler


def disable(trainer):
    """Undo enable(): stock blocks, step, train_episode and scaler (keeping the scaler's state). On
    a shallow copy sharing an engine another trainer's disable() already put back: its own
    train_episode and scaler."""
    state: Optional[_Saved] = getattr(trainer, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("disable(): qca_lowmem is not enabled on this trainer")
    undo = state.undo
    if undo.live and id(undo.motor) in _TRAINING:
        raise RuntimeError("disable(): called while an episode of this trainer (or of one sharing its engine) trains, "
                           "from its loss or a hook: the backward would recompute its steps on other code than they "
                           "ran; call it between episodes")
    # Their scaler back where the trainer still holds the one enable() set (one they set since stays).
    if undo.installed_scaler is not None and getattr(trainer, "scaler", None) is undo.installed_scaler:
        if undo.scaler is not None:
            carry_state(undo.installed_scaler, undo.scaler)
        if undo.had_scaler_attr:
            trainer.scaler = undo.scaler
        else:
            del trainer.scaler
    if undo.live:
        _restore_engine(undo)
        undo.live = False
    vars(trainer).pop(_COPY_HOOK, None)
    if undo.had_train_episode_attr:
        trainer.train_episode = undo.train_episode
    else:
        del trainer.train_episode
    delattr(trainer, _STATE_ATTR)
    return trainer


def _restore_engine(undo: _Undo):
    """The engine's stock blocks, layouts and step."""
    _park(undo)
    layouts_put_back(undo.made_channels_last)
