"""The reference trainer and the qca-lowmem CLI on tiny CPU configs."""

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import qca_lowmem
from helpers import cuda_only
from qca_lowmem.recompute import Policy
from qca_lowmem.trainer import cli
from qca_lowmem.trainer import config as config_mod
from qca_lowmem.trainer import train as train_mod
from qca_lowmem.trainer.checkpoint import atomic_save
from qca_lowmem.trainer.errors import UsageError
from qca_lowmem.trainer.footprint import LOSS_STATES
from qca_lowmem.trainer.oom import EXIT_OOM, RunPolicy
from qca_lowmem.trainer.plan import Estimate, recommend
from qca_lowmem.units import parse_bytes

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = {
    "model": {"d_state": 2, "hidden": 8},
    # max_noise 1.0: the curriculum's rate passes the stock threshold at episode 3, so noise is on there.
    "training": {"grid": 8, "qca_steps": 5, "episodes": 4, "seed": 3, "max_noise": 1.0},
    "lowmem": {"checkpoint": "step"},
    "output": {"save_every": 2},
    "device": "cpu",
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def run_cli(*args):
    return cli.main([str(a) for a in args])


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_params(path):
    return torch.load(path, weights_only=False)["model_state_dict"]


def test_train_writes_csv_and_checkpoint(tiny_config, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", "--config", tiny_config, "--out", out, "--no-progress") == 0
    rows = read_csv(out / "metrics.csv")
    assert [int(r["episode"]) for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert float(r["loss"]) == float(r["loss"])  # finite, not NaN
        assert int(r["saved_bytes"]) > 0 and float(r["seconds"]) > 0
        assert r["policy"] == "checkpoint=step batch=1 fp32 channels_last"
        assert {"survival", "symmetry", "complexity"} <= set(r)
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["episode"] == 4
    assert {"model_state_dict", "optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict",
            "rng_state", "policy", "config"} <= set(state)
    assert "inc.conv_block.0.weight" in state["model_state_dict"]  # stock state_dict keys
    assert len(state["optimizer_state_dict"]["state"]) == len(state["model_state_dict"])
    assert "last loss" in capsys.readouterr().out


def test_a_checkpoint_written_before_the_layers_moved_still_resumes(tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "pre_layout_run"
    config = config_mod.load_config(str(fixture / "tiny.yaml"), out_dir=str(tmp_path / "old"))
    saved = torch.load(fixture / "checkpoint.pt", weights_only=False)
    trainer = train_mod.Trainer(config, progress=False)
    assert trainer.load_checkpoint(fixture / "checkpoint.pt") == 2
    assert all(torch.equal(v, saved["model_state_dict"][k]) for k, v in trainer.model.state_dict().items())
    moments = trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], s["exp_avg"]) for i, s in saved["optimizer_state_dict"]["state"].items())

    old = tmp_path / "old"
    old.mkdir()
    for name in ("checkpoint.pt", "metrics.csv"):
        (old / name).write_bytes((fixture / name).read_bytes())
    assert run_cli("train", "--config", fixture / "tiny.yaml", "--out", old, "--resume", "--no-progress") == 0
    assert [r["episode"] for r in read_csv(old / "metrics.csv")] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("scheduler", ["none", "cosine"])
def test_resume_continues_exactly(tmp_path, scheduler):
    tiny_config = tmp_path / "tiny.yaml"
    tiny_config.write_text(yaml.safe_dump({**TINY, "training": {**TINY["training"], "scheduler": scheduler}}))
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_cli("train", "--config", tiny_config, "--out", full, "--no-progress") == 0
    assert run_cli("train", "--config", tiny_config, "--out", split, "--stop-after", 2, "--no-progress") == 0
    assert torch.load(split / "checkpoint.pt", weights_only=False)["episode"] == 2
    assert run_cli("train", "--config", tiny_config, "--out", split, "--resume", "--no-progress") == 0
    full_rows, split_rows = read_csv(full / "metrics.csv"), read_csv(split / "metrics.csv")
    assert [r["episode"] for r in split_rows] == ["0", "1", "2", "3"]
    assert [r["loss"] for r in split_rows] == [r["loss"] for r in full_rows]
    a, b = load_params(full / "checkpoint.pt"), load_params(split / "checkpoint.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(split / "checkpoint.pt", weights_only=False)
    assert (state["scheduler_state_dict"] is not None) == (scheduler == "cosine")


def test_resume_refuses_a_different_model(tiny_config, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", "--config", tiny_config, "--out", out, "--episodes", 1, "--no-progress") == 0
    assert run_cli("train", "--config", tiny_config, "--out", out, "--hidden", 16, "--resume", "--no-progress") == 2
    assert "a resume cannot change hidden (checkpoint 8, now 16)" in capsys.readouterr().err


# What CUDA raises, and what the CPU allocator raises (a plain RuntimeError).
OUT_OF_MEMORY = {
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)"),
    "cpu": lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                "memory: you tried to allocate 140737488355328 bytes. Error code 12 (injected)"),
}


def _inject_oom(monkeypatch, when, kind="cuda"):
    original = train_mod.Trainer.forward_episode
    calls = []

    def forward_episode(self, episode, policy):
        if (episode, policy.describe()) not in calls:  # the CPU memory measure runs a forward too
            calls.append((episode, policy.describe()))
        if when(episode, policy):
            raise OUT_OF_MEMORY[kind]()
        return original(self, episode, policy)

    monkeypatch.setattr(train_mod.Trainer, "forward_episode", forward_episode)
    return calls


def test_oom_guard_lowers_the_policy_and_continues(tiny_config, tmp_path, monkeypatch, capsys):
    reference = tmp_path / "reference"
    assert run_cli("train", "--config", tiny_config, "--out", reference, "--no-progress") == 0
    calls = _inject_oom(monkeypatch, lambda episode, run: episode >= 1 and run.policy == Policy.every_step())
    out = tmp_path / "run"
    assert run_cli("train", "--config", tiny_config, "--out", out, "--no-progress") == 0
    assert calls[:3] == [(0, "checkpoint=step batch=1"), (1, "checkpoint=step batch=1"),
                         (1, "checkpoint=revolve slots=1 batch=1")]
    assert "out of memory at episode 1" in capsys.readouterr().err
    rows = read_csv(out / "metrics.csv")
    assert [r["policy"] for r in rows] == [f"checkpoint={policy} batch=1 fp32 channels_last"
                                           for policy in ["step"] + ["revolve slots=1"] * 3]
    # The retried episodes are the same episodes: revolve gives stock gradients, so the same losses.
    for r, ref in zip(rows, read_csv(reference / "metrics.csv")):
        assert float(r["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-5)
    assert torch.load(out / "checkpoint.pt", weights_only=False)["policy"]["checkpoint"] == "revolve"


@pytest.mark.parametrize("kind", OUT_OF_MEMORY)
def test_oom_guard_saves_and_explains_when_nothing_fits(tiny_config, tmp_path, monkeypatch, capsys, kind):
    calls = _inject_oom(monkeypatch, lambda episode, policy: episode >= 2, kind)
    out = tmp_path / "run"
    status = run_cli("train", "--config", tiny_config, "--out", out, "--batch", 2, "--no-progress")
    assert status == EXIT_OOM
    tried = [p for e, p in calls if e == 2]
    assert tried == ["checkpoint=step batch=2", "checkpoint=revolve slots=1 batch=2", "checkpoint=revolve slots=1 batch=1"]
    err = capsys.readouterr().err
    assert "out of memory at episode 2" in err and f"--resume {out / 'checkpoint.pt'}" in err
    assert "--amp-dtype bf16" in err
    assert "plan --gpu-mem" not in err  # a CPU run: plan predicts GPU memory
    assert "Episodes 0-1 are saved in" in err and "continues at episode 2" in err
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["episode"] == 2  # no progress lost: episodes 0 and 1 are in it


def test_oom_in_the_optimizer_step_stops_with_an_explanation(tiny_config, tmp_path, monkeypatch, capsys):
    def step(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert run_cli("train", "--config", tiny_config, "--out", tmp_path / "run", "--no-progress") == EXIT_OOM
    err = capsys.readouterr().err
    assert "out of memory in the optimizer step after episode 0" in err and "AdamW moments" in err
    assert "plan --gpu-mem" not in err and "other processes on this machine" in err  # a CPU run


def test_policy_lowering_chain():
    policy = RunPolicy(Policy.every_step(), 4)
    chain = []
    while policy is not None:
        chain.append(policy.describe())
        policy = policy.lowered(qca_steps=500)
    assert chain == ["checkpoint=step batch=4", "checkpoint=revolve slots=32 batch=4", "checkpoint=revolve slots=8 batch=4",
                     "checkpoint=revolve slots=2 batch=4", "checkpoint=revolve slots=2 batch=2",
                     "checkpoint=revolve slots=2 batch=1"]


def test_atomic_checkpoint_survives_a_failed_save(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    atomic_save({"episode": 1, "weights": torch.arange(5.0)}, path)

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"partial garbage")
        raise OSError("disk full (injected)")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"episode": 2, "weights": torch.zeros(5)}, path)
    monkeypatch.undo()
    state = torch.load(path)
    assert state["episode"] == 1 and torch.equal(state["weights"], torch.arange(5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary left behind


@pytest.mark.slow
def test_ddp_two_cpu_processes_equal_a_single_process(tiny_config, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "qca_lowmem", "train", "--ddp", "--config", tiny_config, "--out", str(ddp), "--no-progress"]
    # Own session, so a hang kills the workers too rather than leaving them behind.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-3000:]
    assert run_cli("train", "--config", tiny_config, "--out", single, "--accumulate", 2, "--no-progress") == 0

    check = json.loads((ddp / "ddp_check.json").read_text())
    assert check == {"world_size": 2, "max_param_difference": 0.0}  # both ranks hold the same parameters
    a, b = load_params(ddp / "checkpoint.pt"), load_params(single / "checkpoint.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # 2 ranks == 1 process accumulating 2 episodes, bit for bit
    assert [r["loss"] for r in read_csv(ddp / "metrics.csv")] == [r["loss"] for r in read_csv(single / "metrics.csv")]


THREADS_AFTER_CLOSE = """
import os, socket, time
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from qca_lowmem.trainer.config import TrainConfig, parameter_count
from qca_lowmem.trainer.distributed import Distributed

def thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended between the listing and the read
            pass
    return sorted(names)

before = thread_names()
group = Distributed(True, "cpu")
parameter_count(TrainConfig())  # check_run's meta-device model: its imports reach torch.distributed.nn
group.close()
# A joined thread's /proc entry can outlast pthread_join by a moment (the kernel wakes the joiner
# before it reaps the task), so wait for it; a thread of a group still held never goes.
deadline = time.monotonic() + 30
while thread_names() != before and time.monotonic() < deadline:
    time.sleep(0.05)
print(" ".join(before), "|", " ".join(thread_names()))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names in /proc")
def test_closing_the_process_group_leaves_no_gloo_threads():
    """The cause of the two-rank test's rare abort at exit: gloo threads kept alive past
    destroy_process_group (a module imported after init_process_group held the group) ran into
    interpreter shutdown. Deterministic, where the abort needs an unlucky schedule."""
    result = subprocess.run([sys.executable, "-c", THREADS_AFTER_CLOSE], capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = (part.split() for part in result.stdout.split("|"))
    assert after == before, f"threads outlive the closed process group: {after} (before the group: {before})"


def test_bench_writes_json_and_plot(tiny_config, tmp_path, capsys):
    out = tmp_path / "bench"
    assert run_cli("bench", "--config", tiny_config, "--steps", "2,8", "--out", out) == 0
    result = json.loads((out / "bench_cpu.json").read_text())
    assert result["kind"] == "bench" and result["measure"] == "saved_bytes"
    assert [r["qca_steps"] for r in result["rows"]] == [2, 8]
    short, long = result["rows"]
    # stock keeps every step's activations; step recompute keeps one psi per step
    assert long["stock_bytes"] > 3 * short["stock_bytes"]
    assert long["lowmem_bytes"] < long["stock_bytes"] / 4
    printed = capsys.readouterr().out
    assert "qca_steps" in printed and "bench_cpu.json" in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench_cpu.png").stat().st_size > 0


def test_plan_predicts_and_recommends(tiny_config, tmp_path, capsys):
    assert run_cli("plan", "--config", tiny_config, "--gpu-mem", "1GiB", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommendation"] == "lowmem step fp32"  # the most faithful policy, when it fits
    by_name = {e["name"]: e for e in result["estimates"]}
    stock, step = by_name["stock (for reference)"], by_name["lowmem step fp32"]
    params = result["parameters"]
    assert stock["model_state_bytes"] == step["model_state_bytes"] == 16 * params
    psi = 8 * 8 * 2 * 8
    assert step["kept_bytes"] == (5 + LOSS_STATES) * psi
    assert stock["kept_bytes"] > step["kept_bytes"]
    # The kept-state prediction against what a real episode's graph keeps (saved_bytes, CPU).
    for name, policy in (("lowmem step fp32", RunPolicy(Policy.every_step(), 1)),
                         ("stock (for reference)", None)):
        config = config_mod.load_config(tiny_config, out_dir=str(tmp_path))
        if policy is None:
            from qca_lowmem.trainer.bench import EpisodeRunner

            runner = EpisodeRunner(config, torch.device("cpu"))
            measured = qca_lowmem.saved_bytes(runner.episode_loss, "stock", config.qca_steps,
                                              train_mod.Trainer(config, progress=False).initial_state(0, 1))
        else:
            measured = qca_lowmem.saved_bytes(train_mod.Trainer(config, progress=False).forward_episode, 0, policy)
        assert abs(by_name[name]["kept_bytes"] / measured - 1) < 0.15, (name, by_name[name]["kept_bytes"], measured)
    # Nothing fits in less than the model state: exit 1 with advice.
    assert run_cli("plan", "--config", tiny_config, "--gpu-mem", f"{16 * params}B", "--reserve", "0") == 1
    assert "Nothing fits in the " in capsys.readouterr().out


def _estimate(name, policy, peak):
    return Estimate(name, policy, None, model_state_bytes=peak, kept_bytes=0, working_bytes=0)


def test_recommend_takes_the_first_policy_that_fits_with_margin():
    estimates = [_estimate("stock", None, 10), _estimate("step fp32", Policy.every_step(), 5000),
                 _estimate("step bf16", Policy.every_step(), 1000), _estimate("revolve", Policy.revolve(8), 500)]
    assert recommend(estimates, gpu_mem=10_000, reserve=0).name == "step fp32"  # stock is never recommended
    assert recommend(estimates, gpu_mem=5400, reserve=0).name == "step bf16"  # 5000 * 1.1 > 5400
    assert recommend(estimates, gpu_mem=1500, reserve=500).name == "revolve"
    assert recommend(estimates, gpu_mem=500, reserve=0) is None


def test_doctor_runs(capsys):
    assert run_cli("doctor") == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out.replace("  ", " ") or torch.__version__ in out
    assert "_C has CUDA kernels" in out and "allocator settings" in out
    if torch.version.cuda is None:
        assert "torch is a CPU-only build" in out


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"training": {"qca_stepz": 5}}))
    assert run_cli("train", "--config", path) == 2
    assert "unknown key 'qca_stepz'" in capsys.readouterr().err
    assert run_cli("train", "--grid", 10) == 2
    assert "multiple of 4" in capsys.readouterr().err
    assert run_cli("train", "--max-noise", -0.1) == 2
    assert "--max-noise must be a probability in [0, 1], got -0.1" in capsys.readouterr().err
    assert run_cli("plan", "--gpu-mem", "lots") == 2
    assert "3.68GiB" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"lowmem": {"cuda_graph": "yes"}}))
    assert run_cli("train", "--config", path) == 2
    assert "cuda_graph must be true, false or null (on where it can run), got 'yes'" in capsys.readouterr().err


def test_bundled_configs_by_name_are_the_repositorys():
    assert config_mod.bundled_configs() == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    for name in config_mod.bundled_configs():
        assert config_mod.load_config(name) == config_mod.load_config(str(ROOT / "configs" / f"{name}.yaml"))
    with pytest.raises(ValueError, match=r"'small_cpu' is neither a YAML file nor a bundled config \(default, small_gpu\)"):
        config_mod.load_config("small_cpu")


def test_parse_bytes():
    assert parse_bytes("3.68GiB") == int(3.68 * 2**30)
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("4GB") == 4 * 10**9
    assert parse_bytes("0", allow_zero=True) == 0
    for text in ("1e400", "nan", "-1", "3 parsecs"):
        with pytest.raises(ValueError, match=f"--reserve must look like 3.68GiB, 512MiB or 4GB, got '{text}'"):
            parse_bytes(text, allow_zero=True, name="--reserve")


@pytest.mark.slow
def test_allocator_default_set_only_when_unset():
    # A fresh interpreter each time: in this one an earlier test may have started CUDA, after
    # which the setting is rightly left alone.
    script = ("import os; from qca_lowmem.trainer import train; train.set_allocator_defaults(); "
              "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}

    def setting_after_defaults(**extra):
        result = subprocess.run([sys.executable, "-c", script], env=dict(env, **extra), capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert setting_after_defaults() == "expandable_segments:True"
    assert setting_after_defaults(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64") == "max_split_size_mb:64"


def test_shipped_configs_load():
    default = config_mod.load_config(str(ROOT / "configs" / "default.yaml"))
    small = config_mod.load_config(str(ROOT / "configs" / "small_gpu.yaml"))
    for config in (default, small):
        assert (config.grid, config.d_state, config.hidden, config.qca_steps) == (64, 14, 128, 500)
    assert small.amp_dtype == "fp16" and small.checkpoint == "step"
    embedded = config_mod.load_config()
    assert embedded.device == "auto" and embedded.grid <= 32 and embedded.hidden <= 16
    assert embedded.threads == 1 and default.threads is None


def test_episode_keys_differ_and_are_stable():
    keys = {train_mod.episode_key(0, e, s) for e in range(100) for s in (0, 1)}
    assert len(keys) == 200 and all(0 <= k < 2**63 for k in keys)
    assert train_mod.episode_key(7, 3, 0) == train_mod.episode_key(7, 3, 0)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_cap.py", "bench_plan.py"])
def test_gpu_benchmark_scripts_import_and_explain(script):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--config" in done.stdout


@cuda_only
def test_train_on_cuda_records_peak_memory(tiny_config, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "--config", tiny_config, "--device", "cuda", "--amp-dtype", "fp16", "--out", out,
                   "--no-progress") == 0
    rows = read_csv(out / "metrics.csv")
    assert len(rows) == 4 and all(int(r["peak_bytes"]) > 0 for r in rows)
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["scaler_state_dict"]["scale"] > 0  # fp16 trains with qca_lowmem.amp.GradScaler


@cuda_only
def test_bench_on_cuda_reports_peaks(tiny_config, tmp_path):
    assert run_cli("bench", "--config", tiny_config, "--device", "cuda", "--steps", "2,8", "--out", tmp_path) == 0
    result = json.loads((tmp_path / "bench_cuda.json").read_text())
    assert result["measure"] == "peak_bytes"
    long = result["rows"][1]
    assert long["lowmem_bytes"] < long["stock_bytes"]


@cuda_only
def test_train_on_cuda_with_captured_steps_equals_eager(tiny_config, tmp_path):
    """--cuda-graph replays captured graphs of the same kernels: the same losses, to rounding."""
    losses = {}
    for flag in ("--no-cuda-graph", "--cuda-graph"):
        out = tmp_path / flag
        assert run_cli("train", "--config", tiny_config, "--device", "cuda", flag, "--out", out, "--no-progress") == 0
        losses[flag] = [float(r["loss"]) for r in read_csv(out / "metrics.csv")]
    assert losses["--cuda-graph"] == pytest.approx(losses["--no-cuda-graph"], rel=1e-4)


def test_ddp_on_cuda_with_more_ranks_than_gpus_says_so(monkeypatch):
    """The CUDA branch of --ddp's setup, without a GPU: a rank beyond the visible GPUs is told in
    one line (it once raised UnboundLocalError: a later `import torch.distributed.nn` in the same
    function made `torch` a local name)."""
    from qca_lowmem.trainer import distributed

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed, "resolve_device", lambda name, local_rank=0: torch.device("cuda", local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"--ddp: local rank 1 has no GPU \(1 visible\)"):
        distributed.Distributed(True, "cuda")


def test_ddp_ranks_with_other_settings_than_rank_0s_refuse_naming_them(monkeypatch):
    """A seed of a rank's own trained other replicas (a warning at the end), another grid silently,
    another hidden size aborted inside gloo, another episode count hung."""
    import torch.distributed as dist

    from qca_lowmem.trainer import distributed

    group = distributed.Distributed(False)
    group.enabled, group.world_size = True, 2
    rank_1 = {"seed": 2, "grid": 8}
    monkeypatch.setattr(dist, "all_gather_object", lambda gathered, mine: gathered.__setitem__(slice(None), [mine, rank_1]))
    group.refuse_other_settings({"seed": 2, "grid": 8})
    with pytest.raises(UsageError, match=r"^--ddp: every rank must run rank 0's settings: seed is 2 on rank 1, 1 on "
                                         r"rank 0; grid is 8 on rank 1, 16 on rank 0$"):
        group.refuse_other_settings({"seed": 1, "grid": 16})


@pytest.mark.parametrize("world, local, head", [("2", "2", "torchrun --nproc_per_node=2"),
                                                ("4", "2", "torchrun --nnodes=2 --nproc_per_node=2"),
                                                ("2", None, "torchrun --nproc_per_node=2")])
def test_the_resume_command_of_a_ddp_run_is_torchruns(monkeypatch, world, local, head):
    """Two nodes of one process each printed --nproc_per_node=2 (the world size)."""
    monkeypatch.setenv("WORLD_SIZE", world)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    args = cli.build_parser().parse_args(["train", "--ddp", "--grid", "8"])
    args.argv = ["train", "--ddp", "--grid", "8"]
    assert cli.resume_command(args, "runs/a") == f"{head} -m qca_lowmem train --ddp --grid 8 --out runs/a --resume"


def test_a_rank_other_than_0_stopped_claims_no_checkpoint_of_its_own(tiny_config, tmp_path):
    """SIGTERM to rank 1 alone: it said 'episodes 0-97 are in checkpoint.pt' where rank 0, which
    writes the checkpoints, had saved none since episode 0."""
    from qca_lowmem.trainer import distributed

    group = distributed.Distributed(False)
    group.rank = 1
    trainer = train_mod.Trainer(config_mod.load_config(tiny_config, out_dir=str(tmp_path / "run")), group, progress=False)
    trainer.next_episode = trainer.saved_episode = 3
    said = str(trainer._interrupted(KeyboardInterrupt()))
    assert said == (f"interrupted at episode 3; rank 1; rank 0 writes {tmp_path / 'run' / 'checkpoint.pt'}, --resume "
                    f"{tmp_path / 'run' / 'checkpoint.pt'} continues from its last episode")


@pytest.mark.parametrize("command", ["bench", "plan"])
@pytest.mark.parametrize("threads_in_config, flags, expected", [(None, [], 1), (2, [], 2), (2, ["--threads", "1"], 1)])
def test_bench_and_plan_run_at_the_configs_threads_as_train_does(tmp_path, monkeypatch, command, threads_in_config,
                                                                   flags, expected):
    """The embedded config's one thread, a YAML's `threads`, or --threads (not torch's choice)."""
    seen = []
    monkeypatch.setattr(f"qca_lowmem.trainer.{command}.main_{command}",
                        lambda *args, **kwargs: seen.append(torch.get_num_threads()) or 0)
    config = []
    if threads_in_config is not None:
        path = tmp_path / "threads.yaml"
        path.write_text(yaml.safe_dump({"threads": threads_in_config}))
        config = ["--config", str(path)]
    torch.set_num_threads(3)
    try:
        assert cli.main([command, *config, *flags, *(["--gpu-mem", "4GiB"] if command == "plan" else [])]) == 0
    finally:
        torch.set_num_threads(1)
    assert seen == [expected]
