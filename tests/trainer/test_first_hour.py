"""What a new user meets in the first hour: bench's times and plot, where a run runs, what the
README promises after its two commands (or a line saying what is missing) and --stop-after's way
back."""

import os
import shlex
import subprocess
import sys

import pytest
import torch
import yaml

import qca_lowmem
from qca_lowmem.trainer import bench as bench_mod
from qca_lowmem.trainer import cli, doctor
from qca_lowmem.trainer import config as config_mod

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"model": {"d_state": 2, "hidden": 8}, "training": {"grid": 8, "qca_steps": 4}, "device": "cpu"}


def test_bench_times_no_first_call(tmp_path, monkeypatch):
    """The first run of each kind is a warm-up: the first call of a kind reports 1000 s here."""
    calls = []

    def run(self, variant, steps):
        calls.append(variant)
        return {"bytes": 1, "seconds": 1000.0 if calls.count(variant) == 1 else 1.0}

    monkeypatch.setattr(bench_mod.EpisodeRunner, "run", run)
    config = config_mod.config_from_dict(TINY)
    result = bench_mod.bench(config, [1, 2], str(tmp_path), repeats=2, plot=False)
    assert [r["stock_s"] for r in result["rows"]] == [1.0, 1.0] and [r["lowmem_s"] for r in result["rows"]] == [1.0, 1.0]
    assert calls.count("stock") == 1 + 2 * 2


def test_bench_plot_ticks_are_the_measured_steps():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    result = {"rows": [{"qca_steps": s, "stock_bytes": 10 * s, "lowmem_bytes": 2 * s} for s in (1, 2, 4, 8)],
              "measure": "saved_bytes", "config": {"grid": 8, "d_state": 2, "hidden": 8}, "device": "cpu"}
    for r in result["rows"]:
        r.update(stock_s=0.1 * r["qca_steps"], lowmem_s=0.15 * r["qca_steps"])
    fig = bench_mod.plot_figure(result)
    try:
        memory, time = fig.axes
        assert list(memory.get_xticks()) == [1, 2, 4, 8] and list(time.get_xticks()) == [1, 2, 4, 8]
        assert memory.get_yscale() == "log" and "time" in time.get_ylabel()
    finally:
        plt.close(fig)


def test_bench_per_step_column_is_what_one_more_step_adds(monkeypatch, tmp_path):
    """The README's "stock keeps 56 MiB more per step": the slope between rows, not the average
    (which folds in what does not grow with the steps)."""
    def run(self, variant, steps):
        return {"bytes": (1000 if variant == "stock" else 500) + (56 if variant == "stock" else 1) * steps,
                "seconds": 1.0}

    monkeypatch.setattr(bench_mod.EpisodeRunner, "run", run)
    result = bench_mod.bench(config_mod.config_from_dict(TINY), [1, 2, 4], str(tmp_path), plot=False)
    assert [r["stock_bytes_per_step"] for r in result["rows"]] == [1056, 56, 56]
    assert [r["lowmem_bytes_per_step"] for r in result["rows"]] == [501, 1, 1]
    assert "+step" in bench_mod.format_table(result)


def test_check_says_where_the_run_runs_and_refuses_fp16_on_the_cpu(tmp_path, capsys):
    """fp16 on the CPU: the rule enable() follows too (precision.refuse_fp16_on_cpu)."""
    path = tmp_path / "fp16.yaml"
    path.write_text(yaml.safe_dump({**TINY, "device": "auto", "lowmem": {"amp_dtype": "fp16"}}))
    code = cli.main(["train", "--config", str(path), "--out", str(tmp_path / "run"), "--check"])
    captured = capsys.readouterr()
    if torch.cuda.is_available():
        assert code == 0 and "on cuda:0" in captured.out
    else:
        assert code == 2 and "fp16 on the CPU (amp_dtype fp16) is a GPU setting" in captured.err
        assert "--amp-dtype bf16" in captured.err
    path.write_text(yaml.safe_dump({**TINY, "device": "auto"}))
    assert cli.main(["train", "--config", str(path), "--out", str(tmp_path / "run"), "--check"]) == 0
    if not torch.cuda.is_available():
        assert "on cpu (no CUDA GPU visible)" in capsys.readouterr().out


@pytest.mark.parametrize("cuda_graph", [False, True, None])
def test_bench_runs_lowmem_as_the_trainer_would_with_cuda_graph(cuda_graph):
    """On CUDA with cuda_graph the lowmem rows replay captured steps, one StepGraph for all of
    them (the model is made on the CPU here: only the choice is looked at; channels_last set, as
    its unset rule reads the GPU)."""
    config = config_mod.config_from_dict({**TINY, "cuda_graph": cuda_graph, "channels_last": False})
    model = config_mod.build_model(config, "cpu")
    on_cuda = bench_mod.EpisodeRunner(config, torch.device("cuda"), model=model)
    assert isinstance(on_cuda.lowmem_step, qca_lowmem.StepGraph) == (cuda_graph is not False)
    assert not isinstance(bench_mod.EpisodeRunner(config, torch.device("cpu"), model=model).lowmem_step,
                          qca_lowmem.StepGraph)


def write_tiny(tmp_path, episodes=3):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "episodes": episodes}}))
    return path


def test_without_tensorboard_and_matplotlib_a_line_says_so_once_and_doctor_lists_them(tmp_path, monkeypatch, capsys):
    """A fresh `pip install .` has neither: the run and bench say once what is not written and how
    to get it, and doctor lists both under "to fix"."""
    for module in ("tensorboard", "torch.utils.tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)  # what `import` finds when it is not installed
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(write_tiny(tmp_path)), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"no TensorBoard logs in {out / 'tensorboard'}: tensorboard is not installed "
                     "(pip install tensorboard)") == 1, err
    assert not (out / "tensorboard").exists()

    def run(self, variant, steps):
        return {"bytes": 1, "seconds": 1.0}

    monkeypatch.setattr(bench_mod.EpisodeRunner, "run", run)
    bench_mod.bench(config_mod.config_from_dict(TINY), [1, 2], str(tmp_path / "bench"))
    assert capsys.readouterr().out.count("matplotlib is not installed, so no plot was written (pip install matplotlib") == 1
    assert not list((tmp_path / "bench").glob("*.png"))

    facts, fixes = doctor.report()
    assert dict(facts)["tensorboard"] == "no" and dict(facts)["matplotlib"] == "no"
    assert "pip install tensorboard (TensorBoard logs in each run folder)" in fixes
    assert "pip install matplotlib (bench's plot, bench_<device>.png)" in fixes
    doctor.main_doctor()
    printed = capsys.readouterr().out
    assert printed.index("to fix:") < printed.index("pip install tensorboard")


def test_stop_after_says_it_stopped_early_and_how_to_continue(tmp_path, monkeypatch, capsys):
    """The closing line of a run cut short by --stop-after is not a finished run's, and its command
    (run as printed) finishes the run."""
    monkeypatch.chdir(tmp_path)
    config = write_tiny(tmp_path, episodes=3)
    assert cli.main(["train", "--config", str(config), "--no-progress", "--stop-after", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("qca-lowmem train: stopped early (--stop-after 1) after 1 episodes, at episode 1 of 3")
    command = line.split("; continue with: ")[1]
    assert command == f"qca-lowmem train --config {config} --no-progress --out runs/qca --resume"
    assert cli.main(shlex.split(command)[1:]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("qca-lowmem train: 2 episodes,") and "continue with" not in line
    # the flags a user gave come back, those that would start over or stop again do not
    assert cli.main(["train", "--config", str(config), "--no-progress", "--stop-after=1", "--out", "b", "--overwrite",
                     "--episodes", "2", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"continue with: qca-lowmem train --config {config} --no-progress --episodes 2 --seed 3 --out b --resume")


@pytest.mark.slow
def test_after_the_readme_commands_every_output_it_names_exists(tmp_path):
    """`train` twice (run.sh's job and a second run) and `bench` as processes in a fresh folder,
    with the packages run.sh and test.sh install: each run folder holds metrics.csv, checkpoint.pt
    and TensorBoard's logs, and bench writes its table and plot to bench_results/."""
    pytest.importorskip("tensorboard", reason="scripts/run.sh and scripts/test.sh install tensorboard")
    pytest.importorskip("matplotlib", reason="scripts/run.sh and scripts/test.sh install matplotlib")
    config = str(write_tiny(tmp_path, episodes=2))
    for command in (["train", "--config", config, "--no-progress"], ["train", "--config", config, "--no-progress"],
                    ["bench", "--config", config, "--steps", "1,2"]):
        done = subprocess.run([sys.executable, "-m", "qca_lowmem", *command], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr
        assert "not installed" not in done.stdout + done.stderr
    for run in ("qca", "qca-2"):
        folder = tmp_path / "runs" / run
        assert (folder / "metrics.csv").is_file() and (folder / "checkpoint.pt").is_file()
        assert list((folder / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "bench_results" / "bench_cpu.json").is_file()
    assert (tmp_path / "bench_results" / "bench_cpu.png").stat().st_size > 0
