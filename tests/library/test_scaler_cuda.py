"""qca_lowmem.amp on CUDA: the kernels against references and torch's, many tensors over several
launches, GradScaler under autocast, clip_grad_norm_, a CUDA graph capture, no host sync
outside step()."""

import copy

import pytest
import torch
from torch import nn

from fixtures.scaler import CHUNK, DTYPES, INJECT, SIZES, Net, bits_equal, check_unscale, ops, random_list, reference_unscale
from helpers import cuda_only
from qca_lowmem.amp import GradScaler
from qca_lowmem.recompute.cuda_graphs import caching_allocator_off


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


@cuda_only
def test_cuda_accumulate_adds_as_add_():
    """Every pair of dtypes, more pairs than one launch holds, a pair cut across launches, and a
    channels_last accumulator with a contiguous gradient: CUDA's add_ bit for bit; captured in a
    CUDA graph, a replay adds again."""
    reals = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    pairs = [(a, g) for a in reals for g in reals] * 5
    sizes = [int(s) for s in torch.randint(0, 5000, (len(pairs),))]
    sizes[3] = 400 * CHUNK + 3
    accumulators = [torch.randn(n, device="cuda").to(a) for n, (a, _) in zip(sizes, pairs)]
    grads = [torch.randn(n, device="cuda").to(g) for n, (_, g) in zip(sizes, pairs)]
    accumulators.append(torch.randn(8, 6, 3, 3, device="cuda").to(memory_format=torch.channels_last))
    grads.append(torch.randn(8, 6, 3, 3, device="cuda", dtype=torch.bfloat16))
    want = [a.clone().add_(g) for a, g in zip(accumulators, grads)]
    ops.accumulate_(accumulators, grads)
    assert all(bits_equal(a, w) for a, w in zip(accumulators, want))

    static = [a.clone() for a in accumulators[:20]]
    start = [a.clone() for a in static]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.accumulate_(static, grads[:20])
    for a, s in zip(static, start):
        a.copy_(s)
    graph.replay()
    assert all(bits_equal(a, s.clone().add_(g)) for a, s, g in zip(static, start, grads))
