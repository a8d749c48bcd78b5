"""The CUDA emulator itself (tests/cuda_emu): its warp and block operations give CUDA's results,
each of its checks reports the kernel that breaks the rule (tests/cuda_emu/selftest.cu), and
it reports a real kernel of the library with one barrier removed."""

import ctypes
import re

import pytest
import torch

from cuda_emu import emulator
from cuda_emu.build import KERNELS

pytestmark = pytest.mark.slow  # the emulator builds its self-test kernels

ptr = ctypes.c_void_p
CUDA_ERROR_INVALID_CONFIGURATION = 9


@pytest.fixture(scope="module")
def emu():
    return emulator()


def call(emu, name, *args):
    emu.lib.qca_emu_clear_reports()
    status = getattr(emu.lib, name)(*args)
    return status, emu.reports()


def p(t):
    return ptr(t.data_ptr())


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_tree_sum_with_barriers_is_exact_and_clean(emu, order):
    values = torch.arange(4 * 256, dtype=torch.float32)
    out = torch.zeros(4)
    with emu.settings(order=order, seed=3):
        status, reports = call(emu, "selftest_tree_sum", 1, p(values), p(out), 4, 256)
    assert status == 0 and reports == []
    assert torch.equal(out, values.view(4, 256).sum(1))


def test_race_detector_reports_a_tree_sum_without_barriers(emu):
    values = torch.arange(256, dtype=torch.float32)
    out = torch.zeros(1)
    status, reports = call(emu, "selftest_tree_sum", 0, p(values), p(out), 1, 256)
    assert status == 0
    assert len(reports) == 1 and "shared-memory race" in reports[0], reports
    assert "tree_sum_kernel<false>" in reports[0] and "partial" in reports[0], reports


def expected_warp_ops(threads, width):
    rows = []
    values = [t * 10 + 1 for t in range(threads)]
    for t in range(threads):
        lane, base = t % 32, t - t % 32
        segment = base + lane // width * width
        offset = lane % width
        up = t - 2 if offset >= 2 else t
        down = t + 5 if offset + 5 < width else t
        xor = base + (lane ^ 6)
        xor = xor if xor < segment + width else t
        ballot = sum(1 << (u - base) for u in range(base, base + 32) if u % 3 == 0)
        ballot = ballot - (1 << 32) if ballot >= 1 << 31 else ballot  # as an int
        warp = range(base, base + 32)
        count = sum(1 for u in range(threads) if u % 5 == 0)
        rows.append([values[segment + 3 % width], values[up], values[down], values[xor], ballot,
                     int(37 in warp), int(all(u < 60 for u in warp)),
                     count * 10000 + int(threads > 40) * 100 + 1])
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("width", [32, 16, 8, 1])
def test_warp_and_block_operations_give_cudas_results(emu, width):
    out = torch.zeros(64, 8, dtype=torch.int32)
    status, reports = call(emu, "selftest_warp_ops", p(out), 64, width)
    assert status == 0 and reports == []
    assert torch.equal(out, expected_warp_ops(64, width))


def test_a_shuffle_moves_all_eight_bytes_of_a_double(emu):
    out = torch.zeros(32, dtype=torch.float64)
    status, reports = call(emu, "selftest_shuffle_double", p(out))
    assert status == 0 and reports == []
    v = 1.0 + torch.arange(32, dtype=torch.float64) / 3.0
    assert torch.equal(out, torch.cat([v[1:], v[31:]]))


@pytest.mark.parametrize("kind, message", [
    (0, r"divergent barrier: .* at __syncthreads \(.*selftest.cu:\d+\), .* at __syncthreads \(.*selftest.cu:\d+\)"),
    (1, r"__syncthreads .* reached after 32 of the block's threads returned"),
    (2, r"__shfl_down_sync .* lane 16 calls it with mask 0x0000ffff, which leaves it out"),
    (3, r"deadlock: thread \(0,0,0\) waits at __shfl_sync .* mask 0x0000ffff for lane 8, which returned"),
    (4, r"deadlock: .* waits at __shfl_down_sync .* for lane 16, which waits at a block barrier"),
])
def test_broken_synchronisation_is_reported(emu, kind, message):
    out = torch.zeros(64, dtype=torch.int32)
    status, reports = call(emu, "selftest_broken_sync", kind, p(out), 64)
    assert status == 0  # the launch itself is valid; what happens inside is reported
    assert any(re.search(message, r) for r in reports), reports
    assert all("broken_sync_kernel" in r for r in reports)


def test_a_shuffle_reading_a_lane_outside_its_mask_is_reported(emu):
    out = torch.zeros(32, dtype=torch.int32)
    status, reports = call(emu, "selftest_broken_sync", 2, p(out), 32)
    assert any("lane 15 reads lane 16, which the mask 0x0000ffff leaves out" in r for r in reports), reports


@pytest.mark.parametrize("atomic", [True, False])
def test_shared_atomics_do_not_race_and_plain_updates_do(emu, atomic):
    out = torch.zeros(3, dtype=torch.int32)
    status, reports = call(emu, "selftest_shared_count", int(atomic), p(out), 3, 128)
    assert status == 0
    if atomic:
        assert reports == [] and out.tolist() == [128] * 3
    else:
        assert len(reports) == 1 and "shared-memory race" in reports[0] and "count" in reports[0]


@pytest.mark.parametrize("syncwarp", [True, False])
def test_syncwarp_orders_a_warps_shared_memory_accesses(emu, syncwarp):
    out = torch.zeros(32, dtype=torch.int32)
    status, reports = call(emu, "selftest_warp_exchange", int(syncwarp), p(out))
    assert status == 0
    if syncwarp:
        assert reports == [] and out.tolist() == list(range(31, -1, -1))
    else:
        # lane 0 reads slot 31 before lane 31 wrote it (reported), then lane 31 writes it
        assert any("write after read" in r and "slots" in r for r in reports), reports


def test_reading_shared_memory_no_thread_wrote_is_reported(emu):
    out = torch.zeros(32)
    status, reports = call(emu, "selftest_uninitialized_read", p(out))
    assert len(reports) == 1 and "never_written" in reports[0] and "before any thread" in reports[0]
    assert torch.isnan(out).all()  # shared memory starts as 0xff bytes


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_thread_and_block_order(emu, order):
    blocks, threads = 3, 64
    log = torch.full((blocks * threads,), -1, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    with emu.settings(order=order, seed=1):
        status, reports = call(emu, "selftest_order", p(log), p(counter), blocks, threads)
    assert status == 0 and reports == []
    ids = log.tolist()
    assert sorted(ids) == list(range(blocks * threads))
    if order == "forward":
        assert ids == list(range(blocks * threads))
    elif order == "reverse":
        assert ids == list(range(blocks * threads))[::-1]
    else:
        block_order = [ids[b * threads] // threads for b in range(blocks)]
        assert ids != sorted(ids) and sorted(block_order) == [0, 1, 2]


@pytest.mark.parametrize("grid, block, smem, problem", [
    ((1, 1, 1), (33, 32, 1), 0, "more than 1024 threads per block"),
    ((1, 1, 1), (1025, 1, 1), 0, "block dimensions over"),
    ((1, 1, 1), (1, 1, 65), 0, "block dimensions over"),
    ((1, 1, 1), (0, 1, 1), 0, "a block dimension is 0"),
    ((0, 1, 1), (32, 1, 1), 0, "a grid dimension is 0"),
    ((1, 65536, 1), (32, 1, 1), 0, "grid dimensions over"),
    ((2 ** 31, 1, 1), (32, 1, 1), 0, "grid dimensions over"),
    ((1, 1, 1), (32, 1, 1), 48 * 1024 + 1, "dynamic shared memory, over the 49152 allowed"),
])
def test_invalid_launch_configurations_fail_as_on_a_gpu(emu, grid, block, smem, problem):
    status, reports = call(emu, "selftest_empty", *grid, *block, ctypes.c_int64(smem))
    assert status == CUDA_ERROR_INVALID_CONFIGURATION
    assert len(reports) == 1 and "invalid launch configuration" in reports[0] and problem in reports[0]


def test_the_largest_valid_launch_is_accepted(emu):
    status, reports = call(emu, "selftest_empty", 1, 1, 1, 32, 32, 1, ctypes.c_int64(48 * 1024))
    assert status == 0 and reports == []


def test_static_shared_memory_over_48_kib_is_reported(emu):
    out = torch.zeros(64, dtype=torch.float64)
    status, reports = call(emu, "selftest_big_static_shared", p(out))
    assert any("56000 bytes of static" in r and "big_static_shared_kernel" in r for r in reports), reports


@pytest.mark.parametrize("smem, opt_in, expected", [
    (256 * 4, 0, 0), (60000, 0, CUDA_ERROR_INVALID_CONFIGURATION), (60000, 60000, 0),
    (60000, 70000, 1),  # cudaErrorInvalidValue: over the emulated device's 64 KiB opt-in limit
])
def test_dynamic_shared_memory(emu, smem, opt_in, expected):
    values = torch.arange(2 * 256, dtype=torch.float32)
    out = torch.zeros_like(values)
    status, reports = call(emu, "selftest_dynamic_reverse", p(values), p(out), 2, 256,
                           ctypes.c_int64(smem), opt_in)
    assert status == expected
    if expected == 0:
        assert reports == [] and torch.equal(out, values.view(2, 256).flip(1).flatten())


def test_multiprocessor_count_is_the_configured_one(emu):
    sms = ctypes.c_int(0)
    with emu.settings(sms=7):
        assert emu.lib.selftest_multiprocessor_count(ctypes.byref(sms)) == 0
    assert sms.value == 7


def bits_of(values, dtype):
    return values.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("name, dtype", [("half", torch.float16), ("bfloat16", torch.bfloat16)])
def test_half_and_bfloat16_conversions_round_like_torch(emu, name, dtype):
    to_float = getattr(emu.lib, f"selftest_{name}_to_float")
    to_narrow = getattr(emu.lib, f"selftest_float_to_{name}")
    to_float.restype, to_float.argtypes = ctypes.c_float, [ctypes.c_ushort]
    to_narrow.restype, to_narrow.argtypes = ctypes.c_ushort, [ctypes.c_float]
    # Every 16-bit pattern widens exactly as torch widens it.
    patterns = torch.arange(0, 1 << 16, dtype=torch.int32)
    widened = torch.tensor([to_float(int(b)) for b in patterns], dtype=torch.float32)
    reference = patterns.to(torch.int16).view(dtype).float()
    assert torch.equal(widened.isnan(), reference.isnan())
    keep = ~reference.isnan()
    assert torch.equal(widened[keep], reference[keep])
    # Narrowing: each value exactly between two neighbours (ties go to even), just either side of
    # it, random floats, subnormals, overflow, infinities; NaN becomes CUDA's canonical 0x7fff.
    finite = reference[keep & reference.isfinite()].double().unique()
    middles = (finite[1:] + finite[:-1]) / 2
    samples = torch.cat([middles, torch.nextafter(middles, torch.tensor(-torch.inf, dtype=torch.float64)),
                         torch.nextafter(middles, torch.tensor(torch.inf, dtype=torch.float64)),
                         torch.randn(2000, dtype=torch.float64) * 1e3,
                         torch.randn(2000, dtype=torch.float64) * 1e-6,
                         torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e39, 3.4e38, -3.4e38,
                                       1e-45, -1e-40, torch.inf, -torch.inf], dtype=torch.float64)])
    samples = samples.float()  # the conversions take a float
    narrowed = torch.tensor([to_narrow(float(v)) for v in samples], dtype=torch.int32)
    assert torch.equal(narrowed, bits_of(samples, dtype))
    assert to_narrow(float("nan")) == 0x7FFF and to_narrow(-float("nan")) == 0x7FFF


def test_a_scaler_kernel_with_its_barrier_removed_is_reported(emu, tmp_path):
    """The detector can fail on real code: scaler.cu's block reduction with its one
    __syncthreads() removed, built into its own library."""
    source = (KERNELS / "scaler.cu").read_text()
    assert source.count("__syncthreads();") == 1
    mutant = tmp_path / "scaler.cu"
    mutant.write_text(source.replace("__syncthreads();", ""))
    cuda_sources = tuple(sorted([mutant] + [s for s in KERNELS.glob("*.cu") if s.name != "scaler.cu"]))
    broken = emulator(cuda_sources)
    data = torch.randn(3000)
    factor, found_inf = torch.ones(1), torch.zeros(1)
    sumsq = torch.zeros(1, dtype=torch.float64)
    numel = torch.tensor([data.numel()])
    workspace = torch.zeros(broken.lib.emu_unscale_workspace_size(1, p(numel)), dtype=torch.float64)
    tensors = (ctypes.c_void_p * 1)(data.data_ptr())
    for lib in (emu, broken):
        result = lib.run("emu_unscale", 1, 0, 1, tensors, p(numel), p(factor), p(found_inf),
                         p(sumsq), p(workspace))
        if lib is emu:
            result.check()
    assert any("shared-memory race" in r and "unscale_chunks_kernel::shared" in r for r in result.reports), result.reports
