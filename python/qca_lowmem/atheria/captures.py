"""The capture of the episode's step (a StepGraph), kept on the trainer between episodes: made at
its first CUDA episode, made again when a value it read once changes (GAMMA_DECAY, the operator,
a setting of one of its layers), and left aside while the operator has a module hook or runs code
qca_lowmem does not follow (operator_code.py: a replay runs no Python, so no hook, no counter)."""

import functools
import logging
from typing import Any, Callable, Optional

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


_PLAIN = (bool, int, float, complex, str, tuple, type(None))


def layer_settings(operator) -> tuple:
    """The plain values each of the operator's modules holds (a GroupNorm's eps, an ELU's alpha, a
    convolution's padding, `training`), which its forward may read: a capture keeps the ones it
    read, so a change between episodes makes a new one."""
    return tuple(tuple(sorted(((name, value) for name, value in vars(module).items()
                               if not name.startswith("_") and isinstance(value, _PLAIN)), key=lambda item: item[0]))
                 for module in operator.modules())
