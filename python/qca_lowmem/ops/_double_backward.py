"""Second-order gradients of the fused ops.

The fused backward kernels are not differentiable themselves. Under `create_graph=True` (autograd
runs a backward with grad mode on exactly then) an op's backward is instead taken through its
plain-torch reference, so gradient penalties and Hessian-vector products get the true second
derivative; the kernels serve every first-order backward. The ops that are backwards themselves
(and groupnorm_elu_apply) have torch's not-implemented autograd kernel (csrc/ops/library.cpp):
differentiating them raises, naming the op.
"""

from typing import Callable, Sequence

import torch


def second_order_requested() -> bool:
    """True inside a backward that builds a graph (create_graph=True)."""
    return torch.is_grad_enabled()


def reference_backward(ctx, reference: Callable, inputs: Sequence, grad_outputs) -> tuple:
    """The op's input gradients through `reference(*inputs)`, recomputed with grad: a graph again
    under create_graph=True. One entry per input, None where not needed."""
    needed = [i for i, needs in enumerate(ctx.needs_input_grad) if needs]
    grads = [None] * len(ctx.needs_input_grad)
    if not needed:
        return tuple(grads)
    with torch.enable_grad():
        # Fresh aliases, so each gradient is the partial one: an input computed from another
        # (delta from psi in a step) would otherwise carry the path between them.
        inputs = [t.view_as(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        outputs = reference(*inputs)
    found = torch.autograd.grad(outputs, [inputs[i] for i in needed], grad_outputs,
                                create_graph=torch.is_grad_enabled(), allow_unused=True)
    for i, grad in zip(needed, found):
        grads[i] = grad
    return tuple(grads)

