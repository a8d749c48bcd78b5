"""Every bad input to `qca-lowmem train` through the real command: one line on stderr naming
what is wrong, the documented exit status, no traceback, and the previous checkpoint untouched."""

import csv
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from helpers import TINY, report_lines, write_config
from qca_lowmem.trainer import cli
from qca_lowmem.trainer.checkpoint import CHECKPOINT_NAME, previous_path
from qca_lowmem.trainer.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

# A pid above Linux's largest (pid_max is at most 2**22): never a live process.
DEAD_PID = 2**22 + 1


def run_command(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("QCA_LOWMEM_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "qca_lowmem", "train", "--no-progress", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def assert_one_line(done, status, *expected):
    assert done.returncode == status, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def _corrupt(run):
    (run / CHECKPOINT_NAME).write_bytes(random.Random(0).randbytes(4096))


def _truncate(run):
    data = (run / CHECKPOINT_NAME).read_bytes()
    (run / CHECKPOINT_NAME).write_bytes(data[: len(data) // 2])


def _empty_without_previous(run):
    (run / CHECKPOINT_NAME).write_bytes(b"")
    previous_path(run / CHECKPOINT_NAME).unlink()


def _folder_as_checkpoint(run):
    (run / "ckpt_dir").mkdir()


def _checkpoint_is_a_folder(run):
    (run / CHECKPOINT_NAME).rename(run / "saved.pt")
    (run / CHECKPOINT_NAME).mkdir()


# (id, arguments after `train` ({run}: the run folder, {config}: its config), change to the run
# folder first, exit status, texts the line must hold)
ROWS = [
    ("yaml-syntax", ["--config", "{bad}"], "training: {grid: 8\n  seed: [1\n", None, 2,
     ["config", "YAML syntax error at line 2, column 7: expected ',' or '}'"]),
    ("yaml-list", ["--config", "{bad}"], "- grid\n- 8\n", None, 2, ["expected a mapping", "got a list"]),
    ("config-folder", ["--config", "{run}"], None, None, 2, ["--config", "is a folder"]),
    ("save-every-string", ["--config", "{bad}"], yaml.safe_dump({**TINY, "output": {"save_every": "5"}}), None, 2,
     ["save_every must be an integer >= 0", "got '5' (a str)"]),
    ("seed-string", ["--config", "{bad}"], yaml.safe_dump({**TINY, "training": {"seed": "abc"}}), None, 2,
     ["seed must be an integer", "got 'abc'"]),
    ("unknown-key", ["--config", "{bad}"], yaml.safe_dump({**TINY, "lowmem": {"slot": 3}}), None, 2,
     ["unknown key 'slot'"]),
    ("device-tpu", ["--config", "{config}", "--device", "tpu"], None, None, 2,
     ["--device must be auto, cpu, cuda or cuda:N, got 'tpu'"]),
    ("device-cuda-absent", ["--config", "{config}", "--device", "cuda" if not torch.cuda.is_available() else "cuda:99"],
     None, None, 2, ["--device cuda"]),
    ("argument-type", ["--config", "{config}", "--batch", "two"], None, None, 2,
     ["argument --batch: invalid int value: 'two'"]),
    ("stop-after-zero", ["--config", "{config}", "--stop-after", "0"], None, None, 2, ["--stop-after", "got 0"]),
    ("ddp-without-torchrun", ["--config", "{config}", "--ddp"], None, None, 2, ["--ddp needs torchrun's environment"]),
    ("checkpoint-corrupt", ["--config", "{config}", "--resume"], None, _corrupt, 2,
     ["checkpoint.pt is unreadable (truncated?)", "checkpoint.prev.pt (episode 1) is readable: --resume"]),
    ("checkpoint-truncated", ["--config", "{config}", "--resume"], None, _truncate, 2,
     ["checkpoint.pt is unreadable (truncated?)", "(episode 1) is readable"]),
    ("checkpoint-empty", ["--config", "{config}", "--resume"], None, _empty_without_previous, 2,
     ["is unreadable (truncated?)", "no older checkpoint exists"]),
    ("checkpoint-folder", ["--config", "{config}", "--resume", "{run}/ckpt_dir"], None, _folder_as_checkpoint, 2,
     ["--resume", "ckpt_dir: is a folder, not a checkpoint file"]),
    ("resume-batch", ["--config", "{config}", "--resume", "--episodes", "4", "--batch", "2"], None, None, 2,
     ["a resume cannot change batch (checkpoint 1, now 2)", "it can change checkpoint"]),
    ("resume-lr", ["--config", "{lr}", "--resume", "--episodes", "4"], None, None, 2,
     ["a resume cannot change lr (checkpoint 0.0001, now 0.001)"]),
    ("out-is-a-file", ["--config", "{config}", "--out", "{run}/metrics.csv"], None, None, 2,
     ["--out", "a file is in the way"]),
    ("checkpoint-pt-folder", ["--config", "{config}", "--episodes", "4"], None, _checkpoint_is_a_folder, 2,
     ["checkpoint.pt is a folder"]),
    ("out-not-writable", ["--config", "{config}", "--out", "/proc/qca-lowmem-run"], None, None, 2,
     ["--out /proc/qca-lowmem-run: not writable"]),
    # --overwrite: the folder holds a run; a check failing after it sets nothing aside
    ("cpu-memory", ["--config", "{config}", "--grid", "4096", "--qca-steps", "1000000", "--overwrite"], None, None, 3,
     ["needs at least", "of CPU memory", "--checkpoint revolve --slots 32", "--grid (now 4096)"]),
    ("nothing-to-do", ["--config", "{config}", "--resume"], None, None, 0,
     ["is at episode 2, --episodes is 2: nothing to do"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, bad_text, prepare, status, expected",
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_and_loses_nothing(run_dir, args, bad_text, prepare, status, expected):
    folder = run_dir.parent
    stale = f".{CHECKPOINT_NAME}.tmp-{DEAD_PID}"
    (run_dir / stale).write_bytes(b"a save killed mid-way")
    if prepare is not None:
        prepare(run_dir)
    names = {"run": run_dir, "config": folder / "tiny.yaml",
             "bad": write_config(folder / "bad.yaml", text=bad_text or ""),
             "lr": write_config(folder / "lr.yaml", {**TINY, "training": {**TINY["training"], "lr": 1e-3}})}
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    if "--out" not in args:
        args = [*args, "--out", "{run}"]
    done = run_command(*[a.format(**names) for a in args], cwd=folder)
    assert_one_line(done, status, *expected)
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    if status == 0:  # past its checks, the run removed the temporary of the save that was killed
        assert stale not in after
    after.pop(stale, None), before.pop(stale)
    assert after == before


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130(tmp_path):
    config = write_config(tmp_path / "tiny.yaml", {**TINY, "training": {**TINY["training"], "episodes": 10_000},
                                                   "output": {"save_every": 0}})
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A shell without job control starts background jobs with SIGINT ignored, and the trainer
    # honours an ignored SIGINT (nohup): the child gets the default back, as a terminal's would.
    proc = subprocess.Popen([sys.executable, "-m", "qca_lowmem", "train", "--no-progress", "--config", config,
                             "--out", str(out)], stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.csv").exists() and len((out / "metrics.csv").read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and len(report_lines(stderr)) == 1, stderr
    episode = torch.load(out / CHECKPOINT_NAME, weights_only=False)["episode"]
    assert episode >= 2
    assert f"interrupted at episode {episode}; episodes 0-{episode - 1} are in" in stderr
    assert f"continues at episode {episode}" in stderr
    assert f"; continue with: qca-lowmem train --no-progress --config {config} --out {out} --resume" in stderr
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert len(rows) == episode  # the checkpoint holds every episode metrics.csv reports


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_resume_honours_a_new_recompute_policy(tmp_path, capsys):
    """--checkpoint changes memory, not results: a resume takes it, and continues the same run."""
    config = write_config(tmp_path / "tiny.yaml", {**TINY, "training": {**TINY["training"], "episodes": 3}})
    full, split = tmp_path / "full", tmp_path / "split"
    assert cli.main(["train", "--config", config, "--out", str(full), "--no-progress"]) == 0
    assert cli.main(["train", "--config", config, "--out", str(split), "--episodes", "1", "--no-progress"]) == 0
    for policy in (["--checkpoint", "none"], ["--slots", "2"]):
        assert cli.main(["train", "--config", config, "--out", str(split), "--resume", "--no-progress",
                         "--episodes", str(1 + len(read_rows(split / "metrics.csv"))), *policy]) == 0
    rows = read_rows(split / "metrics.csv")
    assert [r["policy"] for r in rows] == [f"checkpoint={policy} batch=1 fp32 channels_last"
                                           for policy in ("step", "none", "revolve slots=2")]
    assert [float(r["loss"]) for r in rows] == pytest.approx([float(r["loss"]) for r in read_rows(full / "metrics.csv")],
                                                             rel=1e-6)


def test_a_failure_while_training_is_one_line_with_status_1(run_dir, monkeypatch, capsys):
    from qca_lowmem.trainer import train as train_mod

    def forward_episode(self, episode, policy):
        raise RuntimeError("injected failure\nwith a second line")

    monkeypatch.setattr(train_mod.Trainer, "forward_episode", forward_episode)
    before = (run_dir / CHECKPOINT_NAME).read_bytes()
    capsys.readouterr()
    status = cli.main(["train", "--config", str(run_dir.parent / "tiny.yaml"), "--out", str(run_dir), "--resume",
                       "--episodes", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and len(report_lines(err)) == 1, err
    assert "failed: RuntimeError: injected failure with a second line" in err
    assert (run_dir / CHECKPOINT_NAME).read_bytes() == before


def _fuzz_strategies():
    """(YAML documents, argument lists): mostly well-formed, so that most examples get past the
    parsers to the checks behind them."""
    from hypothesis import strategies as st

    from qca_lowmem.trainer.config import _FIELDS, _SECTIONS

    fields = sorted(_FIELDS)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-8, 64), st.floats(),
                        st.text(max_size=8), st.sampled_from(["step", "revolve", "none", "cpu", "cuda", "tpu", "bf16",
                                                              "cosine", "1e-4", "5", "auto", "cuda:3"]))
    keys = st.one_of(st.sampled_from(fields + list(_SECTIONS)), st.text(max_size=6), st.integers(), st.none())
    trees = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(keys, inner, max_size=5)), max_leaves=12)
    sections = st.dictionaries(st.sampled_from(fields + list(_SECTIONS)),
                               st.one_of(scalars, st.dictionaries(st.sampled_from(fields + ["enabled"]), scalars,
                                                                  max_size=4)), max_size=5)
    documents = st.one_of(sections.map(yaml.safe_dump), trees.map(lambda tree: yaml.safe_dump(tree, allow_unicode=True)),
                          st.text(max_size=40))
    train = cli.build_parser()._subparsers._group_actions[0].choices["train"]
    flags = sorted(option for action in train._actions for option in action.option_strings
                   if option not in ("-h", "--help"))
    values = st.one_of(st.integers(1, 64).map(str), st.integers().map(str), st.floats().map(str),
                       st.text(max_size=6),
                       st.sampled_from(["cuda", "tpu", "revolve", "none", "bf16", "-1", "0", ".", "default", "4"]))
    pairs = st.tuples(st.sampled_from(flags), values).map(list)
    arguments = st.lists(st.one_of(pairs, pairs, st.sampled_from(flags).map(lambda flag: [flag]), values.map(
        lambda value: [value])), max_size=5).map(lambda groups: [token for group in groups for token in group])
    return documents, arguments


@pytest.mark.slow
def test_fuzz_config_and_arguments_give_a_config_or_one_line(tmp_path_factory):
    """Random YAML documents, and random argument lists on a valid config, through `train --check`:
    a valid run, or one line and status 2 (3: far over this machine's memory); never a traceback."""
    import contextlib
    import io

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    documents, arguments = _fuzz_strategies()
    folder = tmp_path_factory.mktemp("fuzz")

    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
    @given(document=documents, argv=arguments, fuzz_arguments=st.booleans())
    def check(document, argv, fuzz_arguments):
        config = folder / "fuzz.yaml"
        if fuzz_arguments:
            write_config(config)
        else:
            config.write_text(document)
            argv = []
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main(["train", "--check", "--config", str(config), "--out", str(folder / "run"),
                                   *argv])
            except SystemExit as stop:  # argparse: --help, or a bad argument
                status = stop.code
        lines = err.getvalue().splitlines()
        assert "Traceback" not in err.getvalue()
        assert status in (0, 2, 3), (status, err.getvalue())
        assert len(lines) == (0 if status == 0 else 1), err.getvalue()
        if status == 0 and "--help" not in argv and "-h" not in argv:
            assert out.getvalue().startswith("qca-lowmem train: ok:")

    check()


@pytest.mark.parametrize("training, flags, refused", [
    ({}, ["--accumulate", "2"], "episodes per optimizer step, accumulate x processes (checkpoint 1, now 2)"),
    ({"scheduler": "cosine"}, ["--episodes", "3"], "episodes, which sets the cosine schedule (checkpoint 2, now 3)"),
    ({}, ["--amp-dtype", "bf16"], "amp_dtype (checkpoint None, now 'bf16')"),
])
def test_resume_refuses_what_changes_the_results(tmp_path, capsys, training, flags, refused):
    config = write_config(tmp_path / "tiny.yaml", {**TINY, "training": {**TINY["training"], **training}})
    out = tmp_path / "run"
    assert cli.main(["train", "--config", config, "--out", str(out), "--stop-after", "1", "--no-progress"]) == 0
    before = (out / CHECKPOINT_NAME).read_bytes()
    capsys.readouterr()
    assert cli.main(["train", "--config", config, "--out", str(out), "--resume", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a resume cannot change" in err and refused in err, err
    assert (out / CHECKPOINT_NAME).read_bytes() == before


def test_every_config_field_has_a_train_flag():
    import dataclasses

    from qca_lowmem.trainer.config import TrainConfig

    train = cli.build_parser().commands["train"]
    flags = {option for action in train._actions for option in action.option_strings}
    missing = [f.name for f in dataclasses.fields(TrainConfig) if cli._flag(f.name) not in flags]
    assert not missing, f"config fields without a train flag: {missing}"
    assert set(cli.CONFIG_FLAGS) == {f.name for f in dataclasses.fields(TrainConfig)} - {"d_state"} | {"d_state"}


def test_an_unknown_train_flag_points_at_trains_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--learning-rate", "1e-3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("qca-lowmem train: unrecognized arguments: --learning-rate 1e-3 "
                                       "(see qca-lowmem train --help)\n")


def test_the_new_flags_reach_the_config(tmp_path):
    args = cli.build_parser().parse_args(["train", "--lr", "3e-4", "--weight-decay", "0", "--max-grad-norm", "2",
                                          "--max-skipped-steps", "3", "--scheduler", "cosine", "--no-fused-blocks",
                                          "--gamma", "0.1"])
    config = cli._config(args)
    assert (config.lr, config.weight_decay, config.max_grad_norm, config.max_skipped_steps, config.scheduler,
            config.fused_blocks, config.gamma) == (3e-4, 0.0, 2.0, 3, "cosine", False, 0.1)


@pytest.mark.parametrize("flags, refused", [
    (["--checkpoint", "step", "--slots", "4"], "--slots applies only to --checkpoint revolve, got --checkpoint step"),
    (["--checkpoint", "revolve", "--budget", "1GiB"], "--budget applies only to --checkpoint auto, got --checkpoint revolve"),
    (["--slots", "4", "--budget", "1GiB"], "--slots (revolve) and --budget (auto) are for two policies"),
])
def test_slots_or_budget_a_policy_does_not_read_are_refused(flags, refused):
    """As enable() and rollout() refuse them, not dropped: the run would not do what they say."""
    with pytest.raises(UsageError, match=re.escape(refused)):
        cli._config(cli.build_parser().parse_args(["train", *flags]))


def test_a_checkpoint_flag_drops_the_configs_slots_for_its_own_policy(tmp_path):
    path = write_config(tmp_path / "revolve.yaml", {**TINY, "lowmem": {"checkpoint": "revolve", "slots": 8}})
    config = cli._config(cli.build_parser().parse_args(["train", "--config", str(path), "--checkpoint", "step"]))
    assert (config.checkpoint, config.slots) == ("step", None)
    config = cli._config(cli.build_parser().parse_args(["train", "--config", str(path), "--slots", "3"]))
    assert (config.checkpoint, config.slots) == ("revolve", 3)
