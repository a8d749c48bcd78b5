"""The users' config switch: `enable_from_config` reads a config's `LOWMEM` section (a mapping, an
object's attributes, or a boolean) and the `QCA_LOWMEM` environment variable, and calls
`enable`. Its boolean settings accept the spellings of `parse_flag` (the reference trainer's own
config takes booleans only).

`QCA_LOWMEM=1` asks for the library wherever it can run, not for one trainer: a trainer that
enable() refuses then trains on stock, said in one warning. A section that enables it asks for
this trainer, so a refusal stands, its advice in the section's terms."""

import logging
import os
import re
from typing import Optional

from .say import say
from .switch import enable

_ENV_FLAG = "QCA_LOWMEM"


def _section(cfg, name):
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        for key in (name, name.lower()):
            if key in cfg:
                return cfg[key]
        return None
    for key in (name, name.lower()):
        if hasattr(cfg, key):
            return getattr(cfg, key)
    return None


def _get(section, key, default):
    if isinstance(section, dict):
        return section.get(key, default)
    return getattr(section, key, default)


# The LOWMEM section's settings (enable()'s keyword arguments); the trainer's config shares them.
LOWMEM_OPTIONS = ("checkpoint", "amp_dtype", "fused_blocks", "slots", "cuda_graph", "budget", "channels_last")
# enable()'s other keyword arguments, for the users' trainer only.
_TRAINER_ONLY_OPTIONS = ("noise", "fused_step_ops", "assume_stock_episode", "lowmem_scaler", "max_grad_norm",
                         "grid_size", "batch_size", "d_state", "initial_state")
_CONFIG_KEYS = ("enabled", *LOWMEM_OPTIONS, *_TRAINER_ONLY_OPTIONS)
_FLAG_OPTIONS = ("fused_blocks", "cuda_graph", "channels_last", "fused_step_ops", "assume_stock_episode",
                 "lowmem_scaler")
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


def enable_from_config(trainer, cfg=None, **overrides):
    """enable(trainer, ...) as the config's `LOWMEM` section (dict or attributes) says.

    `LOWMEM: {enabled: true, checkpoint: step, amp_dtype: bf16, fused_blocks: true, slots: null}`;
    every keyword argument of enable() is a key (`noise: fused`, `fused_step_ops: false`, ...). A
    setting left out or null is enable()'s default (`cuda_graph`: on where a capture can run).
    `LOWMEM: true` alone means enabled with the defaults. Boolean settings take the spellings of
    `parse_flag`. `QCA_LOWMEM=1` in the environment switches it on (with the section's other
    settings, or the defaults) and `QCA_LOWMEM=0` off, whatever the config says; switched on by
    the environment alone, a trainer enable() refuses trains on stock, said in one warning.
    Returns True when enabled; either way one line says which and why (say.py).
    """
    section = _section(cfg, "LOWMEM")
    if isinstance(section, (bool, int, str)):
        enabled, section = parse_flag(section, "LOWMEM"), None
    elif isinstance(section, (list, tuple, float)):
        raise ValueError(f"LOWMEM must be a mapping of settings or a boolean, got {section!r}")
    else:
        if isinstance(section, dict):
            unknown = sorted(set(section) - set(_CONFIG_KEYS))
            if unknown:
                raise ValueError(f"LOWMEM section: unknown keys {unknown}; known keys are {list(_CONFIG_KEYS)}")
        enabled = parse_flag(_get(section, "enabled", False), "LOWMEM.enabled") if section is not None else False
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
    options = {}
    if section is not None:
        for key in LOWMEM_OPTIONS + _TRAINER_ONLY_OPTIONS:
            value = _get(section, key, None)
            if value is not None:
                options[key] = parse_flag(value, f"LOWMEM.{key}") if key in _FLAG_OPTIONS else value
    options.update(overrides)
    try:
        enable(trainer, **options)
    except (TypeError, ValueError) as error:
        if asked_by_config and type(error) in (TypeError, ValueError):
            raise type(error)(in_config_terms(str(error))).with_traceback(error.__traceback__) from None
        if asked_by_config:
            raise
        # What and why, without enable()'s advice: the environment reaches none of its settings.
        why = str(error).splitlines()[0].removeprefix("enable(): ").split("; ")[0]
        say(logging.WARNING, f"off, {type(trainer).__name__} trains on stock: {why}; "
                             f"unset {_ENV_FLAG} for it to silence this")
        return False
    return True


# enable()'s keyword advice, `fused_step_ops=False`, as the LOWMEM section spells it.
_KEYWORD_ADVICE = re.compile(r"\b(" + "|".join(LOWMEM_OPTIONS + _TRAINER_ONLY_OPTIONS)
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
