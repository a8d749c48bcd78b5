"""The users' config switch: `enable_from_config` reads a config's `LOWMEM` section (a mapping, an
object's attributes, or a boolean) and the `QCA_LOWMEM` environment variable, and calls
`enable`. Its boolean settings accept the spellings of `parse_flag` (the reference trainer's own
config takes booleans only).

`QCA_LOWMEM=1` asks for the library wherever it can run, not for one trainer: a trainer that
enable() refuses then trains on stock, said in one warning, and so does one from an episode that
the library cannot run (a caller's autocast, a compiled layer on the engine's own step). A section that enables it asks for
this trainer, so a refusal stands, its advice in the section's terms."""

import inspect
import logging
import os
import re
from collections.abc import Mapping
from typing import Optional

from .options import FLAG_OPTIONS, LOWMEM_KEYS, OPTION_NAMES, check_options
from .say import say
from .switch import enable, stock_on_refusal

_ENV_FLAG = "QCA_LOWMEM"


def _section(cfg, name):
    if cfg is None:
        return None
    if isinstance(cfg, Mapping):
        for key in (name, name.lower()):
            if key in cfg:
                return cfg[key]
        return None
    for key in (name, name.lower()):
        if hasattr(cfg, key):
            return getattr(cfg, key)
    return None


def section_settings(section) -> dict:
    """A LOWMEM section's settings by key, whatever holds them: a mapping (a dict or any other
    Mapping), or an object's public attributes (a SimpleNamespace, as their load_experiment_config
    makes, a dataclass, a class), its bound methods left out. One dict, so that every kind is
    validated alike."""
    if isinstance(section, Mapping):
        return dict(section)
    settings = {}
    for name in dir(section):
        if not name.startswith("_"):
            value = getattr(section, name)
            if not inspect.ismethod(value) and not inspect.isbuiltin(value):
                settings[name] = value
    return settings


# The LOWMEM section's settings the reference trainer's `lowmem` section shares: it reads them here,
# the one module of atheria/ besides its face that others may import.
LOWMEM_OPTIONS = LOWMEM_KEYS
_CONFIG_KEYS = ("enabled", *OPTION_NAMES)
_TRUE_SPELLINGS = ("1", "true", "yes", "on")
_FALSE_SPELLINGS = ("0", "false", "no", "off")


def parse_flag(value, name: str) -> bool:
    """A boolean setting as YAML or the environment may spell it: a bool, 0/1, or (any case)
    true/false, yes/no, on/off, 1/0. Anything else is refused, naming the setting."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        flag = value.strip().lower()
        if flag in _TRUE_SPELLINGS:
            return True
        if flag in _FALSE_SPELLINGS:
            return False
    raise ValueError(f"{name} must be a boolean (true/false, yes/no, on/off or 1/0), got {value!r}")


def _env_enabled() -> Optional[bool]:
    value = os.environ.get(_ENV_FLAG)
    if value is None or value.strip() == "":
        return None
    return parse_flag(value, _ENV_FLAG)


def _read_section(section):
    """(enabled, enable()'s keyword arguments) of a LOWMEM section of any kind, checked alike:
    unknown keys refused by name, every setting by its type (options.Options)."""
    settings = section_settings(section)
    unknown = sorted(set(settings) - set(_CONFIG_KEYS), key=str)
    if unknown:
        raise ValueError(f"LOWMEM section ({type(section).__name__}): unknown keys {unknown}; "
                         f"known keys are {list(_CONFIG_KEYS)}")
    enabled = parse_flag(settings.get("enabled", False), "LOWMEM.enabled")
    options = {key: parse_flag(value, f"LOWMEM.{key}") if key in FLAG_OPTIONS else value
               for key, value in settings.items() if key != "enabled" and value is not None}
    check_options(options, lambda name: f"LOWMEM.{name}", yaml=True)
    return enabled, options


def enable_from_config(trainer, cfg=None, **overrides):
    """enable(trainer, ...) as the config's `LOWMEM` section (dict or attributes) says.

    `LOWMEM: {enabled: true, checkpoint: step, amp_dtype: bf16, fused_blocks: true, slots: null}`;
    every keyword argument of enable() is a key (`noise: fused`, `fused_step_ops: false`, ...). A
    setting left out or null is enable()'s default (`cuda_graph`: on where a capture can run).
    `LOWMEM: true` alone means enabled with the defaults. Boolean settings take the spellings of
    `parse_flag`. `QCA_LOWMEM=1` in the environment switches it on (with the section's other
    settings, or the defaults) and `QCA_LOWMEM=0` off, whatever the config says; switched on by
    the environment alone, a trainer enable() refuses trains on stock, said in one warning (and so
    from an episode the library cannot run).
    Returns True when enabled; either way one line says which and why (say.py).
    """
    section = _section(cfg, "LOWMEM")
    options = {}
    if section is None:
        enabled = False
    elif isinstance(section, (bool, int, str)):
        enabled, section = parse_flag(section, "LOWMEM"), None
    elif isinstance(section, (list, tuple, set, frozenset, float, complex, bytes)):
        raise ValueError(f"LOWMEM must be a mapping of settings or a boolean, got {section!r}")
    else:
        enabled, options = _read_section(section)
    asked_by_config = enabled
    env = _env_enabled()
    if env is not None:
        enabled = env
    if not enabled:
        why = (f"{_ENV_FLAG}={os.environ[_ENV_FLAG]} in the environment" if env is not None
               else "LOWMEM is off in the config" if section is not None or _section(cfg, "LOWMEM") is not None
               else f"no LOWMEM in the config and {_ENV_FLAG} unset")
        say(logging.INFO, f"off, {why}")
        return False
    options.update(overrides)
    try:
        enable(trainer, **options)
    except (TypeError, ValueError) as error:
        if asked_by_config and type(error) in (TypeError, ValueError):
            raise type(error)(in_config_terms(str(error))).with_traceback(error.__traceback__) from None
        if asked_by_config:
            raise
        # What and why, without enable()'s advice: the environment reaches none of its settings.
        why = str(error).splitlines()[0].removeprefix("enable(): ").split("; ")[0].rstrip(".")
        say(logging.WARNING, f"off, {type(trainer).__name__} trains on stock: {why}; "
                             f"unset {_ENV_FLAG} for it to silence this")
        return False
    if not asked_by_config:  # an episode the library cannot run then trains on stock too
        stock_on_refusal(trainer)
    return True


# enable()'s keyword advice, `fused_step_ops=False`, as the LOWMEM section spells it.
_KEYWORD_ADVICE = re.compile(r"\b(" + "|".join(OPTION_NAMES)
                             + r")=(True|False|None|'[^']*'|\d+|\.\.\.)")
_YAML_VALUES = {"True": "true", "False": "false", "None": "null"}


def in_config_terms(message: str) -> str:
    """A refusal of enable() as a LOWMEM section's user reads it: its settings as the section's keys,
    and how to train this experiment on stock."""
    def key(match):
        value = match.group(2)
        value = _YAML_VALUES.get(value, value.strip("'"))
        return f"LOWMEM.{match.group(1)}: {value}"

    message = _KEYWORD_ADVICE.sub(key, message).replace("without enable()", "with LOWMEM: false")
    return message if "LOWMEM: false" in message else message + "\nLOWMEM: false trains this experiment on stock."
