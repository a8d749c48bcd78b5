"""Mixed precision that runs natively: bf16 asked for on a GPU below compute capability 8.0
(emulated there) becomes fp16 with the loss scaler in the trainer, enable() and plan, with a
note; doctor says which precision each GPU gets. GPUs are simulated on the CPU."""

from types import SimpleNamespace

import pytest
import torch

import qca_lowmem
from qca_lowmem import amp, precision
from qca_lowmem.atheria import switch
from qca_lowmem.examples.qc_trainer_v4 import QC_Trainer_v4, make_config
from qca_lowmem.trainer import config as config_mod
from qca_lowmem.trainer import doctor
from qca_lowmem.trainer import plan as plan_mod
from qca_lowmem.trainer import train as train_mod

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def gpu(monkeypatch):
    """Simulates one visible GPU of the given compute capability."""

    def install(major, minor, name="Tesla T4"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
            name=name, total_memory=16 * 2**30, major=major, minor=minor))

    return install


@pytest.mark.parametrize("major,minor", [(7, 5), (6, 1)])
def test_bf16_below_compute_capability_8_becomes_fp16_with_a_note(gpu, major, minor):
    gpu(major, minor)
    dtype, note = precision.native_amp_dtype(torch.bfloat16, "cuda:0")
    assert dtype == torch.float16
    assert f"Tesla T4 (compute capability {major}.{minor}" in note and "fp16 with the loss scaler" in note


@pytest.mark.parametrize("asked", [torch.bfloat16, torch.float16, None])
def test_native_precisions_are_kept(gpu, asked):
    gpu(8, 0, "NVIDIA A100")
    assert precision.native_amp_dtype(asked, "cuda") == (asked, "")
    gpu(7, 5)
    for dtype in (torch.float16, None):
        assert precision.native_amp_dtype(dtype, "cuda") == (dtype, "")
    assert precision.native_amp_dtype(asked, "cpu") == (asked, "")  # the CPU's bf16 is what autocast has


def _pretend_pre_ampere(monkeypatch):
    monkeypatch.setattr(precision, "native_amp_dtype", lambda dtype, device: (
        (torch.float16, "bf16 was asked for, but a simulated GPU only emulates bf16") if dtype == torch.bfloat16
        else (dtype, "")))


def test_trainer_runs_fp16_with_the_scaler_and_says_so(monkeypatch, tmp_path, capsys):
    _pretend_pre_ampere(monkeypatch)
    config = config_mod.TrainConfig(grid=8, d_state=2, hidden=8, qca_steps=3, episodes=1, amp_dtype="bf16",
                                    device="cpu", out_dir=str(tmp_path))
    trainer = train_mod.Trainer(config, progress=False)
    assert trainer.amp_dtype == torch.float16 and isinstance(trainer.scaler, amp.GradScaler)
    assert capsys.readouterr().err.count("only emulates bf16") == 1


def test_enable_runs_fp16_and_warns(monkeypatch):
    _pretend_pre_ampere(monkeypatch)
    trainer = QC_Trainer_v4(make_config(grid=8, qca_steps=3))
    with pytest.warns(UserWarning, match=r"enable\(\): bf16 was asked for.*only emulates bf16"):
        qca_lowmem.enable(trainer, amp_dtype="bf16")
    assert getattr(trainer, switch._STATE_ATTR).options.amp_dtype == torch.float16


def test_plan_considers_fp16_on_a_pre_ampere_gpu(gpu, capsys):
    gpu(7, 5)
    config = config_mod.TrainConfig(grid=8, d_state=2, hidden=8, qca_steps=4)
    assert plan_mod.main_plan(config, "4GiB", "0", as_json=False, half="bf16") == 0
    out = capsys.readouterr().out
    assert "only emulates bf16" in out and "lowmem step fp16" in out and "bf16" not in out.split("\n", 1)[1]


def test_doctor_shows_each_gpus_precision(gpu, monkeypatch):
    for capability, expected in (((7, 5), "fp16 with the loss scaler, also when bf16 is asked (compute capability 7.5"),
                                 ((8, 6), "bf16 and fp16 as asked")):
        gpu(*capability)
        facts = dict(doctor.report()[0])
        assert facts["GPU 0 precision"].startswith(expected)
