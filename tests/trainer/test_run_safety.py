"""A training run never loses or poisons what it saved, through the real `qca-lowmem train`:
non-finite steps, two runs on one folder, metrics.csv rewrites, preemption signals, damaged
checkpoints and a full disk."""

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import TINY, report_lines, write_config
from qca_lowmem.trainer import checkpoint as train_state
from qca_lowmem.trainer import cli
from qca_lowmem.trainer import metrics as metrics_mod
from qca_lowmem.trainer.checkpoint import CHECKPOINT_NAME, atomic_save, previous_path, read_checkpoint
from qca_lowmem.trainer.errors import UsageError
from qca_lowmem.trainer.runlock import LOCK_NAME
from qca_lowmem.trainer.signals import STOP_SIGNALS

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = {**TINY, "training": {**TINY["training"], "episodes": 10_000}}


def train(*args) -> int:
    return cli.main(["train", "--no-progress", *map(str, args)])


def finite_weights(path) -> bool:
    state = torch.load(path, weights_only=False)
    return all(torch.isfinite(t).all() for t in state["model_state_dict"].values())


# -- non-finite values ----------------------------------------------------------------------------

@pytest.mark.parametrize("training, expected", [
    ({"lr": 1.0e+6}, "optimizer steps in a row skipped (max_skipped_steps)"),
    ({"weight_decay": 1.0e+300}, "the optimizer step made the weights non-finite"),
])
def test_a_diverging_run_stops_and_keeps_its_last_finite_checkpoint(tmp_path, capsys, training, expected):
    config = write_config(tmp_path / "bad.yaml", {**TINY, "training": {**TINY["training"], "episodes": 12,
                                                                      "max_skipped_steps": 2, **training}})
    out = tmp_path / "run"
    assert train("--config", config, "--out", out) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("qca-lowmem train: stopped at episode"), err
    assert expected in err, err
    if (out / CHECKPOINT_NAME).exists():
        assert f"the last checkpoint, {out / CHECKPOINT_NAME} (episode" in err and "is untouched" in err, err
    else:
        assert "no checkpoint was written yet" in err, err
    for path in (out / CHECKPOINT_NAME, previous_path(out / CHECKPOINT_NAME)):
        if path.exists():
            assert finite_weights(path), path
            read_checkpoint(path)  # resumable


def test_a_single_non_finite_loss_skips_the_step_and_training_goes_on(run_dir, monkeypatch, capsys):
    from qca_lowmem.trainer import train as train_mod

    forward = train_mod.Trainer.forward_episode

    def nan_at_episode_2(self, episode, policy):
        loss, metrics, psi = forward(self, episode, policy)
        return (loss * float("nan") if episode == 2 else loss), metrics, psi

    monkeypatch.setattr(train_mod.Trainer, "forward_episode", nan_at_episode_2)
    before = torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)["model_state_dict"]
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 3) == 0
    assert "episode 2: loss nan; optimizer step skipped, weights unchanged (1 in a row" in capsys.readouterr().err
    after = torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)
    assert after["episode"] == 3
    assert all(torch.equal(before[k], v) for k, v in after["model_state_dict"].items())


def test_a_checkpoint_with_non_finite_weights_is_neither_written_nor_resumed(run_dir, capsys):
    state = torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)
    next(iter(state["model_state_dict"].values()))[0] = float("nan")
    atomic_save(state, run_dir / CHECKPOINT_NAME)
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 4) == 2
    err = capsys.readouterr().err
    assert "cannot be resumed" in err and "holds non-finite values" in err, err
    assert "checkpoint.prev.pt (episode 1) is readable: --resume" in err

    from qca_lowmem.trainer.config import load_config
    from qca_lowmem.trainer.errors import TrainingStopped
    from qca_lowmem.trainer.train import Trainer

    trainer = Trainer(load_config(str(run_dir.parent / "tiny.yaml"), out_dir=str(run_dir.parent / "new")),
                      progress=False)
    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("inf")
    with pytest.raises(TrainingStopped, match="not writing .* holds non-finite values"):
        trainer.save_checkpoint()
    assert not (run_dir.parent / "new" / CHECKPOINT_NAME).exists()


@pytest.mark.parametrize("value", [0, -1.0])
def test_max_grad_norm_that_would_zero_the_gradients_is_refused(tmp_path, capsys, value):
    config = write_config(tmp_path / "c.yaml", {**TINY, "training": {**TINY["training"], "max_grad_norm": value}})
    assert train("--check", "--config", config, "--out", tmp_path / "run") == 2
    assert "max_grad_norm must be a finite number > 0" in capsys.readouterr().err


# -- checkpoints ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_one_flipped_byte_anywhere_is_refused(finished_run, tmp_path):
    data = (finished_run / CHECKPOINT_NAME).read_bytes()
    path = tmp_path / CHECKPOINT_NAME
    offsets = sorted({*range(0, 64), *range(0, len(data), max(1, len(data) // 300)), *range(len(data) - 128, len(data))})
    for offset in offsets:
        damaged = bytearray(data)
        damaged[offset] ^= 0x01
        path.write_bytes(damaged)
        with pytest.raises(UsageError, match="is damaged|is unreadable") as refused:
            read_checkpoint(path)
        assert str(path) in str(refused.value)
    path.write_bytes(data)
    assert read_checkpoint(path)["episode"] == 2


def test_a_checkpoint_saved_without_a_digest_is_checked_by_its_crcs(finished_run, tmp_path):
    state = torch.load(finished_run / CHECKPOINT_NAME, weights_only=False)
    path = tmp_path / CHECKPOINT_NAME
    torch.save(state, path)  # as saves before digests wrote them
    assert read_checkpoint(path)["episode"] == 2
    data = bytearray(path.read_bytes())
    weights = bytes(state["model_state_dict"]["inc.conv_block.0.weight"].untyped_storage())  # as saved, any layout
    data[bytes(data).index(weights) + 5] ^= 0x10
    path.write_bytes(data)
    with pytest.raises(UsageError, match="is damaged: its member .* fails the zip's CRC check"):
        read_checkpoint(path)


def test_a_damaged_checkpoint_exits_2_offering_the_previous(run_dir, capsys):
    data = bytearray((run_dir / CHECKPOINT_NAME).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run_dir / CHECKPOINT_NAME).write_bytes(data)
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 4) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged: its bytes differ from the digest" in err, err
    assert "checkpoint.prev.pt (episode 1) is readable: --resume" in err


def test_a_checkpoint_missing_a_key_exits_2(run_dir, capsys):
    state = torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)
    del state["rng_state"]
    atomic_save(state, run_dir / CHECKPOINT_NAME)
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 4) == 2
    err = capsys.readouterr().err
    assert "is damaged: it lacks rng_state" in err and "(episode 1) is readable" in err, err


def test_a_meta_tensor_in_a_checkpoint_is_refused(run_dir, capsys):
    state = torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)
    name = next(iter(state["model_state_dict"]))
    state["model_state_dict"][name] = torch.empty_like(state["model_state_dict"][name], device="meta")
    atomic_save(state, run_dir / CHECKPOINT_NAME)
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 4) == 2
    assert f"model tensor {name!r} has no data (meta device)" in capsys.readouterr().err


# -- metrics.csv ------------------------------------------------------------------------------------

def test_an_interrupted_metrics_rewrite_leaves_the_file_whole(run_dir, monkeypatch, capsys):
    path = run_dir / "metrics.csv"
    before = path.read_bytes()
    real_fsync = os.fsync

    def interrupted(fd):
        real_fsync(fd)
        raise KeyboardInterrupt  # Ctrl-C between writing the new file and renaming it

    monkeypatch.setattr(metrics_mod.os, "fsync", interrupted)
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 4) == 130
    assert path.read_bytes() == before
    assert [p.name for p in run_dir.iterdir() if ".tmp-" in p.name] == []


def test_a_hand_edited_metrics_csv_keeps_its_edits(run_dir):
    path = run_dir / "metrics.csv"
    rows = path.read_text().splitlines()
    edited = ["# my notes"] + [rows[0].replace(",", ";") + ";note"] + [r.replace(",", ";") + ";ok" for r in rows[1:]]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(edited).encode() + b"\n")
    assert train("--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 3) == 0
    text = path.read_bytes()
    assert text.startswith(b"\xef\xbb\xbf# my notes\n")
    lines = text.decode("utf-8-sig").splitlines()
    assert lines[1:4] == edited[1:4]  # header and the two rows before the resume, verbatim
    assert lines[4].startswith("2;") and lines[4].split(";")[len(edited[1].split(";")) - 1] == ""


@pytest.mark.parametrize("check", [False, True], ids=["train", "check"])
def test_a_metrics_csv_without_an_episode_column_is_refused_by_name(run_dir, capsys, check):
    """Refused before anything is said of the run (`--check` too), in its one line."""
    (run_dir / "metrics.csv").write_text("step,loss\n0,1.0\n")
    args = ["--config", run_dir.parent / "tiny.yaml", "--out", run_dir, "--resume", "--episodes", 3]
    assert train(*args, *(["--check"] if check else [])) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"qca-lowmem train: {run_dir / 'metrics.csv'}: its header (line 1) has no 'episode' "
                                "column, which says which rows a resume keeps; restore it, or move the file away"], err


# -- a full disk ----------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 4 MiB tmpfs where the machine lets us mount one; else the same folder with ENOSPC
    injected into every fsync of a checkpoint save."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True).returncode == 0
    yield folder, mounted
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_keeps_the_last_checkpoint_and_names_the_file(small_disk, tmp_path, monkeypatch, capsys):
    folder, mounted = small_disk
    config = write_config(tmp_path / "tiny.yaml")
    out = folder / "run"
    assert train("--config", config, "--out", out, "--episodes", 1) == 0
    before = (out / CHECKPOINT_NAME).read_bytes()
    if mounted:  # leave half a checkpoint free
        free = shutil.disk_usage(folder).free
        (folder / "filler").write_bytes(b"\0" * (free - len(before) // 2))
    else:
        def full(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(train_state.os, "fsync", full)
    capsys.readouterr()
    assert train("--config", config, "--out", out, "--resume", "--episodes", 2) == 1
    err = capsys.readouterr().err
    assert len(report_lines(err)) == 1 and "No space left on device" in err, err
    assert f"cannot write {out / CHECKPOINT_NAME} at episode 2" in err or f"cannot write {out / 'metrics.csv'}" in err
    assert "is untouched" in err and "Traceback" not in err
    assert (out / CHECKPOINT_NAME).read_bytes() == before
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []


# -- two runs, signals ------------------------------------------------------------------------------

def signals_as_from(ignored=()):
    """A child's stop signals as a terminal's shell leaves them (default), but `ignored`: the
    suite's own may be inherited ignored (SIGINT by a shell without job control, SIGHUP by
    nohup), and the trainer honours an ignored signal."""
    def preexec():
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN if number in ignored else signal.SIG_DFL)
    return preexec


@contextlib.contextmanager
def training(config, out, ignored=()):
    """A `qca-lowmem train` process writing `out`, handed over once two episodes are in its
    metrics.csv; killed on the way out, whatever the test did with it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("QCA_LOWMEM_TRACEBACK", None)
    proc = subprocess.Popen([sys.executable, "-m", "qca_lowmem", "train", "--no-progress", "--config", config,
                             "--out", str(out)], stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=signals_as_from(ignored))
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.csv").exists() and len((out / "metrics.csv").read_text().splitlines()) > 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()


def finish(proc):
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return stderr


@pytest.mark.slow
def test_a_second_run_on_the_folder_exits_2_naming_the_first(tmp_path):
    config = write_config(tmp_path / "long.yaml", LONG)
    out = tmp_path / "run"
    with training(config, out) as first:
        second = subprocess.run([sys.executable, "-m", "qca_lowmem", "train", "--no-progress", "--config", config,
                                 "--out", str(out), "--resume"], capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"another qca-lowmem train (PID {first.pid}) is writing there" in second.stderr
        assert "Traceback" not in second.stderr and len(second.stderr.splitlines()) == 1
        assert first.poll() is None  # the first run goes on
        first.send_signal(signal.SIGTERM)
        stderr = finish(first)
    assert first.returncode == 143, stderr
    assert not (out / LOCK_NAME).exists()
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(len(rows)))  # one writer: no spliced rows


@pytest.mark.slow
def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    config = write_config(tmp_path / "long.yaml", LONG)
    out = tmp_path / "run"
    with training(config, out) as proc:
        proc.kill()
        proc.wait()
    assert (out / LOCK_NAME).exists()  # left behind, but no longer locked
    episode = torch.load(out / CHECKPOINT_NAME, weights_only=False)["episode"]
    assert train("--config", config, "--out", out, "--resume", "--episodes", episode + 1) == 0


@pytest.mark.slow
@pytest.mark.parametrize("signals, status, said", [
    ((signal.SIGTERM,), 143, "interrupted by SIGTERM at episode"),
    ((signal.SIGHUP,), 129, "interrupted by SIGHUP at episode"),
    ((signal.SIGINT, signal.SIGINT), 130, "interrupted at episode"),
    ((signal.SIGTERM, signal.SIGTERM), 143, "interrupted by SIGTERM at episode"),
], ids=["sigterm", "sighup", "ctrl-c-twice", "sigterm-twice"])
def test_a_stop_signal_saves_and_exits_with_its_status(tmp_path, signals, status, said):
    config = write_config(tmp_path / "long.yaml", {**LONG, "output": {"save_every": 0}})
    out = tmp_path / "run"
    with training(config, out) as proc:
        for number in signals:
            proc.send_signal(number)
            time.sleep(0.02)
        stderr = finish(proc)
    assert proc.returncode == status, stderr
    assert "Traceback" not in stderr and len(report_lines(stderr)) == 1, stderr
    episode = read_checkpoint(out / CHECKPOINT_NAME)["episode"]
    assert episode >= 2 and f"{said} {episode}; episodes 0-{episode - 1} are in" in stderr
    assert len((out / "metrics.csv").read_text().splitlines()) - 1 == episode


@pytest.mark.slow
def test_under_nohup_a_hangup_does_not_stop_training(tmp_path):
    """nohup's SIGHUP, inherited ignored, stays ignored: the user asked for the run to outlive
    the terminal. Other stop signals still stop it."""
    config = write_config(tmp_path / "long.yaml", {**LONG, "output": {"save_every": 0}})
    out = tmp_path / "run"
    with training(config, out, ignored=(signal.SIGHUP,)) as proc:
        rows = len((out / "metrics.csv").read_text().splitlines())
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 240
        while len((out / "metrics.csv").read_text().splitlines()) < rows + 2:  # two more episodes: still training
            assert proc.poll() is None and time.monotonic() < deadline, "training stopped after a SIGHUP under nohup"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stderr = finish(proc)
    assert proc.returncode == 143, stderr
    assert "interrupted by SIGTERM at episode" in stderr


@pytest.mark.parametrize("until_exit", [True, False], ids=["process", "in-process"])
def test_after_a_stop_the_process_ignores_stop_signals_through_its_exit(until_exit):
    """The stop's save and report can end before a second signal arrives (the runs above send
    it 20 ms later): then it lands in the interpreter's exit, and restored handlers would let it
    kill the process or print a traceback there. A command that is the process keeps them
    ignored; one run in-process (tests, a notebook) gets its handlers back."""
    from qca_lowmem.trainer.signals import STOP_SIGNALS, Stop, stop_signals_handled

    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    try:
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        with stop_signals_handled(until_exit=until_exit):
            with pytest.raises(Stop):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs at the next bytecode, before this returns
        expected = signal.SIG_IGN if until_exit else signal.SIG_DFL
        assert all(signal.getsignal(number) == expected for number in STOP_SIGNALS)
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
