"""The operator's weights in NHWC for enable(channels_last=True), and given their layout back by
disable(): only those it changed, so weights a researcher made NHWC themselves stay so."""

import itertools
from typing import List, Tuple

import torch

# (module, name) of each parameter or buffer whose layout enable() changed
Made = List[Tuple[torch.nn.Module, str]]


def to_channels_last(operator: torch.nn.Module) -> Made:
    """operator.to(memory_format=torch.channels_last); the tensors whose layout it changed."""
    changed = [(module, name) for module in operator.modules()
               for name, t in itertools.chain(module._parameters.items(), module._buffers.items())
               if t is not None and t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last)]
    operator.to(memory_format=torch.channels_last)
    return changed


def layouts_put_back(made: Made) -> None:
    """Each tensor of `made` contiguous again, as Module.to sets a layout: a Parameter keeps its
    object (the optimizer's), a buffer is replaced."""
    with torch.no_grad():
        for module, name in made:
            if module._parameters.get(name) is not None:
                module._parameters[name].data = module._parameters[name].data.contiguous()
            elif module._buffers.get(name) is not None:
                module._buffers[name] = module._buffers[name].contiguous()
