"""benchmarks/users_pipeline.py, the users' CLI run with the README's patch under a GPU cap, on a
stand-in checkout written here (CI has none of theirs): the patch applied to a copy, one process
per run with the bootstrap's record (exit, exception and the frame that raised it), the episodes
read from what their loop prints, and the result file written after every run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import BENCHMARKS, benchmark_module, cuda_only

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

# Their CLI's shape, as far as the script depends on it: `python -m src.trainer` from the checkout,
# their V4 loop's lines, their pipeline file (here patched or not), an out-of-memory error raised
# in a frame of theirs in the stock run, and a package of their environment on PYTHONPATH.
STAND_IN_TRAINER = """\
import argparse
import os
import signal
import sys

import standin_dependency  # from --pythonpath

parser = argparse.ArgumentParser()
parser.add_argument("--total_episodes", type=int)
args, _ = parser.parse_known_args()
patched = open("src/pipelines/pipeline_train.py").read().count("qca_lowmem.enable_from_config(trainer, exp_cfg)")
assert patched == 2 and sys.path[0] == os.getcwd() and not os.path.exists("output/old"), (patched, sys.path)
stock = os.environ["QCA_LOWMEM"] == "0"
if stock and os.environ.get("STAND_IN_KILLS_THE_SCRIPT"):
    os.kill(os.getppid(), signal.SIGKILL)
    sys.exit(0)
print("qca_lowmem: off, QCA_LOWMEM=0 in the environment" if stock else "qca_lowmem: on, checkpoint=step, fp32")


def group_norm(episode):
    raise MemoryError(f"out of memory in episode {episode}")


for episode in range(args.total_episodes):
    if stock and episode == 1:
        print(f"ERROR - CUDA Out of Memory en episodio {episode}: out of memory", flush=True)
        group_norm(episode)
    print(f"Episodio {episode}/{args.total_episodes} | Loss: 0.5")
print("\\u2705 Entrenamiento completado.")
"""


def stand_in_checkout(root: Path, common) -> Path:
    """src/trainer.py above, and their pipeline file as the lines the README's patch reads, in order."""
    pre_image = [line[1:] for line in common.readme_patch("src/pipelines/pipeline_train.py").splitlines()[2:]
                 if not line.startswith(("@@", "+"))]
    (root / "src" / "pipelines").mkdir(parents=True)
    (root / "src" / "pipelines" / "pipeline_train.py").write_text("\n".join(pre_image) + "\n")
    (root / "src" / "trainer.py").write_text(STAND_IN_TRAINER)
    (root / "output" / "old").mkdir(parents=True)  # an earlier run's experiment: not copied
    return root


def run_script(tmp_path, *extra, env=None):
    checkout = stand_in_checkout(tmp_path / "Atheria", benchmark_module("common"))
    (tmp_path / "deps").mkdir()
    (tmp_path / "deps" / "standin_dependency.py").write_text("")
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "users_pipeline.py"), "--atheria", str(checkout),
                           "--grid", "8", "--steps", "2", "--episodes", "3", "--pythonpath", str(tmp_path / "deps"),
                           "--out", str(out), *extra], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=300)
    return done, out, checkout


@pytest.mark.slow
@needs_git
def test_both_runs_are_recorded_with_episodes_line_and_where_stock_failed(tmp_path):
    done, out, checkout = run_script(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["kind"] == "users_pipeline" and (result["grid"], result["steps"], result["episodes"]) == (8, 2, 3)
    lowmem, stock = result["runs"]
    assert lowmem["name"] == "QCA_LOWMEM=1" and lowmem["exit"] == 0 and lowmem["episodes_trained"] == 3
    assert lowmem["line"] == "qca_lowmem: on, checkpoint=step, fp32" and "failure" not in lowmem
    assert lowmem["command"].startswith("PYTHONPATH=src QCA_LOWMEM=1 python -m src.trainer --experiment_name lowmem8 ")
    assert "--grid_size_training 8 --qca_steps_training 2 --total_episodes 3" in lowmem["command"]
    assert stock["exit"] == 1 and stock["episodes_trained"] == 1 and stock["line"].startswith("qca_lowmem: off")
    failure = stock["failure"]
    assert failure["type"] == "MemoryError" and failure["message"] == "out of memory in episode 1"
    assert failure["raised_in"].startswith("src/trainer.py:") and failure["raised_in"].endswith(
        "in group_norm: raise MemoryError(f\"out of memory in episode {episode}\")")
    assert failure["innermost_in_checkout"] == failure["raised_in"]
    for run in (lowmem, stock):  # no GPU here: no cap, and the record says so
        assert run["cap_applied"] is False and "no CUDA" in run["cap_note"] and not run["timed_out"]
    assert "qca_lowmem" not in (checkout / "src/pipelines/pipeline_train.py").read_text()  # theirs untouched


@pytest.mark.slow
@needs_git
def test_the_result_file_holds_each_run_as_soon_as_it_ends(tmp_path):
    """The script killed during the stock run (as at a time limit) leaves the QCA_LOWMEM=1 run."""
    done, out, _ = run_script(tmp_path, env={"STAND_IN_KILLS_THE_SCRIPT": "1"})
    assert done.returncode == -signal.SIGKILL
    [run] = json.loads(out.read_text())["runs"]
    assert run["name"] == "QCA_LOWMEM=1" and run["episodes_trained"] == 3


@cuda_only
@pytest.mark.slow
def test_the_bootstrap_caps_the_process_and_records_where_it_ran_out(tmp_path):
    """Under a 2.5 GiB cap the third GiB fails: the peak is the two kept, the frame the third's."""
    (tmp_path / "greedy.py").write_text("import torch\n\nkept = []\nwhile True:\n"
                                        "    kept.append(torch.empty(2**28, device='cuda'))\n")
    record = tmp_path / "record.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "pipeline_bootstrap.py"), str(record), "2.5", "greedy"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    result = json.loads(record.read_text())
    assert result["cap_applied"] and result["cap_gib"] == 2.5 and result["peak_allocated_bytes"] == 2 * 2**30
    assert 2 * 2**30 <= result["peak_reserved_bytes"] <= 2.5 * 2**30
    assert "OutOfMemoryError" in result["failure"]["type"]
    assert result["failure"]["raised_in"] == result["failure"]["innermost_in_checkout"] == \
        "greedy.py:5 in <module>: kept.append(torch.empty(2**28, device='cuda'))"


def test_what_was_live_at_the_peak_is_summed_by_the_place_that_allocated_it():
    """Their frames and the library's name the place (innermost first); torch's alone are
    elsewhere; a free of memory allocated before the history began changes nothing."""
    bootstrap = benchmark_module("pipeline_bootstrap")
    root = os.path.join(os.sep, "tmp", "run", "Atheria")
    theirs = {"filename": os.path.join(root, "src", "trainers", "qc_trainer_v4.py"), "line": 231, "name": "train_episode"}
    library = {"filename": os.path.join(os.sep, "venv", "site-packages", "qca_lowmem", "rollout.py"), "line": 40,
               "name": "rollout"}
    torch_frame = {"filename": os.path.join(os.sep, "venv", "site-packages", "torch", "nn", "modules", "conv.py"),
                   "line": 5, "name": "forward"}

    def alloc(addr, size, *frames):
        return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}

    def free(addr, size):
        return {"action": "free_completed", "addr": addr, "size": size, "frames": []}

    trace = [free(99, 1000), alloc(1, 100, torch_frame, library, theirs), alloc(2, 50, torch_frame, theirs),
             alloc(3, 30, torch_frame), free(1, 100), alloc(4, 20, theirs), alloc(5, 200, theirs), free(5, 200),
             free(2, 50), alloc(6, 10, library)]
    found = bootstrap.at_peak(trace, root)
    assert found["allocated_bytes"] == 300 and found["events"] == 10 and not found["history_full"]
    assert found["by_place"] == [
        {"where": os.path.join("src", "trainers", "qc_trainer_v4.py") + ":231 in train_episode", "bytes": 270},
        {"where": "elsewhere", "bytes": 30}]
    assert bootstrap.at_peak(trace[:4], root)["by_place"] == [
        {"where": os.path.join("qca_lowmem", "rollout.py") + ":40 in rollout", "bytes": 100},
        {"where": os.path.join("src", "trainers", "qc_trainer_v4.py") + ":231 in train_episode", "bytes": 50},
        {"where": "elsewhere", "bytes": 30}]


@cuda_only
@pytest.mark.slow
def test_the_bootstrap_says_what_was_live_at_the_peak(tmp_path):
    (tmp_path / "spender.py").write_text(textwrap.dedent("""\
        import torch

        kept = torch.empty(2**26, device='cuda')
        brief = torch.empty(2**27, device='cuda')
        del brief
        after = torch.empty(2**20, device='cuda')
        """))
    record = tmp_path / "record.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "pipeline_bootstrap.py"), str(record), "2.5", "spender"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "QCA_PIPELINE_AT_PEAK": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(record.read_text())["at_peak"]
    assert found["allocated_bytes"] == 3 * 2**28
    assert found["by_place"] == [{"where": "spender.py:4 in <module>", "bytes": 2**29},
                                 {"where": "spender.py:3 in <module>", "bytes": 2**28}]


def test_a_missing_checkout_is_named_with_where_to_put_it(tmp_path):
    script = benchmark_module("users_pipeline")
    with pytest.raises(SystemExit, match=r"no checkout of Jonakss/Atheria at .*missing.*4df21e7"):
        script.patched_copy(tmp_path / "missing", tmp_path)


@needs_git
def test_the_checkout_commit_is_its_own_repositorys_or_none(tmp_path):
    """Their src/ archived into a folder of another repository (this one's atheria/) records no
    commit, not that repository's; a clone of theirs records its own."""
    script = benchmark_module("users_pipeline")

    def committed(root: Path) -> str:
        git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()

    committed(tmp_path)
    archive = tmp_path / "atheria"
    (archive / "src").mkdir(parents=True)
    assert script.checkout_commit(archive) is None
    clone = tmp_path / "clone"
    clone.mkdir()
    head = committed(clone)
    assert script.checkout_commit(clone) == head


def test_episodes_are_read_from_their_loops_lines():
    episodes_trained = benchmark_module("users_pipeline").episodes_trained
    finished = "Episodio 0/3 | Loss: 1\n\u2705 Entrenamiento completado.\n"
    assert episodes_trained(finished, 3) == (3, [])
    skipped = "ERROR - Error en episodio 1: boom\nTraceback...\n\u2705 Entrenamiento completado.\n"
    assert episodes_trained(skipped, 3) == (2, [1])  # their loop logs and goes on
    out_of_memory = textwrap.dedent("""\
        ERROR - Error en episodio 0: boom
        ERROR - \u274c CUDA Out of Memory en episodio 2: CUDA out of memory. Tried to allocate 2.00 GiB
        ERROR - \u274c CUDA Out of Memory persistente en episodio 2. Deteniendo entrenamiento.
        """)
    assert episodes_trained(out_of_memory, 3) == (1, [0])
    assert episodes_trained("Episodio 0/3 | Loss: 1\n", 3) == (None, [])  # stopped without saying why


def test_the_switch_line_is_read_wherever_their_logging_puts_it():
    lowmem_line = benchmark_module("users_pipeline").lowmem_line
    assert lowmem_line("x\nWARNING:qca_lowmem:qca_lowmem: off, QCA_LOWMEM=0 in the environment\n") == \
        "qca_lowmem: off, QCA_LOWMEM=0 in the environment"
    assert lowmem_line("no switch here\n") is None
