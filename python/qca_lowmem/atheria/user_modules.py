"""Helpers on the users' torch modules that the switch, its probes and its episode share: the
module a torch.compile'd operator wraps, and the bindings of a module's buffers (which their
spiking neurons rebind in a call)."""

import torch


def compiled_module(operator):
    """The module a torch.compile'd operator wraps (its forward takes *args), else the operator."""
    return getattr(operator, "_orig_mod", operator)


def buffer_bindings(root: torch.nn.Module):
    """(module, name, tensor) of every buffer under root."""
    return [(module, name, buffer) for module in root.modules() for name, buffer in module.named_buffers(recurse=False)]


def rebind(bindings) -> None:
    """Bind each buffer back to its tensor where a call rebound it (`self.mem = ...`, as snntorch's
    neurons keep their membrane): no op shows such a write, so neither the rollout's watch nor a
    copy of the buffers' values puts it back."""
    for module, name, buffer in bindings:
        if getattr(module, name) is not buffer:
            setattr(module, name, buffer)
