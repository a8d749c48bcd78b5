"""benchmarks/bench_accumulate.py runs at a tiny size and writes its rows, its three candidates
giving the same bits."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_and_its_candidates_agree(tmp_path):
    out = tmp_path / "accumulate.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_accumulate.py"), "--device", "cpu",
                             "--d-state", "2", "--hidden", "4", "--warmup", "1", "--reps", "2", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["same_bits"] and report["config"]["tensors"] == 42 and report["config"]["half_tensors"] == 12
    assert [r["candidate"] for r in report["runs"]] == ["ours", "torch_per_tensor", "torch_foreach", "copy"]
