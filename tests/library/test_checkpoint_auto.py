"""rollout(checkpoint="auto", budget=N): the full graphs of as many last steps as N bytes allow,
"step" before them (revolve when not even that fits); gradients as the full graph's, what is
kept within the budget."""

import pytest
import torch

import qca_lowmem
from helpers import episode, full_step_bytes, initial_state, randomize_affine
from qca_lowmem import rollout, saved_bytes
from qca_lowmem.recompute import Policy, memory, schedule

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 7


def fused_unet_step():
    torch.manual_seed(1)
    unet = randomize_affine(qca_lowmem.UNetUnitary(2, 4)).double()
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.3)
    return list(unet.parameters()), lambda psi: qca_lowmem.qca_update(psi, unet(qca_lowmem.qca_pack(psi)), 0.05)


def weighted_history_loss(psi0, psi_T, history):
    loss, _ = qca_lowmem.stock.evolutionary_loss(history, psi0)
    return loss + sum((h.real * (i + 1)).sum() for i, h in enumerate(history))


def grads(step, params, checkpoint, **options):
    run = episode(step, params, initial_state(), STEPS, weighted_history_loss, checkpoint=checkpoint,
                  noise=qca_lowmem.NoiseSchedule(0.5, 2000, seed=1), record_every=3, **options)
    return run.length, run.grads


def sizes(step):
    psi = initial_state()
    return psi.nbytes, full_step_bytes(step, psi)


def budgets(step):
    """Budgets for: revolve with 2 slots, step only, 3 full graphs, everything full."""
    state, graph = sizes(step)
    return {"revolve": 2 * state, "step": STEPS * state, "3 full": STEPS * state + 3 * (graph - state),
            "all full": STEPS * graph}


@pytest.mark.parametrize("case", ["revolve", "step", "3 full", "all full"])
def test_gradients_equal_the_full_graph(case):
    params, step = fused_unet_step()
    expected_length, expected = grads(step, params, "none")
    budget = budgets(step)[case]
    assert schedule.budget_split(STEPS, *sizes(step), budget) == {
        "revolve": (0, 2), "step": (0, None), "3 full": (3, None), "all full": (STEPS, None)}[case]
    length, got = grads(step, params, "auto", budget=budget)
    assert length == expected_length
    for g, e in zip(got, expected):
        assert ((g - e).abs().max() / e.abs().max()).item() < 1e-12


@pytest.mark.parametrize("short", [0, 1], ids=["every graph fits", "one byte short"])
def test_a_budget_holding_every_graph_is_plain_autograd(short):
    """With every step's full graph within the budget, and a state that needs no gradient, the
    episode is plain autograd from the probe's step on: step_fn runs once a step, nothing is
    recomputed, and the gradients are plain autograd's bit for bit; one byte less, step 0 (the
    probe's, whose graph the budget then does not hold) is recomputed."""
    params, step = fused_unet_step()
    calls = []

    def counted(psi):
        calls.append(1)
        return step(psi)

    def run(**options):
        calls.clear()
        for p in params:
            p.grad = None
        psi0 = initial_state()
        psi_T, history = rollout(counted, psi0, STEPS, noise=qca_lowmem.NoiseSchedule(0.5, 2000, seed=1),
                                 record_every=3, **options)
        weighted_history_loss(psi0, psi_T, history).backward()
        return len(calls), [p.grad for p in params]

    with qca_lowmem.keep_block_intermediates():
        _, expected = run(checkpoint="none")
    budget = budgets(step)["all full"] - short
    n_calls, got = run(checkpoint="auto", budget=budget)
    assert n_calls == STEPS + short
    assert all(torch.equal(g, e) for g, e in zip(got, expected)) or short
    for g, e in zip(got, expected):
        assert ((g - e).abs().max() / e.abs().max()).item() < 1e-12
    assert saved_bytes(lambda: rollout(step, initial_state(), STEPS, checkpoint="auto", budget=budget)) <= budget


def test_what_the_episode_keeps_stays_within_the_budget():
    params, step = fused_unet_step()
    kept = {}
    for case, budget in budgets(step).items():
        psi0 = initial_state().requires_grad_()
        kept[case] = saved_bytes(lambda: rollout(step, psi0, STEPS, checkpoint="auto", budget=budget))
        assert kept[case] <= budget, case
    assert kept["revolve"] < kept["step"] < kept["3 full"] < kept["all full"]


def test_policy_for_budget_keeps_as_many_full_graphs_as_fit():
    for budget in range(0, 400, 7):
        kept, slots = schedule.budget_split(10, 3, 20, budget)
        if budget < 30:
            assert kept == 0 and slots == max(1, budget // 3)
        else:
            assert slots is None and (10 - kept) * 3 + kept * 20 <= budget
            assert kept == 10 or (10 - kept - 1) * 3 + (kept + 1) * 20 > budget


def test_budget_free_reads_the_devices_free_memory(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 11_000)
    assert memory.free_budget(torch.device("cuda", 0), step_bytes=1_000) == 9_000


@pytest.mark.parametrize("fraction, expected", [(1.0, 63_000), (0.5, 48_000), (0.04, 3_000)])
def test_free_memory_counts_the_process_cap_and_the_allocators_unused_blocks(monkeypatch, fraction, expected):
    """A 100 kB card with 60 kB free; this process has 5 kB reserved, 2 kB of them in use. No cap:
    the free 60 kB and the 3 kB reserved but unused. Capped at half (the small-GPU emulation):
    50 kB less the 5 kB reserved, and the 3 kB. Capped below what is reserved: the 3 kB alone."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60_000, 100_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2_000)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])
    assert memory.free_bytes(torch.device("cuda", 0)) == expected
    assert Policy.auto("2KiB").budget == 2048


def segment(device, pool, total, active):
    return dict(device=device, segment_pool_id=pool, total_size=total, allocated_size=active, active_size=active)


def test_free_memory_leaves_out_a_graph_pools_free_blocks(monkeypatch):
    """Of the 5 kB reserved, 2 kB in use: a captured graph's private pool holds a 2.5 kB segment
    with 1 kB in use, so 1.5 kB of the 3 kB unused are the pool's, kept for its replays. The
    default pool's free blocks, and another device's pool, stay counted."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60_000, 100_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2_000)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    segments = [segment(0, (0, 0), 2_500, 1_000), segment(0, (1, 0), 2_500, 1_000), segment(1, (1, 0), 9_000, 0)]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert memory.free_bytes(torch.device("cuda", 0)) == 60_000 + 1_500
    assert memory.private_pool_free_bytes(torch.device("cuda", 1)) == 9_000


@pytest.mark.parametrize("options,message", [
    (dict(checkpoint="auto"), "checkpoint='auto' needs budget"),
    (dict(checkpoint="step", budget=10), "budget applies only to checkpoint='auto'"),
    (dict(checkpoint="auto", budget=-1), "budget must be an int >= 0.*got -1"),
    (dict(checkpoint="auto", budget="lots"), "budget must be a number of bytes.*got 'lots'"),
    (dict(checkpoint="auto", budget=True), "budget must be an int >= 0.*got True"),
    (dict(checkpoint="auto", budget="free"), "budget='free' reads the free memory of a CUDA device.*cpu"),
])
def test_clear_errors(options, message):
    params, step = fused_unet_step()
    with pytest.raises(ValueError, match=message):
        rollout(step, initial_state().requires_grad_(), 3, **options)


def test_an_error_in_the_full_graph_tail_names_the_episodes_step():
    """The tail of full graphs is part of the one episode: its steps keep their numbers."""
    params, step = fused_unet_step()
    budget = budgets(step)["3 full"]  # steps 4, 5, 6 keep their full graphs

    def noise(psi, t):
        return psi[..., :1] if t == 5 else psi

    with pytest.raises(ValueError, match="noise must keep psi's shape.*at step 5 it got"):
        rollout(step, initial_state().requires_grad_(), STEPS, checkpoint="auto", budget=budget, noise=noise)


@pytest.mark.parametrize("case", ["3 full", "all full"])
def test_a_backward_retaining_the_graph_keeps_the_full_graphs(case):
    """A first backward with retain_graph=True (a gradient the loss itself takes) leaves the kept
    full graphs to the next, as plain autograd leaves its graph; one without it frees them."""
    params, step = fused_unet_step()
    psi0 = initial_state()

    def twice(checkpoint, **options):
        for p in params:
            p.grad = None
        psi_T, _ = rollout(step, psi0.clone().requires_grad_(), STEPS, checkpoint=checkpoint, **options)
        loss = psi_T.abs().sum()
        first = torch.autograd.grad(loss, params, retain_graph=True)
        loss.backward()
        return first, [p.grad for p in params], loss

    expected_first, expected = twice("none")[:2]
    first, got, loss = twice("auto", budget=budgets(step)[case])
    for g, e in zip([*first, *got], [*expected_first, *expected]):
        assert ((g - e).abs().max() / e.abs().max()).item() < 1e-12
    with pytest.raises(RuntimeError, match="backward through the graph a second time|full graphs kept .* were freed"):
        loss.backward()


def test_enable_refuses_budget_free_off_cuda():
    trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=3))
    with pytest.raises(ValueError, match=r"enable\(\): budget='free' reads the free memory of a CUDA device.*cpu"):
        qca_lowmem.enable(trainer, checkpoint="auto", budget="free")
    assert not hasattr(trainer, "_qca_lowmem_state")


def test_a_policy_is_normalised_once_and_said_the_same_everywhere():
    auto = Policy.auto("2KiB")
    assert auto == Policy.of("auto", budget=2048) and auto.budget == 2048 and auto.byte_budget == 2048
    assert auto.describe() == "checkpoint=auto budget=2KiB" and auto.label() == "auto"
    assert Policy.auto(3_291_795_274).cli_arguments() == ["--checkpoint", "auto", "--budget", "3.07GiB"]
    assert Policy.auto("3.07GiB").describe() == "checkpoint=auto budget=3.07GiB"  # said as typed
    assert Policy.revolve(8).describe() == "checkpoint=revolve slots=8" and Policy.revolve(8).label() == "revolve 8"
    assert Policy.auto("free").reads_free_memory and Policy.auto("free").byte_budget is None
    for policy in (Policy.every_step(), Policy.revolve(8), Policy.auto("2KiB"), Policy.plain()):
        assert Policy.of(**policy.options()) == policy
    assert Policy.revolve(2).lowered(500) is None and Policy.every_step().lowered(500) == Policy.revolve(32)


# ---------------------------------------------------------------- the trainer, plan and enable()

import csv  # noqa: E402
import json  # noqa: E402

import yaml  # noqa: E402

from qca_lowmem.examples.qc_trainer_v4 import QC_Trainer_v4, make_config  # noqa: E402
from qca_lowmem.trainer import cli  # noqa: E402
from qca_lowmem.trainer.oom import RunPolicy  # noqa: E402

TINY = {"model": {"d_state": 2, "hidden": 8}, "training": {"grid": 8, "qca_steps": 5, "episodes": 2, "seed": 3,
                                                         "max_noise": 1.0}, "device": "cpu"}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def losses(out):
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return [float(r["loss"]) for r in rows], [r["policy"] for r in rows]


def test_train_with_checkpoint_auto_equals_step(tiny_config, tmp_path):
    assert cli.main(["train", "--config", tiny_config, "--out", str(tmp_path / "step"), "--no-progress"]) == 0
    assert cli.main(["train", "--config", tiny_config, "--out", str(tmp_path / "auto"), "--no-progress",
                     "--budget", "1MiB"]) == 0
    (step_losses, _), (auto_losses, policies) = losses(tmp_path / "step"), losses(tmp_path / "auto")
    assert policies == ["checkpoint=auto budget=1MiB batch=1 fp32 channels_last"] * 2
    assert auto_losses == pytest.approx(step_losses, rel=1e-5)


def test_budget_free_on_the_cpu_is_refused_by_name(tiny_config, tmp_path, capsys):
    assert cli.main(["train", "--config", tiny_config, "--out", str(tmp_path / "run"), "--checkpoint", "auto",
                     "--budget", "free"]) == 2
    assert "--budget: budget='free' reads the free memory of a CUDA device, but the device is cpu" in capsys.readouterr().err


def test_oom_guard_lowers_auto_like_step():
    assert RunPolicy(Policy.auto("1MiB"), 2).lowered(48) == RunPolicy(Policy.revolve(12), 2)
    assert RunPolicy(Policy.auto("1MiB"), 1).describe() == "checkpoint=auto budget=1MiB batch=1"


def plan_json(tiny_config, capsys, gpu_mem):
    assert cli.main(["plan", "--config", tiny_config, "--gpu-mem", gpu_mem, "--reserve", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    return result, {e["name"]: e for e in result["estimates"]}


def test_plan_shows_auto_with_what_it_would_keep(tiny_config, capsys):
    """auto's row keeps what the rollout's schedule keeps: one state per step and every step's
    full graph but the first's (probed, then recomputed) when the GPU holds them (its budget every
    step's full graph, not the whole GPU), else what the budget that fills the GPU buys."""
    result, by_name = plan_json(tiny_config, capsys, "1GiB")
    auto, step = by_name["lowmem auto fp32"], by_name["lowmem step fp32"]
    assert result["recommendation"] == "lowmem step fp32"
    steps, psi = TINY["training"]["qca_steps"], 8 * 8 * 2 * 8
    loss_states = step["kept_bytes"] - steps * psi
    whole = steps * auto["full_graph_bytes"]
    activations = auto["full_graph_bytes"] - psi
    assert auto["budget"] == whole
    assert auto["kept_bytes"] == steps * psi + (steps - 1) * activations + loss_states
    assert auto["peak_bytes"] * 1.10 < result["gpu_mem"] / 5  # 1 GiB is far more than it needs

    # A GPU with room for two or three full graphs beyond step's peak: the budget fills it.
    gpu_mem = int((step["peak_bytes"] + 2.5 * activations + 2 * 512 * 64) * 1.10)
    result, by_name = plan_json(tiny_config, capsys, f"{gpu_mem}B")
    auto = by_name["lowmem auto fp32"]
    assert step["kept_bytes"] - loss_states < auto["budget"] < whole
    graphs, rest = divmod(auto["kept_bytes"] - step["kept_bytes"], activations)
    assert 2 <= graphs < steps - 1 and rest == 0
    assert auto["peak_bytes"] * 1.10 <= gpu_mem


def test_enable_with_checkpoint_auto_equals_step():
    results = []
    for options in (dict(checkpoint="step"), dict(checkpoint="auto", budget=10**8)):
        torch.manual_seed(1234)
        trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=4))
        qca_lowmem.enable(trainer, **options)
        torch.manual_seed(99)
        results.append(trainer.train_episode(0)[0])
    assert results[1] == pytest.approx(results[0], rel=1e-5)


def test_bench_command_runs_checkpoint_auto(tiny_config, tmp_path, capsys):
    assert cli.main(["bench", "--config", tiny_config, "--steps", "2", "--budget", "1MiB", "--out",
                     str(tmp_path / "bench")]) == 0
    assert "checkpoint=auto" in capsys.readouterr().out
