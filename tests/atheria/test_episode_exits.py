"""An episode that does not end as it should (an error from the loss, a KeyboardInterrupt from a hook
in the forward or the backward, disable() called from inside it): the engine left as stock's
episode would leave it there (its memory the last step's, never the rollout's tensors requiring
grad), so the next episode gives stock's answer; where the fused step kept the memory off the
engine, said. disable() inside an episode refuses, naming it."""

import copy

import pytest
import torch

import qca_lowmem
from fixtures.model_families import make_operator, make_trainer, relative
from qca_lowmem.atheria import switch
from qca_lowmem.examples import QC_Trainer_v3, make_config

pytestmark = pytest.mark.usefixtures("one_thread")


def v3_with_memory():
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=4, gamma=0.05, dtype=torch.complex128)
    return QC_Trainer_v3(cfg, operator=make_operator("convlstm", 2, 4), memory=True, batch_size=2)


TRAINERS = {"v4": lambda: make_trainer("convlstm"), "v3": v3_with_memory}


def memory(trainer):
    state = trainer.motor.state
    return [m for m in (state.h_state, state.c_state) if m is not None]


def run(trainer, episodes):
    """The losses, then every weight and gradient after the episodes."""
    torch.manual_seed(99)
    losses = [trainer.train_episode(e)[0] for e in episodes]
    return losses, [t.detach().clone() for p in trainer.motor.operator.parameters() for t in (p, p.grad)]


def assert_same_run(actual, expected):
    assert actual[0] == pytest.approx(expected[0], rel=1e-10, abs=0)
    assert max(relative(a, e) for a, e in zip(actual[1], expected[1], strict=True)) <= 1e-10


def loss_raising(trainer):
    """The trainer's loss raising once, after the episode's forward."""
    version_loss = "loss_fn" if hasattr(trainer, "loss_fn") else "compute_reward"
    own, raised = getattr(trainer, version_loss), []

    def loss(*args, **kwargs):
        if not raised:
            raised.append(None)
            raise ValueError("their loss failed")
        return own(*args, **kwargs)
    setattr(trainer, version_loss, loss)


def backward_interrupted(trainer):
    """A KeyboardInterrupt from a parameter's hook, in the episode's backward (after its recomputes began)."""
    weight = trainer.motor.operator.inc.conv_block[0].weight
    handle = []

    def hook(grad):
        handle.pop().remove()
        raise KeyboardInterrupt("stopped in the backward")
    handle.append(weight.register_hook(hook))


def forward_interrupted(trainer):
    """A KeyboardInterrupt from a forward hook at the operator's third call (their step then runs)."""
    calls, handle = [], []

    def hook(module, args, out):
        calls.append(None)
        if len(calls) == 3:
            handle.pop().remove()
            raise KeyboardInterrupt("stopped in the forward")
    handle.append(trainer.motor.operator.register_forward_hook(hook))


EXITS = {"loss": (loss_raising, ValueError), "backward": (backward_interrupted, KeyboardInterrupt),
         "forward": (forward_interrupted, KeyboardInterrupt)}


@pytest.mark.parametrize("options", [{}, dict(fused_step_ops=False)], ids=["fused", "own_step"])
@pytest.mark.parametrize("exit_", EXITS)
@pytest.mark.parametrize("version", TRAINERS)
def test_the_episode_after_one_that_raised_is_stocks(version, exit_, options):
    make_exit, raised = EXITS[exit_]
    runs = []
    for enabled in (False, True):
        torch.manual_seed(0)
        trainer = TRAINERS[version]()
        if enabled:
            qca_lowmem.enable(trainer, checkpoint="step", **options)
        run(trainer, range(1))
        make_exit(trainer)
        with pytest.raises(raised):
            trainer.train_episode(1)
        left = memory(trainer)
        assert not any(m.requires_grad for m in left)
        runs.append((left, run(trainer, range(2, 4))))
    (stock_left, stock_run), (left, lowmem_run) = runs
    assert len(left) == len(stock_left) and all(relative(m, s) <= 1e-12 for m, s in zip(left, stock_left))
    assert_same_run(lowmem_run, stock_run)
    assert "evolve_step" not in vars(trainer.motor)


def test_the_fused_step_interrupted_in_its_forward_says_the_memory_it_left(caplog):
    """The fused step carries the memory through the rollout, not on the engine: a forward stopped
    midway leaves the engine's memory as the episode found it, where stock's holds the last
    step's; said in one line (V4's next episode resets it, V3's starts from it)."""
    trainer = v3_with_memory()
    qca_lowmem.enable(trainer, checkpoint="step")
    run(trainer, range(1))
    engine_class = type(trainer.motor)
    calls = []

    def gamma_interrupted(motor):
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt("stopped in the forward")
        return 0.05
    with pytest.MonkeyPatch.context() as patch, caplog.at_level("WARNING", logger="qca_lowmem"):
        patch.setattr("qca_lowmem.atheria.engine_step.live_gamma", gamma_interrupted)
        with pytest.raises(KeyboardInterrupt):
            trainer.train_episode(1)
    assert f"{engine_class.__name__}.state's memory is left as the episode found it" in caplog.text


@pytest.mark.parametrize("version", TRAINERS)
def test_disable_from_inside_an_episode_refuses_naming_it(version):
    """Its backward would recompute the steps on their code, not the one they ran: the episode
    stops there, trains nothing, and the trainer stays enabled, its engine theirs."""
    trainer = TRAINERS[version]()
    qca_lowmem.enable(trainer)
    loss_name = "loss_fn" if hasattr(trainer, "loss_fn") else "compute_reward"
    own = getattr(trainer, loss_name)

    def loss(*args, **kwargs):
        qca_lowmem.disable(trainer)
        return own(*args, **kwargs)
    setattr(trainer, loss_name, loss)
    before = [p.detach().clone() for p in trainer.motor.operator.parameters()]
    with pytest.raises(RuntimeError, match="disable\\(\\): called while an episode of this trainer"):
        trainer.train_episode(0)
    assert all(torch.equal(p, b) for p, b in zip(trainer.motor.operator.parameters(), before))
    assert hasattr(trainer, "_qca_lowmem_state") and "evolve_step" not in vars(trainer.motor)
    setattr(trainer, loss_name, own)
    qca_lowmem.disable(trainer)  # between episodes
    trainer.train_episode(1)


def test_a_copy_of_the_engine_made_inside_an_episode_is_in_none():
    """A deep copy of the engine taken inside an episode (from the loss) holds the installed step;
    that step's copy checks the engine and writes at each call, as outside an episode."""
    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer)
    own, copies = trainer.loss_fn, []

    def loss(*args, **kwargs):
        copies.append(copy.deepcopy(trainer.motor))
        return own(*args, **kwargs)
    trainer.loss_fn = loss
    trainer.train_episode(0)
    step = vars(copies[0])["evolve_step"]
    assert (step.in_episode, step.deferred, step.pending, step.fixed_gamma) == (False, False, None, None)
    psi = torch.randn(1, 8, 8, 2, dtype=torch.complex128)
    assert torch.allclose(step(psi), copies[0].evolve_step(psi)) and step.motor is copies[0]


def test_an_episode_called_from_another_on_its_engine_refuses_naming_it():
    """A trainer sharing the engine (a copy.copy) trained from inside an episode: its steps would
    leave the engine other than the outer episode's backward recomputes them on."""
    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer)
    inner, own = copy.copy(trainer), trainer.loss_fn

    def loss(*args, **kwargs):
        inner.train_episode(7)
        return own(*args, **kwargs)
    trainer.loss_fn = loss
    with pytest.raises(RuntimeError, match=r"an episode on this engine \(Motor\) is training, and this one was called"):
        trainer.train_episode(0)
    trainer.loss_fn = own
    trainer.train_episode(1)
    inner.train_episode(2)
    assert "evolve_step" not in vars(trainer.motor)


@pytest.mark.parametrize("interrupted", ["fuse_pools", "put_back"])
def test_a_ctrl_c_while_the_stand_ins_come_or_go_leaves_the_rest_theirs(interrupted, monkeypatch):
    """Interrupted as the episode gives its stand-ins (at its start) or takes them back (at its
    end): the engine's step and every layer the interrupt did not stop are theirs after it."""
    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer)
    theirs = [type(m) for m in trainer.motor.operator.modules()]
    real = getattr(switch, interrupted)

    def interrupting(*args):
        monkeypatch.setattr(switch, interrupted, real)
        raise KeyboardInterrupt("Ctrl-C")
    monkeypatch.setattr(switch, interrupted, interrupting)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_episode(0)
    assert "evolve_step" not in vars(trainer.motor)
    left = [(type(m), cls) for m, cls in zip(trainer.motor.operator.modules(), theirs) if type(m) is not cls]
    if interrupted == "fuse_pools":
        assert left == []
    else:  # the blocks' put_back was the part interrupted: they come back at the next episode's end
        assert left and all(cls.__name__ == "ConvBlock" for _, cls in left)
    trainer.train_episode(1)
    assert [type(m) for m in trainer.motor.operator.modules()] == theirs
