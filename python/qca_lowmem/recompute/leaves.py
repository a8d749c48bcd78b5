"""Which leaves (parameters) a step reaches: its graph walked from its outputs to the leaves,
refusing a tensor that requires grad but was computed before the step."""

from typing import List, Optional

import torch

from .. import _torch_private as torch_private


def next_sequence_nr() -> int:
    """Autograd nodes created from now on in this thread have a sequence number >= this."""
    with torch.enable_grad():
        node = torch.zeros((), requires_grad=True).view(()).grad_fn
    return torch_private.sequence_nr(node) + 1


def leaves_reached(outputs, inputs: set, marker: int, node_names: Optional[dict] = None) -> List[torch.Tensor]:
    """The leaf tensors requiring grad that the graphs of `outputs` reach, other than the
    tensors whose ids are in `inputs`; `node_names` collects the nodes walked, a node by its name."""
    leaves, seen_leaves, visited = [], set(), set()
    stack = [out.grad_fn for out in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if node_names is not None:
            node_names.setdefault(node.name(), node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the edge into a leaf
        if variable is not None:
            if id(variable) not in inputs and id(variable) not in seen_leaves:
                seen_leaves.add(id(variable))
                leaves.append(variable)
            continue
        if torch_private.sequence_nr(node) < marker and not _cast_of_a_leaf(node):
            raise RuntimeError(
                "rollout: step_fn uses a tensor that requires grad but was computed outside "
                f"step_fn (its autograd node {node.name()} predates the step). Only leaf tensors "
                "(parameters) can be reached through the closure, since the recompute runs after "
                "the rest of the graph may be freed: compute that tensor inside step_fn, or detach it."
            )
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _cast_of_a_leaf(node) -> bool:
    """A dtype cast of a parameter made before the step: autocast's cache hands a step the cast an
    earlier op in the same autocast block made (a model call, the rollout before). Its node keeps
    nothing for backward, and a recompute, under its own autocast, casts afresh."""
    return torch_private.is_dtype_cast(node) and all(
        next_node is not None and hasattr(next_node, "variable") for next_node, _ in node.next_functions)
