"""enable()'s settings, declared once (options.Options): enable()'s signature and docstring, the
LOWMEM section's keys and flags read off its fields; every setting refused by type, naming it and
the value, by enable() and by the LOWMEM section alike; the section validated the same way
whatever holds it (a dict, a SimpleNamespace as the users' load_experiment_config makes, any
object's attributes, a Mapping that is not a dict)."""

import dataclasses
import inspect
import re
import types
import typing
from collections import UserDict
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch

import qca_lowmem
from qca_lowmem.atheria import config_section, options
from qca_lowmem.atheria.trainers import ADAPTERS, TrainerVersion
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
    # flags: neither a bool for enable() nor a spelling of one for the section
    ("fused_blocks", "maybe"), ("cuda_graph", 2), ("fused_step_ops", 0.5), ("lowmem_scaler", "maybe"),
    ("assume_stock_episode", 2), ("channels_last", "sometimes"),
]


def test_every_option_has_a_wrong_type_here():
    assert {name for name, _ in WRONG_TYPES} == set(options.OPTION_NAMES)


@pytest.mark.parametrize("name, value", WRONG_TYPES)
def test_enable_refuses_a_wrong_type_by_name_before_anything_changes(name, value):
    trainer = trainer_of()
    before = dict(vars(trainer))
    with pytest.raises(ValueError, match=rf"^enable\(\): {name} must be .*, got {re.escape(repr(value))}"):
        qca_lowmem.enable(trainer, **{name: value})
    assert vars(trainer) == before


SECTIONS = {
    "dict": lambda settings: dict(settings),
    "SimpleNamespace": lambda settings: SimpleNamespace(**settings),
    "object": lambda settings: type("Section", (), dict(settings))(),
    "Mapping": lambda settings: types.MappingProxyType(dict(settings)),
    "UserDict": lambda settings: UserDict(settings),
}


@pytest.mark.parametrize("kind", ["dict", "SimpleNamespace"])
@pytest.mark.parametrize("name, value", WRONG_TYPES)
def test_the_section_refuses_a_wrong_type_by_its_key(monkeypatch, name, value, kind):
    monkeypatch.delenv("QCA_LOWMEM", raising=False)
    calls = []
    monkeypatch.setattr(config_section, "enable", lambda trainer, **kw: calls.append(kw))
    section = SECTIONS[kind]({"enabled": True, name: value})
    with pytest.raises(ValueError, match=rf"^LOWMEM\.{name} must be .*, got {re.escape(repr(value))}") as refused:
        qca_lowmem.enable_from_config(object(), {"LOWMEM": section})
    assert "None" not in str(refused.value).split(", got")[0]  # the section's words: null
    assert calls == []


def test_a_grid_given_as_a_pair_or_a_numpy_int_trains_on_that_grid():
    shapes = []
    for grid_size in ((12, 12), [12, 12], numpy.int64(12), [numpy.int32(12), 12]):
        trainer = qca_lowmem.enable(trainer_of(), grid_size=grid_size)
        assert trainer._qca_lowmem_state.options.grid == (12, 12)
        assert all(type(side) is int for side in trainer._qca_lowmem_state.options.grid)
        trainer.motor.operator.register_forward_pre_hook(
            lambda module, args: None if qca_lowmem.recomputing() else shapes.append(args[0].shape[-2:]))
        trainer.train_episode(0)
    assert shapes and set(shapes) == {(12, 12)}


class Lowmem:
    """A section as a class's attributes, with a method that is no setting."""

    enabled = True
    chekpoint = "revolve"

    def describe(self):
        return "lowmem"




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


def test_enables_signature_and_docstring_are_the_options_fields():
    """enable() as its users see it (help(), inspect.signature): the options in their order, with
    their defaults and types; the five it has always taken by position still positional."""
    parameters = list(inspect.signature(qca_lowmem.enable).parameters.values())
    assert parameters[0].name == "trainer"
    fields = dataclasses.fields(options.Options)
    assert [(p.name, p.default, p.annotation) for p in parameters[1:]] == [(f.name, f.default, f.type) for f in fields]
    positional = [p.name for p in parameters[1:] if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["checkpoint", "amp_dtype", "fused_blocks", "slots", "cuda_graph"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[6:])
    for field in fields:
        assert re.search(rf"^    {field.name}: \S", qca_lowmem.enable.__doc__, re.M), field.name
        assert field.metadata["doc"] and field.metadata["expected"]
    assert set(options.FLAG_OPTIONS) == {"fused_blocks", "cuda_graph", "fused_step_ops", "lowmem_scaler",
                                         "assume_stock_episode", "channels_last"}


def test_a_flag_unset_is_accepted_after_typings_caches_are_cleared():
    """A flag is read off its type, compared by equality: torch.compile can clear typing's caches,
    after which Optional[bool] is another object, equal to the field's."""
    for cleanup in getattr(typing, "_cleanups", ()):
        cleanup()
    trainer = qca_lowmem.enable(trainer_of(), cuda_graph=None, channels_last=None)
    assert not trainer._qca_lowmem_state.options.cuda_graph


def test_readme_lists_every_option():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", readme, re.M)
    listed = {name.strip("` ") for row in rows for name in row.split(",")}
    assert set(options.OPTION_NAMES) | {"enabled"} <= listed


def test_enable_takes_the_options_by_position_and_refuses_others_naming_itself():
    trainer = trainer_of()
    qca_lowmem.enable(trainer, "revolve", None, True, 2)
    assert trainer._qca_lowmem_state.options.policy.describe() == "checkpoint=revolve slots=2"
    with pytest.raises(TypeError, match=r"^enable\(\): got an unexpected keyword argument 'chekpoint'"):
        qca_lowmem.enable(trainer_of(), chekpoint="step")
    with pytest.raises(TypeError, match=r"^enable\(\): too many positional arguments"):
        qca_lowmem.enable(trainer_of(), "step", None, True, None, None, True)
    with pytest.raises(TypeError, match=r"^enable\(\) missing .*'trainer'"):
        qca_lowmem.enable(checkpoint="step")


def test_every_trainer_version_is_a_trainer_version():
    assert ADAPTERS and all(isinstance(version, TrainerVersion) for version in ADAPTERS)
    members = {name for name in vars(TrainerVersion) if not name.startswith("_")} | set(
        TrainerVersion.__annotations__)
    assert all(members <= set(dir(version)) for version in ADAPTERS)


@pytest.mark.parametrize("option", [dict(grid_size=8), dict(grid_size=(8, 8)), dict(batch_size=1)])
def test_a_grid_or_batch_that_would_replace_the_engines_own_draw_is_refused(option):
    """Their V4 draws psi0 by its engine's state reset: a grid or batch size of enable()'s would
    draw another psi0 (other states, another loss), so it is refused; initial_state still overrides."""
    trainer = trainer_of(state_object=True)
    with pytest.raises(ValueError, match=r"draws psi0 by its engine's motor.state._reset_state_random\(\)"):
        qca_lowmem.enable(trainer, **option)
    assert not hasattr(trainer, "_qca_lowmem_state")
    qca_lowmem.enable(trainer, initial_state=lambda t: t.motor.state.psi)
