"""The episode enable() puts under train_episode: the stock episode of the trainer's version
(trainers.py) rolled out through qca_lowmem.rollout, and what it checks before it draws, calls or
trains anything (`checked_before`, raising episode_refusals' ProofStale or EpisodeRefused, which
the switch acts on). `state` is the switch's record of what enable() decided and changed."""

import contextlib
import logging

import torch

from ..precision import autocast
from ..recompute import rollout
from ..recompute.history_grads import history_grads_guarded
from ..recompute.policy import NONE
from ..recompute.replay import around_each_recompute
from .engine_state import memory_of, put_side_state, side_state_of, store_memory
from .engine_step import EngineMemoryStep, engine_code, live_gamma
from .episode_options import check_reads
from .episode_refusals import EpisodeRefused
from .mask_free_noise import injector_code
from .operator_code import backward_hook_code, refuse_compiled_own_step, unfollowed_code
from .say import say
from .scaler_swap import clip_scaled, scales_for_fp16
from .state_drift import episode_drift
from .user_modules import buffer_bindings, compiled_module, rebind


def checked_before(trainer, state):
    """What the episode checks before it draws, calls or trains anything (the model set to train
    mode, as stock's episode sets it, aside): the engine, what enable() read once, and the step the
    engine runs now. Returns (the model, the engine's own step where that runs now, else None)."""
    _check_engine(trainer, state)
    opts, version = state.options, state.version
    device = next(trainer.motor.operator.parameters()).device
    check_reads(trainer, opts, version, device)  # what enable() read once, as their episode would read it now
    model = version.model(trainer)
    if model is not None:  # as the stock episode: a model left in eval mode (by a visualisation) trains in train mode
        model.train()  # before the verdicts below, which read the layers' modes (a dropout draws in training only)
    own = state.engine_identity.own_step(trainer.motor) if state.engine_identity is not None else None
    if own is not None or state.fused is None:  # the engine's own step: a fallback, or what enable() kept
        refuse_compiled_own_step(trainer.motor.operator, opts.policy.checkpoint != NONE)
    return model, own


def _episode_step(trainer, state, own):
    """The step the episode rolls out: the one enable() installed while the engine's code is the
    one it recognised, else the engine's own (`own`, eager); GAMMA_DECAY pinned for an episode that recomputes."""
    opts = state.options
    if own is not None:
        return EngineMemoryStep(trainer.motor, own) if state.memory_step is not None else own
    if state.fused is not None:
        state.fused.start_episode(live_gamma(trainer.motor) if opts.policy.checkpoint != NONE else None)
    step = state.memory_step or trainer.motor.evolve_step
    if opts.cuda_graph:  # off CUDA a StepGraph is the plain step
        step = state.captures.step(trainer.motor, step)
    return step


def train_episode(trainer, state, episode_num, model, own):
    """train_episode with the stock semantics of the trainer's version (trainers.py), running the
    episode through qca_lowmem.rollout, after checked_before gave (`model`, `own`)."""
    opts, version = state.options, state.version
    operator = trainer.motor.operator
    device = next(operator.parameters()).device
    if opts.fused_step_ops and not state.said.compiled and compiled_module(operator) is not operator:
        state.said.compiled = True
        say(logging.WARNING, f"motor.operator is compiled ({type(operator).__name__}); the fused step runs the "
                             "module it wraps, uncompiled")
    trainer.optimizer.zero_grad()
    psi0 = version.initial_state(trainer, opts, device)
    noise = version.noise(trainer, episode_num, opts.given.noise)
    step = _episode_step(trainer, state, own)
    # The memory the episode starts from: what the engine holds (zeroed by V4's state reset, None after V3's episodes).
    memory = {} if state.memory_step is None else dict(carry=memory_of(trainer.motor))
    left = _Left()
    with _engine_as_stock_leaves_it(trainer, state, own, left):
        with autocast(device.type, opts.amp_dtype):
            psi, history, *carry_T = rollout(step, psi0, trainer.qca_steps, checkpoint=opts.policy, noise=noise,
                                             record_every=version.record_every(trainer), **memory)
            # The engine as the forward's steps leave it, for the loss to read: the memory, the side state.
            memory_T = left.memory_T = carry_T[0] if carry_T else None
            left.forward_done = True
            version.leave_memory(trainer, memory_T)
            side_state_read = left.side_state_read = state.fused.flush() if state.fused is not None else None
            with history_grads_guarded(history, "qca_lowmem", opts.policy.checkpoint):
                loss, details = version.loss(trainer, psi0, psi, history)
        bound = left.bound = buffer_bindings(compiled_module(operator))  # as the forward left them
        # The forward's last step's, as stock leaves it.
        side_state = left.side_state = side_state_of(trainer.motor, copy=opts.cuda_graph)

        # The state the steps' unfollowed code keeps, as the forward left it (the recomputes run it again).
        drift = _step_drift(trainer, state, noise) if opts.policy.checkpoint != NONE else None

        # All of them, as their clipping reads them: a frozen one's gradient left from before counts in the norm.
        parameters = [] if model is None else list(model.parameters())
        scaler = getattr(trainer, "scaler", None)
        scaled = scaler is not None and scaler.is_enabled() and (version.scales(trainer) or scales_for_fp16(opts))
        with around_each_recompute(drift.note_recompute) if drift is not None else contextlib.nullcontext():
            (scaler.scale(loss) if scaled else loss).backward()
    # After the backward, whose recomputes ran the steps again.
    rebind(bound)  # a buffer each recompute bound again (snntorch's membrane): as the forward left it
    put_side_state(trainer.motor, side_state)
    version.leave_memory(trainer, memory_T)
    if side_state_read is not None:
        side_state_read.check()
        side_state_read.release(trainer.motor)
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
    return version.result(trainer, episode_num, loss, details, psi)


class _Left:
    """How far the episode went, for what an exception out of it leaves on the engine."""

    forward_done = False
    memory_T = None  # the memory the forward's last step left
    bound = None  # the buffer bindings the forward left, once read
    side_state = None  # the side state the forward's last step left, once read
    side_state_read = None  # the check on the side state the forward's last step left


@contextlib.contextmanager
def _engine_as_stock_leaves_it(trainer, state, own, left: _Left):
    """On an exception out of the episode's forward or backward (an error, a KeyboardInterrupt): the
    engine's memory, side state and buffer bindings as stock's episode would leave them there, not the rollout's
    (its memory leaves require grad: the next episode's in-place reset would fail)."""
    try:
        yield
    except BaseException:
        motor = trainer.motor
        if left.forward_done:  # the recomputes may have written the engine: the forward's last step's
            state.version.leave_memory(trainer, left.memory_T)
            if left.bound is not None:
                rebind(left.bound)
            if left.side_state is not None:
                put_side_state(motor, left.side_state)
            if left.side_state_read is not None:
                left.side_state_read.release(motor)
        else:
            if state.fused is not None:
                state.fused.write_pending()
            if own is not None or isinstance(state.memory_step, EngineMemoryStep):
                store_memory(motor, memory_of(motor))  # the engine's own step's, or the step's input memory
            elif state.memory_step is not None:  # the fused step carries the memory, not written on the engine
                say(logging.WARNING, f"the episode raised during its steps: {type(motor).__name__}.state's memory is "
                                     "left as the episode found it, where stock's would hold the last step's")
        raise


def _step_drift(trainer, state, noise):
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


def _check_engine(trainer, state):
    """The episode runs on the engine enable() changed, still enabled: a shallow copy of the trainer
    shares it, and may be given another, or see it disabled through the original (or the other way)."""
    if not state.undo.live:
        raise EpisodeRefused("qca_lowmem: disable() was called on a trainer sharing this one's engine (a copy.copy "
                             "of it, or the trainer it was copied from; or one of its episodes enabled it again) and "
                             "put the engine back to stock; call qca_lowmem.disable() on this trainer too, then "
                             "enable() to train it low-memory")
    if trainer.motor is not state.undo.motor:  # enabling it again would put back the engine another may hold
        raise EpisodeRefused(f"qca_lowmem: trainer.motor ({type(trainer.motor).__name__}) is not the engine enable() "
                             "changed (set after enable(), or after copying the trainer): qca_lowmem.disable(trainer), "
                             "then enable(trainer) again")


def _max_norm(trainer, opts, version):
    """The clipping norm, read after the backward as their episodes read it (V3's gradient_clip)."""
    return opts.given.max_grad_norm if opts.given.max_grad_norm is not None else version.max_grad_norm(trainer)


