"""Every private torch API qca_lowmem calls, in one place. Each is checked against torch 2.13 (the
CPU build) and 2.14.1 (the CUDA 13 build, CI's second part) by tests/project/test_torch_private.py,
which fails naming any this torch lacks (`missing()`), so a torch that drops one fails loudly there
instead of answering wrongly elsewhere; all but `op_schema` also ran on torch 2.11 on an H200.

Private attributes of torch's own objects (`node._sequence_nr()`, `tensor._backward_hooks`,
`module._forward_hooks`, ...) are read here too, for the same reason.
"""

import contextlib
from typing import List, Optional

import torch
from torch import Tensor  # (a global: the op walk below reads it per value, faster than torch.Tensor)

# Dispatch modes (the base class of every mode that sees ops below autograd): a private module
# path, public in all but name since torch 2.0.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (re-exported)

# (owner, attribute): what must exist; the CUDA ones only on a CUDA build.
REQUIRED = [
    ("torch._C", "_AutoDispatchBelowAutograd"),
    ("torch._C", "_len_torch_dispatch_stack"),
    ("torch._C", "_get_dispatch_stack_at"),
    ("torch._C", "_DisableTorchDispatch"),
    ("torch._C", "_len_torch_function_stack"),
    ("torch._C", "_get_function_stack_at"),
    ("torch.nn.modules.module", "_has_any_global_hook"),
    ("torch.nn.modules.module", "_global_forward_hooks"),
    ("torch.nn.modules.module", "_global_forward_pre_hooks"),
    ("torch._C", "_are_functorch_transforms_active"),
    ("torch.autograd.forward_ad", "_current_level"),
    ("torch._C", "_dispatch_has_kernel_for_dispatch_key"),
    ("torch._C._functorch", "is_functorch_wrapped_tensor"),
    ("torch._C._autograd", "_get_current_graph_task_keep_graph"),
    ("torch._C", "_current_graph_task_id"),
    ("torch._C._autograd", "_top_saved_tensors_default_hooks"),
    ("torch.nn.utils.stateless", "_reparametrize_module"),
    ("torch._C._nn", "elu"),
]
REQUIRED_WITH_CUDA = [("torch._C", "_cuda_endAllocateToPool")]
# The autograd node of a dtype cast (`tensor.to(dtype)`), by its class name.
TO_COPY_NODE = "ToCopyBackward0"
# The module whose functions torch.nn.functional's call, looked up at each call (`elu`).
NN_KERNELS = torch._C._nn


def sparse_parts(tensor: torch.Tensor) -> tuple:
    """The strided tensors holding a sparse tensor's data (its indices and values), uncoalesced too."""
    if tensor.layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    return tensor.ccol_indices(), tensor.row_indices(), tensor.values()


def sequence_nr(node) -> int:
    """An autograd node's creation order within its thread (nodes made later have larger ones)."""
    return node._sequence_nr()


def is_dtype_cast(node) -> bool:
    return node.name() == TO_COPY_NODE


def backward_hooks(tensor: torch.Tensor) -> dict:
    """The tensor's hook dict (`register_hook`'s), made where it has none yet, so that hooks can
    be set aside and put back in their order."""
    if tensor._backward_hooks is None:
        tensor.register_hook(lambda grad: grad).remove()  # creates the dict, as register_hook does
    return tensor._backward_hooks


def has_hooks(tensor: torch.Tensor) -> bool:
    return bool(tensor._backward_hooks)


def gradient_hook_count(tensor: torch.Tensor) -> int:
    """The hooks on the tensor's gradient: `register_hook`'s and `register_post_accumulate_grad_hook`'s."""
    return len(tensor._backward_hooks or ()) + len(getattr(tensor, "_post_accumulate_grad_hooks", None) or ())


def global_module_hooks() -> bool:
    """Whether hooks registered for every module (`register_module_forward_hook`, ...) exist."""
    return bool(torch.nn.modules.module._has_any_global_hook())


# The hooks a module's call runs: its own dicts, and the ones every module's call reads.
_CALL_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_CALL_HOOKS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
                      "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")


def forward_hooks(modules) -> list:
    """The forward and forward-pre hooks calls of `modules` run: the global ones and each module's
    own (the `_with_kwargs` and `_always_called` dicts hold flags for the same hooks)."""
    module_globals = vars(torch.nn.modules.module)
    found = [hook for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
             for hook in module_globals[name].values()]
    return found + [hook for module in modules for name in ("_forward_hooks", "_forward_pre_hooks")
                    for hook in getattr(module, name, {}).values()]


def backward_run_hooks(modules) -> list:
    """The hooks a backward through calls of `modules` runs: the global and each module's own
    backward and backward-pre hooks, and the hooks on its parameters (`register_hook`,
    `register_post_accumulate_grad_hook`)."""
    module_globals = vars(torch.nn.modules.module)
    found = [hook for name in ("_global_backward_hooks", "_global_backward_pre_hooks")
             for hook in module_globals.get(name, {}).values()]
    found += [hook for module in modules for name in ("_backward_hooks", "_backward_pre_hooks")
              for hook in (getattr(module, name, None) or {}).values()]
    return found + [hook for module in modules for p in module.__dict__["_parameters"].values() if p is not None
                    for hooks in (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None)) if hooks
                    for hook in hooks.values()]


@contextlib.contextmanager
def module_hooks_set_aside(root: torch.nn.Module):
    """Calls of root and its layers run no module hook (theirs or global ones), each put back
    after, in its order, under the same handles."""
    module_globals = vars(torch.nn.modules.module)
    dicts = [module_globals[name] for name in _GLOBAL_CALL_HOOKS if name in module_globals]
    dicts += [hooks for module in root.modules() for name in _CALL_HOOKS
              if isinstance(hooks := getattr(module, name, None), dict)]
    saved = [(hooks, dict(hooks)) for hooks in dicts if hooks]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


def module_has_hooks(module: torch.nn.Module) -> bool:
    """Hooks registered on the module itself (forward, forward-pre, backward, backward-pre)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def any_call_hooked(modules, with_submodules: bool) -> bool:
    """Whether a hook of its own (module_has_hooks) or a `forward` set on the instance is on any of
    `modules` (None entries skipped) or, `with_submodules`, on any module inside them. Asked at
    every call of a fused block or U-Net: one read of each module's __dict__, no call a module."""
    pending = list(modules)
    for module in pending:  # grows while walked: the submodules, in turn
        if module is None:  # a submodule slot registered empty
            continue
        d = module.__dict__
        if (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d.get("_backward_pre_hooks")
                or "forward" in d):
            return True
        if with_submodules:
            pending.extend(d["_modules"].values())
    return False


def op_schema(func):
    """An OpOverload's schema (its arguments and returns, with their alias information)."""
    return func._schema


def below_autograd():
    """A context in which calls dispatch below the Autograd key (a custom Function's body)."""
    return torch._C._AutoDispatchBelowAutograd()


def argument_tensors(args, kwargs) -> List[torch.Tensor]:
    """The tensors among an op's arguments, as a dispatch mode receives them: each a Tensor or
    Tensor? argument, or in a Tensor[] or Tensor?[] one (op schemas nest no deeper). The walk of
    every mode here, at the cost of the inline loops it replaced: torch's pytree (tree_leaves)
    finds the same at several times the cost per op."""
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, Tensor)]
    return found


def result_tensors(out) -> List[torch.Tensor]:
    """The tensors an op returned: a Tensor, or in a tuple or list of Tensors and Tensor[]s (none
    where it returned a number or nothing)."""
    if isinstance(out, Tensor):
        return [out]
    return argument_tensors(out, None) if isinstance(out, (tuple, list)) else []


def dispatch_modes() -> list:
    """The dispatch modes active in this thread, outermost first ([] without any)."""
    count = torch._C._len_torch_dispatch_stack()
    return [torch._C._get_dispatch_stack_at(i) for i in range(count)] if count else []


def function_modes() -> list:
    """The torch function modes active in this thread, outermost first ([] without any)."""
    count = torch._C._len_torch_function_stack()
    return [torch._C._get_function_stack_at(i) for i in range(count)] if count else []


def dispatch_disabled():
    """A context in which no dispatch mode or tensor subclass sees the ops run."""
    return torch._C._DisableTorchDispatch()


def functorch_transforms_active() -> bool:
    return torch._C._are_functorch_transforms_active()


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (torch.autograd.forward_ad.dual_level), where tensors
    may carry tangents that qca_lowmem's ops have no rule for."""
    return torch.autograd.forward_ad._current_level >= 0


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def backward_keeps_graph() -> bool:
    """Inside a backward: whether it was asked to keep the graph (retain_graph=True)."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def saved_tensors_pack_hook():
    """The pack hook of the innermost `torch.autograd.graph.saved_tensors_hooks` active in this
    thread (the one autograd applies to what it saves), or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if hooks is None else hooks[0]


def parameters_swapped(module: torch.nn.Module, tensors: dict):
    """A context in which `module`'s parameters named in `tensors` are those tensors (what
    torch.func.functional_call does around its call)."""
    return torch.nn.utils.stateless._reparametrize_module(module, tensors)


def in_backward() -> bool:
    """Whether this thread is running a backward (its graph task)."""
    return torch._C._current_graph_task_id() != -1


def has_kernel_for(op: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


def end_allocate_to_pool(device_index: int, pool) -> None:
    """Stop routing this thread's allocations on the device to a graph pool (what a CUDA graph's
    capture_end does, needed where ending a failed capture raised before it got there)."""
    torch._C._cuda_endAllocateToPool(device_index, pool)


def missing(with_cuda: Optional[bool] = None) -> List[str]:
    """The private APIs this torch lacks, by dotted name."""
    with_cuda = torch.version.cuda is not None if with_cuda is None else with_cuda
    absent = []
    for owner, name in REQUIRED + (REQUIRED_WITH_CUDA if with_cuda else []):
        target = torch
        for part in owner.split(".")[1:]:
            target = getattr(target, part, None)
        if not hasattr(target, name):
            absent.append(f"{owner}.{name}")
    return absent
