"""enable()'s line is seen once, with one `qca_lowmem:` prefix, however the program set up logging
(say.py): through logging where it shows the record, else on stderr; a level set on the
`qca_lowmem` logger, or logging.disable(), silences it. And every keyword of enable() is a key
of the LOWMEM section."""

import inspect
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qca_lowmem
from qca_lowmem.atheria import config_section, say


@pytest.fixture
def logging_tree(monkeypatch):
    """A root logger and a `qca_lowmem` logger of their own, so pytest's handlers play no part."""
    root = logging.RootLogger(logging.WARNING)
    logger = logging.Logger("qca_lowmem")
    logger.parent = root
    monkeypatch.setattr(say, "log", logger)
    return root, logger


def stream_handler(fmt, style="%"):
    handler = logging.StreamHandler(io.StringIO())
    if fmt is not None:
        handler.setFormatter(logging.Formatter(fmt, style=style))
    return handler


def test_their_pipeline_root_at_warning_writes_the_on_line_to_stderr(logging_tree, capsys):
    """A library's logging.warning() at import ran basicConfig: root at WARNING, and their
    basicConfig(level=INFO) did nothing. INFO is dropped there; the line goes to stderr."""
    root, _ = logging_tree
    handler = stream_handler(logging.BASIC_FORMAT)
    root.addHandler(handler)
    say.say(logging.INFO, "on, checkpoint=step")
    assert capsys.readouterr().err == "qca_lowmem: on, checkpoint=step\n"
    assert handler.stream.getvalue() == ""
    say.say(logging.WARNING, "off, X trains on stock")  # shown by their handler, whose format names the logger
    assert handler.stream.getvalue() == "WARNING:qca_lowmem:off, X trains on stock\n"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("fmt, line", [
    ("%(asctime)s - %(levelname)s - %(message)s", " - INFO - qca_lowmem: on\n"),  # their intended format
    (None, "qca_lowmem: on\n"),
    ("{levelname} {name}: {message}", "INFO qca_lowmem: on\n"),
])
def test_logging_that_shows_info_shows_the_line_once_with_one_prefix(logging_tree, capsys, fmt, line):
    root, _ = logging_tree
    root.setLevel(logging.INFO)
    handler = stream_handler(fmt, style="{" if fmt and fmt.startswith("{") else "%")
    root.addHandler(handler)
    say.say(logging.INFO, "on")
    assert handler.stream.getvalue().endswith(line) and handler.stream.getvalue().count("qca_lowmem") == 1
    assert capsys.readouterr().err == ""


def test_a_plain_interpreter_writes_to_stderr(logging_tree, capsys):
    say.say(logging.INFO, "off, no LOWMEM in the config and QCA_LOWMEM unset")
    say.say(logging.WARNING, "off, X trains on stock")
    assert capsys.readouterr().err.splitlines() == [
        "qca_lowmem: off, no LOWMEM in the config and QCA_LOWMEM unset", "qca_lowmem: off, X trains on stock"]


@pytest.mark.parametrize("how", ["level", "disable"])
def test_the_users_level_or_logging_disable_silences_it(logging_tree, capsys, how):
    root, logger = logging_tree
    handler = stream_handler(logging.BASIC_FORMAT)
    root.addHandler(handler)
    if how == "level":
        logger.setLevel(logging.WARNING)
    else:
        logging.disable(logging.INFO)
    try:
        say.say(logging.INFO, "on")
    finally:
        logging.disable(logging.NOTSET)
    assert capsys.readouterr().err == "" and handler.stream.getvalue() == ""


def test_a_handler_that_would_drop_the_record_does_not_count(logging_tree, capsys):
    root, _ = logging_tree
    root.setLevel(logging.INFO)
    handler = stream_handler(logging.BASIC_FORMAT)
    handler.setLevel(logging.WARNING)
    root.addHandler(handler)
    say.say(logging.INFO, "on")
    assert capsys.readouterr().err == "qca_lowmem: on\n" and handler.stream.getvalue() == ""


THEIR_PATTERN = """
import logging
logging.warning("redis o zstandard no disponibles")  # a library's warning at import: basicConfig, root at WARNING
logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(message)s")  # now does nothing
import qca_lowmem
from qca_lowmem.examples import QC_Trainer_v4, make_config
qca_lowmem.enable_from_config(QC_Trainer_v4(make_config(grid=8, qca_steps=2)), None)
"""


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("flag, line", [("1", "qca_lowmem: on, checkpoint=step, fp32, fused blocks, fused step"),
                                        (None, "qca_lowmem: off, no LOWMEM in the config and QCA_LOWMEM unset")])
def test_their_pattern_in_a_fresh_interpreter_shows_the_line(tmp_path, flag, line):
    env = {k: v for k, v in os.environ.items() if k != "QCA_LOWMEM"}
    env.update(PYTHONPATH=str(Path(qca_lowmem.__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    if flag is not None:
        env["QCA_LOWMEM"] = flag
    done = subprocess.run([sys.executable, "-c", THEIR_PATTERN], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [x for x in done.stderr.splitlines() if "qca_lowmem" in x] == [line]


def test_every_keyword_of_enable_is_a_key_of_the_lowmem_section(monkeypatch):
    keywords = set(inspect.signature(qca_lowmem.enable).parameters) - {"trainer"}
    assert set(config_section._CONFIG_KEYS) - {"enabled"} == keywords
    calls = []
    monkeypatch.setattr(config_section, "enable", lambda trainer, **kw: calls.append(kw))
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    section = {"enabled": True, "fused_step_ops": "no", "assume_stock_episode": "yes", "lowmem_scaler": 0,
               "max_grad_norm": 0.5, "d_state": 4}
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": section})
    assert calls == [dict(fused_step_ops=False, assume_stock_episode=True, lowmem_scaler=False, max_grad_norm=0.5,
                          d_state=4)]
