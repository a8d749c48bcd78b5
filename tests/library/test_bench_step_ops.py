"""The ops a step of the step recompute issues (benchmarks/bench_step_ops.py, torch's profiler on
the CPU) stay within today's counts, kind by kind: one more fill, add, copy or cat a step fails."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Today's counts a step, the same at every size and in both layouts (docs/benchmarks.md): adds are
# the parameters' gradient accumulation (one accumulate_ for all 42, the bfloat16 copies' gradients
# with the rest), psi's gradient and the U-Net's two skip-connection gradient sums; fills the scalar
# that reads autograd's sequence number; cats the U-Net's two, in the forward and in the
# recompute, and the recompute check's stack. The total counts views too: the two `detach`es of a
# forward step's fresh inputs and output (recompute/escapes.py), which launch no kernel; under
# autocast, the casts' views and autocast's own ops.
BOUNDS = {"adds": 4, "fills": 1, "copies": 0, "cats": 4, "total": 111}
BOUNDS_BF16 = {**BOUNDS, "total": 129}


def bench_step_ops():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_step_ops as module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.mark.slow
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_a_steps_ops_stay_within_todays_counts(channels_last, autocast_dtype):
    counts = bench_step_ops().step_counts(8, 2, 4, 1, channels_last=channels_last, autocast_dtype=autocast_dtype)
    assert counts["linear_in_steps"]  # exact counts a step
    bounds = BOUNDS if autocast_dtype is None else BOUNDS_BF16
    over = {kind: (counts["issued"][kind], bound) for kind, bound in bounds.items() if counts["issued"][kind] > bound}
    assert not over, f"a step issues more ops than today's (count, bound): {over}"


@pytest.mark.slow
def test_the_count_sees_one_more_op_a_step():
    """An add in the step is counted twice a step, in the forward and in the recompute: the bounds
    above can fail."""
    module = bench_step_ops()
    counts = module.step_counts(8, 2, 4, 1)
    more = module.step_counts(8, 2, 4, 1, wrap_step=lambda step: lambda psi: step(psi).add(0))
    assert more["issued"]["adds"] == counts["issued"]["adds"] + 2 > BOUNDS["adds"]
    assert more["issued"]["total"] == counts["issued"]["total"] + 2
    assert {kind: more["issued"][kind] for kind in ("fills", "copies", "cats")} == \
        {kind: counts["issued"][kind] for kind in ("fills", "copies", "cats")}


def test_the_result_file_states_the_bounds():
    """benchmarks/results/step_ops_cpu.json (what docs/benchmarks.md quotes) holds the counts the
    bounds are: a change in either is made in both."""
    report = json.loads((ROOT / "benchmarks" / "results" / "step_ops_cpu.json").read_text())
    assert report["kind"] == "step_ops" and report["config"]["checkpoint"] == "step"
    for layout in ("nchw", "channels_last"):
        for precision, bounds in (("", BOUNDS), ("_bf16", BOUNDS_BF16)):
            assert report["per_step"][layout + precision]["linear_in_steps"]
            assert report["per_step"][layout + precision]["issued"] == bounds
