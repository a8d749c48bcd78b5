"""benchmarks/gpu_probe.py's dry run on the CPU at tiny shapes: every section but the budget (a
CUDA cap) runs without error, so a lent GPU's minutes are not spent finding a fault in the script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qca_lowmem import stock

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_every_section_runs_on_the_cpu(tmp_path):
    out = tmp_path / "probe.json"
    sections = ["capture", "fallback", "determinism", "groupnorm", "noise", "step_kernels", "pools", "convolutions"]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"), "--device", "cpu",
                             "--grid", "8", "--d-state", "2", "--hidden", "8", "--steps", "2",
                             "--sections", *sections, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())["sections"]
    assert [name for name in sections if isinstance(report[name], dict) and "error" in report[name]] == []
    assert report["pools"]["all_bitwise"]

    convolutions = report["convolutions"]
    unet = stock.UNetUnitary(2, 8)
    layers = [m for m in unet.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))]
    assert sum(row["calls_per_forward"] for row in convolutions["rows"]) == len(layers) == 15
    for search in ("heuristics", "benchmark"):
        step = convolutions["step_ms"][search]
        assert set(step) == {"now", "weight_grads_deferred_over_8", "weight_grads_deferred_over_32"}
        assert all(ms > 0 for ms in step.values())
    for row in convolutions["rows"]:
        assert all(row[f"{name}_us"] > 0 for name in ("forward", "input_grad", "weight_grad", "weight_grad_batch8",
                                                       "weight_grad_benchmark"))
