"""enable() replaces train_episode only where it is the stock one, whose episode qca_lowmem's
repeats: the bundled stand-in's, a subclass's that does not override it, or the users' own, by
the identity of its code; a train_episode of its own (an override, a function set on the instance, an edited
source, a line moved into or out of a block) is refused naming it, the trainer left as it was,
unless the user assumes the stock episode by name."""

import inspect
import textwrap
import types

import pytest

import qca_lowmem
from qca_lowmem.atheria.code_identity import FOLLOWED, PYTHON, digest, followed
from qca_lowmem.atheria.switch import LowmemEpisode
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4, make_config
from qca_lowmem.examples import qc_trainer_v4 as stand_in_module
from qca_lowmem.examples.qc_trainer_v4 import MemoryMotor, Motor
from qca_lowmem.stock import NoiseInjector

EPISODES = sorted(role for role in FOLLOWED.get(PYTHON, {}) if role.endswith(".train_episode"))


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


def test_under_the_environment_an_edited_episode_trains_on_stock_said_in_one_line(monkeypatch, caplog):
    monkeypatch.setenv("QCA_LOWMEM", "1")
    caplog.set_level("INFO", logger="qca_lowmem")
    trainer = trainer_of(Overriding)
    assert qca_lowmem.enable_from_config(trainer) is False
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("off, Overriding trains on stock: Overriding.train_episode is test_train_episode.Overriding."
                    "train_episode (its class's), not a stock episode qca_lowmem follows (edited, or a version it has "
                    "not recorded); unset QCA_LOWMEM for it to silence this")


def test_an_episode_of_its_own_is_refused_naming_it():
    refused(trainer_of(Overriding), r"Overriding.train_episode is test_train_episode.Overriding.train_episode "
                                    r"\(its class's\), not a stock episode qca_lowmem follows")
    patched = trainer_of()
    patched.train_episode = types.MethodType(lambda self, e: (0.0, {}, None), patched)
    refused(patched, r"QC_Trainer_v4.train_episode is test_train_episode.test_an_episode_of_its_own_is_refused_"
                     r"naming_it.<locals>.<lambda> \(set on the instance\)")
    other = trainer_of()
    other.train_episode = trainer_of().train_episode  # the stock function, but another trainer's
    refused(other, r"is qca_lowmem.examples.qc_trainer_v4.QC_Trainer_v4.train_episode \(set on the instance\)")


def defined(tmp_path, name, text, qualname, namespace=None):
    """What `text`, written to a file and run in `namespace` (a fresh one by default), defines as `qualname`."""
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    namespace = {} if namespace is None else namespace
    exec(compile(text, str(path), "exec"), namespace)
    owner, _, attribute = qualname.rpartition(".")
    return getattr(namespace[owner], attribute) if owner else namespace[attribute]


@pytest.mark.parametrize("role", EPISODES)
def test_the_users_episode_is_recognised_by_its_code_only(tmp_path, role):
    """A function named as theirs passes only when its code is a version the library follows."""
    owner = role.split(".")[0]
    edited = defined(tmp_path, "edited", f"class {owner}:\n    def train_episode(self, episode_num):\n"
                     "        return 1\n", role)
    assert edited.__qualname__ == role and digest(edited) is not None
    assert followed(role, edited) is None


def test_every_recorded_digest_names_its_origin():
    assert len({tuple(roles) for roles in FOLLOWED.values()}) == 1, "every Python's entry lists the same roles, in order"
    for roles in FOLLOWED.values():
        for known in roles.values():
            assert all(len(d) == 64 and origin for d, origin in known.items())
    ours = {origin: d for known in FOLLOWED.get(PYTHON, {}).values() for d, origin in known.items() if "qca_lowmem" in origin}
    # What qca_lowmem ships; an edit of it (or of stock.py, whose functions they call) needs its digest here again.
    assert ours == {"the bundled stand-in, qca_lowmem/examples/qc_trainer_v4.py": digest(QC_Trainer_v4.train_episode),
                    "the bundled stand-in, qca_lowmem/examples/qc_trainer_v3.py": digest(QC_Trainer_v3.train_episode),
                    "the bundled stand-in, qca_lowmem/examples/qc_trainer_v4.py Motor": digest(Motor.evolve_step),
                    "the bundled stand-in, qca_lowmem/examples/qc_trainer_v4.py MemoryMotor":
                        digest(MemoryMotor.evolve_step),
                    "qca_lowmem/stock.py NoiseInjector.apply_phase_flip": digest(NoiseInjector.apply_phase_flip),
                    "qca_lowmem/stock.py NoiseInjector.apply_bit_flip": digest(NoiseInjector.apply_bit_flip)}


def test_the_digest_ignores_layout_and_comments_only(tmp_path):
    base = digest(defined(tmp_path, "base", "def f(x):\n    y = x + 1\n    return y\n", "f"))
    layout = defined(tmp_path, "layout", "def f(x):\n\n        # why\n        y = x + 1\n        return y\n", "f")
    assert digest(layout) == base
    assert digest(defined(tmp_path, "edit", "def f(x):\n    y = x + 2\n    return y\n", "f")) != base


def test_a_line_moved_out_of_its_block_is_an_edit(tmp_path):
    """The stand-in's episode with its noise coin moved out of its `if` block, indentation only,
    is not the stock episode; the same text indented otherwise, in the same module's globals, is."""
    source = textwrap.dedent(inspect.getsource(QC_Trainer_v4.train_episode))
    lines = source.splitlines()
    j = next(i for i, line in enumerate(lines) if line.strip() == "psi = noise_step(self.noise_injector, psi, rate)")
    depth = len(lines[j]) - len(lines[j].lstrip())
    assert lines[j - 1].strip() == "if rate > 0.001:"
    lines[j:j + 1] = [" " * depth + "pass", " " * (depth - 4) + lines[j].strip()]
    # `import torch` as in the module: Python 3.11 compiles `torch.autocast(...)` otherwise when torch is imported
    indented = "import torch\nclass QC_Trainer_v4:\n" + textwrap.indent("\n".join(lines) + "\n", "    ")
    role = "QC_Trainer_v4.train_episode"
    edited = defined(tmp_path, "moved", indented, role, dict(vars(stand_in_module)))
    assert digest(edited) != digest(QC_Trainer_v4.train_episode)
    assert followed(role, edited) is None
    same = defined(tmp_path, "same", "import torch\nclass QC_Trainer_v4:\n" + textwrap.indent(source, "  "), role,
                   dict(vars(stand_in_module)))
    assert followed(role, same) == "the bundled stand-in, qca_lowmem/examples/qc_trainer_v4.py"


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
