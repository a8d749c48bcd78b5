"""What ptxas makes of every CUDA kernel on sm_75 to sm_90 (benchmarks/cuda_resources.py, which
also writes the README's table): no kernel spills registers, every kernel states its block size
with __launch_bounds__, and none takes so many registers that a 256-thread block would run below
half occupancy, unless its source says so on purpose: a comment starting `// occupancy:` with
the reason, in the comment block just above the kernel's `__global__` line."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cuda_resources", ROOT / "benchmarks" / "cuda_resources.py")
cuda_resources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_resources)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cuda_resources.nvcc() is None, reason="nvcc not found")]
CU_FILES = sorted(p.name for p in cuda_resources.KERNELS.glob("*.cu"))


@pytest.fixture(scope="module")
def records():
    return cuda_resources.collect()


def marked_on_purpose(source_text, kernel):
    """Whether the comment block above `kernel`'s __global__ declaration has `// occupancy:`."""
    name = kernel.split("<")[0].split("::")[-1]
    lines = source_text.splitlines()
    for i, line in enumerate(lines):
        if "__global__" in line and re.search(rf"\b{name}\s*\(", " ".join(lines[i:i + 3])):
            j = i - 1
            while j >= 0 and (lines[j].lstrip().startswith(("//", "template")) or lines[j].strip() == ""):
                if lines[j].lstrip().startswith("// occupancy:"):
                    return True
                if lines[j].strip() == "":
                    break
                j -= 1
    return False


@pytest.mark.parametrize("arch, threads, registers, expected", [
    ("sm_80", 512, 72, 0.25),   # 2304 registers a warp: 7 warps a partition, one 16-warp block
    ("sm_86", 512, 68, 1 / 3),
    ("sm_80", 256, 64, 0.5),    # 8 warps a partition: four 8-warp blocks of the 64 warps
    ("sm_80", 256, 65, 0.375),
    ("sm_75", 1024, 32, 1.0),
    ("sm_90", 32, 10, 0.5),     # 32 resident blocks of one warp
])
def test_occupancy_formula(arch, threads, registers, expected):
    assert cuda_resources.occupancy(arch, threads, registers) == pytest.approx(expected)


def test_the_occupancy_marker_is_found(tmp_path):
    source = ("// Sums things.\n// occupancy: one block per SM on purpose\n"
              "template <typename T>\n__global__ void __launch_bounds__(512)\n    big_kernel(T x) {}\n"
              "// occupancy: not this one's\n\n__global__ void small_kernel() {}\n")
    assert marked_on_purpose(source, "big_kernel<float>")
    assert not marked_on_purpose(source, "small_kernel")


def test_every_kernel_states_its_block_size(records):
    assert records and {r["file"] for r in records} == set(CU_FILES)
    assert {r["arch"] for r in records} == set(cuda_resources.ARCHS)
    missing = sorted({r["kernel"] for r in records if r["threads"] is None})
    assert not missing, f"kernels without __launch_bounds__: {missing}"


@pytest.mark.parametrize("source", CU_FILES)
def test_no_kernel_spills(records, source):
    spills = [f"{r['kernel']} on {r['arch']}: {r['spill_stores']} bytes stored, {r['spill_loads']} loaded"
              for r in records if r["file"] == source and (r["spill_stores"] or r["spill_loads"])]
    assert not spills, "\n".join(spills)


@pytest.mark.parametrize("source", CU_FILES)
def test_registers_leave_a_256_thread_block_half_occupancy(records, source):
    text = (cuda_resources.KERNELS / source).read_text()
    low = [f"{r['kernel']} on {r['arch']}: {r['registers']} registers, "
           f"{cuda_resources.occupancy(r['arch'], 256, r['registers']):.0%}"
           for r in records if r["file"] == source
           and cuda_resources.occupancy(r["arch"], 256, r["registers"]) < 0.5
           and not marked_on_purpose(text, r["kernel"])]
    assert not low, "\n".join(low)
