"""`qca-lowmem plan`: its advice runs as printed, it starts from the config's own policy, it
refuses budgets nothing can fit in, and the bundled configs' comments say what it says."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from qca_lowmem.recompute import Policy
from qca_lowmem.recompute.schedule import Auto
from qca_lowmem.trainer import cli
from qca_lowmem.trainer import config as config_mod
from qca_lowmem.trainer.plan import StepMeasure, auto_split, measure_step, plan
from qca_lowmem.units import format_bytes, parse_bytes

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"model": {"d_state": 2, "hidden": 8}, "training": {"grid": 8, "qca_steps": 5, "episodes": 2},
        "device": "cpu"}


def run_cli(*args):
    return cli.main([str(a) for a in args])


def write_config(folder: Path, **lowmem) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "lowmem": lowmem}))
    return path


def recommended_command(out: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith("recommended:"))
    return line.split(" -> ", 1)[1]


def test_the_printed_command_trains_the_planned_config_from_any_folder(tmp_path, monkeypatch, capsys):
    write_config(tmp_path / "configs", checkpoint="step")
    monkeypatch.chdir(tmp_path)
    assert run_cli("plan", "--config", "configs/tiny.yaml", "--hidden", 4, "--gpu-mem", "1GiB") == 0
    command = shlex.split(recommended_command(capsys.readouterr().out))
    assert command[:2] == ["qca-lowmem", "train"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_cli(*command[1:], "--out", elsewhere / "run", "--check") == 0
    checked = capsys.readouterr().out
    assert "grid 8" in checked and "hidden 4" in checked  # the planned model, not the embedded one


@pytest.mark.parametrize("flags", [["--checkpoint", "revolve", "--slots", 3], ["--slots", 3],
                                   ["--amp-dtype", "bf16"], ["--no-fused-blocks", "--channels-last"]])
def test_the_printed_command_trains_the_policy_and_options_plan_was_given(tmp_path, capsys, flags):
    """Where the recommendation is the policy given by flags, the command spells it out (the
    config's own is another); the other options plan was given are in it too."""
    path = write_config(tmp_path, checkpoint="step")
    assert run_cli("plan", "--config", path, *flags, "--gpu-mem", "1GiB") == 0
    out = capsys.readouterr().out
    assert "(config)" in next(line for line in out.splitlines() if line.startswith("lowmem"))
    command = shlex.split(recommended_command(out))
    planned = cli._config(cli.build_parser().parse_args(["plan", "--config", str(path), *map(str, flags),
                                                         "--gpu-mem", "1GiB"]))
    trained = cli._config(cli.build_parser().parse_args(command[1:]))
    fp32_spelt = dataclasses.replace(planned, amp_dtype=planned.amp_dtype or "fp32")  # None and "fp32" alike
    assert trained in (planned, fp32_spelt)


def test_a_bundled_config_is_named_in_the_command():
    assert config_mod.config_reference("small_gpu") == "small_gpu"
    assert config_mod.config_reference("configs/small_gpu.yaml") == str(Path.cwd() / "configs" / "small_gpu.yaml")


def test_the_configs_own_precision_and_policy_come_first(tmp_path, capsys):
    path = write_config(tmp_path, checkpoint="revolve", slots=3, amp_dtype="fp16")
    assert run_cli("plan", "--config", path, "--gpu-mem", "1GiB") == 0
    out = capsys.readouterr().out
    rows = [line.split()[:4] for line in out.splitlines()[2:] if line.startswith("lowmem") and " auto " not in line]
    assert rows[0] == ["lowmem", "revolve", "3", "fp16"] and "(config)" in out.splitlines()[3]
    assert ["lowmem", "step", "fp16"] == rows[2][:3]  # the reduced precision considered is the config's
    assert not any("bf16" in row for row in rows)
    assert recommended_command(out) == f"qca-lowmem train --config {path}"  # the config as it is


def test_a_budget_the_reserve_takes_whole_is_refused_in_one_line(capsys):
    assert run_cli("plan", "--gpu-mem", "300MiB") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--gpu-mem 300MiB is no more than --reserve 0.3GiB, the memory the CUDA context takes." in err
    assert run_cli("plan", "--gpu-mem", "1GiB", "--reserve", "1GiB") == 2


def test_a_config_path_from_another_folder_points_to_the_bundled_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli("train", "--config", "configs/default.yaml", "--check") == 2
    assert "the bundled default config is --config default from any folder" in capsys.readouterr().err


MEMORY = re.compile(r"(\d+(?:\.\d+)?) ?([KMG]i?B)\b")


@pytest.mark.parametrize("name", config_mod.bundled_configs())
def test_every_figure_in_a_bundled_configs_comments_is_plans(name):
    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    comments = " ".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    gpu_mem = re.search(rf"qca-lowmem plan --config {name} --gpu-mem (\S+)", comments)
    assert gpu_mem, f"configs/{name}.yaml: its comment should name the plan command for it"
    budget = parse_bytes(gpu_mem.group(1))
    result = plan(config_mod.load_config(name), budget, parse_bytes("0.3GiB"))
    own = next(e for e in result["estimates"] if e.from_config)
    assert result["recommendation"] is own  # "it fits": the config's own policy is what plan recommends
    planned = {format_bytes(b) for e in result["estimates"]
               for b in (e.peak_bytes, e.model_state_bytes, e.kept_bytes, e.working_bytes)}
    planned.add(format_bytes(budget))
    stated = {f"{number} {unit}" for number, unit in MEMORY.findall(comments.replace(gpu_mem.group(0), ""))}
    assert stated, f"configs/{name}.yaml states no figure"
    assert stated <= planned, f"configs/{name}.yaml: {sorted(stated - planned)} are not plan's figures"
    assert format_bytes(own.peak_bytes) in stated


@pytest.mark.parametrize("cuda_graph", [False, True, None])
def test_the_memory_left_is_offered_to_auto_with_what_it_gives_up(tmp_path, capsys, cuda_graph):
    """auto runs the steps it keeps as plain autograd: with cuda_graph on (unset: on, on the GPU
    planned for), step's captured replays can beat it, so plan does not call auto faster there."""
    path = write_config(tmp_path, checkpoint="step", cuda_graph=cuda_graph)
    assert run_cli("plan", "--config", path, "--gpu-mem", "8GiB") == 0
    advice = next(line for line in capsys.readouterr().out.splitlines() if "the memory left" in line)
    command = shlex.split(advice.split(" -> ", 1)[1])
    assert command[:2] == ["qca-lowmem", "train"] and "--checkpoint" in command and "auto" in command
    if cuda_graph is not False:
        assert not advice.startswith("Faster") and "run without cuda_graph's captured replays" in advice
    else:
        assert advice.startswith("Faster, with the memory left: ")


def test_autocast_weight_copies_are_counted_once_not_per_step(tmp_path):
    """Under autocast a step's graph holds the weights' half-precision copies, made once per
    episode: plan keeps them out of the per-step bytes that "auto" and plain autograd multiply by
    the episode's steps (on an H200 that put "auto bf16" at 3x its measured peak)."""
    config = config_mod.load_config(str(write_config(tmp_path, checkpoint="step")), device="cpu")
    model = config_mod.build_model(config, "cpu")
    half = measure_step(config, "lowmem", torch.bfloat16, model)
    full = measure_step(config, "lowmem", None, model)
    weights = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    assert half.weight_copy_bytes == pytest.approx(2 * weights, rel=0.05)
    assert full.weight_copy_bytes < 0.05 * half.weight_copy_bytes
    assert half.saved_bytes < full.saved_bytes


def test_the_peak_counts_a_captured_steps_pool_where_cuda_graph_runs():
    """cuda_graph unset or true (plan is for a GPU, where it is on): every recomputing policy's
    working set holds a StepGraph's private pool besides the eager step's: one more working set
    and a set of parameter gradients (fp32, and the half copy under autocast). Stock and plain
    autograd capture nothing; cuda_graph false counts no pool."""
    results = {cuda_graph: plan(config_mod.config_from_dict({**TINY, "lowmem": {"cuda_graph": cuda_graph}}),
                                parse_bytes("8GiB"), 0)
               for cuda_graph in (None, True, False)}
    parameters = results[None]["parameters"]
    for on, off in zip(results[None]["estimates"], results[False]["estimates"], strict=True):
        assert off.graph_pool_bytes == 0
        if on.policy is None or not on.policy.recomputes:
            assert on.peak_bytes == off.peak_bytes and on.graph_pool_bytes == 0
            continue
        half = 2 * parameters if on.amp_dtype in ("bf16", "fp16") else 0
        assert on.graph_pool_bytes > 4 * parameters + half
        assert on.working_bytes == off.working_bytes + on.graph_pool_bytes
        # The pool's own segments and its warm-up's share of the margin come on top.
        assert on.margin_bytes > off.margin_bytes
        assert on.peak_bytes >= off.peak_bytes + on.graph_pool_bytes + on.margin_bytes - off.margin_bytes
    assert [e.as_dict() for e in results[True]["estimates"]] == [e.as_dict() for e in results[None]["estimates"]]


def test_auto_keeps_what_the_rollouts_own_schedule_keeps():
    """plan's "auto" row splits its budget as the rollout does: its probe counts a step with the
    weight copies it reaches (under autocast, more than the step's own graph), the probed first
    step is recomputed where a captured step runs, and without one a budget holding every step
    runs plain autograd (on an H200 "auto bf16" kept a third of the graphs plan had assumed)."""
    m = StepMeasure(saved_bytes=1000, largest_bytes=600, weight_copy_bytes=500, activation_sizes=(600, 400),
                    weight_copy_sizes=(500,))
    psi, steps = 10, 6
    counted = m.saved_bytes + m.weight_copy_bytes + psi  # a step as the rollout's probe counts it
    every = Policy.auto(steps * counted)
    assert auto_split(every, steps, psi, m, captured=False) == (steps, steps)
    assert auto_split(every, steps, psi, m, captured=True) == (steps - 1, steps)
    for budget in (steps * psi + 2 * counted, steps * (m.saved_bytes + psi)):
        schedule = Auto.for_bytes(steps, counted, psi, budget, keeps_final_state=True, probed=1)
        assert isinstance(schedule, Auto)
        assert auto_split(Policy.auto(budget), steps, psi, m) == (steps - schedule.graphs_from, steps)


def test_a_model_the_cpu_cannot_hold_to_measure_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("qca_lowmem.trainer.oom.available_cpu_memory", lambda: 2**20)
    assert run_cli("plan", "--hidden", 64, "--gpu-mem", "4GiB") == 2
    err = capsys.readouterr().err
    assert err.startswith("qca-lowmem plan: plan measures a step of the model on the CPU: hidden 64")
    assert err.count("\n") == 1 and "1.00 MiB is available" in err


def test_an_episode_of_ten_billion_steps_is_planned_by_counting_not_listing(capsys):
    """The states an episode keeps are counted by size: planning takes no memory per step."""
    assert run_cli("plan", "--qca-steps", 10**10, "--gpu-mem", "4GiB") == 0
    assert "recommended: lowmem revolve" in capsys.readouterr().out
