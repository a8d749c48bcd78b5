"""enable() replaces train_episode only where it is the stock one, whose episode qca_lowmem's
repeats: the bundled stand-in's, a subclass's that does not override it, or the users' own, by
its structure; a train_episode of its own (an override, a function set on the instance, an edited
source, a line moved into or out of a block) is refused naming it, the trainer left as it was,
unless the user assumes the stock episode by name."""

import inspect
import textwrap
import types

import pytest

import qca_lowmem
from qca_lowmem.atheria.switch import LowmemEpisode
from qca_lowmem.atheria.stock_guard import STOCK_EPISODES, stock_origin, structure_digest
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4, make_config


def trainer_of(cls=QC_Trainer_v4):
    return cls(make_config(grid=8, qca_steps=2))


class Logging(QC_Trainer_v4):
    """A subclass that adds to the trainer but keeps the stock episode."""

    def describe(self):
        return "logging"


class Overriding(QC_Trainer_v4):
    def train_episode(self, episode_num):
        out = super().train_episode(episode_num)
        self.seen = episode_num
        return out


def test_the_stock_episode_is_replaced():
    for trainer in (trainer_of(), trainer_of(Logging)):
        qca_lowmem.enable(trainer, checkpoint="step")
        assert isinstance(trainer.train_episode, LowmemEpisode) and trainer.train_episode.trainer is trainer
    trainer = trainer_of()
    trainer.train_episode = types.MethodType(QC_Trainer_v4.train_episode, trainer)  # the stock one, rebound
    qca_lowmem.enable(trainer)


def refused(trainer, match):
    with pytest.raises(TypeError, match=match) as error:
        qca_lowmem.enable(trainer)
    first, *details = str(error.value).splitlines()
    assert len(first) <= 200 and len(details) <= 1 and "assume_stock_episode=True" in details[0]
    assert not hasattr(trainer, "_qca_lowmem_state") and "evolve_step" not in vars(trainer.motor)


def test_an_episode_of_its_own_is_refused_naming_it():
    refused(trainer_of(Overriding), r"Overriding.train_episode is test_enable_episode.Overriding.train_episode "
                                    r"\(its class's\), not a stock episode qca_lowmem follows")
    patched = trainer_of()
    patched.train_episode = types.MethodType(lambda self, e: (0.0, {}, None), patched)
    refused(patched, r"QC_Trainer_v4.train_episode is test_enable_episode.test_an_episode_of_its_own_is_refused_"
                     r"naming_it.<locals>.<lambda> \(set on the instance\)")
    other = trainer_of()
    other.train_episode = trainer_of().train_episode  # the stock function, but another trainer's
    refused(other, r"is qca_lowmem.examples.qc_trainer_v4.QC_Trainer_v4.train_episode \(set on the instance\)")


def defined(tmp_path, name, text, qualname):
    """What `text`, written to a file and run, defines as `qualname` (its source readable)."""
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    namespace = {}
    exec(compile(text, str(path), "exec"), namespace)
    owner, _, attribute = qualname.rpartition(".")
    return getattr(namespace[owner], attribute) if owner else namespace[attribute]


@pytest.mark.parametrize("qualname", sorted({e.qualname for e in STOCK_EPISODES}))
def test_the_users_episode_is_recognised_by_its_structure_only(tmp_path, qualname):
    """A function named as theirs passes only when its structure is a version the library follows."""
    owner = qualname.split(".")[0]
    edited = defined(tmp_path, "edited", f"class {owner}:\n    def train_episode(self, episode_num):\n"
                     "        return 1\n", qualname)
    assert edited.__qualname__ == qualname and structure_digest(edited) is not None
    assert stock_origin(edited) is None


def test_every_recorded_digest_names_its_origin():
    for episode in STOCK_EPISODES:
        assert len(episode.digest) == 64 and episode.origin
    stand_ins = {e.origin: e.digest for e in STOCK_EPISODES if "stand-in" in e.origin}
    assert stand_ins == {"qca_lowmem/examples/qc_trainer_v4.py, the bundled stand-in":
                         structure_digest(QC_Trainer_v4.train_episode),
                         "qca_lowmem/examples/qc_trainer_v3.py, the bundled stand-in":
                         structure_digest(QC_Trainer_v3.train_episode)}


def test_the_digest_ignores_layout_and_comments_only(tmp_path):
    base = structure_digest(defined(tmp_path, "base", "def f(x):\n    y = x + 1\n    return y\n", "f"))
    layout = defined(tmp_path, "layout", "def f(x):\n\n        # why\n        y = x + 1\n        return y\n", "f")
    assert structure_digest(layout) == base
    assert structure_digest(defined(tmp_path, "edit", "def f(x):\n    y = x + 2\n    return y\n", "f")) != base


def test_a_line_moved_out_of_its_block_is_an_edit(tmp_path):
    """The stand-in's episode with its noise coin moved out of its `if` block, indentation only,
    is not the stock episode: the digest reads block depth."""
    source = textwrap.dedent(inspect.getsource(QC_Trainer_v4.train_episode))
    lines = source.splitlines()
    j = next(i for i, line in enumerate(lines) if line.strip() == "psi = noise_step(self.noise_injector, psi, rate)")
    depth = len(lines[j]) - len(lines[j].lstrip())
    assert lines[j - 1].strip() == "if rate > 0.001:"
    lines[j:j + 1] = [" " * depth + "pass", " " * (depth - 4) + lines[j].strip()]
    indented = "class QC_Trainer_v4:\n" + textwrap.indent("\n".join(lines) + "\n", "    ")
    edited = defined(tmp_path, "moved", indented, "QC_Trainer_v4.train_episode")
    assert structure_digest(edited) != structure_digest(QC_Trainer_v4.train_episode)
    assert stock_origin(edited) is None
    same = defined(tmp_path, "same", "class QC_Trainer_v4:\n" + textwrap.indent(source, "  "), "QC_Trainer_v4.train_episode")
    assert stock_origin(same) == "qca_lowmem/examples/qc_trainer_v4.py, the bundled stand-in"


def test_an_edited_episode_runs_as_stock_only_when_assumed(caplog):
    trainer = trainer_of(Overriding)
    with caplog.at_level("INFO", logger="qca_lowmem"):
        qca_lowmem.enable(trainer, assume_stock_episode=True)
    assert "the stock episode assumed: Overriding.train_episode" in caplog.text
    trainer.train_episode(0)
    assert not hasattr(trainer, "seen")  # the override's own line was dropped, as the user accepted
    qca_lowmem.disable(trainer)
    with pytest.raises(ValueError, match="assume_stock_episode must be True or False, got 'yes'"):
        qca_lowmem.enable(trainer_of(), assume_stock_episode="yes")
