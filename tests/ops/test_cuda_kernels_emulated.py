"""Every CUDA kernel family run by the CPU emulator (tests/cuda_emu) and compared with the C
kernels on the same inputs: the CPU tests' shapes plus edge shapes (one cell, counts that are not
a multiple of the block size, zero-size, strided, permuted and channels_last layouts) in every
supported dtype. Each emulated launch must also pass the emulator's checks (no race, no
divergent barrier or shuffle, valid launch configuration).

Bit-identical where CUDA and C run the same maths: the QCA step and the noise (their shared
.inc files; CUDA rounds each product on its own, as C does, see docs/cuda_emulation.md), the
scaler's multiply, non-finite check and scale update. GroupNorm+ELU and the scaler's sums of
squares add in a different order than C (and GroupNorm+ELU's CUDA kernels accumulate float data
in float throughout, where C adds float lanes of at most 32 terms into double), so they compare
within the tolerances stated at each comparison. GroupNorm+ELU's CUDA results are compared with
themselves bit for bit instead: a sample's bits must not depend on the batch it is in or on the
GPU's size."""

import ctypes
import math

import pytest
import torch

from cuda_emu import CUDA, QCA_DTYPE, C, describe, emulator
from helpers import pool_specials

pytestmark = pytest.mark.slow  # the emulator builds every kernel and runs each thread as a fiber

COMPLEX = [torch.complex64, torch.complex128]
REALS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
QCA_OK, QCA_ERR_UNSUPPORTED_DTYPE, QCA_ERR_CUDA = 0, 2, 3
BAD_DTYPE = 7


@pytest.fixture(scope="module")
def emu():
    return emulator()


def ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def bits(t):
    """The tensor's storage as integers, so that equal means equal bits (NaN and -0.0 included)."""
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bits(a, b, what):
    same = bits(a) == bits(b)
    assert bool(same.all()), (
        f"{what}: {int((~same).sum())} of {same.numel()} values differ; first at "
        f"{(~same).nonzero()[0].tolist()}: C {a.flatten()[(~same).flatten().nonzero()[0]].item()}, "
        f"CUDA {b.flatten()[(~same).flatten().nonzero()[0]].item()}")


def padded(shape, dtype, fill=float("nan"), channels_last=False):
    """An output buffer inside a larger one filled with `fill`, so that a write out of range
    shows when the whole storage is compared."""
    n = math.prod(shape)
    storage = torch.full((n + 37,), fill, dtype=dtype)
    view = storage[17:17 + n].view(shape)
    if channels_last:
        view = storage[17:17 + n].view(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2)
    return view, storage


def run_both(emu, name, make_args, outputs):
    """Calls `name` on the C kernels and on the emulated CUDA launchers, each with fresh output
    buffers from `outputs()`; returns the two sets of buffers."""
    results = []
    for backend in (C, CUDA):
        out = outputs()
        result = emu.run(name, backend, *make_args(out))
        result.check()
        results.append(out)
    return results


# ---- layouts ----

def state(shape, dtype, layout, generator=None):
    """psi (B, H, W, d): contiguous, every other element of a larger tensor, or a permuted
    storage; a few cells exactly zero (the update's n == 0 case)."""
    B, H, W, d = shape
    if layout == "contiguous":
        psi = torch.randn(shape, dtype=dtype, generator=generator)
    elif layout == "strided":
        psi = torch.randn(B, H, 2 * W, d, dtype=dtype, generator=generator)[:, :, ::2]
    else:
        psi = torch.randn(d, W, B, H, dtype=dtype, generator=generator).permute(2, 3, 1, 0)
    if psi.numel():
        psi[0, 0, 0] = 0
    return psi


def planar(shape, dtype, layout, generator=None):
    """x / delta (B, 2d, H, W): NCHW, channels_last, or a permuted storage."""
    B, C2, H, W = shape
    if layout == "nchw":
        return torch.randn(shape, generator=generator).to(dtype)
    if layout == "channels_last":
        return torch.randn(B, H, W, C2, generator=generator).to(dtype).permute(0, 3, 1, 2)
    return torch.randn(H, C2, W, B, generator=generator).to(dtype).permute(3, 1, 0, 2)


# The last spans three of the C kernels' tiles (1,016 cells at d = 14), the last one partial.
QCA_SHAPES = [(1, 1, 1, 1), (2, 3, 5, 3), (0, 4, 4, 2), (3, 17, 19, 4), (2, 8, 8, 14), (1, 33, 64, 14)]
STATE_LAYOUTS = ["contiguous", "strided", "permuted"]
PLANAR_LAYOUTS = ["nchw", "channels_last", "permuted"]


def empty_planar(shape, dtype, layout):
    """An output (B, 2d, H, W) in `layout`, padded; returns (view, storage)."""
    B, C2, H, W = shape
    order = {"nchw": (B, C2, H, W), "channels_last": (B, H, W, C2), "permuted": (H, C2, W, B)}[layout]
    back = {"nchw": (0, 1, 2, 3), "channels_last": (0, 3, 1, 2), "permuted": (3, 1, 0, 2)}[layout]
    view, storage = padded(order, dtype)
    return view.permute(back), storage


@pytest.mark.parametrize("state_dtype", COMPLEX)
@pytest.mark.parametrize("x_dtype", REALS)
def test_qca_pack(emu, state_dtype, x_dtype):
    for shape in QCA_SHAPES:
        for psi_layout, x_layout in zip(STATE_LAYOUTS, PLANAR_LAYOUTS):
            psi = state(shape, state_dtype, psi_layout)
            B, H, W, d = shape
            x_shape = (B, 2 * d, H, W)
            c, cuda = run_both(emu, "emu_qca_pack",
                               lambda out: (describe(psi), describe(out[0])),
                               lambda: empty_planar(x_shape, x_dtype, x_layout))
            assert_same_bits(c[1], cuda[1], f"pack {shape} {psi_layout} -> {x_layout}")


@pytest.mark.parametrize("state_dtype", COMPLEX)
@pytest.mark.parametrize("x_dtype", REALS)
def test_qca_pack_backward(emu, state_dtype, x_dtype):
    for shape in QCA_SHAPES:
        for layout in PLANAR_LAYOUTS:
            B, H, W, d = shape
            x = planar((B, 2 * d, H, W), x_dtype, layout)
            c, cuda = run_both(emu, "emu_qca_pack_backward",
                               lambda out: (describe(x), describe(out[0])),
                               lambda: padded(shape, state_dtype))
            assert_same_bits(c[1], cuda[1], f"pack backward {shape} {layout}")


UPDATE_CASES = [(0.0, True), (0.25, True), (0.0, False), (0.25, False)]


@pytest.mark.parametrize("state_dtype", COMPLEX)
@pytest.mark.parametrize("delta_dtype", REALS)
def test_qca_update(emu, state_dtype, delta_dtype):
    if state_dtype == torch.complex128 and delta_dtype != torch.float64:
        delta_dtype = torch.float64  # the glue pairs complex128 with float64 only; C takes any
    for shape in QCA_SHAPES:
        for psi_layout, delta_layout in zip(STATE_LAYOUTS, PLANAR_LAYOUTS):
            for gamma, multiplicative in UPDATE_CASES:
                psi = state(shape, state_dtype, psi_layout)
                B, H, W, d = shape
                delta = planar((B, 2 * d, H, W), delta_dtype, delta_layout)
                if delta.numel():
                    delta[0, :, 0, 0] = 0  # with psi[0, 0, 0] = 0: n == 0 in the additive case
                c, cuda = run_both(
                    emu, "emu_qca_update",
                    lambda out: (describe(psi), describe(delta), gamma, int(multiplicative), 1e-9,
                                 ptr(out[0])),
                    lambda: padded(shape, state_dtype))
                assert_same_bits(c[1], cuda[1], f"update {shape} {psi_layout} {delta_layout} "
                                                f"gamma={gamma} multiplicative={multiplicative}")


@pytest.mark.parametrize("state_dtype", COMPLEX)
@pytest.mark.parametrize("delta_dtype", REALS)
def test_qca_update_backward(emu, state_dtype, delta_dtype):
    for shape in QCA_SHAPES:
        for psi_layout, delta_layout in zip(STATE_LAYOUTS, PLANAR_LAYOUTS):
            for (gamma, multiplicative), wanted in zip(UPDATE_CASES, ["both", "psi", "delta", "both"]):
                psi = state(shape, state_dtype, psi_layout)
                grad_out = state(shape, state_dtype, psi_layout[::-1] if psi_layout != "strided" else "strided")
                B, H, W, d = shape
                delta = planar((B, 2 * d, H, W), delta_dtype, delta_layout)

                def outputs():
                    grad_psi = padded(shape, state_dtype) if wanted != "delta" else (None, torch.zeros(0))
                    grad_delta = padded((B, 2 * d, H, W), delta_dtype) if wanted != "psi" else (None, torch.zeros(0))
                    return grad_psi + grad_delta

                c, cuda = run_both(
                    emu, "emu_qca_update_backward",
                    lambda out: (describe(grad_out), describe(psi), describe(delta), gamma,
                                 int(multiplicative), 1e-9, ptr(out[0]), ptr(out[2])),
                    outputs)
                what = f"update backward {shape} {psi_layout} {delta_layout} gamma={gamma}"
                assert_same_bits(c[1], cuda[1], what + " grad_psi")
                assert_same_bits(c[3], cuda[3], what + " grad_delta")


@pytest.mark.parametrize("state_dtype", COMPLEX)
@pytest.mark.parametrize("kind", ["phase_flip", "bit_flip"])
def test_noise(emu, state_dtype, kind):
    for shape in QCA_SHAPES:
        for layout in STATE_LAYOUTS:
            for rate, seed, step, conjugate in [(0.0, 1, 2, 0), (0.3, 12345, 7, 0),
                                                (0.3, 2 ** 40 + 3, 2 ** 33 + 5, 1), (1.0, 9, 0, 1)]:
                psi = state(shape, state_dtype, layout)
                c, cuda = run_both(
                    emu, "emu_noise",
                    lambda out: (int(kind == "bit_flip"), describe(psi), rate, seed, step, conjugate,
                                 ptr(out[0])),
                    lambda: padded(shape, state_dtype))
                # The phases come from sincos: the host's in the emulator, as in C; on a GPU CUDA's
                # own (tests/ops/test_noise.py states that tolerance).
                assert_same_bits(c[1], cuda[1], f"{kind} {shape} {layout} rate={rate}")


# ---- GroupNorm + ELU ----

GN_CASES = [  # (shape, groups, channels_last)
    ((2, 32, 16, 16), 8, False),   # the CPU tests' shape
    ((2, 32, 16, 16), 8, True),
    ((3, 6, 5, 7), 3, False),      # pixel counts that are not a multiple of anything
    ((3, 6, 5, 7), 3, True),
    ((2, 4, 1, 1), 2, False),      # one pixel
    ((1, 1024, 3, 3), 1, True),    # more channels per group than threads per block
    ((1, 1024, 3, 3), 1, False),
    ((4, 8, 9, 9), 8, True),       # one channel per group
    ((1, 4, 96, 96), 2, False),    # several chunks a pair: the split path when the GPU is large
    ((1, 4, 96, 96), 2, True),
    ((2, 32, 24, 24), 8, True),    # channels_last tiles (groups of more than one per-group chunk),
    ((3, 6, 37, 41), 3, True),     # at odd pixel counts
    ((2, 8, 50, 50), 8, True),
    ((0, 4, 4, 4), 2, False),      # no samples
    ((2, 4, 0, 3), 1, False),      # no pixels
    ((2, 4, 0, 3), 1, True),
]
GN_DTYPES = [  # (x, weight and bias): each data type with its own and with float32 parameters
    (torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float16, torch.float16),
    (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
]
# Multiprocessors: with 1, two pairs fill the GPU (only a lone pair is split); with 132 every
# NCHW case with enough elements per pair is split. channels_last takes its tiles on any GPU.
SPLIT_SETTINGS = {"one_block": 1, "split": 132}
SPLIT_CASE = ((1, 4, 96, 96), 2)  # NCHW: split on the large GPU only


def assert_path_taken(path, split_by_case):
    """The NCHW split case has a workspace on the large GPU only; channels_last, on both."""
    cases = [c for c in split_by_case if c[:2] == SPLIT_CASE]
    assert cases and all(split_by_case[c] == (path == "split" or c[2]) for c in cases), split_by_case


def gn_inputs(case, dtypes, seed):
    (shape, groups, channels_last), (x_dtype, affine_dtype) = case, dtypes
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 1.5  # a mean well off zero, as after a conv
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x = x.to(x_dtype)
    weight = (torch.rand(shape[1], generator=g) + 0.5).to(affine_dtype)
    bias = torch.randn(shape[1], generator=g).to(affine_dtype)
    stat_dtype = torch.float64 if x_dtype == torch.float64 else torch.float32
    return x, weight, bias, groups, int(channels_last), stat_dtype


def workspace(emu, x, groups, channels_last, stat_dtype, backward):
    n = emu.lib.emu_gn_workspace_bytes(describe(x), groups, channels_last, QCA_DTYPE[stat_dtype],
                                       backward)
    return torch.empty(n, dtype=torch.uint8), n


def gn_tolerance(dtype, stat_dtype, magnitude):
    """Allowed |C - CUDA| for a GroupNorm+ELU output of `dtype` whose values (or, for a sum, the
    sum of the absolute values of its terms) are of size `magnitude`.

    C and CUDA add the up to n = 2^15 terms of a group (or channel) in different orders, so they
    round differently. CUDA adds at most 16 terms per channel per thread in each chunk (4 to 16
    pixels a pixel lane, gn_geometry), combines the 512 threads in a shuffle tree of depth 5 then
    the 16 warps one after another (the backward's per-channel sums: a tree of depth 9 at most),
    then the chunks one after another (at most MAX_TESTED_CHUNKS), in the statistics dtype: under
    2^6 roundings, 2^-47 in double and 2^-18 in float (all but float64 data); channels_last
    (groups up to 256 channels) as few: a thread's sums about its first value (8 pixels at most
    here), a tree of at most 8 levels over the group's threads, the at most 64 tiles taken in
    turn by those threads, a second tree, and for the backward's group means the channels of the
    group one after another (8 at most here). C adds lanes of at most
    32 terms (float lanes for float statistics, double for double ones) into double once per
    512-element tile, the tiles' sums with compensation: within about sqrt(32) roundings of the
    lane type, 2^-50 in double and 2^-21 in float. The tolerance is more than twice the sum:
    2^-44 with double statistics, 2^-15 with float ones. The result is then rounded to `dtype`,
    so a value near a rounding boundary may land one ulp of `dtype` away."""
    accumulation = 2.0 ** -44 if stat_dtype == torch.float64 else 2.0 ** -15
    ulp = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23,
           torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    return (accumulation + ulp) * magnitude


def assert_close_gn(c, cuda, dtype, stat_dtype, what, magnitude=None):
    c, cuda = c.double(), cuda.double()
    assert torch.equal(c.isnan(), cuda.isnan()), what
    if magnitude is None:
        magnitude = c.abs().clamp_min(1.0)  # values of size one at least: rstd ~ 1 here
    excess = (c - cuda).abs() - gn_tolerance(dtype, stat_dtype, magnitude)
    assert not bool((excess > 0).any()), (
        f"{what}: {int((excess > 0).sum())} values beyond the tolerance, worst by "
        f"{excess.max().item():.3g}")


def gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype, stats=None):
    """C and CUDA forward; `stats` (mean, rstd) makes it the apply-only variant, which is given
    no workspace: it needs none, on the split path too."""
    ws, ws_bytes = workspace(emu, x, groups, channels_last, stat_dtype, 0) if stats is None else (None, 0)

    def outputs():
        y = padded(tuple(x.shape), x.dtype, channels_last=bool(channels_last))
        if stats is not None:
            return y + (stats[0].clone(), stats[1].clone())
        mean = torch.full((x.shape[0], groups), float("nan"), dtype=stat_dtype)
        return y + (mean, torch.full_like(mean, float("nan")))

    return run_both(emu, "emu_gn_forward",
                    lambda out: (describe(x), groups, channels_last, 1e-5, describe(weight),
                                 describe(bias), int(stats is not None), describe(out[2]),
                                 describe(out[3]), ptr(out[0]), ptr(ws), ws_bytes),
                    outputs)


@pytest.mark.parametrize("path", SPLIT_SETTINGS)
@pytest.mark.parametrize("dtypes", GN_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_groupnorm_elu_forward(emu, path, dtypes):
    split_by_case = {}
    with emu.settings(sms=SPLIT_SETTINGS[path]):
        for i, case in enumerate(GN_CASES):
            x, weight, bias, groups, channels_last, stat_dtype = gn_inputs(case, dtypes, seed=i)
            split_by_case[case] = workspace(emu, x, groups, channels_last, stat_dtype, 0)[1] > 0
            c, cuda = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)
            what = f"forward {case}"
            # the output's padding and every value
            assert_close_gn(c[1], cuda[1], x.dtype, stat_dtype, what + " y")
            assert_close_gn(c[2], cuda[2], stat_dtype, stat_dtype, what + " mean")
            assert_close_gn(c[3], cuda[3], stat_dtype, stat_dtype, what + " rstd")
            # Given statistics (the recompute's variant): both apply C's statistics.
            c, cuda = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype,
                                 stats=(c[2], c[3]))
            assert_close_gn(c[1], cuda[1], x.dtype, stat_dtype, what + " y from given statistics")
    assert_path_taken(path, split_by_case)


@pytest.mark.parametrize("path", SPLIT_SETTINGS)
@pytest.mark.parametrize("dtypes", GN_DTYPES[:2] + GN_DTYPES[4:5], ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_groupnorm_elu_forward_with_a_non_finite_value_spoils_its_group_only(emu, path, dtypes, value):
    """As torch: an inf or NaN anywhere in a group makes the whole group's output NaN (its
    statistics are NaN) and leaves the other groups as they are; C and CUDA alike."""
    with emu.settings(sms=SPLIT_SETTINGS[path]):
        for i, case in enumerate([c for c in GN_CASES if c[0][0] > 0 and c[0][2] > 0][:6]):
            x, weight, bias, groups, channels_last, stat_dtype = gn_inputs(case, dtypes, seed=i)
            per_group = x.shape[1] // groups
            x[0, per_group - 1, x.shape[2] // 2, x.shape[3] - 1] = value  # inside group 0, not its first element
            c, cuda = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)
            for y in (c[0], cuda[0]):
                spoiled = y[0, :per_group].isnan()
                assert bool(spoiled.all()), f"{case}: {int((~spoiled).sum())} values of the group are not NaN"
                assert not bool(y[:, per_group:].isnan().any()) and not bool(y[1:].isnan().any()), case
            assert_close_gn(c[0], cuda[0], x.dtype, stat_dtype, f"non-finite {case}")


def gn_backward_against_c(emu, x, weight, bias, groups, channels_last, stat_dtype, what):
    """C and emulated CUDA backward of x with C's statistics and a random grad_y, compared within
    the tolerances; returns whether CUDA was given a workspace."""
    c_forward, _ = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)
    mean, rstd = c_forward[2], c_forward[3]
    grad_y = torch.randn(x.shape).to(x.dtype)
    if channels_last:
        grad_y = grad_y.contiguous(memory_format=torch.channels_last)
    ws, ws_bytes = workspace(emu, x, groups, channels_last, stat_dtype, 1)
    per_sample = (x.shape[0], x.shape[1])

    def outputs():
        return (padded(tuple(x.shape), x.dtype, channels_last=bool(channels_last))
                + padded(per_sample, stat_dtype) + padded(per_sample, stat_dtype))

    c, cuda = run_both(
        emu, "emu_gn_backward",
        lambda out: (describe(grad_y), describe(x), groups, channels_last, describe(weight),
                     describe(bias), describe(mean), describe(rstd), ptr(out[0]),
                     ptr(out[2]), ptr(out[4]), ptr(ws), ws_bytes),
        outputs)
    # Per-channel sums: the tolerance scales with the sum of |terms|, bounded here by
    # |grad_y| * max(1, |xhat|) summed over the channel's pixels.
    pixels = x.shape[2] * x.shape[3]
    xhat = ((x.double() - mean.double().repeat_interleave(x.shape[1] // groups, 1)[..., None, None])
            * rstd.double().repeat_interleave(x.shape[1] // groups, 1)[..., None, None])
    term = (grad_y.double().abs() * xhat.abs().clamp_min(1.0)).sum((2, 3)) if pixels else torch.zeros(per_sample)
    padding = torch.ones(37, dtype=torch.float64)
    magnitude = torch.cat([padding[:17], term.flatten().clamp_min(1.0), padding[17:]])
    assert_close_gn(c[3], cuda[3], stat_dtype, stat_dtype, what + " grad_weight", magnitude)
    assert_close_gn(c[5], cuda[5], stat_dtype, stat_dtype, what + " grad_bias", magnitude)
    # grad_x = rstd * (w g - mean(w g) - xhat mean(w g xhat)): values of size |grad_y|,
    # plus the two group means, each within the sum tolerance of its magnitude.
    assert_close_gn(c[1], cuda[1], x.dtype, stat_dtype, what + " grad_x",
                    c[1].double().abs().clamp_min(1.0) * 4)
    return ws_bytes > 0


@pytest.mark.parametrize("path", SPLIT_SETTINGS)
@pytest.mark.parametrize("dtypes", GN_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_groupnorm_elu_backward(emu, path, dtypes):
    split_by_case = {}
    with emu.settings(sms=SPLIT_SETTINGS[path]):
        for i, case in enumerate(GN_CASES):
            x, weight, bias, groups, channels_last, stat_dtype = gn_inputs(case, dtypes, seed=i)
            split_by_case[case] = gn_backward_against_c(emu, x, weight, bias, groups, channels_last,
                                                        stat_dtype, f"backward {case}")
    assert_path_taken(path, split_by_case)


# The chunk geometry of groupnorm_elu_plan.cuh, from the shape of one sample: (channel lanes,
# pixel lanes, pixels of a chunk, chunks of a pair). Channel lanes: channels_last one a channel
# (up to 512); NCHW the largest power of two up to the group's channels and 16, leaving 32 pixel
# lanes at least. A chunk is 16, 8 or 4 pixels a pixel lane: the largest that cuts the sample into
# 256 chunks, or a pair into 64, else 4.
def gn_geometry(channels, pixels, groups, channels_last):
    per_group = channels // groups
    if channels_last:
        channel_lanes = min(per_group, 512)
    else:
        channel_lanes = 1
        while 2 * channel_lanes <= min(per_group, 16):
            channel_lanes *= 2
    pixel_lanes = 512 // channel_lanes
    for per_lane in (16, 8, 4):
        chunk = pixel_lanes * per_lane
        chunks = max(1, -(-pixels // chunk))
        if chunks >= 64 or groups * chunks >= 256:
            break
    return channel_lanes, pixel_lanes, chunk, chunks


def gn_nhwc_geometry(channels, pixels, groups):
    """The channels_last plan of groupnorm_elu_nhwc.cuh, from the shape of one sample: (slab
    channels, pixel lanes, pixels of a tile, tiles, slabs). A slab is the most whole groups up to
    32 channels that divide the groups; 256 threads make 256 // slab pixel lanes; a tile is 1, 2,
    4 or 8 pixels a lane: the fewest that make at most 64 tiles, more while the sample stays 256
    blocks (more than 8 where 64 tiles need it)."""
    per_group = channels // groups
    slab_groups = max(1, min(groups, 32 // per_group))
    while groups % slab_groups:
        slab_groups -= 1
    slab, slabs = slab_groups * per_group, groups // slab_groups
    lanes = 256 // slab

    def tiles(per_lane):
        return max(1, -(-pixels // (lanes * per_lane)))

    per_lane = 1
    while tiles(per_lane) > 64:
        per_lane *= 2
    while per_lane < 8 and slabs * tiles(2 * per_lane) >= 256:
        per_lane *= 2
    return slab, lanes, lanes * per_lane, tiles(per_lane), slabs


def gn_takes_tiles(shape, groups):
    """Whether channels_last data takes the tiles (nhwc_takes): groups of up to 256 channels that
    are more than one chunk of the per-group kernels (those run a group of one chunk in one
    launch)."""
    return shape[1] // groups <= 256 and gn_geometry(shape[1], shape[2] * shape[3], groups, True)[3] > 1


def gn_splits(batch, groups, chunks, sms):
    """Blocks a pair: one when the pairs fill two blocks a multiprocessor, else up to one a chunk."""
    pairs = batch * groups
    return 1 if pairs >= 2 * sms or chunks == 1 else min(-(-2 * sms // pairs), chunks, 64)


MAX_TESTED_CHUNKS = 16  # of a pair, in the cases compared with C (gn_tolerance's premise)
WELFORD_FLOAT_BYTES = 16  # float mean, float m2, int64 count


def gn_chunks_from_workspace(emu, x, groups, channels_last):
    """Chunks a pair, read from the sizes of the two workspaces (float statistics; 0 when the
    pairs are not split), checked against each other."""
    forward = workspace(emu, x, groups, channels_last, torch.float32, 0)[1]
    backward = workspace(emu, x, groups, channels_last, torch.float32, 1)[1]
    pairs, per_group = x.shape[0] * groups, x.shape[1] // groups
    assert forward * per_group * 2 * 4 == backward * WELFORD_FLOAT_BYTES
    return forward // (pairs * WELFORD_FLOAT_BYTES)


@pytest.mark.parametrize("channels_last", [0, 1], ids=["nchw", "channels_last"])
def test_groupnorm_elu_chunk_geometry_is_the_plan(emu, channels_last):
    """NCHW (and the channels_last groups the tiles leave: wider than a block, or of one chunk):
    every emulated case with samples, and the U-Net's shapes at batch 1 (hidden 64 and 128: 8
    channels a group at 64x64, 32x32 and 16x16), is cut into the chunks gn_geometry says, read
    from the workspace sizes on a 132-multiprocessor GPU. A 64x64 group is 16 chunks, a 32x32 one
    4 (the split path, 128 to 256 blocks at batch 1); a 16x16 one stays one chunk, one block a
    pair, in either layout."""
    unet = [((1, c, side, side), c // 8) for c, side in
            [(64, 64), (128, 64), (128, 32), (256, 32), (256, 16), (512, 16), (1024, 16)]]
    cases = [(shape, groups) for shape, groups, layout in GN_CASES if layout == bool(channels_last) and shape[0]]
    cases = [(shape, groups) for shape, groups in cases + unet
             if not (channels_last and gn_takes_tiles(shape, groups))]
    if channels_last:  # the U-Net's 16x16 groups, and the small cases'
        assert {shape for shape, _ in cases} >= {(1, 256, 16, 16), (1, 512, 16, 16), (1, 1024, 16, 16),
                                                 (2, 32, 16, 16), (1, 1024, 3, 3)}
    expected = {(1, 64, 64, 64): 16, (1, 128, 64, 64): 16, (1, 128, 32, 32): 4, (1, 256, 32, 32): 4,
                (1, 256, 16, 16): 1, (1, 512, 16, 16): 1, (1, 1024, 16, 16): 1}
    for shape, groups in cases:
        x = torch.empty(shape, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        chunks = gn_geometry(shape[1], shape[2] * shape[3], groups, channels_last)[3]
        assert expected.get(shape, chunks) == chunks <= MAX_TESTED_CHUNKS, shape
        split = gn_splits(shape[0], groups, chunks, 132) > 1
        with emu.settings(sms=132):
            assert gn_chunks_from_workspace(emu, x, groups, channels_last) == (chunks if split else 0), shape


UNET_TILES = {  # hidden 128 at grid 64 (8 channels a group) above 16x16, and hidden 64's largest
    (1, 128, 64, 64): 64, (1, 256, 32, 32): 32, (1, 512, 32, 32): 16, (1, 64, 64, 64): 64}


def test_groupnorm_elu_channels_last_tiles_are_the_plan_and_fill_the_gpu(emu):
    """channels_last: every emulated case with samples that takes the tiles (groups up to 256
    channels, more than one per-group chunk) is cut into the tiles gn_nhwc_geometry says, read
    from the workspace sizes, the same on a GPU of 1 multiprocessor and of 132. Each of the
    default U-Net's shapes above 16x16 (hidden 128) is 256 blocks a launch at batch 1 (where the
    per-group kernels made 128 to 256), at least a wave on 132 multiprocessors; a block re-reads
    at most 64 tiles a group."""
    cases = [(shape, groups) for shape, groups, layout in GN_CASES
             if layout and shape[0] and gn_takes_tiles(shape, groups)]
    assert len(cases) == 4
    cases += [(shape, shape[1] // 8) for shape in UNET_TILES]
    assert all(gn_takes_tiles(shape, groups) for shape, groups in cases)
    for shape, groups in cases:
        x = torch.empty(shape, memory_format=torch.channels_last)
        _, _, _, tiles, slabs = gn_nhwc_geometry(shape[1], shape[2] * shape[3], groups)
        assert UNET_TILES.get(shape, tiles) == tiles <= 64, shape
        if shape in UNET_TILES and shape[1] >= 128:
            assert slabs * tiles == 256, shape
        for sms in (1, 132):
            with emu.settings(sms=sms):
                assert gn_chunks_from_workspace(emu, x, groups, 1) == tiles, (shape, sms)


def gn_cuda_passes(emu, xs, grads, weight, bias, groups, channels_last, sms):
    """Emulated CUDA forward then backward (float data and statistics) on a GPU of `sms`
    multiprocessors: the outputs (y, mean, rstd, grad_x, grad_weight, grad_bias) and the blocks
    each pass launched."""
    batch, channels = xs.shape[:2]
    y = torch.empty_like(xs)
    mean, rstd = torch.empty(batch, groups), torch.empty(batch, groups)
    grad_x, grad_weight, grad_bias = torch.empty_like(xs), torch.empty(batch, channels), torch.empty(batch, channels)
    blocks = []
    with emu.settings(sms=sms):
        before = emu.counters()["blocks"]
        ws, ws_bytes = workspace(emu, xs, groups, channels_last, torch.float32, 0)
        emu.run("emu_gn_forward", CUDA, describe(xs), groups, channels_last, 1e-5, describe(weight),
                describe(bias), 0, describe(mean), describe(rstd), ptr(y), ptr(ws), ws_bytes).check()
        blocks.append(emu.counters()["blocks"] - before)
        before = emu.counters()["blocks"]
        ws, ws_bytes = workspace(emu, xs, groups, channels_last, torch.float32, 1)
        emu.run("emu_gn_backward", CUDA, describe(grads), describe(xs), groups, channels_last,
                describe(weight), describe(bias), describe(mean), describe(rstd), ptr(grad_x),
                ptr(grad_weight), ptr(grad_bias), ptr(ws), ws_bytes).check()
        blocks.append(emu.counters()["blocks"] - before)
    return (y, mean, rstd, grad_x, grad_weight, grad_bias), blocks


OUTPUT_NAMES = ["y", "mean", "rstd", "grad_x", "grad_weight", "grad_bias"]


# (batch size, multiprocessors): one block a pair (two blocks per multiprocessor filled), or 2,
# 3 or 9 blocks a pair taking different runs of the sample's 9 chunks (2 over 9 chunks: runs of
# 4 and 5).
BATCHES_AND_GPUS = {(1, 1): 2, (1, 132): 9, (3, 1): 1, (3, 4): 3, (140, 64): 1}


@pytest.mark.parametrize("channels_last", [0, 1], ids=["nchw", "channels_last"])
def test_groupnorm_elu_gives_a_sample_the_same_bits_in_any_batch_on_any_gpu(emu, channels_last):
    """Forward and backward of one sample alone and inside larger batches, on GPUs of several
    sizes (the one-block and the split paths): bit-identical."""
    x, weight, bias, groups, _, _ = gn_inputs(((1, 2, 72, 120), 1, channels_last),
                                              (torch.float32, torch.float32), seed=11)
    assert gn_geometry(2, 72 * 120, groups, channels_last)[3] == 9
    nhwc_blocks = 34  # channels_last: 34 tiles of 256 pixels, one slab
    grad_y = torch.randn(x.shape)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    results = {}
    for (batch, sms), splits in BATCHES_AND_GPUS.items():
        at = batch // 2  # the sample's place in the batch; the other samples are random
        xs, grads = torch.randn((batch,) + x.shape[1:]), torch.randn((batch,) + x.shape[1:])
        xs[at], grads[at] = x[0], grad_y[0]
        xs, grads = xs.contiguous(memory_format=memory_format), grads.contiguous(memory_format=memory_format)
        outputs, blocks = gn_cuda_passes(emu, xs, grads, weight, bias, groups, channels_last, sms)
        assert gn_splits(batch, groups, 9, sms) == splits
        # the split path launches a partial kernel before the main one in each pass, as the
        # channels_last kernels always do
        per_launch = batch * nhwc_blocks if channels_last else batch * groups * splits
        assert blocks == [per_launch * (1 if splits == 1 and not channels_last else 2)] * 2, (batch, sms)
        results[batch, sms] = [t[at] for t in outputs]
    reference = results[1, 1]
    for (batch, sms), outputs in results.items():
        for name, a, b in zip(OUTPUT_NAMES, reference, outputs):
            assert_same_bits(a, b, f"{name}, batch {batch} on {sms} multiprocessors")


@pytest.mark.parametrize("channels_last", [0, 1], ids=["nchw", "channels_last"])
def test_groupnorm_elu_at_the_unets_64x64_shape_is_split_and_batch_invariant(emu, channels_last):
    """(1, 64, 64, 64) with 8 groups, the U-Net's largest tensor at hidden 64: NCHW on a 132-SM
    GPU each pair's 16 chunks go to 16 blocks (128 a launch, where one block a pair made 8),
    channels_last 64 tiles of 2 slabs on any GPU (128 blocks a launch, two launches a pass),
    with the bits of a 1-SM GPU, and within the tolerance of the C kernels."""
    case = ((1, 64, 64, 64), 8, channels_last)
    x, weight, bias, groups, _, stat_dtype = gn_inputs(case, (torch.float32, torch.float32), seed=4)
    grad_y = torch.randn(x.shape).contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    split, split_blocks = gn_cuda_passes(emu, x, grad_y, weight, bias, groups, channels_last, 132)
    one_block, one_blocks = gn_cuda_passes(emu, x, grad_y, weight, bias, groups, channels_last, 1)
    if channels_last:
        assert split_blocks == one_blocks == [2 * 2 * 64] * 2
    else:
        assert split_blocks == [2 * 8 * 16] * 2 and one_blocks == [8] * 2
    for name, a, b in zip(OUTPUT_NAMES, one_block, split):
        assert_same_bits(a, b, f"{name} on 1 and on 132 multiprocessors")
    c, _ = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)
    assert_close_gn(c[0], split[0], x.dtype, stat_dtype, "y against C")
    assert_close_gn(c[2], split[1], stat_dtype, stat_dtype, "mean against C")



UNET_LIKE_CASES = [((1, 16, 64, 64), 2), ((2, 128, 16, 16), 16)]  # 8 channels a group, as the U-Net's


@pytest.mark.parametrize("channels_last", [0, 1], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtypes", [GN_DTYPES[0], GN_DTYPES[3]], ids=["float32", "float16-float32"])
def test_groupnorm_elu_at_unet_shapes_matches_c_and_keeps_each_samples_bits(emu, channels_last, dtypes):
    """The U-Net's GroupNorm (8 channels a group) at 64x64 with few channels and at a mid shape,
    as mixed precision runs it too: forward, the recompute's apply and backward within the C
    kernels' tolerance; each sample's bits alone on a 1-SM GPU the same as inside the batch on a
    132-SM one; the apply given the forward's own statistics gives its y bit for bit."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for shape, groups in UNET_LIKE_CASES:
        x, weight, bias, groups, _, stat_dtype = gn_inputs((shape, groups, channels_last), dtypes, seed=shape[1])
        what = f"{tuple(shape)} {memory_format}"
        grad_y = torch.randn(shape).to(x.dtype).contiguous(memory_format=memory_format)
        batch, _ = gn_cuda_passes(emu, x, grad_y, weight, bias, groups, channels_last, 132)
        for n in range(shape[0]):
            alone, _ = gn_cuda_passes(emu, x[n:n + 1].clone(memory_format=memory_format),
                                      grad_y[n:n + 1].clone(memory_format=memory_format),
                                      weight, bias, groups, channels_last, 1)
            for name, a, b in zip(OUTPUT_NAMES, alone, batch):
                assert_same_bits(a[0], b[n], f"{what} {name} of sample {n}")
        with emu.settings(sms=132):
            c, cuda = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)
            assert_close_gn(c[1], cuda[1], x.dtype, stat_dtype, what + " y")
            assert_close_gn(c[2], cuda[2], stat_dtype, stat_dtype, what + " mean")
            assert_close_gn(c[3], cuda[3], stat_dtype, stat_dtype, what + " rstd")
            _, applied = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype,
                                    stats=(batch[1], batch[2]))
            assert_same_bits(batch[0], applied[0], what + " y of the apply")
            gn_backward_against_c(emu, x, weight, bias, groups, channels_last, stat_dtype, what)

# ---- the loss scaler ----

def unscale_lists():
    """(name, sizes): tensors of one dtype as the list the optimizer's gradients make."""
    g = torch.Generator().manual_seed(5)
    many = torch.randint(0, 300, (210,), generator=g).tolist()  # > 64 per launch, > 200 per sum pass
    return [("small", [1000, 0, 1, 70000]), ("many", many)]


def make_list(sizes, dtype, nonfinite_at=None, misaligned=False):
    tensors = []
    for i, n in enumerate(sizes):
        t = (torch.randn(n + int(misaligned)) * 100).to(dtype)
        if misaligned:
            t = t[1:]  # not 16-byte aligned: the kernel's scalar path
        if nonfinite_at is not None and i == nonfinite_at and n:
            t[n // 2] = float("inf")
        tensors.append(t)
    return tensors


def unscale(emu, backend, tensors, factor, check, sumsq):
    dtype = tensors[0].dtype
    numel = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    data = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    factor_t = torch.tensor([factor], dtype=torch.float32)
    found_inf = torch.zeros(1) if check else None
    sums = torch.full((len(tensors),), -1.0, dtype=torch.float64) if sumsq else None
    work = None
    if sumsq:
        work = torch.full((max(1, emu.lib.emu_unscale_workspace_size(len(tensors), ptr(numel))),),
                          float("nan"), dtype=torch.float64)
    result = emu.run("emu_unscale", backend, QCA_DTYPE[dtype], len(tensors), data, ptr(numel),
                     ptr(factor_t), ptr(found_inf), ptr(sums), ptr(work))
    result.check()
    return found_inf, sums


def assert_sums_close(c, cuda, tensors):
    """Sums of squares of n values in double, added in two different orders: each within
    (n - 1) * 2^-53 of the exact sum (the terms are positive), so within twice that of each
    other."""
    assert torch.equal(c.isnan(), cuda.isnan())
    n = torch.tensor([max(t.numel(), 1) for t in tensors], dtype=torch.float64)
    finite = ~c.isnan()
    bound = 2 * (n - 1) * 2.0 ** -53 * c.abs()
    assert bool(((c - cuda).abs() <= bound)[finite].all()), ((c - cuda).abs() / c.abs().clamp_min(1e-300))[finite].max()


@pytest.mark.parametrize("dtype", REALS)
@pytest.mark.parametrize("mode", ["multiply", "check", "sumsq"])
def test_unscale(emu, dtype, mode):
    check, sumsq = mode != "multiply", mode == "sumsq"
    for name, sizes in unscale_lists():
        for factor, nonfinite_at, misaligned in [(0.5, None, False), (1.0, None, True),
                                                 (2.0 ** -16, 0, False), (1.0 / 3, 2, True)]:
            torch.manual_seed(len(sizes))
            original = make_list(sizes, dtype, nonfinite_at, misaligned)
            results = []
            for backend in (C, CUDA):
                tensors = [t.clone() for t in original]
                if misaligned:  # clone() aligns; keep the kernels' scalar path
                    tensors = [torch.cat([t[:1], t])[1:] for t in tensors]
                results.append((tensors,) + unscale(emu, backend, tensors, factor, check, sumsq))
            (c_tensors, c_inf, c_sums), (cuda_tensors, cuda_inf, cuda_sums) = results
            what = f"{mode} {name} factor={factor} nonfinite_at={nonfinite_at}"
            for i, (a, b) in enumerate(zip(c_tensors, cuda_tensors)):
                assert_same_bits(a, b, f"{what} tensor {i}")
            if check:
                assert torch.equal(c_inf, cuda_inf), what
                assert c_inf.item() == float(nonfinite_at is not None and sizes[nonfinite_at] > 0)
            if sumsq:
                assert_sums_close(c_sums, cuda_sums, c_tensors)


def test_unscale_of_a_tensor_longer_than_one_launch(emu):
    """One tensor of more chunks than one launch covers (320), cut across two launches."""
    n = 320 * 65536 + 1000
    original = [torch.randn(n), torch.randn(10)]
    original[0][n - 5] = float("nan")
    results = []
    for backend in (C, CUDA):
        tensors = [t.clone() for t in original]
        results.append((tensors,) + unscale(emu, backend, tensors, 0.25, True, True))
    (c_tensors, c_inf, c_sums), (cuda_tensors, cuda_inf, cuda_sums) = results
    for a, b in zip(c_tensors, cuda_tensors):
        assert_same_bits(a, b, "long tensor")
    assert c_inf.item() == cuda_inf.item() == 1.0
    assert c_sums[0].isnan() and cuda_sums[0].isnan()
    assert_sums_close(c_sums, cuda_sums, c_tensors)


def accumulate(emu, backend, accumulators, grads):
    n = len(accumulators)
    codes = [torch.tensor([QCA_DTYPE[t.dtype] for t in ts], dtype=torch.int64) for ts in (accumulators, grads)]
    numel = torch.tensor([t.numel() for t in accumulators], dtype=torch.int64)
    emu.run("emu_accumulate", backend, n, (ctypes.c_void_p * n)(*[t.data_ptr() for t in accumulators]),
            ptr(codes[0]), (ctypes.c_void_p * n)(*[t.data_ptr() for t in grads]), ptr(codes[1]),
            ptr(numel)).check()


def test_accumulate(emu):
    """Every pair of element types in one list (more pairs than a launch's 64 slots, a pair of
    two chunks, empty pairs, tensors whose data is not aligned to the kernel's vectors), on C and
    emulated CUDA: the same bits, and torch's add_'s."""
    g = torch.Generator().manual_seed(11)
    pairs = [(a, b) for a in REALS for b in REALS]
    sizes = [70000, 0, 1] + torch.randint(1, 300, (len(pairs) * 5 - 3,), generator=g).tolist()
    accumulators, grads = [], []
    for i, n in enumerate(sizes):
        acc_dtype, grad_dtype = pairs[i % len(pairs)]
        accumulators.append((torch.randn(n, generator=g) * 3).to(acc_dtype))
        grads.append(torch.randn(n, generator=g).to(grad_dtype))
    for i in (5, 12):  # float64 += float64, bfloat16 += float32
        grads[i][:1] = float("nan")
    expected = [a.clone().add_(b) for a, b in zip(accumulators, grads)]
    for backend in (C, CUDA):
        ours = [a.clone() for a in accumulators]
        for i in range(1, len(ours), 3):  # one real in: the scalar loop only
            ours[i] = torch.cat([ours[i][:1], ours[i]])[1:]
        launches = emu.counters()["launches"]
        accumulate(emu, backend, ours, grads)
        if backend == CUDA:
            assert emu.counters()["launches"] - launches == 2  # 79 pairs with reals: 64 slots, then 15
        for i, (a, e) in enumerate(zip(ours, expected)):
            what = f"{'C' if backend == C else 'CUDA'} pair {i} ({a.dtype} += {grads[i].dtype}, {a.numel()})"
            if a.dtype == torch.bfloat16 and bool(e.isnan().any()):  # torch's NaN bits differ from CUDA's
                assert torch.equal(a.isnan(), e.isnan()), what
                a, e = a.nan_to_num(), e.nan_to_num()
            assert_same_bits(e, a, what)


def test_accumulate_into_itself(emu):
    """A gradient that is its accumulator (full overlap): each element read before its write."""
    for backend in (C, CUDA):
        t = torch.randn(1000)
        expected = t * 2
        accumulate(emu, backend, [t], [t])
        assert_same_bits(expected, t, "t += t")


def test_scale_update(emu):
    cases = [(65536.0, 0, 0.0, 2000), (65536.0, 1998, 0.0, 2000), (65536.0, 1999, 0.0, 2000),
             (3.0e38, 1999, 0.0, 2000), (1024.0, 5, 1.0, 2000), (1024.0, 5, float("nan"), 2000),
             (1.0, 0, 0.0, 1)]
    for scale, tracker, found_inf, interval in cases:
        results = []
        for backend in (C, CUDA):
            s = torch.tensor([scale], dtype=torch.float32)
            t = torch.tensor([tracker], dtype=torch.int32)
            f = torch.tensor([found_inf], dtype=torch.float32)
            emu.run("emu_scale_update", backend, ptr(s), ptr(t), ptr(f), 2.0, 0.5, interval).check()
            results.append((s, t))
        assert_same_bits(results[0][0], results[1][0], f"scale {scale, tracker, found_inf}")
        assert torch.equal(results[0][1], results[1][1])


# ---- the launchers' contract ----

def zero_cell_calls(emu, bad):
    psi = torch.zeros(0, 3, 3, 2, dtype=torch.complex64)
    x = torch.zeros(0, 4, 3, 3)
    out = torch.zeros(1)
    state = describe(psi, dtype=bad)
    return {
        "pack": lambda b: emu.run("emu_qca_pack", b, state, describe(x)),
        "pack_backward": lambda b: emu.run("emu_qca_pack_backward", b, describe(x), state),
        "update": lambda b: emu.run("emu_qca_update", b, state, describe(x), 0.0, 1, 1e-9, ptr(out)),
        "update_backward": lambda b: emu.run("emu_qca_update_backward", b, describe(psi, dtype=bad),
                                             state, describe(x), 0.0, 1, 1e-9, ptr(out), ptr(out)),
        "phase_flip": lambda b: emu.run("emu_noise", b, 0, state, 0.5, 1, 2, 0, ptr(out)),
        "bit_flip": lambda b: emu.run("emu_noise", b, 1, state, 0.5, 1, 2, 0, ptr(out)),
    }


@pytest.mark.parametrize("op", ["pack", "pack_backward", "update", "update_backward", "phase_flip",
                                "bit_flip"])
def test_zero_cells_with_an_unknown_state_dtype_are_rejected_like_c(emu, op):
    call = zero_cell_calls(emu, BAD_DTYPE)[op]
    assert call(C).status == QCA_ERR_UNSUPPORTED_DTYPE
    assert call(CUDA).status == QCA_ERR_UNSUPPORTED_DTYPE
    good = zero_cell_calls(emu, QCA_DTYPE[torch.complex64])[op]
    assert good(C).status == QCA_OK and good(CUDA).status == QCA_OK


@pytest.mark.parametrize("x_dtype, stat_dtype", [(torch.float32, torch.float64),
                                                  (torch.float16, torch.float64),
                                                  (torch.float64, torch.float32)], ids=str)
def test_groupnorm_elu_cuda_takes_only_the_statistics_dtype_of_its_data(emu, x_dtype, stat_dtype):
    """The CUDA kernels exist for the (data, statistics) pairs the ops use: any other is refused."""
    x = torch.randn(2, 4, 3, 3).to(x_dtype)
    weight, bias, y = torch.ones(4), torch.zeros(4), torch.empty_like(x)
    grads = [torch.empty_like(x), torch.empty(2, 4, dtype=stat_dtype), torch.empty(2, 4, dtype=stat_dtype)]
    mean, rstd = torch.zeros(2, 2, dtype=stat_dtype), torch.ones(2, 2, dtype=stat_dtype)
    forward = emu.run("emu_gn_forward", CUDA, describe(x), 2, 0, 1e-5, describe(weight), describe(bias), 0,
                      describe(mean), describe(rstd), ptr(y), None, 0)
    backward = emu.run("emu_gn_backward", CUDA, describe(x), describe(x), 2, 0, describe(weight),
                       describe(bias), describe(mean), describe(rstd), *[ptr(g) for g in grads], None, 0)
    assert forward.status == backward.status == QCA_ERR_UNSUPPORTED_DTYPE


def test_a_pending_error_is_neither_blamed_on_a_launch_nor_cleared(emu):
    psi = torch.randn(2, 3, 3, 2, dtype=torch.complex64)
    x = torch.zeros(2, 4, 3, 3)
    emu.lib.qca_emu_set_last_error(700)  # left by some earlier, unrelated call
    try:
        result = emu.run("emu_qca_pack", CUDA, describe(psi), describe(x))
        assert result.status == QCA_OK and result.cuda_error == 0
        assert emu.lib.qca_emu_peek_last_error() == 700
    finally:
        emu.lib.qca_emu_set_last_error(0)


def test_a_failed_device_query_fails_the_launch_that_made_it_and_is_cleared(emu):
    # a shape of several chunks a pair: the launch asks the device's size (with one, it need not)
    case = next(c for c in GN_CASES if c[:2] == SPLIT_CASE)
    x, weight, bias, groups, channels_last, stat_dtype = gn_inputs(case, GN_DTYPES[0], 0)
    mean = torch.zeros(x.shape[0], groups)
    emu.lib.qca_emu_fail_device_queries(100)  # cudaErrorNoDevice
    try:
        assert emu.lib.emu_gn_workspace_bytes(describe(x), groups, channels_last, 0, 0) == 0
        assert emu.lib.qca_emu_peek_last_error() == 0
        y = torch.zeros_like(x)
        result = emu.run("emu_gn_forward", CUDA, describe(x), groups, channels_last, 1e-5,
                         describe(weight), describe(bias), 0, describe(mean), describe(mean.clone()),
                         ptr(y), None, 0)
        assert result.status == QCA_ERR_CUDA and result.cuda_error == 100
        assert emu.lib.qca_emu_peek_last_error() == 0
    finally:
        emu.lib.qca_emu_fail_device_queries(0)
    # and the next launch succeeds
    with emu.settings(sms=1):
        c, cuda = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)


# ---- independence of the order threads run in ----

@pytest.mark.parametrize("path", SPLIT_SETTINGS)
def test_results_do_not_depend_on_the_order_threads_run_in(emu, path):
    """The kernels with barriers and shared memory give the same bits whether the emulator runs
    a block's threads (and the blocks) forward, backward or shuffled: an order-dependent result
    would be a race its checks did not name."""
    case, dtypes = ((1, 4, 96, 96), 2, True), (torch.float16, torch.float32)
    x, weight, bias, groups, channels_last, stat_dtype = gn_inputs(case, dtypes, seed=3)
    grad_y = torch.randn(x.shape).to(x.dtype).contiguous(memory_format=torch.channels_last)
    tensors = make_list([70000, 5, 1000], torch.float32, nonfinite_at=None)
    results = []
    for order, seed in [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]:
        with emu.settings(sms=SPLIT_SETTINGS[path], order=order, seed=seed):
            _, forward = gn_forward(emu, x, weight, bias, groups, channels_last, stat_dtype)
            ws, ws_bytes = workspace(emu, x, groups, channels_last, stat_dtype, 1)
            grads = [torch.empty_like(x), torch.empty(x.shape[:2]), torch.empty(x.shape[:2])]
            emu.run("emu_gn_backward", CUDA, describe(grad_y), describe(x), groups, channels_last,
                    describe(weight), describe(bias), describe(forward[2]), describe(forward[3]),
                    *[ptr(g) for g in grads], ptr(ws), ws_bytes).check()
            scaled = [t.clone() for t in tensors]
            _, sums = unscale(emu, CUDA, scaled, 0.5, True, True)
        results.append([forward[1], forward[2], forward[3], *grads, *scaled, sums])
    for other in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], other)):
            assert_same_bits(a, b, f"output {i}")


def step_difference(emu, backend, actual, expected, before):
    out = torch.full((), -1.0)
    parts = actual if not actual.is_complex() else torch.view_as_real(actual)
    emu.run("emu_step_difference", backend, QCA_DTYPE[actual.dtype], int(actual.is_complex()), actual.numel(),
            ptr(parts), ptr(expected), ptr(before), ptr(out)).check()
    return out


@pytest.mark.parametrize("dtype", COMPLEX + REALS, ids=str)
def test_step_difference(emu, dtype):
    """The same float on C and emulated CUDA: counts around the block size, past the launch's 512
    blocks (a grid-stride loop), empty; with and without `before`; NaN and infinite elements.
    Maxima do not depend on their order, so the bits agree whatever the split."""
    g = torch.Generator().manual_seed(3)
    for count in [0, 1, 255, 257, 512 * 256 + 77]:
        wide = torch.complex128 if dtype.is_complex else torch.float64
        expected = torch.randn(count, generator=g, dtype=wide)
        actual = expected + 1e-3 * torch.randn(count, generator=g, dtype=wide)
        before = expected - torch.randn(count, generator=g, dtype=wide)
        actual, expected, before = (t.to(dtype) for t in (actual, expected, before))
        cases = [(actual, expected, before), (actual, expected, None)]
        if count > 300:
            special = actual.clone()
            special[7], expected[7] = float("nan"), float("nan")  # equal
            special[9] = float("inf")
            cases.append((special, expected, before))
            special = special.clone()
            special[count - 1] = float("nan")  # in the last block's loop: the result is NaN
            cases.append((special, expected, before))
        for a, e, b in cases:
            c, cuda = (step_difference(emu, backend, a, e, b) for backend in (C, CUDA))
            assert_same_bits(c, cuda, f"step difference of {count} {dtype}")
            assert c.item() >= 0 or math.isnan(c.item())
        if count > 300:
            assert math.isnan(c.item())


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", REALS, ids=str)
def test_max_pool(emu, dtype, channels_last):
    """The same bits from the C and emulated CUDA kernels, forward and backward (with either
    rule for a window of -infinities), odd heights and widths, more elements than a block; and
    the C forward is torch's max_pool2d."""
    g = torch.Generator().manual_seed(5)
    for shape in [(1, 3, 2, 2), (2, 5, 7, 9), (1, 40, 6, 11)]:
        x = pool_specials(shape, dtype, channels_last, g)
        sizes = torch.tensor(shape, dtype=torch.int64)
        memory = torch.channels_last if channels_last else torch.contiguous_format
        pooled = (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
        ys = []
        for backend in (C, CUDA):
            y = torch.full(pooled, 5.0, dtype=dtype).contiguous(memory_format=memory)
            emu.run("emu_max_pool", backend, QCA_DTYPE[dtype], ptr(sizes), int(channels_last), ptr(x), ptr(y)).check()
            ys.append(y)
        assert_same_bits(*ys, f"max pool of {shape} {dtype}")
        assert torch.equal(ys[0].nan_to_num(9.0, 8.0, -8.0), torch.nn.functional.max_pool2d(x, 2).nan_to_num(9.0, 8.0, -8.0))
        grad_y = torch.randn(pooled, generator=g).to(dtype).contiguous(memory_format=memory)
        grad_y[0, 0, 0, 0] = -0.0
        for to_origin in (0, 1):
            grads = []
            for backend in (C, CUDA):
                grad_x = torch.full(shape, 5.0, dtype=dtype).contiguous(memory_format=memory)
                emu.run("emu_max_pool_backward", backend, QCA_DTYPE[dtype], ptr(sizes), int(channels_last),
                        ptr(grad_y), ptr(x), ptr(grad_x), to_origin).check()
                grads.append(grad_x)
            assert_same_bits(*grads, f"max pool backward of {shape} {dtype}, to origin {to_origin}")
            assert not bool(torch.signbit(grads[0]).logical_and(grads[0] == 0).any())  # 0 + (-0) is +0
