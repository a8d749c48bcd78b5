"""train_episode, and the engine's step the switch installed, called under a context of the
caller's: a torch function or dispatch mode of theirs (which sees each op run) or a saved-tensors
hook (which sees what autograd saves). Their episode runs its ops and saves its tensors under it;
the lowmem episode runs and saves others (its fused ops, its recomputes, one psi a step), so under
one that changes values (a convolution's output bent, what is saved rounded through bfloat16) its
result would differ: the episode is refused before it trains, naming it, and the installed step
runs the engine's own. torch's own (save_on_cpu, a default device) keep the lowmem episode."""

import pytest
import torch

import qca_lowmem
from fixtures.switch_oracle import first_difference, is_clear
from fixtures.switch_variants import (
    CALLER_CONTEXTS,
    POLICIES,
    TRAINERS,
    VALUE_KEEPING_CONTEXTS,
    Variant,
    build,
    caller_context,
    outcome,
    switch_on,
)
from qca_lowmem import stock as R

pytestmark = pytest.mark.usefixtures("one_thread")

CHANGING = [name for name in sorted(CALLER_CONTEXTS) if name not in VALUE_KEEPING_CONTEXTS]
NAMED = {"rounding": "_through_bf16", "dispatch_mode": "BendConvolutions", "function_mode": "BendConv2d"}


def installed_step(trainer):
    """The fused step the switch puts on the engine while an episode runs."""
    step = trainer._qca_lowmem_state.undo.installed_step
    assert type(step).__module__.startswith("qca_lowmem")
    return step


def model_of(trainer):
    return trainer.motor.operator if hasattr(trainer, "loss_fn") else trainer.motor.get_model_for_params()


@pytest.mark.parametrize("context", CHANGING)
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("version", ["v4", "v3"])
def test_an_episode_under_a_value_changing_context_is_refused_before_it_trains(version, policy, context):
    variant = Variant(version=version, policy=policy)
    trainer = build(variant, TRAINERS[version])
    switch_on(trainer, variant)
    before = {name: p.detach().clone() for name, p in model_of(trainer).named_parameters()}
    with caller_context(Variant(caller_context=context)), pytest.raises(RuntimeError) as refused:
        trainer.train_episode(0)
    assert is_clear(refused.value) and NAMED[context] in str(refused.value)
    assert all(torch.equal(p, before[name]) and p.grad is None for name, p in model_of(trainer).named_parameters())
    trainer.train_episode(1)  # outside it, it trains
    assert any(not torch.equal(p, before[name]) for name, p in model_of(trainer).named_parameters())


@pytest.mark.parametrize("context", VALUE_KEEPING_CONTEXTS)
@pytest.mark.parametrize("policy", ["none", "step", "revolve1", "auto_all"])
@pytest.mark.parametrize("version", ["v4", "v3"])
def test_an_episode_under_torchs_own_context_runs_lowmem_and_gives_stocks_result(version, policy, context):
    variant = Variant(version=version, policy=policy, caller_context=context)
    got = outcome(variant, True)
    assert got.error is None and len(got.episodes) == 2
    assert first_difference(got, outcome(variant, False)) is None


@pytest.mark.parametrize("context", CHANGING)
def test_the_installed_step_under_the_context_outside_episodes_is_the_engines_own(context):
    """Their inference or analysis code calling the engine's step with grad under the context gets
    the engine's own step, bitwise: between episodes the engine holds no other, and the installed
    step called outside one (held from an episode) runs the engine's own."""
    stock, lowmem = build(Variant(), TRAINERS["v4"]), build(Variant(), TRAINERS["v4"])
    qca_lowmem.enable(lowmem)
    assert "evolve_step" not in vars(lowmem.motor)
    psi = R.initial_state(2, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(5))
    runs = []
    for trainer, step in ((stock, stock.motor.evolve_step), (lowmem, lowmem.motor.evolve_step),
                          (lowmem, installed_step(lowmem))):
        with caller_context(Variant(caller_context=context)):
            out = step(psi)
            params = list(trainer.motor.operator.parameters())
            runs.append((out.detach(), torch.autograd.grad(out.abs().square().sum(), params)))
    (out_stock, grads_stock), *lowmem_runs = runs
    for out_lowmem, grads_lowmem in lowmem_runs:
        assert torch.equal(out_lowmem, out_stock)
        assert all(torch.equal(a, b) for a, b in zip(grads_lowmem, grads_stock))


@pytest.mark.parametrize("transform", ["jacrev", "vmap"])
@pytest.mark.parametrize("version", ["v4", "v3"])
def test_the_installed_step_under_a_torch_func_transform_is_the_engines_own(version, transform):
    """A researcher's torch.func analysis of their engine's step (its Jacobian for a unitarity
    check, a vmap over states) after enable(): the installed step runs the engine's own and the
    operator its stock layers, so it gives stock's result, bitwise (it raised: the fused ops have
    no rule for a transform); an episode then still trains on the fused step."""
    stock, lowmem = build(Variant(version=version), TRAINERS[version]), build(Variant(version=version), TRAINERS[version])
    qca_lowmem.enable(lowmem)
    psi = R.initial_state(2, 8, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(5))

    def analysed(evolve_step):
        def step(x):
            return torch.view_as_real(evolve_step(torch.view_as_complex(x)))
        x = torch.view_as_real(psi).contiguous()
        return torch.func.jacrev(step)(x[:1]) if transform == "jacrev" else torch.func.vmap(step)(x.unsqueeze(1))
    expected = analysed(stock.motor.evolve_step)
    assert torch.equal(analysed(lowmem.motor.evolve_step), expected)
    assert torch.equal(analysed(installed_step(lowmem)), expected)
    assert first_difference(outcome(Variant(version=version), True), outcome(Variant(version=version), False)) is None
