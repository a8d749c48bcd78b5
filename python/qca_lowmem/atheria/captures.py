"""The capture of the episode's step (a StepGraph), kept on the trainer between episodes: made at
its first CUDA episode, made again when a value it read once changes (GAMMA_DECAY, the operator,
a setting of one of its layers), and left aside while the operator has a module hook or runs code
qca_lowmem does not follow (operator_code.py: a replay runs no Python, so no hook, no counter)."""

import functools
import logging
import numbers
from typing import Any, Callable, Optional

import numpy
import torch

from ..recompute import StepGraph
from .engine_step import live_gamma
from .operator_code import first_hook, operator_unfollowed
from .say import say
from .user_modules import compiled_module


class StepCaptures:
    """The episode's cache of the motor's captured step. A copy of the trainer (deepcopy, pickle)
    starts a fresh one: it captures its own graphs."""

    def __init__(self):
        self.step_graph: Optional[StepGraph] = None
        self.graph_reads: Any = None  # what the capture read once: GAMMA_DECAY, the operator
        self.said_eager: Optional[str] = None

    def step(self, motor, step: Callable) -> Callable:
        """The step an episode of `motor` rolls out: `step` captured, or `step` itself (said once)
        while the operator has a hook or runs code qca_lowmem does not follow."""
        operator = compiled_module(motor.operator)
        hook = first_hook(operator)
        eager = hook or operator_unfollowed(operator)
        if eager != self.said_eager:
            self.said_eager = eager
            if eager is not None:
                say(logging.WARNING, f"{eager}: the episodes run their steps eagerly while it is there (a captured "
                                     f"step's replays would run {'no hook' if hook else 'one call of it at every step'})")
        if eager is not None:
            return step
        # A capture keeps the values its step read as constants: captured again when they change.
        reads = (live_gamma(motor), motor.operator, layer_settings(motor.operator))
        if self.step_graph is None or self.graph_reads is None or self.graph_reads[0] != reads[0] \
                or self.graph_reads[1] is not reads[1] or self.graph_reads[2] != reads[2]:
            self.step_graph = StepGraph(step, settings=functools.partial(layer_settings, motor.operator))
            self.graph_reads = reads
        return self.step_graph


def layer_settings(operator) -> tuple:
    """What each of the operator's modules holds that its forward may read (a GroupNorm's eps, an
    ELU's alpha, a convolution's padding, `training`, its parameters and buffers): a capture keeps
    the values it read and the memory its tensors were at, so a change between episodes (a value
    set, a buffer or frozen weight replaced) makes a new one."""
    return tuple(tuple(sorted(((name, _comparable(value, depth=1)) for name, value in _held(module)),
                              key=lambda item: item[0]))
                 for module in operator.modules())


def _held(module):
    """(name, value) of a module's own attributes, parameters and buffers (not its submodules,
    listed on their own; not torch's hook dicts and other private state)."""
    for name, value in vars(module).items():
        if not name.startswith("_"):
            yield name, value
    for kind in ("_parameters", "_buffers"):
        for name, tensor in getattr(module, kind, {}).items():
            yield f"{kind}.{name}", tensor


def _comparable(value, depth: int):
    """`value` as a key that equals another only where the two read the same: numbers of any type
    (NumPy's included) by value, sequences and mappings item by item, a tensor by its identity and
    memory (a replay reads that memory, whatever is written into it), an array by its bytes, any
    other object by its identity and, one level down, its own attributes."""
    if value is None or isinstance(value, (bool, str, bytes, type)):
        return value
    if isinstance(value, numbers.Number):
        return ("number", value.item() if hasattr(value, "item") else value)
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_meta:
            return ("tensor", id(value), value.layout, value.device)
        return ("tensor", id(value), value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, numpy.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_comparable(item, depth) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), _comparable(v, depth)) for k, v in value.items()), key=lambda i: i[0])))
    if isinstance(value, torch.nn.Module) or depth == 0 or not hasattr(value, "__dict__"):
        return ("object", id(value))
    return ("object", id(value), tuple(sorted(((k, _comparable(v, depth - 1)) for k, v in vars(value).items()
                                               if not k.startswith("_")), key=lambda i: i[0])))
