"""channels_last end to end (pack -> U-Net -> update in NHWC): the same episode as NCHW on the
CPU, the layout kept through the step, recorded in metrics and checkpoints; the trainer's default
where it is unset."""

import csv

import pytest
import torch
import yaml

import qca_lowmem
from helpers import cuda_only, randomize_affine
from qca_lowmem import rollout
from qca_lowmem.ops.qca_step import fused_step
from qca_lowmem.trainer import cli
from qca_lowmem.trainer.config import CPU_CHANNELS_LAST_MAX_HIDDEN, TrainConfig, channels_last_for
from qca_lowmem.trainer.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")


def unet_pair(dtype):
    torch.manual_seed(1)
    nchw = randomize_affine(qca_lowmem.UNetUnitary(2, 8)).to(dtype)
    with torch.no_grad():
        nchw.outc.weight.normal_(0.0, 0.3)
    nhwc = qca_lowmem.UNetUnitary(2, 8).to(dtype)
    nhwc.load_state_dict(nchw.state_dict())
    return nchw, nhwc.to(memory_format=torch.channels_last)


def episode(unet, channels_last, dtype, checkpoint, device="cpu", graph=False):
    for p in unet.parameters():
        p.grad = None
    torch.manual_seed(3)
    psi0 = qca_lowmem.stock.initial_state(1, 8, 2, dtype=dtype).to(device).requires_grad_()
    step = fused_step(unet, 0.0, True, channels_last=channels_last)
    stepper = qca_lowmem.StepGraph(step) if graph else step
    psi_T, history = rollout(stepper, psi0, 5, checkpoint=checkpoint,
                             noise=qca_lowmem.NoiseSchedule(0.5, 2000, seed=1), record_every=2)
    if graph:
        assert stepper.captures_made == 1 and not stepper.failed_keys  # replayed, not fallen back
    loss, _ = qca_lowmem.stock.evolutionary_loss(history, psi0)
    loss.backward()
    return [psi_T.detach(), psi0.grad] + [p.grad for p in unet.parameters()]


@pytest.mark.parametrize("checkpoint", ["none", "step"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.complex128, 1e-12), (torch.complex64, 1e-4)])
def test_channels_last_equals_nchw(checkpoint, dtype, tolerance):
    nchw, nhwc = unet_pair(dtype.to_real())
    expected = episode(nchw, False, dtype, checkpoint)
    got = episode(nhwc, True, dtype, checkpoint)
    # The same function (float64); NHWC convolutions sum in another order, so float32 differs by rounding.
    for g, e in zip(got, expected):
        assert (torch.linalg.vector_norm(g - e) / torch.linalg.vector_norm(e)).item() < tolerance
    assert all(p.grad.is_contiguous(memory_format=torch.channels_last) for p in nhwc.parameters() if p.dim() == 4)


@cuda_only
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "captured"])
def test_channels_last_equals_nchw_on_cuda(graph, monkeypatch):
    """cuDNN's NHWC kernels, the CUDA pack's NHWC output and the GroupNorm+ELU kernels on NHWC
    tensors, eager and captured: the NCHW episode's gradients, to fp32 rounding (TF32 off)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    nchw, nhwc = (unet.cuda() for unet in unet_pair(torch.float32))
    expected = episode(nchw, False, torch.complex64, "step", "cuda")
    got = episode(nhwc, True, torch.complex64, "step", "cuda", graph=graph)
    for g, e in zip(got, expected):
        assert (torch.linalg.vector_norm(g - e) / torch.linalg.vector_norm(e)).item() < 1e-4
    assert all(p.grad.is_contiguous(memory_format=torch.channels_last) for p in nhwc.parameters() if p.dim() == 4)


def test_the_layout_is_kept_from_pack_to_update(monkeypatch):
    _, nhwc = unet_pair(torch.float32)
    seen = []
    fused_forward = qca_lowmem.FusedConvBlock.forward

    def recording(block, x, **kwargs):  # not a hook: a hooked block runs its stock layers
        out = fused_forward(block, x, **kwargs)
        seen.append((block.runs_fused(), x.is_contiguous(memory_format=torch.channels_last),
                     out.is_contiguous(memory_format=torch.channels_last)))
        return out

    monkeypatch.setattr(qca_lowmem.FusedConvBlock, "forward", recording)
    delta = nhwc(qca_lowmem.qca_pack(qca_lowmem.stock.initial_state(1, 8, 2), channels_last=True))
    assert seen and all(seen_flags == (True, True, True) for seen_flags in seen)
    assert delta.is_contiguous(memory_format=torch.channels_last)


def test_the_trainer_setting_is_recorded_in_metrics_and_checkpoints(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"model": {"d_state": 2, "hidden": 8}, "device": "cpu",
                                      "training": {"grid": 8, "qca_steps": 3, "episodes": 1}}))
    runs = {}
    for flag in ("--channels-last", "--no-channels-last"):
        out = tmp_path / flag
        assert cli.main(["train", "--config", str(config), "--out", str(out), "--no-progress", flag]) == 0
        with open(out / "metrics.csv") as f:
            row = next(csv.DictReader(f))
        state = torch.load(out / "checkpoint.pt", weights_only=False)
        runs[flag] = float(row["loss"])
        assert row["policy"].endswith(" channels_last") == (flag == "--channels-last")
        assert state["config"]["channels_last"] == (flag == "--channels-last")
    assert runs["--channels-last"] == pytest.approx(runs["--no-channels-last"], rel=1e-5)


@pytest.mark.parametrize("changes, device, amp, expected", [
    ({}, "cpu", None, True),
    ({"hidden": CPU_CHANNELS_LAST_MAX_HIDDEN}, "cpu", None, True),
    ({"hidden": 2 * CPU_CHANNELS_LAST_MAX_HIDDEN}, "cpu", None, False),
    ({}, "cpu", torch.bfloat16, False),
    ({"fused_blocks": False}, "cpu", None, False),
    ({"channels_last": False}, "cpu", None, False),
    ({"channels_last": True, "hidden": 128}, "cuda", torch.bfloat16, True),
], ids=["embedded", "widest", "wider", "bf16", "unfused", "asked-off", "asked-on"])
def test_unset_it_is_on_where_it_measured_faster_and_as_asked_otherwise(changes, device, amp, expected):
    config = TrainConfig(**{"hidden": 16, **changes}).validate()
    assert channels_last_for(config, torch.device(device), amp) is expected


def test_the_trainers_default_on_the_cpu_at_the_embedded_size_is_nhwc(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"model": {"d_state": 2, "hidden": 8}, "device": "cpu",
                                      "training": {"grid": 8, "qca_steps": 3, "episodes": 1}}))
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    with open(out / "metrics.csv") as f:
        assert next(csv.DictReader(f))["policy"].endswith(" channels_last")
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["config"]["channels_last"] is None  # unset stays unset: a resume decides again
    assert state["model_state_dict"]["inc.conv_block.0.weight"].is_contiguous(memory_format=torch.channels_last)


def test_a_setting_that_is_not_a_flag_is_refused_by_name():
    with pytest.raises(UsageError, match=r"config channels_last must be true, false or null .*got 'yes'"):
        TrainConfig(channels_last="yes").validate()


@pytest.mark.parametrize("changes, gpu_name, amp_dtype, expected", [
    ({}, "NVIDIA H200", None, True),
    ({"hidden": 128}, "NVIDIA H200", torch.bfloat16, True),
    ({"fused_blocks": False}, "NVIDIA H200", None, False),
    ({"channels_last": False}, "NVIDIA H200", None, False),
    ({}, "NVIDIA GeForce GTX 1650", torch.float16, False),
    ({"channels_last": True}, "NVIDIA GeForce GTX 1650", torch.float16, True),
])
def test_the_trainers_unset_channels_last_on_cuda(monkeypatch, changes, gpu_name, amp_dtype, expected):
    """Unset on CUDA with fused blocks: where the convolutions run on Tensor Cores (a faked GPU)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0) if "H200" in gpu_name else (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu_name)
    config = TrainConfig(**{"hidden": 16, **changes}).validate()
    assert channels_last_for(config, torch.device("cuda"), amp_dtype) is expected
