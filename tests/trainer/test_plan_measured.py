"""`qca-lowmem plan`'s reserved peak against what a GPU measured: every row of bench_plan and every
capped run recorded in benchmarks/results/ for the commit whose code plan models (each file says
its device, commit, date and command), within 10% of torch.cuda.max_memory_reserved; and the
caching allocator's rounding as plan counts it."""

import json
from pathlib import Path

import pytest

from qca_lowmem.trainer.allocator import MiB, expandable_in_environment, reserved_bytes
from qca_lowmem.trainer.config import load_config
from qca_lowmem.trainer.plan import plan

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED_COMMIT = "d26e294"
H200_BYTES = 143771 * MiB  # what bench_plan planned for: the H200's whole memory
CAPPED_RUNS = ("cap128_fp16_step_20", "cap256_fp16_revolve32_5")

pytestmark = pytest.mark.usefixtures("one_thread")


def measured(name: str) -> dict:
    result = json.loads((RESULTS / f"{name}.json").read_text())
    assert (result["device"], result["commit"]) == ("NVIDIA H200", MEASURED_COMMIT), name
    assert result["date"].startswith("2026-11-27") and result["command"], name
    return result


def within_ten_percent(predicted: int, reserved: int) -> bool:
    return abs(predicted / reserved - 1) <= 0.10


@pytest.mark.slow
def test_every_bench_plan_row_is_within_10_percent_of_reserved():
    """bench_plan ran with the allocator's defaults (no expandable_segments), grid 64, every policy
    plan listed; "auto" with the budget plan gave it (every step's full graph)."""
    result = measured("plan_nvidia_h200")
    config = load_config("default", device="cuda", qca_steps=result["config"]["qca_steps"])
    assert {k: getattr(config, k) for k in result["config"]} == result["config"]
    estimates = plan(config, H200_BYTES, 0, expandable=False)["estimates"]
    # bench_plan named auto's rows without their budget.
    by_name = {f"lowmem auto {e.amp_dtype or 'fp32'}" if e.policy and e.policy.byte_budget else e.name: e
               for e in estimates}
    ratios = {row["policy"]: by_name[row["policy"]].peak_bytes / row["measured_reserved_bytes"]
              for row in result["rows"]}
    assert len(ratios) == 10
    assert all(abs(ratio - 1) <= 0.10 for ratio in ratios.values()), ratios


@pytest.mark.slow
@pytest.mark.parametrize("name", CAPPED_RUNS)
def test_every_capped_run_is_within_10_percent_of_reserved(name):
    """bench_cap sets expandable_segments, as `qca-lowmem train` does."""
    run = measured(name)
    options = {k: run["config"][k] for k in ("grid", "checkpoint", "slots", "amp_dtype")}
    config = load_config("small_gpu", device="cuda", **options)
    own = next(e for e in plan(config, run["cap_bytes"], 0)["estimates"] if e.from_config)
    assert own.name == run["plan"]["name"]
    reserved = run["last_episode_peak_reserved_bytes"]
    assert within_ten_percent(own.peak_bytes, reserved), own.peak_bytes / reserved


def test_the_allocator_rounds_as_torchs_caching_allocator():
    state = 64 * 64 * 14 * 8  # 0.44 MiB: four to a 2 MiB small segment
    assert reserved_bytes([state] * 4) == 2 * MiB
    assert reserved_bytes([state] * 5) == 4 * MiB
    assert reserved_bytes([8 * MiB] * 2) == 20 * MiB  # under 10 MiB: two to a 20 MiB segment
    assert reserved_bytes([8 * MiB] * 3) == 40 * MiB
    assert reserved_bytes([11 * MiB]) == 12 * MiB  # its own segment, rounded up to 2 MiB
    assert reserved_bytes([1]) == 2 * MiB and reserved_bytes([]) == 0
    # expandable_segments: blocks end to end, pages of 2 MiB (small) and 20 MiB (large)
    assert reserved_bytes([8 * MiB] * 3, expandable=True) == 40 * MiB
    assert reserved_bytes([8 * MiB] * 2 + [state] * 5, expandable=True) == 20 * MiB + 4 * MiB


def test_plan_reads_the_allocators_settings_as_train_leaves_them(monkeypatch):
    """Unset, `train` sets expandable_segments; settings of one's own are kept as they are."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert expandable_in_environment(unset=True) and not expandable_in_environment()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert not expandable_in_environment(unset=True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    assert expandable_in_environment()
