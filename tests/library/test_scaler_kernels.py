"""qca_lowmem.amp's kernels (unscale with the non-finite check and sums of squares, multiply,
scale update) against plain references and torch's own kernels, and the CUDA launcher's batch
plan run on the host."""

import pytest
import torch

from fixtures.scaler import CHUNK, DTYPES, SIZES, bits_equal, check_unscale, ops, random_list, reference_unscale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unscale_matches_reference(dtype):
    check_unscale("cpu", dtype, SIZES, 2.0**-13)
    check_unscale("cpu", dtype, [5, 0, CHUNK + 3], 1.0)
    check_unscale("cpu", dtype, [CHUNK + 3, 17], 3.0)  # not a power of two: rounding matters


def test_unscale_random_lists_many_sizes():
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        sizes = torch.randint(0, 3 * CHUNK, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        sizes[0] = 0  # mixed empty tensors
        inv = float(torch.rand((), generator=g)) * 4
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=g))]
        check_unscale("cpu", dtype, sizes, inv)


def test_unscale_matches_torch_kernel_bitwise():
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        ours = random_list(SIZES, dtype)
        theirs = [t.clone() for t in ours]
        inv = torch.tensor(1.0 / 3.0, dtype=torch.float32)
        ops.amp_unscale_(ours, torch.zeros(()), inv)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch.zeros(()), inv)
        assert all(bits_equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_detected_per_tensor(dtype, bad):
    grads = random_list([10, CHUNK * 2 + 5, 0, 7], dtype)
    position = CHUNK + 9  # in a later chunk
    if dtype.is_complex:
        grads[1][position] = complex(1.0, bad)
    else:
        grads[1][position] = bad
    originals = [g.clone() for g in grads]
    found_inf = torch.zeros(())
    sumsq = ops.amp_unscale_(grads, found_inf, torch.tensor(0.5), True)
    assert found_inf.item() == 1.0
    flags = torch.isnan(sumsq).tolist()
    assert flags == [False, True, False, False]
    # the finite values are still unscaled, as torch does
    assert bits_equal(grads[0], reference_unscale(originals[0], 0.5))
    # found_inf is only ever set, never cleared
    ops.amp_unscale_(grads[:1], found_inf, torch.tensor(0.5))
    assert found_inf.item() == 1.0


def test_finite_check_is_before_unscaling():
    big = torch.tensor([60000.0], dtype=torch.float16)
    found_inf = torch.zeros(())
    sumsq = ops.amp_unscale_([big], found_inf, torch.tensor(4.0), True)
    assert torch.isinf(big).all() and found_inf.item() == 0.0  # overflow by the multiply is not flagged
    assert torch.isinf(sumsq).all() and not torch.isnan(sumsq).any()


def test_factor_one_keeps_bits():
    t = torch.tensor([1.0, float("nan"), -0.0, 3.0])
    t.view(torch.int32)[1] = 0x7FC01234  # a NaN payload a multiply could change
    before = t.clone()
    found_inf = torch.zeros(())
    ops.amp_unscale_([t], found_inf, torch.tensor(1.0))
    assert bits_equal(t, before) and found_inf.item() == 1.0


def test_non_contiguous_layouts():
    x = torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)
    y = torch.randn(6, 4).t()
    base = torch.randn(3 * CHUNK)
    z = base[::3]  # not dense: processed in a copy, written back
    untouched = base[1::3].clone()
    ref = [reference_unscale(t, 0.25) for t in (x, y, z)]
    found_inf = torch.zeros(())
    z[5] = float("nan")
    sumsq = ops.amp_unscale_([x, y, z], found_inf, torch.tensor(0.25), True)
    assert bits_equal(x, ref[0]) and bits_equal(y, ref[1])
    assert torch.equal(z[6:], ref[2][6:]) and torch.equal(base[1::3], untouched)
    assert found_inf.item() == 1.0 and torch.isnan(sumsq).tolist() == [False, False, True]


def test_sums_do_not_depend_on_threads():
    grads = random_list([5 * CHUNK + 3, 3 * CHUNK], torch.float32)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(ops.amp_unscale_([g.clone() for g in grads], torch.zeros(()), torch.tensor(0.5), True))
    finally:
        torch.set_num_threads(previous)
    assert bits_equal(results[0], results[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_mul_matches_foreach_mul(dtype):
    ours = random_list([3, CHUNK + 1, 0], dtype)
    theirs = [t.clone() for t in ours]
    factor = torch.tensor(0.3)
    ops.amp_mul_(ours, factor)
    torch._foreach_mul_(theirs, factor)
    assert all(bits_equal(a, b) for a, b in zip(ours, theirs))
    with_nan = torch.tensor([float("nan"), 2.0], dtype=dtype)
    ops.amp_mul_([with_nan], torch.tensor(1.0))  # a plain multiply checks nothing
    assert with_nan[1].item() == 2.0


def test_update_scale_follows_torch_rule():
    g = torch.Generator().manual_seed(3)
    cases = [(2.0, 0.5, 3), (2.0, 0.5, 1), (1.5, 0.25, 2), (1.0001, 0.999, 4)]
    for growth, backoff, interval in cases:
        for init in (65536.0, 3.0e38, 1.0e-30, 7.0):
            ours = (torch.tensor(init), torch.tensor(0, dtype=torch.int32))
            theirs = (torch.tensor(init), torch.tensor(0, dtype=torch.int32))
            for _ in range(40):
                flag = [0.0, 0.0, 0.0, 1.0, float("nan")][int(torch.randint(0, 5, (1,), generator=g))]
                found_inf = torch.tensor(flag)
                ops.amp_update_scale_(*ours, found_inf, growth, backoff, interval)
                torch._amp_update_scale_(*theirs, found_inf, growth, backoff, interval)
                assert bits_equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    # never grows to inf
    scale, tracker = torch.tensor(3.0e38), torch.tensor(0, dtype=torch.int32)
    ops.amp_update_scale_(scale, tracker, torch.tensor(0.0), 2.0, 0.5, 1)
    assert scale.item() == pytest.approx(3.0e38) and tracker.item() == 0


def test_ops_bump_version_counters():
    g, found_inf = torch.randn(4), torch.zeros(())
    before = (g._version, found_inf._version)
    ops.amp_unscale_([g], found_inf, torch.tensor(0.5))
    assert g._version > before[0] and found_inf._version > before[1]


def test_opcheck_every_op():
    grads = [torch.randn(70000), torch.randn(3), torch.empty(0)]
    torch.library.opcheck(ops.amp_unscale_, (grads, torch.zeros(()), torch.tensor(0.5), True))
    torch.library.opcheck(ops.amp_unscale_, ([torch.randn(4, dtype=torch.complex64)], torch.zeros(()), torch.tensor(0.5)))
    torch.library.opcheck(ops.amp_mul_, ([torch.randn(5), torch.randn(2, 3)], torch.tensor(0.5)))
    torch.library.opcheck(
        ops.amp_update_scale_, (torch.tensor(8.0), torch.tensor(1, dtype=torch.int32), torch.tensor(0.0), 2.0, 0.5, 2)
    )


def test_bad_inputs_raise_clearly():
    g = [torch.randn(3), torch.randn(3, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match=r"one dtype.*grads\[1\].*Double"):
        ops.amp_unscale_(g, torch.zeros(()), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"inv_scale must be a one-element Float tensor, got .*Double"):
        ops.amp_unscale_([torch.randn(3)], torch.zeros(()), torch.tensor(0.5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"inv_scale must be a one-element Float tensor, got .*shape=\[2\]"):
        ops.amp_unscale_([torch.randn(3)], torch.zeros(()), torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match=r"found_inf must be a one-element Float tensor, got .*Int"):
        ops.amp_unscale_([torch.randn(3)], torch.zeros((), dtype=torch.int32), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"grads must hold float32.*got .*Long"):
        ops.amp_unscale_([torch.arange(3)], torch.zeros(()), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"grads\[0\] has elements that share memory.*strides=\[0\]"):
        ops.amp_unscale_([torch.randn(1).expand(4)], torch.zeros(()), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"grads\[1\] must be a strided"):
        ops.amp_unscale_([torch.randn(2), torch.randn(2).to_sparse()], torch.zeros(()), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"materialize all the conjugate"):  # torch's own check
        ops.amp_unscale_([torch.randn(3, dtype=torch.complex64).conj()], torch.zeros(()), torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"growth_tracker must be a one-element Int tensor"):
        ops.amp_update_scale_(torch.tensor(1.0), torch.tensor(0), torch.tensor(0.0), 2.0, 0.5, 2)
    with pytest.raises(RuntimeError, match=r"factor must be a one-element Float tensor"):
        ops.amp_mul_([torch.randn(2)], torch.tensor([1.0, 2.0]))


PLAN_CHECK = r"""
// Runs the CUDA launcher's batch plan on the host and checks, as the kernels would read it,
// that every real of every tensor is covered exactly once and that each thread block writes the
// workspace slot the per-tensor reduction reads.
#include <cstdio>
#include <vector>
#include "scaler_batches.h"

int main() {
  const int split = QCA_SCALER_CUDA_SPLIT;
  const int64_t part_len = QCA_SCALER_CHUNK / split;
  int64_t n;
  std::vector<int64_t> numel;
  while (std::scanf("%lld", (long long*)&n) == 1) numel.push_back(n);
  std::vector<void*> data(numel.size());
  std::vector<int64_t> first_slot(numel.size() + 1, 0);  // what the reduction assumes
  for (size_t t = 0; t < numel.size(); ++t) {
    data[t] = (void*)(uintptr_t)(0x1000 * (t + 1));
    first_slot[t + 1] = first_slot[t] + (numel[t] + QCA_SCALER_CHUNK - 1) / QCA_SCALER_CHUNK * split;
  }
  std::vector<int64_t> covered(numel.size(), 0);
  std::vector<int> slot_writes(first_slot.back(), 0);
  int launches = 0;
  const qca_status s = qca_scaler_batches::for_each_batch(
      data.data(), numel.data(), (int64_t)numel.size(), split,
      [&](const qca_scaler_batches::ChunkBatch& b, int entries) {
        ++launches;
        if (entries < 1 || entries > qca_scaler_batches::kMaxEntries) return QCA_ERR_INVALID_ARGUMENT;
        for (int e = 0; e < entries; ++e) {
          const int slot = b.entry_tensor[e];
          if (slot >= qca_scaler_batches::kMaxTensors) return QCA_ERR_INVALID_ARGUMENT;
          const size_t t = (uintptr_t)b.data[slot] / 0x1000 - 1;
          if (t >= numel.size() || b.numel[slot] != numel[t]) return QCA_ERR_INVALID_ARGUMENT;
          for (int part = 0; part < split; ++part) {  // blockIdx.x % split
            const int64_t global_part = (int64_t)b.entry_chunk[e] * split + part;
            const int64_t begin = global_part * part_len;
            const int64_t end = begin + part_len < numel[t] ? begin + part_len : numel[t];
            if (end > begin) covered[t] += end - begin;
            const int64_t slot_index = b.first_partial[slot] + global_part;
            if (slot_index - first_slot[t] != global_part) return QCA_ERR_INVALID_ARGUMENT;
            slot_writes[slot_index] += 1;
          }
        }
        return QCA_OK;
      });
  if (s != QCA_OK) { std::printf("bad batch\n"); return 1; }
  for (size_t t = 0; t < numel.size(); ++t)
    if (covered[t] != numel[t]) {
      std::printf("tensor %zu covered %lld of %lld\n", t, (long long)covered[t], (long long)numel[t]);
      return 1;
    }
  for (size_t i = 0; i < slot_writes.size(); ++i)
    if (slot_writes[i] != 1) { std::printf("slot %zu written %d times\n", i, slot_writes[i]); return 1; }
  std::printf("ok %d\n", launches);
  return 0;
}
"""


@pytest.fixture(scope="module")
def plan_checker(tmp_path_factory):
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    root = Path(__file__).resolve().parents[2]
    folder = tmp_path_factory.mktemp("plan")
    (folder / "plan_check.cpp").write_text(PLAN_CHECK)
    binary = folder / "plan_check"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-I", str(root / "include"), "-I", str(root / "csrc" / "kernels"),
         str(folder / "plan_check.cpp"), "-o", str(binary)],
        check=True, capture_output=True, text=True,
    )

    def check(sizes):
        result = subprocess.run([str(binary)], input=" ".join(map(str, sizes)), capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
        return int(result.stdout.split()[1])

    return check


def test_cuda_launch_plan_covers_every_chunk_once(plan_checker):
    g = torch.Generator().manual_seed(7)
    assert plan_checker([]) == 0
    assert plan_checker([0, 0]) == 0
    assert plan_checker([5]) == 1
    assert plan_checker([320 * CHUNK]) == 1  # exactly one full batch
    assert plan_checker([320 * CHUNK + 1]) == 2
    assert plan_checker([1] * 64) == 1 and plan_checker([1] * 65) == 2  # tensor slots
    assert plan_checker([700 * CHUNK + 3, 0, 5, 2 * CHUNK]) == 3  # a tensor spanning three batches
    many = torch.randint(0, 3 * CHUNK, (300,), generator=g).tolist()
    many[::7] = [0] * len(many[::7])
    assert plan_checker(many + [400 * CHUNK + 9] + [7] * 70 + [0]) > 2

