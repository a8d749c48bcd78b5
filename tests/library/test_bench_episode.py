"""The episode benchmark (benchmarks/bench_episode.py) runs end to end on a tiny config."""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType

import qca_lowmem

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_episode.py"
# lowmem_fp32_step and the runs that take its time apart
RUNS = ["stock_fp32", "stock_fp32_checkpoint", "lowmem_fp32_keep", "lowmem_fp32_forward", "lowmem_fp32_step"]


def run(*args):
    # The script imports qca_lowmem as this process does (installed, or PYTHONPATH inherited);
    # one thread, as the other tests (tiny tensors, shared machines).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env)


@pytest.mark.slow
def test_help():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    assert "lowmem_bf16_revolve32" in result.stdout


@pytest.mark.slow
def test_tiny_episode_writes_the_report(tmp_path):
    out = tmp_path / "episode.json"
    result = run("--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps", "3", "--episodes", "1",
                 "--runs", *RUNS, "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["kind"] == "episode" and report["config"]["qca_steps"] == 3
    assert [r["name"] for r in report["runs"]] == RUNS
    assert all(r["episode_s"] > 0 for r in report["runs"])
    assert report["max_grad_rel_err_fp32"] < 1e-5
    for key in ("device", "torch", "cuda", "commit", "date"):
        assert key in report


@pytest.mark.slow
def test_every_run_kind_runs_on_a_tiny_config(tmp_path):
    """Each run the script knows, the ones asked for by name included (checkpoint="auto" among
    them), completes: a command docs/benchmarks.md gives cannot break unseen."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_episode
    finally:
        sys.path.remove(str(SCRIPT.parent))
    runs = [name for name in bench_episode.RUNS + bench_episode.EXTRA_RUNS if name not in bench_episode.CUDA_ONLY_RUNS]
    out = tmp_path / "episode.json"
    result = run("--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps", "3", "--episodes", "1",
                 "--profile", "--profile-steps", "2", "--runs", *runs, "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == runs
    assert {"lowmem_enable_default", "lowmem_enable_channels_last", "stock_v4", "lowmem_bf16_step_graph_cl"} <= set(runs)
    assert all("error" not in r and r["episode_s"] > 0 for r in report["runs"]), report["runs"]
    # Off CUDA the profile has no kernels; every episode reads its loss, so some op waits.
    assert all(r["kernels_per_step"] is None and r["gpu_busy_fraction"] is None and r["host_wait_ops_per_step"] > 0
               and r["kernel_ms_per_step_by_family"] is None and r["kernels_per_step_by_family"] is None
               and r["profiled_steps"] == 2 for r in report["runs"])
    refused = run("--device", "cpu", "--runs", *bench_episode.CUDA_ONLY_RUNS, "--out", str(tmp_path / "refused.json"))
    assert refused.returncode == 2 and "need a CUDA device" in refused.stderr


def test_the_gpu_checks_ask_bench_episode_only_for_runs_it_has():
    """A GPU is lent for minutes: a run name the script refuses would waste a phase."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_episode
    finally:
        sys.path.remove(str(SCRIPT.parent))
    script = (ROOT / "scripts" / "gpu_checks.sh").read_text().replace("\\\n", " ")
    asked = [line.split("--runs", 1)[1].split("--", 1)[0].split() for line in script.splitlines()
             if "bench_episode.py" in line and "--runs" in line]
    assert len(asked) >= 6
    known = set(bench_episode.RUNS + bench_episode.EXTRA_RUNS)
    assert [name for names in asked for name in names if name not in known] == []
    assert {"lowmem_bf16_step_graph_overlap_cl", "stock_compiled_checkpoint"} <= {n for names in asked for n in names}


def test_a_result_names_its_commit_and_says_when_the_files_differ_from_it(tmp_path, monkeypatch):
    """Result files record the commit that ran: a tree changed since its last commit (or a copy
    whose .git is stale, as on a lent GPU machine) is marked -dirty, unless QCA_LOWMEM_COMMIT names
    the commit."""
    import subprocess

    from qca_lowmem.trainer.bench import library_commit

    monkeypatch.delenv("QCA_LOWMEM_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert library_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert library_commit(tmp_path) == head + "-dirty"
    monkeypatch.setenv("QCA_LOWMEM_COMMIT", "abc123")
    assert library_commit(tmp_path) == "abc123"


def bench_module(name):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_gpus_busy_time_is_the_union_of_its_intervals():
    profile = bench_module("episode_profile")
    assert profile.busy_seconds([(0, 10), (5, 12), (20, 25), (21, 22)]) == pytest.approx(17e-6)
    assert profile.busy_seconds([]) == 0
    assert profile.LAYOUT_CONVERSION.search("void cudnn::ops::nchwToNhwcKernel<float>")
    assert not profile.LAYOUT_CONVERSION.search("sm90_xmma_fprop_implicit_gemm")


# Host events in the recorded "top" lists (ops, autograd Functions), and the one recorded device
# event that is no kernel: torch's GPU user annotation of the optimizer's step.
HOST_EVENT_PREFIXES = ("aten::", "qca_lowmem::", "autograd::", "_")
NOT_KERNELS = {"Optimizer.step#AdamW.step"}
# Genuinely other: cub's select behind nonzero (the stock noise's boolean masks), and a name the
# record cut short before its functor.
GENUINELY_OTHER = ("void at_cuda_detail::cub::detail::select::DeviceSelectSweepKernel<",
                   "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
                   "at::native::(anonymous namespac")
MULTI_TENSOR = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<{}>, {}>(...)"
# Names no record holds in full (torch's GroupNorm apply and backward kernels, a Memcpy, a Memset),
# and names two families' patterns match or one must not: the first family in the table wins.
ORDERED = [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::GroupNormKernelImplInternal"
     "<float, float>(...)::{lambda(float, float, float)#1}>(...)", "groupnorm_elu"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float>(...)", "groupnorm_elu"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__half, __half, float, false, true>(...)", "layout"),
    ("void (anonymous namespace)::nhwc_forward_kernel<__half, float>(qca_groupnorm_elu_params, NhwcPlan)", "groupnorm_elu"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_alignedK_contig<float, 4>(...)", "cats"),
    (MULTI_TENSOR.format(2, "BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float"), "adds"),
    (MULTI_TENSOR.format(3, "BinaryOpScalarFunctor<float, 1, 1, 0>, std::plus<float>, float"), "optimizer"),
    (MULTI_TENSOR.format(1, "ZeroFunctor<float, 1, 1, 0>"), "fills"),
    (MULTI_TENSOR.format(2, "CopyFunctor<float, 2, 1, 1>"), "copies"),
    ("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, LoadWithCast<2> >(...)", "adds"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::gelu_kernel(...)", "other"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("Memset (Device)", "fills"),
]


NOT_YET_ON_A_GPU = {"checks"}  # step_difference.cu, since d7c48a1


def recorded_kernel_names():
    """The CUDA kernel names the committed GPU results record: the profiles' top lists and the
    kernel mixes' top kernels."""
    names = set()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*nvidia*.json")):
        report = json.loads(path.read_text())
        for entry in [report, *report.get("runs", [])]:
            names.update(row["name"] for key in ("top", "top_kernels") for row in entry.get(key, []))
    return {name for name in names if not name.startswith(HOST_EVENT_PREFIXES)} - NOT_KERNELS


def test_every_kernel_name_recorded_on_a_gpu_has_its_family():
    profile = bench_module("episode_profile")
    names = recorded_kernel_names()
    assert len(names) > 50  # the H100's profiles and the H200's profile and kernel mixes
    other = {name for name in names if profile.family_of(name) == "other"}
    assert other == {name for name in names if name.startswith(GENUINELY_OTHER)} and len(other) == len(GENUINELY_OTHER)
    # no family without a name, but those of kernels no GPU has run yet
    assert {profile.family_of(name) for name in names} == set(profile.FAMILY_NAMES) - NOT_YET_ON_A_GPU
    assert [(name, profile.family_of(name)) for name, _ in ORDERED] == ORDERED


def our_kernel_names():
    """Each __global__ kernel of csrc/kernels as the profiler names it (its parameters' types in
    its signature; a template's Params as each type it is launched with), and its file."""
    kernels = []
    for path in sorted((ROOT / "csrc" / "kernels").glob("*.cu*")):
        text = path.read_text()
        launched = re.findall(r"launch<(?:\w+, )?(qca_\w+_params)", text)
        for name, param in re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(const (\w+)", text):
            for param_type in launched if param == "Params" else [param]:
                kernels.append((f"void (anonymous namespace)::{name}<float, float>({param_type}, long)", path.name))
    return kernels


def test_our_kernels_are_in_their_families():
    profile = bench_module("episode_profile")
    expected = {"groupnorm_elu.cu": "groupnorm_elu", "groupnorm_elu_nhwc.cuh": "groupnorm_elu", "qca_step.cu": "qca",
                "noise.cu": "qca", "scaler.cu": "optimizer", "step_difference.cu": "checks", "max_pool.cu": "pooling"}
    kernels = our_kernel_names()
    # 4 NCHW and 4 channels_last GroupNorm+ELU, pack and update forward and backward, noise, 3 scaler
    # and the gradient accumulation (in scaler.cu, an add), the check's two, the max pooling's two
    assert len(kernels) == 21
    assert [(name, profile.family_of(name)) for name, _ in kernels] == [
        (name, "adds" if "accumulate_chunks_kernel" in name else expected[file]) for name, file in kernels]


def event(name, start, end, device_type=DeviceType.CUDA, is_user_annotation=False):
    """An event as torch's profiler gives it: start and end in microseconds."""
    return types.SimpleNamespace(name=name, device_type=device_type, is_user_annotation=is_user_annotation,
                                 time_range=types.SimpleNamespace(start=start, end=end))


def test_kernel_time_and_launches_per_step_by_family_add_up_to_the_device_events():
    """Over 2 steps: each device event's milliseconds and launch go to its family, per step; the
    families add up to all the device's time; Memcpy and Memset count there but not as kernels; a
    GPU user annotation counts nowhere; host events only widen the span."""
    profile = bench_module("episode_profile")
    events = [
        event("aten::conv2d", 0, 1000, DeviceType.CPU),
        event("Optimizer.step#AdamW.step", 0, 900, is_user_annotation=True),
        event("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_execute_kernel__5x_cudnn", 100, 400),
        event("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816dgrad_optimized_bf16>(...)", 400, 500),
        event("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>(...)", 500, 520),
        event("void (anonymous namespace)::forward_kernel<__half, float>(qca_groupnorm_elu_params, Plan)", 520, 560),
        event("void (anonymous namespace)::per_cell_kernel<qca_update_params, &update_cell<float>>(qca_update_params, "
              "long)", 560, 570),
        event("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(...)", 600, 602),
        event("Memset (Device)", 602, 604),
        event("Memcpy DtoD (Device -> Device)", 610, 618),
        event("void at_cuda_detail::cub::detail::select::DeviceSelectSweepKernel<...>(...)", 700, 704),
    ]
    counts = profile.device_counts(events + [event("cudaStreamSynchronize", 950, 1000, DeviceType.CPU)], steps=2)
    assert counts["device_syncs_per_step"] == 0.5  # the host's one wait for the device, per step
    assert profile.summary({**counts, "host_wait_ops_per_step": 1.0}) == \
        "   waits/step 1.00 (device syncs 0.50)   kernels/step 4 (layout 0)   GPU busy 49%"
    expected_ms = dict.fromkeys(profile.FAMILY_NAMES, 0.0) | {
        "convolution": 0.2, "layout": 0.01, "groupnorm_elu": 0.02, "qca": 0.005, "fills": 0.002, "copies": 0.004,
        "other": 0.002}
    assert counts["kernel_ms_per_step_by_family"] == pytest.approx(expected_ms, abs=1e-12)
    assert counts["kernels_per_step_by_family"] == dict.fromkeys(profile.FAMILY_NAMES, 0) | {
        "convolution": 1.0, "layout": 0.5, "groupnorm_elu": 0.5, "qca": 0.5, "fills": 1.0, "copies": 0.5, "other": 0.5}
    assert list(counts["kernel_ms_per_step_by_family"]) == list(profile.FAMILY_NAMES)
    device_ms = sum(e.time_range.end - e.time_range.start for e in events[2:]) / 1e3
    assert sum(counts["kernel_ms_per_step_by_family"].values()) == pytest.approx(device_ms / 2)
    assert counts["kernels_per_step"] == 3.5  # 7 kernels: not the Memcpy, Memset or annotation
    assert sum(counts["kernels_per_step_by_family"].values()) == counts["kernels_per_step"] + 1.0
    assert counts["layout_conversions_per_step"] == 0.5
    assert counts["gpu_busy_fraction"] == pytest.approx((470 + 4 + 8 + 4) / 1000)
    top = counts["top_kernels_per_step_by_family"]
    assert set(top) == {"convolution", "layout", "groupnorm_elu", "qca", "fills", "copies", "other"}
    assert [name for name, _, _ in top["convolution"]] == [events[2].name[:profile.NAME_CHARS], events[3].name]
    # equal times: by name
    assert top["fills"] == [["Memset (Device)", 0.5, pytest.approx(0.001)], [events[7].name, 0.5, pytest.approx(0.001)]]
    assert top["other"] == [[events[10].name, 0.5, pytest.approx(0.002)]]
    assert profile.device_counts(events[:2], steps=2) == {}  # no device event but the annotation
    table = profile.family_table(counts)
    assert "by family (launches): convolution 0.200 (1), groupnorm_elu 0.020 (0.5), layout 0.010 (0.5), qca 0.005 " \
           "(0.5), copies 0.004 (0.5), " in table and "adds" not in table
    assert table.endswith("all 0.243 (4.5)")


def test_off_cuda_the_profile_has_no_device_fields():
    """A profiled episode on the CPU: its device fields are None, its host waits counted."""
    import contextlib

    profile = bench_module("episode_profile")
    run = types.SimpleNamespace(device=torch.device("cpu"), args=types.SimpleNamespace(steps=4),
                                steps_set=lambda steps: contextlib.nullcontext(),
                                episode=lambda seed: torch.ones(3).sin().sum().item())
    counts = profile.episode_counts(run, steps=2)
    assert counts == {"profiled_steps": 2, "host_wait_ops_per_step": 0.5, "device_syncs_per_step": None,
                      "kernels_per_step": None,
                      "gpu_busy_fraction": None, "layout_conversions_per_step": None,
                      "kernel_ms_per_step_by_family": None, "kernels_per_step_by_family": None,
                      "top_kernels_per_step_by_family": None}
    assert profile.family_table(counts) == "" and profile.summary(counts) == "   waits/step 0.50"


def test_the_users_trainer_rows_run_their_episode_and_enables_defaults():
    """stock_v4 is the stand-in's own episode; lowmem_enable_default the same trainer after
    enable() with every default; both on an odd, noisy episode (their injector's noise on)."""
    trainer_rows = bench_module("episode_trainer")
    bench_episode = bench_module("bench_episode")
    args = bench_episode.parse_args(["--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps",
                                     "2", "--episode", "1000"])
    stock_model = bench_episode.reference.UNetUnitary(2, 4)
    runs = {name: trainer_rows.TrainerRun(name, stock_model, args, torch.device("cpu"))
            for name in trainer_rows.TRAINER_RUNS}
    assert runs["stock_v4"].episode_number == 1001 and bench_episode.reference.noise_rate(1001, 0.1) > 0.001
    assert not hasattr(runs["stock_v4"].trainer, "_qca_lowmem_state")
    options = runs["lowmem_enable_default"].trainer._qca_lowmem_state.options
    assert options.policy.checkpoint == "step" and options.given.noise == "trainer" and not options.cuda_graph
    assert runs["lowmem_enable_default"].capture_record() == {"cuda_graph": False}
    assert all(run.episode(seed=1) > 0 for run in runs.values())


def test_the_overlap_trainer_row_captures_enables_step_on_two_lanes(replayed_graphs):
    """lowmem_enable_default_overlap: enable()'s defaults, the switch's StepGraph with two lanes
    for that row's episodes only (CUDA graphs replaced by the tests' stand-in, so that enable()
    captures on the CPU); lowmem_enable_default beside it keeps one."""
    trainer_rows = bench_module("episode_trainer")
    bench_episode = bench_module("bench_episode")
    args = bench_episode.parse_args(["--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps",
                                     "3", "--episode", "1000"])
    stock_model = bench_episode.reference.UNetUnitary(2, 4)
    lanes = {}
    for name in ("lowmem_enable_default_overlap", "lowmem_enable_default"):
        run = trainer_rows.TrainerRun(name, stock_model, args, torch.device("cpu"))
        assert run.episode(seed=1) > 0
        graph = run.trainer._qca_lowmem_state.captures.step_graph
        lanes[name] = len(graph.capture.lanes)
        assert run.capture_record() == {"cuda_graph": True, "captures_made": 1, "fell_back": False}
    assert lanes == {"lowmem_enable_default_overlap": 2, "lowmem_enable_default": 1}
    assert sum(graphs.ran_ahead for graphs in replayed_graphs) > 0


def test_a_kernel_is_timed_inside_a_captured_graph_of_calls(monkeypatch, capsys):
    """On CUDA a timed call is one of `calls` in a captured graph (StepGraph's capture, replaced
    here by an eager stand-in: a replay runs the body again); a call that cannot be captured is
    timed call by call, and says so; off CUDA nothing is captured."""
    import contextlib

    from qca_lowmem.recompute import step_graph

    class EagerGraphs:
        def __init__(self, device):
            pass

        def warming_up(self):
            return contextlib.nullcontext()

        def capture(self, body):
            return body(), body

    monkeypatch.setattr(step_graph, "_graphs", EagerGraphs)
    common = bench_module("common")
    calls = []
    replay, per = common.in_graph(lambda: calls.append(1), torch.device("cuda", 0), 5)
    assert per == 5 and len(calls) == 3 + 5  # the warm-up, then the capture's calls
    replay()
    assert len(calls) == 3 + 5 + 5

    def syncs():
        raise RuntimeError("operation not permitted when stream is capturing")

    assert common.in_graph(syncs, torch.device("cuda", 0), 5) == (syncs, 1)
    assert "not captured: operation not permitted" in capsys.readouterr().out
    timed_in = {}
    common.interleaved_medians({"k": lambda: None}, torch.device("cpu"), 1, 2, calls=5, timed_in=timed_in)
    assert timed_in == {"k": 1}


def test_a_kernel_that_cannot_be_captured_is_timed_by_its_kernels_summed(monkeypatch):
    """On CUDA a candidate in_graph cannot capture is timed by torch's profiler, its kernels'
    durations summed (one call between two events would time its launches), and says so."""
    common = bench_module("common")
    monkeypatch.setattr(common, "in_graph", lambda fn, device, calls: (fn, 1))
    monkeypatch.setattr(common, "kernel_seconds", lambda fn, reps: 7e-6)
    timed_in = {}
    times = common.interleaved_medians({"k": lambda: None}, torch.device("cuda", 0), 1, 2, calls=5, timed_in=timed_in)
    assert times == {"k": 7e-6} and timed_in == {"k": "profiler"}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.ones(4).sin()
    assert common.summed_device_seconds(profile.key_averages()) == 0.0  # no device: no kernel time


def test_a_backward_candidates_graph_is_made_in_the_captures_warm_up(monkeypatch):
    """The probe's backward candidates make their forward's graph at their first call, which is
    in_graph's warm-up, on the stream its capture runs on (a stand-in here records where it is),
    once; every call returns the forward's gradients."""
    import contextlib

    from qca_lowmem.recompute import step_graph

    where = ["caller's stream"]

    class SideStreamGraphs:
        def __init__(self, device):
            pass

        @contextlib.contextmanager
        def warming_up(self):
            where.append("side stream")
            yield
            where.pop()

        def capture(self, body):
            return body(), body

    monkeypatch.setattr(step_graph, "_graphs", SideStreamGraphs)
    common = bench_module("common")
    forwards = []

    def forward(x):
        forwards.append(where[-1])
        return x.sin()

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)
    run = common.backward_of(forward, (x,), g)
    assert forwards == []
    replay, per = common.in_graph(run, torch.device("cuda", 0), 5)
    assert per == 5 and forwards == ["side stream"]
    grads = replay()
    assert forwards == ["side stream"] and all(torch.equal(grad, g * x.detach().cos()) for grad in grads[0])


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_the_step_recompute_written_by_hand_is_the_rollouts(channels_last):
    """lowmem_fp32_step_by_hand, the floor docs/benchmarks.md measures the step policy against,
    computes lowmem_fp32_step's loss and gradients."""
    bench_episode = bench_module("bench_episode")
    args = bench_episode.parse_args(["--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps",
                                     "4", "--episode", "2000", "--max-noise", "0.5"])
    torch.manual_seed(0)
    model = bench_episode.lowmem_model(bench_episode.reference.UNetUnitary(2, 4), args)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    step = bench_episode.lowmem_step_fn(model, args.gamma, None, channels_last=channels_last)
    psi0 = bench_episode.initial_state(args, torch.device("cpu"), 5)
    schedule = qca_lowmem.NoiseSchedule(args.max_noise, args.episode, seed=5)
    assert schedule.active  # the recompute replays the noise
    loss = bench_episode.step_back_by_hand(model, psi0, args, schedule, step)
    by_hand = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    history = bench_episode.lowmem_forward(model, psi0, args, schedule, step=step)
    rolled_loss, _ = bench_episode.reference.evolutionary_loss(history, psi0)
    rolled_loss.backward()
    assert loss.item() == rolled_loss.item()
    for got, expected in zip(by_hand, (p.grad for p in model.parameters())):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7 * expected.abs().max().item())


def _stock_episode_gradients(bench_episode, stock_model, args, autocast_dtype=None, compile_mode=None):
    """Loss and parameter gradients of one stock episode of a copy of stock_model, its noise on
    (the users' injector, global generators seeded); through the compiled peer's checkpointed
    step where compile_mode is given."""
    import copy

    import numpy

    episode_peer = bench_module("episode_peer")
    model, step = copy.deepcopy(stock_model), None
    if compile_mode is not None:
        model = model.to(memory_format=torch.channels_last)
        step = episode_peer.peer_step_fn(model, args.gamma, compile_mode)
    psi0 = bench_episode.initial_state(args, torch.device("cpu"), 5)
    torch.manual_seed(7)
    numpy.random.seed(7)
    history = bench_episode.stock_forward(model, psi0, args, bench_episode.reference.noise_rate(args.episode, args.max_noise),
                                          autocast_dtype, checkpoint_steps=step is not None, step=step)
    loss, _ = bench_episode.reference.evolutionary_loss(history, psi0)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


@pytest.mark.slow
def test_the_compiled_peer_computes_the_stock_episode():
    """stock_compiled_checkpoint's step (torch.compile, a checkpoint per step, channels_last) in
    fp32 gives stock's loss and gradients on the same weights, psi0 and noise; under its bf16
    autocast, within bf16's rounding of them."""
    bench_episode = bench_module("bench_episode")
    args = bench_episode.parse_args(["--device", "cpu", "--grid", "8", "--d-state", "2", "--hidden", "4", "--steps",
                                     "4", "--episode", "2000", "--max-noise", "0.5"])
    torch.manual_seed(0)
    stock_model = bench_episode.reference.UNetUnitary(2, 4)
    loss, grads = _stock_episode_gradients(bench_episode, stock_model, args)
    compiled_loss, compiled_grads = _stock_episode_gradients(bench_episode, stock_model, args, compile_mode="default")
    assert compiled_loss == pytest.approx(loss, rel=1e-6)
    for got, expected in zip(compiled_grads, grads):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    bf16_loss, bf16_grads = _stock_episode_gradients(bench_episode, stock_model, args, torch.bfloat16, "default")
    assert bf16_loss == pytest.approx(loss, rel=1e-3) and bf16_loss != loss  # bf16 ran
    for got, expected in zip(bf16_grads, grads):
        assert (got - expected).norm() <= 0.05 * expected.norm()


def test_the_fastest_compile_mode_is_the_row_and_every_mode_is_reported():
    """On CUDA the peer runs once per compile mode: the fastest mode that ran is the row, each
    mode's time or error is kept beside it; where none ran, the fallback mode runs; where that
    fails too, the first mode's error is the row."""
    bench_episode = bench_module("bench_episode")
    episode_peer = bench_module("episode_peer")
    args = bench_episode.parse_args(["--device", "cpu"])
    modes = ["max-autotune", "reduce-overhead"]
    times = {"max-autotune": 2.0, "reduce-overhead": 1.5, episode_peer.FALLBACK_MODE: 3.0}

    def measure(name, mode_args):
        mode, = mode_args.compile_modes
        if times[mode] is None:
            return bench_episode.failed(name, RuntimeError(f"{mode} failed\nsecond line"))
        return {"name": name, "episode_s": times[mode], "peak_bytes": 10}

    row = episode_peer.fastest_mode(measure, "stock_compiled_checkpoint", args, modes)
    assert row["episode_s"] == 1.5 and row["compile_mode"] == "reduce-overhead" and row["name"] == "stock_compiled_checkpoint"
    assert {mode: m["episode_s"] for mode, m in row["compile_modes"].items()} == {"max-autotune": 2.0, "reduce-overhead": 1.5}
    assert args.compile_modes == ["default"]  # each mode measured on a copy
    times.update({"max-autotune": None, "reduce-overhead": None})
    row = episode_peer.fastest_mode(measure, "stock_compiled_checkpoint", args, modes)
    assert row["episode_s"] == 3.0 and row["compile_mode"] == episode_peer.FALLBACK_MODE
    assert row["compile_modes"]["reduce-overhead"] == {"episode_s": None, "peak_bytes": None,
                                                       "error": "reduce-overhead failed",
                                                       "wall_s": row["compile_modes"]["reduce-overhead"]["wall_s"]}
    times[episode_peer.FALLBACK_MODE] = None
    ended = []
    row = episode_peer.fastest_mode(measure, "stock_compiled_checkpoint", args, modes,
                                    mode_done=lambda mode, per_mode: ended.append((mode, list(per_mode))))
    assert row["error"] == "max-autotune failed" and row["episode_s"] is None and row["compile_mode"] == "max-autotune"
    assert list(row["compile_modes"]) == [*modes, episode_peer.FALLBACK_MODE]
    assert ended == [("max-autotune", modes[:1]), ("reduce-overhead", modes),
                     (episode_peer.FALLBACK_MODE, [*modes, episode_peer.FALLBACK_MODE])]


def test_each_compile_mode_of_the_peer_is_written_and_said_as_it_ends(tmp_path, capsys):
    """A run stopped while a later mode compiles keeps the rows before the peer and the modes
    that ended."""
    bench_episode = bench_module("bench_episode")
    out = tmp_path / "peer.json"
    args = bench_episode.parse_args(["--device", "cpu", "--out", str(out)])
    finished = [{"name": "stock_fp32", "episode_s": 2.5, "peak_bytes": 10}]
    per_mode = {"reduce-overhead": {"episode_s": None, "peak_bytes": None, "error": "BackendCompilerFailed: x",
                                    "wall_s": 12.0}}
    bench_episode.peer_mode_done(args, torch.device("cpu"), finished, "stock_compiled_checkpoint", "reduce-overhead",
                                 per_mode)
    said = capsys.readouterr().out
    assert "stock_compiled_checkpoint in reduce-overhead: BackendCompilerFailed: x (12 s with its compile)" in said
    written = json.loads(out.read_text())
    assert not written["complete"] and [r["name"] for r in written["runs"]] == ["stock_fp32", "stock_compiled_checkpoint"]
    assert written["runs"][1]["compile_modes"] == per_mode and written["runs"][1]["episode_s"] is None
    assert finished == [{"name": "stock_fp32", "episode_s": 2.5, "peak_bytes": 10}]


def test_cuda_only_compile_modes_are_refused_off_cuda(capsys):
    episode_peer = bench_module("episode_peer")
    bench_episode = bench_module("bench_episode")
    assert episode_peer.compile_modes(None, torch.device("cpu")) == ["default"]
    assert episode_peer.compile_modes(None, torch.device("cuda")) == episode_peer.CUDA_MODES
    assert bench_episode.parse_args(["--device", "cpu"]).compile_modes == ["default"]
    with pytest.raises(SystemExit) as refused:
        bench_episode.parse_args(["--device", "cpu", "--compile-modes", "default", "max-autotune"])
    assert refused.value.code == 2
    assert "--compile-modes max-autotune need a CUDA device" in capsys.readouterr().err


def test_cudnn_benchmark_is_refused_off_cuda_and_recorded(tmp_path, capsys):
    bench_episode = bench_module("bench_episode")
    assert bench_episode.parse_args(["--device", "cuda", "--cudnn-benchmark"]).cudnn_benchmark
    with pytest.raises(SystemExit) as refused:
        bench_episode.parse_args(["--device", "cpu", "--cudnn-benchmark"])
    assert refused.value.code == 2
    assert "--cudnn-benchmark sets cuDNN's algorithm search, which only a CUDA device has, got --device cpu" in \
        capsys.readouterr().err
    args = bench_episode.parse_args(["--device", "cpu", "--out", str(tmp_path / "e.json")])
    bench_episode.write_report(args, torch.device("cpu"), [])
    assert json.loads((tmp_path / "e.json").read_text())["cudnn_benchmark"] is torch.backends.cudnn.benchmark
