"""qca_lowmem.enable() on a QC_Trainer_v3-style trainer (qca_lowmem.examples.QC_Trainer_v3): a
batch of 4, the reward loss on (psi0, psi_T), gradient clipping, Adam, the ConvLSTM memory
dropped after each episode, the operator compiled or not. In float64 against the same trainer
without the library: every value train_episode returns, the weights after each episode, the
last gradients and the memory, under every policy; what cannot be reproduced is refused."""

from types import SimpleNamespace

import pytest
import torch

import qca_lowmem
from fixtures.model_families import MEMORY_FAMILIES, make_operator
from qca_lowmem.examples import QC_Trainer_v3, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

D_STATE, HIDDEN, STEPS, EPISODES = 2, 4, 5, 3
POLICIES = {"none": {}, "step": {}, "revolve": {"slots": 2}, "auto-0": {"budget": 0},
            "auto-32KiB": {"budget": 2**15}, "auto-1GiB": {"budget": 2**30}}
FAMILIES = ["unet_groupnorm", "unet_rmsnorm", "mlp", "convlstm"]


def make_trainer(family, compiled=False, steps=STEPS, cls=QC_Trainer_v3, **kw):
    cfg = make_config(grid=8, d_state=D_STATE, hidden=HIDDEN, qca_steps=steps, gamma=0.05, dtype=torch.complex128)
    return cls(cfg, operator=make_operator(family, D_STATE, HIDDEN), memory=family in MEMORY_FAMILIES,
               compile_operator=compiled, lr=1e-2, **kw)


def enable(trainer, policy, **options):
    qca_lowmem.enable(trainer, checkpoint=policy.split("-")[0], **POLICIES[policy], **options)


def run(trainer, episodes=range(EPISODES), seed=99, memory0=None):
    """Per episode: what train_episode returned, the weights and the memory after it; then the
    last gradients. `memory0`: (h, c) on the engine before the first episode."""
    state = trainer.motor.state
    if memory0 is not None:
        state.h_state, state.c_state = (m.clone() for m in memory0)
    torch.manual_seed(seed)
    model = trainer.motor.get_model_for_params()
    per_episode = []
    for e in episodes:
        returned = trainer.train_episode(e)
        per_episode.append((returned, [p.detach().clone() for p in model.parameters()], (state.h_state, state.c_state)))
    return per_episode, [p.grad.clone() for p in model.parameters()]


def relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def assert_same_run(actual, expected, rel=1e-10):
    (episodes, grads), (stock_episodes, stock_grads) = actual, expected
    for e, ((returned, weights, memory), (stock_returned, stock_weights, stock_memory)) in enumerate(
            zip(episodes, stock_episodes, strict=True)):
        assert len(returned) == 4 and all(isinstance(v, float) for v in returned)
        assert returned == pytest.approx(stock_returned, rel=rel, abs=0), f"loss and rewards, episode {e}"
        for i, (w, s) in enumerate(zip(weights, stock_weights, strict=True)):
            assert relative(w, s) <= rel, f"weight {i} after episode {e}"
        assert memory == stock_memory == (None, None), "V3 drops the memory after each episode"
    for i, (g, s) in enumerate(zip(grads, stock_grads, strict=True)):
        assert relative(g, s) <= rel, f"gradient {i}"


_stock_runs = {}


def stock_run(family, compiled=False):
    if (family, compiled) not in _stock_runs:
        _stock_runs[family, compiled] = run(make_trainer(family, compiled))
    return _stock_runs[family, compiled]


@pytest.mark.parametrize("fused_step_ops", [True, False], ids=["fused-step", "engine-step"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_v3_matches_stock(family, policy, fused_step_ops):
    trainer = make_trainer(family)
    enable(trainer, policy, fused_step_ops=fused_step_ops)
    assert_same_run(run(trainer), stock_run(family))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["step", "revolve", "auto-32KiB"])
@pytest.mark.parametrize("family", ["mlp", "convlstm"])
def test_v3_compiled_operator_matches_stock(family, policy, caplog):
    """Their pipeline compiles the operator before building V3: enable() runs the module it wraps,
    the same function, against stock running the compiled one, and says so."""
    trainer = make_trainer(family, compiled=True)
    with caplog.at_level("INFO", logger="qca_lowmem"):
        enable(trainer, policy)
    assert caplog.records[-1].getMessage().endswith(
        "fused step, the compiled operator's module uncompiled, QC_Trainer_v3 episode")
    assert isinstance(trainer.motor.operator, torch._dynamo.eval_frame.OptimizedModule)
    assert_same_run(run(trainer), stock_run(family, compiled=True), rel=1e-9)


def test_v3_compiled_operator_with_the_engine_step_is_refused():
    trainer = make_trainer("mlp", compiled=True)
    with pytest.raises(TypeError, match=r"OptimizedModule \(torch.compile of MLPOperator\) with fused_step_ops=False"):
        qca_lowmem.enable(trainer, fused_step_ops=False)
    assert "train_episode" not in vars(trainer)


def test_v3_memory_found_on_the_engine_is_read_by_the_first_episode():
    """V3 starts an episode from whatever memory the engine holds (an earlier run's), drops it after."""
    memory0 = tuple(torch.randn(4, HIDDEN, 4, 4, dtype=torch.float64) for _ in range(2))
    stock = run(make_trainer("convlstm"), memory0=memory0)
    assert stock[0][0][0] != run(make_trainer("convlstm"))[0][0][0]  # the memory changes the first episode
    trainer = make_trainer("convlstm")
    enable(trainer, "step")
    assert_same_run(run(trainer, memory0=memory0), stock)


class MemoryReward(QC_Trainer_v3):
    """A reward with a term on the engine's memory where it holds one, as a researcher adds one."""

    def compute_reward(self, psi_initial, psi_final):
        total, quietness, complexity = super().compute_reward(psi_initial, psi_final)
        if self.motor.state.h_state is not None:
            total = total + self.motor.state.h_state.abs().mean()
        return total, quietness, complexity


@pytest.mark.parametrize("fused_step_ops", [True, False], ids=["fused-step", "engine-step"])
@pytest.mark.parametrize("policy", ["none", "step"])
def test_v3_reward_finds_the_memory_dropped(policy, fused_step_ops):
    """V3 drops the memory after its steps, before compute_reward: a reward reading it finds none."""
    stock = run(make_trainer("convlstm", cls=MemoryReward))
    trainer = make_trainer("convlstm", cls=MemoryReward)
    enable(trainer, policy, fused_step_ops=fused_step_ops)
    assert_same_run(run(trainer), stock)


def sensitivity_reward(create_graph):
    """A trainer class whose reward adds a term on d(psi_T)/d(psi_initial): their episode's psi_initial
    requires grad, so a researcher's reward may differentiate with respect to it."""
    class SensitivityReward(QC_Trainer_v3):
        def compute_reward(self, psi_initial, psi_final):
            total, quietness, complexity = super().compute_reward(psi_initial, psi_final)
            grad, = torch.autograd.grad((psi_final.abs() ** 3).sum(), psi_initial, retain_graph=True,
                                        create_graph=create_graph)
            return total - grad.abs().pow(2).mean(), quietness, complexity
    return SensitivityReward


@pytest.mark.parametrize("policy", list(POLICIES))
def test_v3_reward_differentiating_with_respect_to_psi_initial(policy):
    stock = run(make_trainer("unet_groupnorm", cls=sensitivity_reward(create_graph=False)))
    trainer = make_trainer("unet_groupnorm", cls=sensitivity_reward(create_graph=False))
    enable(trainer, policy)
    assert_same_run(run(trainer), stock)


@pytest.mark.parametrize("policy", ["none", "step"])
def test_v3_reward_with_a_second_order_term_in_psi_initial(policy):
    """Trains as stock's with plain autograd; a recomputing policy refuses, naming create_graph."""
    trainer = make_trainer("unet_groupnorm", cls=sensitivity_reward(create_graph=True))
    enable(trainer, policy)
    if policy == "none":
        assert_same_run(run(trainer), run(make_trainer("unet_groupnorm", cls=sensitivity_reward(create_graph=True))))
        return
    before = [p.detach().clone() for p in trainer.motor.get_model_for_params().parameters()]
    with pytest.raises(RuntimeError, match=r"checkpoint='step'\): no second-order gradients \(create_graph=True\)"):
        trainer.train_episode(0)
    assert all(torch.equal(p, b) for p, b in zip(trainer.motor.get_model_for_params().parameters(), before))


@pytest.mark.parametrize("gradient_clip", [0.0, 0.05])
def test_v3_clips_at_its_own_gradient_clip(gradient_clip):
    stock = run(make_trainer("unet_groupnorm", gradient_clip=gradient_clip))
    trainer = make_trainer("unet_groupnorm", gradient_clip=gradient_clip)
    enable(trainer, "step")
    assert_same_run(run(trainer), stock)
    assert relative(stock[0][-1][1][0], stock_run("unet_groupnorm")[0][-1][1][0]) > 1e-6  # the clip mattered


def peak_bytes(steps, policy):
    trainer = make_trainer("convlstm", steps=steps)
    if policy is not None:
        enable(trainer, policy)
    torch.manual_seed(0)
    return qca_lowmem.peak_saved_bytes(trainer.train_episode, 0)


def test_v3_episode_memory_is_flat_in_qca_steps():
    """Stock keeps every step's activations; revolve with 2 slots keeps the same bytes however
    long the episode; step keeps one psi (batch of 4, with the memory) per step more."""
    stock = [peak_bytes(steps, None) for steps in (6, 12)]
    revolve = [peak_bytes(steps, "revolve") for steps in (6, 12)]
    step = [peak_bytes(steps, "step") for steps in (6, 12)]
    psi_bytes = 4 * 8 * 8 * D_STATE * 16
    memory_bytes = 2 * 4 * HIDDEN * 4 * 4 * 8
    assert stock[1] - stock[0] > 6 * 4 * (psi_bytes + memory_bytes)  # the measure sees the activations
    assert revolve[1] == revolve[0]
    assert step[1] - step[0] <= 6 * (psi_bytes + memory_bytes)
    assert step[1] < stock[1] / 2


def test_v3_refusals_name_the_cause():
    trainer = make_trainer("mlp")
    trainer.optimizer = None
    with pytest.raises(ValueError, match=r"QC_Trainer_v3\.optimizer is None"):
        qca_lowmem.enable(trainer)
    for option in ({"grid_size": 8}, {"batch_size": 2}):
        with pytest.raises(ValueError, match=r"draws psi0 as motor.get_initial_state\(trainer.batch_size\)"):
            qca_lowmem.enable(make_trainer("mlp"), **option)
    neither = SimpleNamespace(motor=SimpleNamespace(operator=torch.nn.Linear(1, 1)), optimizer=None, qca_steps=2)
    with pytest.raises(TypeError, match=r"SimpleNamespace lacks .*loss_fn.* \(as QC_Trainer_v4\) and "
                                        r".*compute_reward.* \(as QC_Trainer_v3\)"):
        qca_lowmem.enable(neither)


def test_v3_disable_and_config(caplog):
    """enable_from_config reads their experiment config (a SimpleNamespace); disable() leaves the
    trainer stock, with no scaler it never had."""
    trainer = make_trainer("convlstm")
    evolve_step = trainer.motor.evolve_step
    with caplog.at_level("INFO", logger="qca_lowmem"):
        assert qca_lowmem.enable_from_config(trainer, SimpleNamespace(LOWMEM={"enabled": True, "checkpoint": "revolve",
                                                                              "slots": 2}))
    assert [r.getMessage() for r in caplog.records] == [
        "on, checkpoint=revolve slots=2, fp64, fused blocks, fused step, QC_Trainer_v3 episode"]
    first = run(trainer, range(2))
    qca_lowmem.disable(trainer)
    assert "train_episode" not in vars(trainer) and trainer.motor.evolve_step == evolve_step
    assert not hasattr(trainer, "scaler")
    stock = make_trainer("convlstm")
    assert_same_run(first, run(stock, range(2)))
    assert_same_run(run(trainer, range(2, 4), seed=5), run(stock, range(2, 4), seed=5))
