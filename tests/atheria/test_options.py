"""enable()'s settings, one table (options.OPTIONS): every typed setting refused by type, naming it
and the value, by enable() and by the LOWMEM section alike; the section validated the same way
whatever holds it (a dict, a SimpleNamespace as the users' load_experiment_config makes, any
object's attributes, a Mapping that is not a dict)."""

import inspect
import re
import types
from collections import UserDict
from types import SimpleNamespace

import numpy
import pytest
import torch

import qca_lowmem
from qca_lowmem.atheria import config_section, options
from qca_lowmem.examples import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer_of(**kw):
    torch.manual_seed(3)
    return QC_Trainer_v4(make_config(grid=8, d_state=2, hidden=4, qca_steps=2), **kw)


# (setting, a value of the wrong type): what a YAML or JSON config, or a caller, gets wrong
WRONG_TYPES = [
    ("grid_size", "128"), ("grid_size", "8"), ("grid_size", True), ("grid_size", 0), ("grid_size", 8.0),
    ("grid_size", (8,)), ("grid_size", [8, "8"]), ("grid_size", (8, 8, 8)), ("batch_size", "2"),
    ("batch_size", True), ("batch_size", 0), ("d_state", 2.5), ("d_state", "2"), ("slots", "4"), ("slots", 4.0),
    ("budget", 1.5), ("budget", True), ("max_grad_norm", "1.0"), ("max_grad_norm", True),
    ("max_grad_norm", float("nan")), ("max_grad_norm", 0), ("amp_dtype", "int8"), ("amp_dtype", torch.int8),
    ("checkpoint", 3), ("checkpoint", "steps"), ("noise", 1), ("initial_state", 5), ("initial_state", "psi0"),
]


@pytest.mark.parametrize("name, value", WRONG_TYPES)
def test_enable_refuses_a_wrong_type_by_name_before_anything_changes(name, value):
    trainer = trainer_of()
    before = dict(vars(trainer))
    with pytest.raises(ValueError, match=rf"^enable\(\): {name} must be .*, got {re.escape(repr(value))}"):
        qca_lowmem.enable(trainer, **{name: value})
    assert vars(trainer) == before


@pytest.mark.parametrize("name, value", WRONG_TYPES)
def test_the_section_refuses_a_wrong_type_by_its_key(monkeypatch, name, value):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = []
    monkeypatch.setattr(config_section, "enable", lambda trainer, **kw: calls.append(kw))
    with pytest.raises(ValueError, match=rf"^LOWMEM\.{name} must be .*, got {re.escape(repr(value))}") as refused:
        qca_lowmem.enable_from_config(object(), {"LOWMEM": {"enabled": True, name: value}})
    assert "None" not in str(refused.value).split(", got")[0]  # the section's words: null
    assert calls == []


def test_a_grid_given_as_a_pair_or_a_numpy_int_trains_on_that_grid():
    shapes = []
    for grid_size in ((12, 12), [12, 12], numpy.int64(12), [numpy.int32(12), 12]):
        trainer = qca_lowmem.enable(trainer_of(), grid_size=grid_size)
        assert trainer._qca_lowmem_state.options.grid == (12, 12)
        assert all(type(side) is int for side in trainer._qca_lowmem_state.options.grid)
        trainer.motor.operator.register_forward_pre_hook(lambda module, args: shapes.append(args[0].shape[-2:]))
        trainer.train_episode(0)
    assert shapes and set(shapes) == {(12, 12)}


class Lowmem:
    """A section as a class's attributes, with a method that is no setting."""

    enabled = True
    chekpoint = "revolve"

    def describe(self):
        return "lowmem"


SECTIONS = {
    "dict": lambda settings: dict(settings),
    "SimpleNamespace": lambda settings: SimpleNamespace(**settings),
    "object": lambda settings: type("Section", (), dict(settings))(),
    "Mapping": lambda settings: types.MappingProxyType(dict(settings)),
    "UserDict": lambda settings: UserDict(settings),
}


@pytest.mark.parametrize("kind", SECTIONS)
def test_a_misspelt_key_is_refused_whatever_holds_the_section(monkeypatch, kind):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = []
    monkeypatch.setattr(config_section, "enable", lambda trainer, **kw: calls.append(kw))
    section = SECTIONS[kind]({"enabled": True, "chekpoint": "revolve", "slots": 4})
    for cfg in ({"LOWMEM": section}, SimpleNamespace(LOWMEM=section)):
        with pytest.raises(ValueError, match=r"unknown keys \['chekpoint'\]; known keys are \['enabled', 'checkpoint'"):
            qca_lowmem.enable_from_config(object(), cfg)
    for off in ({"enabled": False, "chekpoint": "step"}, {"enabled": True, "chekpoint": None}):  # off, or null
        with pytest.raises(ValueError, match=r"unknown keys \['chekpoint'\]"):
            qca_lowmem.enable_from_config(object(), {"LOWMEM": SECTIONS[kind](off)})
    good = SECTIONS[kind]({"enabled": "yes", "checkpoint": "revolve", "slots": 4, "grid_size": [8, 8], "budget": None})
    assert qca_lowmem.enable_from_config(object(), {"LOWMEM": good}) is True
    assert calls == [{"checkpoint": "revolve", "slots": 4, "grid_size": [8, 8]}]


def test_a_class_section_reads_its_attributes_and_refuses_a_method_as_a_key(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    with pytest.raises(ValueError, match=r"unknown keys \['chekpoint', 'describe'\]"):
        qca_lowmem.enable_from_config(object(), {"LOWMEM": Lowmem})
    assert config_section.section_settings(Lowmem()) == {"enabled": True, "chekpoint": "revolve"}


def test_a_real_trainer_from_an_attribute_section_refuses_a_string_grid(monkeypatch):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    trainer = trainer_of()
    with pytest.raises(ValueError, match=r"LOWMEM\.grid_size must be an int >= 1, a pair of ints >= 1 or null, "
                                         r"got '128' \(a str\)"):
        qca_lowmem.enable_from_config(trainer, SimpleNamespace(LOWMEM=SimpleNamespace(enabled=True, grid_size="128")))
    assert not hasattr(trainer, "_qca_lowmem_state")


def test_every_option_is_a_keyword_of_enable_and_a_key_of_the_section():
    keywords = set(inspect.signature(qca_lowmem.enable).parameters) - {"trainer"}
    assert set(options.OPTION_NAMES) == keywords
    assert set(config_section._CONFIG_KEYS) == keywords | {"enabled"}
    assert set(config_section.LOWMEM_OPTIONS) < keywords


@pytest.mark.parametrize("option", [dict(grid_size=8), dict(grid_size=(8, 8)), dict(batch_size=1)])
def test_a_grid_or_batch_that_would_replace_the_engines_own_draw_is_refused(option):
    """Their V4 draws psi0 by its engine's state reset: a grid or batch size of enable()'s would
    draw another psi0 (other states, another loss), so it is refused; initial_state still overrides."""
    trainer = trainer_of(state_object=True)
    with pytest.raises(ValueError, match=r"draws psi0 by its engine's motor.state._reset_state_random\(\)"):
        qca_lowmem.enable(trainer, **option)
    assert not hasattr(trainer, "_qca_lowmem_state")
    qca_lowmem.enable(trainer, initial_state=lambda t: t.motor.state.psi)
