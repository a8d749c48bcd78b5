"""Property tests of the fused QCA step: any shape, any strided view, any delta layout and dtype
must give the stock result (hypothesis draws the cases and shrinks any failure)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qca_lowmem
from qca_lowmem import stock as reference

NARROW = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@st.composite
def step_cases(draw):
    b, h, w, d = (draw(st.integers(1, 3)), draw(st.integers(1, 7)), draw(st.integers(1, 7)), draw(st.integers(1, 16)))
    # psi as a view with a step in every dimension, maybe with H and W swapped.
    steps = [draw(st.integers(1, 2)) for _ in range(4)]
    transpose = draw(st.booleans()) and h == w
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn([n * s for n, s in zip((b, h, w, d), steps)], dtype=torch.complex64, generator=generator)
    psi = base[:: steps[0], :: steps[1], :: steps[2], :: steps[3]]
    if transpose:
        psi = psi.transpose(1, 2)
    delta_dtype = NARROW[draw(st.sampled_from(sorted(NARROW)))]
    delta = (0.5 * torch.randn(b, 2 * d, h, w, generator=generator)).to(delta_dtype)
    if draw(st.booleans()):
        delta = delta.contiguous(memory_format=torch.channels_last)
    gamma = draw(st.sampled_from([0.0, 0.01, 0.3]))
    multiplicative = draw(st.booleans())
    return psi, delta, gamma, multiplicative


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_cases())
def test_update_and_pack_match_stock_on_any_layout(case):
    psi, delta, gamma, multiplicative = case
    torch.testing.assert_close(qca_lowmem.qca_pack(psi), reference.pack(psi), rtol=0, atol=0)

    psi_leaf = psi.detach().requires_grad_()
    delta_leaf = delta.detach().requires_grad_()
    out = qca_lowmem.qca_update(psi_leaf, delta_leaf, gamma, multiplicative)
    upstream = torch.randn_like(out)
    grad_psi, grad_delta = torch.autograd.grad(out, (psi_leaf, delta_leaf), upstream)

    psi64 = psi.detach().to(torch.complex128).requires_grad_()
    delta64 = delta.detach().double().requires_grad_()
    ref = reference.update(psi64, delta64, gamma, multiplicative)
    ref_grad_psi, ref_grad_delta = torch.autograd.grad(ref, (psi64, delta64), upstream.to(torch.complex128))

    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_psi, ref_grad_psi.to(grad_psi.dtype), rtol=1e-4, atol=1e-5)
    tolerance = dict(rtol=1e-4, atol=1e-5) if delta.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_delta, ref_grad_delta.to(delta.dtype), **tolerance)
