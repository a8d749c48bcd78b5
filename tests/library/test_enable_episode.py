"""enable() replaces train_episode only where it is the stock one, whose episode qca_lowmem's
repeats: the bundled stand-in's, a subclass's that does not override it, or the users' own by its
source; a train_episode of its own (an override, a function set on the instance, an edited
source) is refused in one line naming it, the trainer left as it was."""

import types

import pytest

import qca_lowmem
from qca_lowmem.examples import QC_Trainer_v4, make_config
from qca_lowmem.stock_episode import ATHERIA_DIGESTS, is_stock_episode, source_digest


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
        assert trainer.train_episode.__func__ is not QC_Trainer_v4.train_episode
    trainer = trainer_of()
    trainer.train_episode = types.MethodType(QC_Trainer_v4.train_episode, trainer)  # the stock one, rebound
    qca_lowmem.enable(trainer)


def refused(trainer, match):
    with pytest.raises(TypeError, match=match) as error:
        qca_lowmem.enable(trainer)
    assert "\n" not in str(error.value)
    assert not hasattr(trainer, "_qca_lowmem_state") and "evolve_step" not in vars(trainer.motor)


def test_an_episode_of_its_own_is_refused_naming_it():
    refused(trainer_of(Overriding), r"Overriding.train_episode is test_enable_episode.Overriding.train_episode "
                                    r"\(its class's\), not the stock QC_Trainer_v4.train_episode")
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


@pytest.mark.parametrize("qualname", sorted(ATHERIA_DIGESTS))
def test_the_users_episode_is_recognised_by_its_source_only(tmp_path, qualname):
    """A function named as theirs passes only when its source is a version the library follows."""
    owner = qualname.split(".")[0]
    edited = defined(tmp_path, "edited", f"class {owner}:\n    def train_episode(self, episode_num):\n"
                     "        return 1\n", qualname)
    assert edited.__qualname__ == qualname and source_digest(edited) is not None
    assert not is_stock_episode(edited)


def test_the_digest_ignores_layout_and_comments_only(tmp_path):
    base = source_digest(defined(tmp_path, "base", "def f(x):\n    y = x + 1\n    return y\n", "f"))
    layout = defined(tmp_path, "layout", "def f(x):\n\n        # why\n        y = x + 1\n        return y\n", "f")
    assert source_digest(layout) == base
    assert source_digest(defined(tmp_path, "edit", "def f(x):\n    y = x + 2\n    return y\n", "f")) != base
