"""The episode benchmark (benchmarks/bench_episode.py) runs end to end on a tiny config."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_episode.py"
# lowmem_fp32_step and the runs that take its time apart
RUNS = ["stock_fp32", "stock_fp32_checkpoint", "lowmem_fp32_keep", "lowmem_fp32_forward", "lowmem_fp32_step"]


def run(*args):
    # The script imports qca_lowmem as this process does (installed, or PYTHONPATH inherited);
    # one thread, as the other tests (tiny tensors, shared machines).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_help():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    assert "lowmem_bf16_revolve32" in result.stdout


def test_tiny_episode_writes_the_report(tmp_path):
    out = tmp_path / "episode.json"
    result = run("--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps", "3", "--episodes", "1",
                 "--runs", *RUNS, "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["kind"] == "episode" and report["config"]["qca_steps"] == 3
    assert [r["name"] for r in report["runs"]] == RUNS
    assert all(r["episode_s"] > 0 for r in report["runs"])
    assert report["max_grad_rel_err_fp32"] < 1e-5
    for key in ("device", "torch", "cuda", "commit", "date"):
        assert key in report


def test_every_run_kind_runs_on_a_tiny_config(tmp_path):
    """Each run the script knows, the ones asked for by name included (checkpoint="auto" among
    them), completes: a command docs/benchmarks.md gives cannot break unseen."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_episode
    finally:
        sys.path.remove(str(SCRIPT.parent))
    runs = [name for name in bench_episode.RUNS + bench_episode.EXTRA_RUNS if name not in bench_episode.CUDA_ONLY_RUNS]
    out = tmp_path / "episode.json"
    result = run("--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps", "3", "--episodes", "1",
                 "--runs", *runs, "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == runs
    assert all("error" not in r and r["episode_s"] > 0 for r in report["runs"]), report["runs"]
    refused = run("--device", "cpu", "--runs", *bench_episode.CUDA_ONLY_RUNS, "--out", str(tmp_path / "refused.json"))
    assert refused.returncode == 2 and "need a CUDA device" in refused.stderr
