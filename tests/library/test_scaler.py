"""qca_lowmem.amp: kernels against plain references, GradScaler side by side with torch's."""

import copy
import pickle
import warnings
from unittest import mock

import pytest
import torch
from helpers import CUDA, cuda_only
from torch import nn

import qca_lowmem
from qca_lowmem.amp import GradScaler
from qca_lowmem.recompute.cuda_graphs import caching_allocator_off

ops = torch.ops.qca_lowmem
CHUNK = 65536
SIZES = [0, 1, 3, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128]


# ----------------------------------------------------------------------------------------------
# References


def reference_unscale(t, inv):
    """torch's arithmetic: fp16/bf16 in float, float64 times the float factor widened; complex as
    pairs of reals; a factor of exactly 1 leaves values untouched."""
    real = torch.view_as_real(t) if t.is_complex() else t
    if inv == 1.0:
        out = real.clone()
    elif real.dtype in (torch.float16, torch.bfloat16):
        out = (real.float() * torch.tensor(inv, dtype=torch.float32)).to(real.dtype)
    else:
        out = real * torch.tensor(inv, dtype=torch.float32).to(real.dtype)
    return torch.view_as_complex(out) if t.is_complex() else out


def reference_sumsq(t):
    real = torch.view_as_real(t) if t.is_complex() else t
    return real.double().pow(2).sum().item()


def random_list(sizes, dtype, device="cpu", generator=None):
    return [(torch.randn(n, dtype=torch.float64, device=device) * 100).to(dtype) if not dtype.is_complex
            else torch.randn(n, dtype=dtype, device=device) * 100 for n in sizes]


def bits_equal(a, b):
    """Bitwise equality (NaNs included)."""
    ra = torch.view_as_real(a) if a.is_complex() else a
    rb = torch.view_as_real(b) if b.is_complex() else b
    if ra.dtype in (torch.float16, torch.bfloat16):
        return torch.equal(ra.view(torch.int16), rb.view(torch.int16))
    if ra.dtype == torch.float32:
        return torch.equal(ra.view(torch.int32), rb.view(torch.int32))
    return torch.equal(ra.view(torch.int64), rb.view(torch.int64))


# ----------------------------------------------------------------------------------------------
# Kernels


def check_unscale(device, dtype, sizes, inv):
    grads = random_list(sizes, dtype, device)
    originals = [g.clone() for g in grads]
    found_inf = torch.zeros((), device=device)
    inv_scale = torch.tensor(inv, dtype=torch.float32, device=device)
    sumsq = ops.amp_unscale_(grads, found_inf, inv_scale, True)
    assert found_inf.item() == 0.0
    assert sumsq.dtype == torch.float64 and sumsq.shape == (len(grads),)
    for g, o, s in zip(grads, originals, sumsq.tolist()):
        expected = reference_unscale(o, inv)
        assert bits_equal(g, expected), (dtype, g.numel())
        assert s == pytest.approx(reference_sumsq(expected), rel=1e-12, abs=0.0)


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


# ----------------------------------------------------------------------------------------------
# GradScaler side by side with torch's


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def twin_runs(device="cpu", optimizer_factory=None):
    torch.manual_seed(0)
    model = Net().to(device)
    twin = copy.deepcopy(model)
    factory = optimizer_factory or (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    return model, factory(model.parameters()), twin, factory(twin.parameters())


def run_training(model, opt, scaler, steps, inject, explicit_unscale, clip, device="cpu"):
    """Returns the scale after each update."""
    scales = []
    g = torch.Generator(device=device).manual_seed(5)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 6, generator=g, device=device)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step in inject:
            model.a.weight.grad[1, 2] = inject[step]
        if explicit_unscale:
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


INJECT = {3: float("inf"), 11: float("nan"), 23: float("-inf"), 37: float("inf"), 52: float("nan")}


@pytest.mark.parametrize("explicit_unscale,clip", [(False, False), (True, False), (True, True)])
def test_side_by_side_with_torch_scaler(explicit_unscale, clip):
    model, opt, twin, twin_opt = twin_runs()
    ours = GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    scales = run_training(model, opt, ours, 60, INJECT, explicit_unscale, clip)
    twin_scales = run_training(twin, twin_opt, theirs, 60, INJECT, explicit_unscale, clip)
    assert scales == twin_scales
    skipped = [i for i in range(1, 60) if scales[i] < scales[i - 1]] + ([0] if scales[0] < 2.0**12 else [])
    assert sorted(skipped) == sorted(INJECT)
    assert sum(scales[i] > scales[i - 1] for i in range(1, 60)) >= 4  # grew several times
    for p, q in zip(model.parameters(), twin.parameters()):
        assert bits_equal(p, q)
    assert opt.state_dict()["state"][0]["step"] == twin_opt.state_dict()["state"][0]["step"] == 60 - len(INJECT)
    assert ours.state_dict() == theirs.state_dict()


def test_is_a_torch_grad_scaler_with_same_defaults():
    ours, theirs = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    assert isinstance(ours, torch.amp.GradScaler)
    assert ours.state_dict() == theirs.state_dict()
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (2.0, 0.5, 2000)
    ours.set_growth_factor(3.0)
    ours.set_backoff_factor(0.25)
    ours.set_growth_interval(7)
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (3.0, 0.25, 7)
    assert ours.is_enabled()
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.0)):
        with pytest.raises(AssertionError, match="factor must be"):
            GradScaler("cpu", **bad)


def stage_error_messages(scaler_cls):
    messages = []

    def attempt(fn):
        try:
            fn()
        except (RuntimeError, AssertionError, ValueError) as e:
            messages.append((type(e).__name__, str(e)))
        else:
            messages.append(None)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu")
    attempt(lambda: scaler.unscale_(opt))  # before scale()
    attempt(lambda: scaler.step(opt))
    attempt(lambda: scaler.update())
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    attempt(lambda: scaler.step(opt, closure=lambda: 0.0))
    scaler.unscale_(opt)
    attempt(lambda: scaler.unscale_(opt))
    scaler.step(opt)
    attempt(lambda: scaler.unscale_(opt))
    attempt(lambda: scaler.step(opt))
    scaler.update()
    attempt(lambda: scaler.update())  # no inf checks recorded
    attempt(lambda: scaler.update(torch.tensor([1.0, 2.0])))
    attempt(lambda: scaler.update(torch.tensor(2.0, requires_grad=True)))
    half = nn.Parameter(torch.randn(3).half())
    half.grad = torch.ones(3, dtype=torch.float16)
    other = torch.optim.SGD([half], lr=0.1)
    attempt(lambda: scaler.unscale_(other))
    return messages


def test_stage_errors_match_torch():
    ours, theirs = stage_error_messages(GradScaler), stage_error_messages(torch.amp.GradScaler)
    assert ours == theirs
    assert all(m is not None for m in ours)
    assert ("RuntimeError", "unscale_() has already been called on this optimizer since the last update().") in ours


def test_fp16_grads_allowed_on_request():
    p = nn.Parameter(torch.randn(5).half())
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, allow_fp16_grads=True)
    scaler.scale(torch.zeros(()))
    p.grad = (torch.randn(5) * 4).half()
    expected = reference_unscale(p.grad, 0.25)
    scaler.unscale_(opt)
    assert bits_equal(p.grad, expected)


def test_disabled_scaler_is_torch_like():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(torch.randn(3, 6)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    scaler.update()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    scaler.load_state_dict({"scale": 3.0})  # no-op
    assert scaler.clip_grad_norm_(model.parameters(), 1.0) > 0
    assert scaler.overflow_report() == []


@pytest.mark.skipif(CUDA, reason="the warning is about CUDA being unavailable")
def test_cuda_scaler_without_cuda_disables_with_torch_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = GradScaler()
    assert not scaler.is_enabled()
    assert any("CUDA is not available" in str(w.message) for w in caught)


def test_multiple_optimizers_side_by_side():
    def run(scaler_cls):
        torch.manual_seed(0)
        m1, m2 = Net(), Net()
        o1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
        o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
        scaler = scaler_cls("cpu", init_scale=2.0**8, growth_interval=3)
        scales = []
        for step in range(20):
            o1.zero_grad()
            o2.zero_grad()
            x = torch.randn(4, 6)
            scaler.scale(m1(x).sum() + m2(x).pow(2).sum()).backward()
            if step in (4, 9):
                m2.b.bias.grad[0] = float("inf")
            if step == 9:
                m1.a.bias.grad[0] = float("nan")
            scaler.unscale_(o1)
            scaler.step(o1)
            scaler.step(o2)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in [*m1.parameters(), *m2.parameters()]]

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0]
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_state_dict_round_trips_both_ways():
    model, opt, _, _ = twin_runs()
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    run_training(model, opt, ours, 7, {2: float("inf")}, False, False)
    state = ours.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert state["_growth_tracker"] == 1 and state["scale"] == 2.0**10
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.state_dict() == state
    again = GradScaler("cpu")
    again.load_state_dict(theirs.state_dict())
    assert again.state_dict() == state
    # loaded values drive the next updates identically
    for scaler in (theirs, again):
        scaler.scale(torch.ones(()))
    for _ in range(2):
        for scaler in (theirs, again):
            scaler._per_optimizer_states[0]["found_inf_per_device"] = {torch.device("cpu"): torch.zeros(())}
            scaler.update()
    assert theirs.state_dict() == again.state_dict()
    assert again.state_dict()["scale"] == 2.0**11
    with pytest.raises(RuntimeError, match="source state dict is empty"):
        again.load_state_dict({})
    restored = pickle.loads(pickle.dumps(ours))
    assert restored.state_dict() == ours.state_dict() and isinstance(restored, GradScaler)


@pytest.mark.parametrize("new_scale", [123.0, torch.tensor(77.0)], ids=["float", "tensor"])
def test_update_with_new_scale(new_scale):
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu")
        scaler.scale(torch.ones(()))
        scaler.update(new_scale)
        results.append(scaler.state_dict())
    assert results[0] == results[1]
    assert results[0]["scale"] == float(new_scale)


def test_step_supports_amp_scaling_optimizer_matches_torch():
    def run(scaler_cls):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        assert opt._step_supports_amp_scaling
        scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3)
        scales = run_training(model, opt, scaler, 12, {4: float("inf")}, False, False)
        return scales, [p.detach().clone() for p in model.parameters()]

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0]
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_sparse_gradients_match_torch():
    def run(scaler_cls):
        torch.manual_seed(0)
        emb = nn.Embedding(20, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = scaler_cls("cpu", init_scale=2.0**6, growth_interval=2)
        scales = []
        for step in range(8):
            opt.zero_grad()
            idx = torch.tensor([1, 3, 3, 7])
            scaler.scale(emb(idx).pow(2).sum()).backward()
            if step == 3:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, emb.weight.detach().clone()

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0] and bits_equal(ours[1], theirs[1])


# ----------------------------------------------------------------------------------------------
# Complex and bfloat16 gradients


class ComplexAndBf16(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, dtype=torch.complex64))
        self.v = nn.Parameter(torch.randn(6).bfloat16())

    def forward(self, x):
        return (self.w * x).abs().pow(2).sum() + (self.v.float() * x.real).sum()


@pytest.mark.parametrize("bad_param", ["w", "v"])
def test_complex_and_bf16_gradients(bad_param):
    model = ComplexAndBf16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(6, dtype=torch.complex64)
    scaler.scale(model(x)).backward()
    scaled = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaler.unscale_(opt)
    for n, p in model.named_parameters():
        assert bits_equal(p.grad, reference_unscale(scaled[n], 2.0**-8)), n
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="ComplexFloat"):  # what this scaler is for
        torch_scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**8

    # a non-finite gradient: detected, step skipped, scale backed off, reported
    opt.zero_grad()
    scaler.scale(model(x)).backward()
    getattr(model, bad_param).grad[2] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(bits_equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7
    assert scaler.overflow_report(model) == [bad_param]


# ----------------------------------------------------------------------------------------------
# clip_grad_norm_ and overflow_report


def scaled_grads_twice(dtype=torch.float32):
    torch.manual_seed(0)
    model = Net()
    model.extra = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    twin = copy.deepcopy(model)
    for m in (model, twin):
        torch.manual_seed(1)
        x = torch.randn(4, 6)
        loss = m(x).pow(2).sum() * 1000 + (m.extra.abs() ** 2).sum()
        (loss * 2.0**10).backward()
    return model, twin


def unscale_ours_and_by_hand(model, twin):
    """Our scaler unscales model's gradients; twin's are unscaled by hand, as torch would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    for p in twin.parameters():
        p.grad.mul_(2.0**-10)
    return scaler


@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_clip_grad_norm_uses_unscale_norm_and_matches_torch(max_norm):
    model, twin = scaled_grads_twice()
    scaler = unscale_ours_and_by_hand(model, twin)
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", side_effect=AssertionError("took torch's path")):
        ours = scaler.clip_grad_norm_(model.parameters(), max_norm, reuse_unscale_norm=True)  # the fused path only
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        if max_norm > 1e8:  # no clipping: untouched
            assert bits_equal(p.grad, q.grad)
    # clipping changed the gradients: a second clip measures them again
    torch_clip = torch.nn.utils.clip_grad_norm_
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", wraps=torch_clip) as spy:
        again = scaler.clip_grad_norm_(model.parameters(), max_norm, reuse_unscale_norm=True)
    assert spy.call_count == 1
    torch.testing.assert_close(again, torch_clip(twin.parameters(), max_norm), rtol=2e-7, atol=0)


def test_clip_grad_norm_bf16_matches_torch():
    model, twin = scaled_grads_twice()
    del model.extra, twin.extra
    model.bfloat16()
    twin.bfloat16()
    scaler = unscale_ours_and_by_hand(model, twin)
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0, reuse_unscale_norm=True)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_grad_norm_falls_back_to_torch():
    model, twin = scaled_grads_twice()
    scaler = GradScaler("cpu")
    # not unscaled by this scaler: exactly torch's
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert bits_equal(ours, theirs)
    # unscaled, then changed behind the scaler's back: the cache is not trusted
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    for p in twin.parameters():
        p.grad.mul_(2.0**-16)
    model.a.weight.grad.mul_(3.0)
    twin.a.weight.grad.mul_(3.0)
    assert scaler._reusable_sums(list(model.parameters())) is None
    assert bits_equal(scaler.clip_grad_norm_(model.parameters(), 1.0), torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0))
    # other norm types
    inf_ours = scaler.clip_grad_norm_(model.parameters(), 1.0, norm_type="inf")
    assert bits_equal(inf_ours, torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0, norm_type="inf"))


def test_clip_grad_norm_nonfinite_error_like_torch():
    model, _ = scaled_grads_twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    model.b.bias.grad[0] = float("inf")
    scaler.unscale_(opt)
    assert torch.isnan(scaler.clip_grad_norm_(model.parameters(), 1.0, reuse_unscale_norm=True))  # torch: inf or nan
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        scaler.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_overflow_report_names_parameters():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    model.a.bias.grad[3] = float("inf")
    model.b.weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    assert scaler.overflow_report(model) == ["a.bias", "b.weight"]
    scaler.update()
    assert scaler.overflow_report(model) == ["a.bias", "b.weight"]  # still there after update
    assert scaler.overflow_report() == ["optimizer[0].param_groups[0].params[1]", "optimizer[0].param_groups[0].params[2]"]
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.overflow_report(model) == []


def test_package_exports_scaler():
    assert qca_lowmem.amp.GradScaler is GradScaler
    assert "amp" in qca_lowmem.__all__


# ----------------------------------------------------------------------------------------------
# CUDA


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_unscale_matches_reference(dtype):
    check_unscale("cuda", dtype, SIZES, 2.0**-13)
    check_unscale("cuda", dtype, [CHUNK * 3 + 1, 5], 3.0)
    check_unscale("cuda", dtype, [0, 5], 1.0)


@cuda_only
def test_cuda_many_tensors_span_batches():
    # more tensors than one launch holds, and a tensor cut across launches
    sizes = [int(s) for s in torch.randint(0, 5000, (300,))] + [400 * CHUNK + 3] + [7] * 70
    check_unscale("cuda", torch.float32, sizes, 0.125)
    grads = random_list(sizes, torch.float32, "cuda")
    grads[-1][3] = float("nan")
    grads[300][399 * CHUNK] = float("inf")
    found_inf = torch.zeros((), device="cuda")
    sumsq = ops.amp_unscale_(grads, found_inf, torch.tensor(0.5, device="cuda"), True)
    flags = torch.isnan(sumsq).nonzero().flatten().tolist()
    assert found_inf.item() == 1.0 and flags == [300, len(sizes) - 1]


@cuda_only
def test_cuda_unaligned_views():
    base = torch.randn(CHUNK * 2 + 9, device="cuda")
    view = base[1:]  # not 16-byte aligned
    expected = reference_unscale(view, 0.5)
    ops.amp_unscale_([view], torch.zeros((), device="cuda"), torch.tensor(0.5, device="cuda"))
    assert bits_equal(view, expected)


@cuda_only
def test_cuda_update_and_mul_match_torch():
    for flag in (0.0, 1.0, 0.0, 0.0):
        ours = (torch.tensor(1024.0, device="cuda"), torch.tensor(1, dtype=torch.int32, device="cuda"))
        theirs = (ours[0].clone(), ours[1].clone())
        f = torch.tensor(flag, device="cuda")
        ops.amp_update_scale_(*ours, f, 2.0, 0.5, 2)
        torch._amp_update_scale_(*theirs, f, 2.0, 0.5, 2)
        assert bits_equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    # The multiply is the CPU one (float factor, one rounding). torch's CUDA foreach multiply by
    # a CUDA scalar tensor rounds the factor to bf16 first (seen on an H100, torch 2.11), so it
    # may differ from ours by one ulp.
    a = random_list(SIZES, torch.bfloat16, "cuda")
    b = [t.clone() for t in a]
    expected = [reference_unscale(t, 0.3) for t in a]
    ops.amp_mul_(a, torch.tensor(0.3, device="cuda"))
    torch._foreach_mul_(b, torch.tensor(0.3, device="cuda"))
    assert all(bits_equal(x, e) for x, e in zip(a, expected))
    assert all(bool(((x.view(torch.int16).int() - y.view(torch.int16).int()).abs() <= 1).all()) for x, y in zip(a, b))


@cuda_only
def test_cuda_mixed_devices_raise():
    with pytest.raises(RuntimeError, match=r"one device.*grads\[1\]"):
        ops.amp_unscale_([torch.randn(2, device="cuda"), torch.randn(2)], torch.zeros((), device="cuda"),
                         torch.tensor(0.5, device="cuda"))
    with pytest.raises(RuntimeError, match=r"inv_scale must be on the same device"):
        ops.amp_unscale_([torch.randn(2, device="cuda")], torch.zeros((), device="cuda"), torch.tensor(0.5))


@cuda_only
def test_cuda_side_by_side_with_torch_autocast():
    def run(scaler_cls):
        torch.manual_seed(0)
        model = Net().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = scaler_cls("cuda", init_scale=2.0**14, growth_interval=3)
        scales = []
        for step in range(50):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(8, 6, device="cuda")).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step in INJECT:
                model.a.weight.grad[0, 0] = INJECT[step]
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    ours, theirs = run(GradScaler), run(torch.amp.GradScaler)
    assert ours[0] == theirs[0]
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


@cuda_only
def test_cuda_clip_grad_norm_matches_torch():
    model = Net().cuda()
    model.extra = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64, device="cuda"))
    (model(torch.randn(4, 6, device="cuda")).pow(2).sum() * 1000 + model.extra.abs().sum()).backward()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):  # (deepcopy may leave grads behind)
        q.grad = p.grad.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cuda", init_scale=1.0)
    scaler.scale(torch.ones((), device="cuda"))
    scaler.unscale_(opt)
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0, reuse_unscale_norm=True)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert ours.device.type == "cuda"  # the norm stays on the GPU: no sync
    torch.testing.assert_close(ours.cpu(), theirs.cpu(), rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


@cuda_only
@pytest.mark.skipif(caching_allocator_off(), reason="a CUDA graph capture needs torch's caching allocator")
def test_cuda_graph_capture_of_scale_unscale_update():
    torch.manual_seed(0)
    model = Net().cuda()
    reference_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    x = torch.randn(8, 6, device="cuda")

    def iteration():
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(opt)
        scaler.update()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch's CUDA-graph recipe asks
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            iteration()
    torch.cuda.current_stream().wait_stream(side)
    scale, tracker = scaler.get_scale(), scaler._get_growth_tracker()

    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration()

    reference_model(x).sum().backward()
    original = x[0, 0].item()
    for replay in range(6):
        overflow = replay == 4
        if overflow:
            x[0, 0] = float("inf")
        graph.replay()
        torch.cuda.synchronize()
        if overflow:
            scale, tracker = scale * 0.5, 0
            x[0, 0] = original
        else:
            tracker += 1
            if tracker == 2:
                scale, tracker = scale * 2, 0
            for p, q in zip(model.parameters(), reference_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)  # unscaled
        assert scaler.get_scale() == scale and scaler._get_growth_tracker() == tracker


# ----------------------------------------------------------------------------------------------
# torch's AMP recipes, side by side (accumulation, gradient penalty, several outputs)


def recipe_run(scaler_cls, recipe):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for step in range(12):
        opt.zero_grad()
        xs = torch.randn(3, 4, 6)
        if recipe == "accumulation":
            for x in xs:
                scaler.scale(model(x).pow(2).mean() / len(xs)).backward()
        elif recipe == "penalty":
            loss = model(xs[0]).pow(2).mean()
            scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in scaled).sqrt()
            scaler.scale(loss + penalty).backward()
        else:  # several outputs, nested
            a, (b, c) = scaler.scale([model(xs[0]).sum(), (model(xs[1]).sum(), model(xs[2]).sum())])
            (a + b + c).backward()
        if step == 5:
            model.b.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["accumulation", "penalty", "outputs"])
def test_amp_recipes_match_torch(recipe):
    ours, theirs = recipe_run(GradScaler, recipe), recipe_run(torch.amp.GradScaler, recipe)
    scales = ours[0]
    assert scales == theirs[0]
    assert max(scales) > 2.0**10 and any(later < earlier for earlier, later in zip(scales, scales[1:]))
    assert all(bits_equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_optimizer_taking_grad_scaler_gets_ours():
    class SelfUnscaling(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.seen = grad_scaler
            return super().step(closure)

    model = Net()
    opt = SelfUnscaling(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(opt)
    assert opt.seen is scaler


@cuda_only
def test_cuda_no_host_sync_outside_step():
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cuda")
    x = torch.randn(4, 6, device="cuda")
    scaler.scale(model(x).sum()).backward()  # first call creates the scale
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    loss = model(x).sum()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaled = scaler.scale(loss)
        scaled.backward()
        scaler.unscale_(opt)
        scaler.clip_grad_norm_(model.parameters(), 1.0, reuse_unscale_norm=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    scaler.step(opt)  # the one synchronization: the skip decision
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_clip_grad_norm_subsets_and_several_optimizers():
    model, twin = scaled_grads_twice()
    for p in twin.parameters():
        p.grad.mul_(2.0**-10)
    first = torch.optim.SGD(list(model.a.parameters()) + [model.extra], lr=0.1)
    second = torch.optim.SGD(model.b.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    scaler.unscale_(first)
    # a subset of one optimizer's parameters
    ours = scaler.clip_grad_norm_([model.a.weight, model.extra], 0.5, reuse_unscale_norm=True)
    theirs = torch.nn.utils.clip_grad_norm_([twin.a.weight, twin.extra], 0.5)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    # parameters of an optimizer not unscaled yet: torch's path on the scaled grads
    assert scaler._reusable_sums(list(model.parameters())) is None
    scaler.unscale_(second)
    assert scaler._reusable_sums(list(model.b.parameters()) + [model.a.bias]) is not None
    ours = scaler.clip_grad_norm_(list(model.b.parameters()) + [model.a.bias], 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(list(twin.b.parameters()) + [twin.a.bias], 0.5)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_without_native_kernels_falls_back_to_torch():
    model, opt, twin, twin_opt = twin_runs()
    ours = GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    ours._native = False  # as on a device our build has no kernels for
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    with mock.patch.object(ops, "amp_unscale_", side_effect=AssertionError("used our kernel")):
        scales = run_training(model, opt, ours, 20, INJECT, True, True)
    assert scales == run_training(twin, twin_opt, theirs, 20, INJECT, True, True)
    assert all(bits_equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert ours.overflow_report() == []


def test_clip_grad_norm_measures_by_default_a_gradient_changed_through_data():
    """Old-style value clipping edits gradients through .data, which keeps their versions: only
    measuring them again sees it, so that is the default; reuse_unscale_norm=True is the caller's
    word that nothing did."""
    model, twin = scaled_grads_twice()
    scaler = unscale_ours_and_by_hand(model, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        if not p.grad.is_complex():
            p.grad.data.clamp_(-0.01, 0.01)
            q.grad.clamp_(-0.01, 0.01)
    ours = scaler.clip_grad_norm_(model.parameters(), 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert bits_equal(p.grad, q.grad)
