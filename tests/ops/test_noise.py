"""Training noise ops: exact agreement with a plain Philox4x32-10 reference of the documented
counter layout, the stock distributions within statistical bounds, replay, gradients, opcheck."""

import math

import pytest
import torch
from torch.library import opcheck

import qca_lowmem
from helpers import DEVICES, cuda_only
from qca_lowmem import NoiseSchedule, bit_flip, noise_coin, phase_flip
from qca_lowmem import stock as reference

MASK = 0xFFFFFFFF


pytestmark = pytest.mark.usefixtures("one_thread")


def philox4x32_10(counter, key):
    """Philox4x32-10 on int64 tensors holding 32-bit words: counter (4, n), key (2, n)."""
    c = [w.clone() for w in counter]
    k0, k1 = key[0].clone(), key[1].clone()
    for _ in range(10):
        p0 = 0xD2511F53 * c[0]  # wraps like uint64: the low 64 bits are exact
        p1 = 0xCD9E8D57 * c[2]
        hi0, lo0 = (p0 >> 32) & MASK, p0 & MASK
        hi1, lo1 = (p1 >> 32) & MASK, p1 & MASK
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return torch.stack(c)


def noise_words(seed, step, cells, stream, block):
    """Words 4*block..4*block+3 of `stream` for the given cells (include/qca_lowmem/noise.h)."""
    seed, step = seed % 2**64, step % 2**64
    cells = torch.as_tensor(cells, dtype=torch.int64)
    n = cells.numel()
    full = lambda v: torch.full((n,), v, dtype=torch.int64)  # noqa: E731
    counter = [cells & MASK, ((cells >> 32) & 0xFFFF) | (block << 16) | (stream << 28), full(step & MASK), full(step >> 32)]
    return philox4x32_10(counter, [full(seed & MASK), full(seed >> 32)])


def reference_phase_factors(shape, rate, seed, step):
    """(hit (B,H,W) bool, theta (B,H,W,d) float64) as the documented generator defines them."""
    b, h, w, d = shape
    cells = torch.arange(b * h * w)
    hit = noise_words(seed, step, cells, 0, 0)[0].double() * 2.0**-32 < rate
    words = torch.cat([noise_words(seed, step, cells, 0, blk) for blk in range((d + 4) // 4)])  # row = word index
    theta = 2 * math.pi * (words[1 : d + 1].double() * 2.0**-32)
    return hit.view(b, h, w), theta.t().reshape(b, h, w, d)


def random_psi(shape, dtype=torch.complex128, device="cpu"):
    return torch.randn(shape, dtype=dtype, device=device)


def test_reference_philox_matches_known_answers():
    # Known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((MASK,) * 4, (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        out = philox4x32_10([torch.tensor([v]) for v in counter], [torch.tensor([v]) for v in key])
        assert tuple(out[:, 0].tolist()) == expected


@pytest.mark.parametrize("seed,step", [(0, 0), (12345, 7), (2**64 - 1, 2**40 + 3), (-5, 3)])
def test_phase_flip_matches_reference_generator(seed, step):
    shape = (2, 5, 3, 6)
    psi = random_psi(shape)
    hit, theta = reference_phase_factors(shape, 0.4, seed, step)
    expected = torch.where(hit[..., None], psi * torch.exp(1j * theta), psi)
    out = phase_flip(psi, 0.4, seed, step)
    assert 0 < hit.sum() < hit.numel()
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-14)
    undone = phase_flip(out, 0.4, seed, step, conjugate=True)
    torch.testing.assert_close(undone, psi, rtol=1e-14, atol=1e-14)


def test_bit_flip_and_coin_match_reference_generator():
    shape = (3, 4, 5, 2)
    psi = random_psi(shape)
    seed, step = 987654321, 11
    u = noise_words(seed, step, torch.arange(60), 1, 0)[0].double() * 2.0**-32
    hit = (u < 0.3).view(3, 4, 5)
    assert torch.equal(bit_flip(psi, 0.3, seed, step), torch.where(hit[..., None], -psi, psi))
    for step in range(5):
        expected = noise_words(seed, step, [0], 2, 0)[0, 0].item() * 2.0**-32
        assert noise_coin(seed, step) == expected


def hits_of(out, psi):
    return (out != psi).any(-1)


def test_phase_flip_rate_and_uniform_phases():
    psi = torch.ones(4, 128, 128, 3, dtype=torch.complex64)
    rate, n = 0.05, 4 * 128 * 128
    out = phase_flip(psi, rate, 2024, 3)
    hit = hits_of(out, psi)
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(hit.sum().item() - n * rate) < 5 * sigma
    theta = torch.remainder(torch.angle(out[hit]).double(), 2 * math.pi).flatten()
    counts = torch.histc(theta, bins=16, min=0, max=2 * math.pi)
    expected = theta.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50  # 15 degrees of freedom: p < 1e-5 above 45
    # Components of a hit cell get independent phases.
    per_cell = torch.remainder(torch.angle(out[hit]).double(), 2 * math.pi)
    corr = torch.corrcoef(per_cell.t())
    assert (corr - torch.eye(3, dtype=corr.dtype)).abs().max() < 0.1
    assert torch.allclose(out.abs(), psi.abs())


def test_rates_match_the_stock_injector():
    from qca_lowmem import stock as reference

    psi = torch.ones(2, 128, 128, 2, dtype=torch.complex64)
    rate = 0.1
    stock = hits_of(reference.NoiseInjector().apply_phase_flip(psi, rate), psi).float().mean().item()
    ours = hits_of(phase_flip(psi, rate, 5, 1), psi).float().mean().item()
    sigma = math.sqrt(rate * (1 - rate) / psi[..., 0].numel())
    assert abs(ours - rate) < 5 * sigma and abs(stock - rate) < 5 * sigma
    ours_bit = (bit_flip(psi, rate, 5, 1) == -psi).all(-1).float().mean().item()
    assert abs(ours_bit - rate) < 5 * sigma


def test_bit_flip_hits_are_independent_of_phase_hits():
    psi = torch.ones(1, 256, 256, 1, dtype=torch.complex64)
    phase_hit = hits_of(phase_flip(psi, 0.5, 9, 9), psi)
    bit_hit = (bit_flip(psi, 0.5, 9, 9) == -psi).all(-1)
    both = (phase_hit & bit_hit).float().mean().item()
    assert abs(both - 0.25) < 0.01


def test_coin_frequency_over_many_steps():
    n = 20000
    coins = torch.tensor([noise_coin(77, t) for t in range(n)])
    assert abs((coins < 0.2).float().mean().item() - 0.2) < 5 * math.sqrt(0.16 / n)
    assert 0 <= coins.min() and coins.max() < 1
    assert noise_coin(77, 3) == noise_coin(77, 3) and noise_coin(77, 3) != noise_coin(78, 3)


def test_same_key_same_hits_different_key_different_hits():
    psi = random_psi((2, 16, 16, 4), torch.complex64)
    a = phase_flip(psi, 0.3, 1, 10)
    assert torch.equal(a, phase_flip(psi, 0.3, 1, 10))
    assert not torch.equal(hits_of(a, psi), hits_of(phase_flip(psi, 0.3, 1, 11), psi))
    assert not torch.equal(hits_of(a, psi), hits_of(phase_flip(psi, 0.3, 2, 10), psi))
    b = bit_flip(psi, 0.3, 1, 10)
    assert torch.equal(b, bit_flip(psi, 0.3, 1, 10))
    assert not torch.equal(b, bit_flip(psi, 0.3, 1, 11))


def test_independent_of_layout_and_threads():
    psi = random_psi((2, 6, 7, 5), torch.complex64)
    expected = phase_flip(psi, 0.5, 3, 4)
    strided = psi.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert not strided.is_contiguous()
    assert torch.equal(phase_flip(strided, 0.5, 3, 4), expected)
    assert torch.equal(bit_flip(strided, 0.5, 3, 4), bit_flip(psi, 0.5, 3, 4))
    big = random_psi((4, 64, 64, 3), torch.complex64)  # enough cells for several chunks
    torch.set_num_threads(2)
    two = phase_flip(big, 0.5, 3, 4)
    torch.set_num_threads(1)
    assert torch.equal(phase_flip(big, 0.5, 3, 4), two)


def test_rate_zero_and_one():
    psi = random_psi((1, 4, 4, 2))
    assert torch.equal(phase_flip(psi, 0.0, 1, 1), psi)
    assert torch.equal(bit_flip(psi, 1.0, 1, 1), -psi)
    assert hits_of(phase_flip(psi, 1.0, 1, 1), psi).all()


@pytest.mark.parametrize("op", [phase_flip, bit_flip])
def test_gradcheck(op):
    psi = random_psi((1, 3, 4, 3)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: op(x, 0.5, 42, 7), (psi,))
    assert torch.autograd.gradgradcheck(lambda x: op(x, 0.5, 42, 7), (psi,))


def test_complex64_gradient_is_the_conjugate_phase():
    psi = random_psi((1, 5, 5, 3), torch.complex64).requires_grad_()
    grad = random_psi((1, 5, 5, 3), torch.complex64)
    out = phase_flip(psi, 0.5, 1, 2)
    (g,) = torch.autograd.grad(out, psi, grad)
    factor = out.detach() / psi.detach()
    torch.testing.assert_close(g, grad * factor.conj())
    (g,) = torch.autograd.grad(bit_flip(psi, 0.5, 1, 2), psi, grad)
    torch.testing.assert_close(g, grad * (bit_flip(psi, 0.5, 1, 2) / psi).detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_opcheck(device, dtype):
    psi = random_psi((1, 3, 4, 5), dtype, device).requires_grad_()
    opcheck(torch.ops.qca_lowmem.phase_flip, (psi, 0.4, 3, 9))
    opcheck(torch.ops.qca_lowmem.phase_flip, (psi, 0.4, 3, 9, True))
    opcheck(torch.ops.qca_lowmem.bit_flip, (psi, 0.4, 3, 9))


def test_opcheck_coin():
    opcheck(torch.ops.qca_lowmem.noise_coin, (3, 9))


@pytest.mark.slow
def test_compile_fullgraph():
    psi = random_psi((1, 4, 4, 2), torch.complex64)

    def noisy(x):
        return bit_flip(phase_flip(x * 2, 0.5, 1, 2), 0.5, 1, 2)

    assert torch.equal(torch.compile(noisy, fullgraph=True)(psi), noisy(psi))


@pytest.mark.slow
def test_compile_fullgraph_of_a_rate_changing_between_calls():
    """The second rate compiles the function again with a symbolic rate (the users' noise grows
    with the episode), which the wrappers' Python check of the rate broke; the fake checks it."""
    psi = random_psi((1, 4, 4, 2), torch.complex64)

    def noisy(x, rate):
        return bit_flip(phase_flip(x, rate, 1, 2), rate, 1, 2)
    compiled = torch.compile(noisy, fullgraph=True, backend="eager")
    for rate in (0.1, 0.7):
        assert torch.equal(compiled(psi, rate), noisy(psi, rate))
    with pytest.raises(RuntimeError, match=r"phase_flip: rate must be a probability in \[0, 1\], got 1\.5"):
        compiled(psi, 1.5)
    rate = torch.tensor(0.2)  # read as a number, as eagerly (a graph break)
    assert torch.equal(torch.compile(noisy, backend="eager")(psi, rate), noisy(psi, rate))


def test_errors_name_the_argument():
    psi = random_psi((1, 2, 2, 2), torch.complex64)
    with pytest.raises(RuntimeError, match=r"psi must be complex64 or complex128.*Float"):
        phase_flip(psi.real.contiguous(), 0.1, 1, 1)
    with pytest.raises(RuntimeError, match=r"psi must have 4 dimensions.*shape=\[2, 2, 2\]"):
        bit_flip(psi[0], 0.1, 1, 1)
    with pytest.raises(ValueError, match=r"rate must be a probability in \[0, 1\], got 1.5"):
        phase_flip(psi, 1.5, 1, 1)
    with pytest.raises(ValueError, match="rate must be a probability"):
        bit_flip(psi, float("nan"), 1, 1)
    with pytest.raises(RuntimeError, match="rate must be a probability in \\[0, 1\\], got -0.5"):
        torch.ops.qca_lowmem.phase_flip(psi, -0.5, 1, 1)
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        phase_flip(psi, 0.1, 1.5, 1)
    with pytest.raises(ValueError, match="step must fit in 64 bits"):
        phase_flip(psi, 0.1, 1, 2**64)


def test_schedule_has_the_stock_semantics():
    assert NoiseSchedule(0.2, 1000, seed=1).rate == pytest.approx(0.1)
    assert NoiseSchedule(0.2, 5000, seed=1).rate == pytest.approx(0.2)
    psi = random_psi((1, 32, 32, 3), torch.complex64)
    quiet = NoiseSchedule(0.2, 5, seed=1)  # rate 0.0005 <= 0.001: no noise
    assert quiet(psi, 0) is psi
    schedule = NoiseSchedule(0.3, 4000, seed=99)
    flips = 0
    for step in range(40):
        expected = phase_flip(psi, 0.3, 99, step)
        if noise_coin(99, step) < 0.2:
            expected = bit_flip(expected, 0.03, 99, step)
            flips += 1
        assert schedule.bit_flips_at(step) == (noise_coin(99, step) < 0.2)
        assert torch.equal(schedule(psi, step), expected)
    assert 0 < flips < 40


def test_schedule_seed_reproducible_under_manual_seed():
    torch.manual_seed(3)
    a = NoiseSchedule(0.1, 10).seed
    torch.manual_seed(3)
    assert NoiseSchedule(0.1, 10).seed == a
    assert NoiseSchedule(0.1, 10).seed != a
    with pytest.raises(ValueError, match="max_noise must be a finite number >= 0, got -0.1"):
        NoiseSchedule(-0.1, 1)
    with pytest.raises(ValueError, match="episode must be an int"):
        NoiseSchedule(0.1, -1)


def test_a_rate_above_one_flips_every_cell_as_stock_does():
    """Stock draws rand < rate: at a rate above 1 every cell's phase flips; the bit flip's rate is
    a tenth of it."""
    psi = reference.initial_state(2, 8, 3, "cpu", torch.Generator().manual_seed(0))
    schedule = NoiseSchedule(1.5, 4000, seed=7)
    assert schedule.rate == 1.5
    noisy = schedule(psi, 0)
    cell_changed = (noisy != psi).any(dim=-1)
    assert cell_changed.all()
    assert torch.allclose(noisy.abs(), psi.abs(), atol=1e-6)


def test_exported():
    for name in ("phase_flip", "bit_flip", "noise_coin", "NoiseSchedule"):
        assert name in qca_lowmem.__all__ and hasattr(qca_lowmem, name)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_cuda_matches_cpu(dtype):
    psi = random_psi((2, 64, 64, 14), dtype)
    for seed, step in [(1, 0), (2**63 + 5, 499)]:
        cpu = phase_flip(psi, 0.3, seed, step)
        gpu = phase_flip(psi.cuda(), 0.3, seed, step).cpu()
        assert torch.equal(hits_of(cpu, psi), hits_of(gpu, psi))
        # Same hits, phases and products (no FMA, test_build.py checks); only sincos differs:
        # CUDA's is within 2 ulp in double, so a float factor moves by at most one float ulp.
        tol = 1e-6 if dtype == torch.complex64 else 1e-13
        torch.testing.assert_close(gpu, cpu, rtol=tol, atol=tol)
        assert torch.equal(bit_flip(psi.cuda(), 0.3, seed, step).cpu(), bit_flip(psi, 0.3, seed, step))


@cuda_only
def test_cuda_gradcheck_and_stream():
    psi = random_psi((1, 3, 4, 3), device="cuda").requires_grad_()
    assert torch.autograd.gradcheck(lambda x: phase_flip(x, 0.5, 42, 7), (psi,))
    stream = torch.cuda.Stream()
    x = random_psi((1, 64, 64, 14), torch.complex64, "cuda")
    expected = phase_flip(x, 0.5, 1, 1)
    # The side stream waits for x and expected (on the default stream) before it reads x; inside
    # the context current_stream() would be the side stream itself (a race, seen on an H100).
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = phase_flip(x, 0.5, 1, 1)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)
