"""Whether a module call is just its class's forward, on which every shortcut past a stock layer
rests: a fused block standing in for a ConvBlock, the fused U-Net's wiring, a torch layer run
hidden from an episode's watch (watchers.py); and whether the caller's context (a mode of theirs, a
saved-tensors hook), a torch.func transform and torch.jit tracing let a fused path stand for the
stock ops (`foreign_context`, `stands_for_stock`)."""

import contextlib
import inspect
import threading
import types
from typing import Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import _torch_private as torch_private
from .. import stock

# The torch methods and functions that a stock U-Net's layers run; a fused path computes what they
# compute, so it stands in for them only while each is still the one torch defined.
_STOCK_METHODS = tuple((owner, name, getattr(owner, name)) for owner, name in (
    (nn.Module, "__call__"), (nn.Module, "_call_impl"), (nn.Sequential, "forward"), (nn.Conv2d, "forward"),
    (nn.Conv2d, "_conv_forward"), (nn.ConvTranspose2d, "forward"), (nn.MaxPool2d, "forward"),
    (nn.GroupNorm, "forward"), (nn.ELU, "forward"), (F, "conv2d"), (F, "conv_transpose2d"), (F, "max_pool2d"),
    (F, "group_norm"), (F, "elu"),
    # What those functions look up at each call.
    (torch, "group_norm"), (torch, "max_pool2d"), (torch_private.NN_KERNELS, "elu")))
# Replaced before this module was imported (a wrapper, a function of another module): never stood in for.
_STOCK_AT_IMPORT = all(getattr(fn, "__module__", "").startswith("torch") and not hasattr(fn, "__wrapped__")
                       for _, _, fn in _STOCK_METHODS)
# The torch layers of the stock U-Net besides its ConvBlocks.
_TORCH_LAYERS = (nn.MaxPool2d, nn.Conv2d, nn.ConvTranspose2d)


# The torch functions and Tensor methods the QCA step runs (the users' CartesianEngine._evolve_logic,
# stock.pack and update): the fused step stands in for them only while each is still torch's own.
_STEP_METHODS = tuple((owner, name, getattr(owner, name)) for owner, name in (
    *((torch, name) for name in ("cat", "chunk", "complex", "sqrt", "sum", "abs")),
    *((torch.Tensor, name) for name in ("real", "imag", "permute", "abs", "pow", "__pow__", "__mul__", "__rmul__",
                                        "__add__", "__radd__", "__sub__", "__neg__", "__truediv__", "__getitem__",
                                        "clone", "to", "detach"))))


def step_function_replaced() -> Optional[str]:
    """The first torch function or Tensor method the QCA step runs that was replaced since import
    (`torch.complex = ...`), named; else None."""
    return next((f"{'Tensor' if owner is torch.Tensor else 'torch'}.{name}"
                 for owner, name, fn in _STEP_METHODS if getattr(owner, name) is not fn), None)


def torch_layers_unchanged() -> bool:
    """Whether the torch methods a stock U-Net layer runs are still torch's own (none replaced on
    its class or in torch.nn.functional since import)."""
    return _STOCK_AT_IMPORT and all(getattr(owner, name) is fn for owner, name, fn in _STOCK_METHODS)


def calls_are_forwards(modules: Iterable[nn.Module], *, with_submodules: bool = False) -> bool:
    """Whether calling each of `modules` (and, `with_submodules`, each module inside them) runs
    just its class's forward, now: no hook registered for every module (forward, forward-pre,
    backward, backward-pre, full backward), none on the module itself, and no `forward` set on
    the instance. A shortcut past such calls (a fused block, a layer run hidden) holds only while
    this does, so it is asked at every call: about 0.2 us a module on a CPU."""
    return not (torch_private.global_module_hooks() or torch_private.any_call_hooked(modules, with_submodules))


def foreign_context() -> Optional[str]:
    """What of the caller's would see other ops or saved tensors under a fused path than under the
    stock ops it stands for, named: a torch function or dispatch mode of theirs (foreign_mode), or
    a saved-tensors pack hook of theirs (`torch.autograd.graph.saved_tensors_hooks`, which may
    change what autograd saves: a cast, a compression; asked with grad off too, so that a step
    entering one takes the same path in a no-grad forward and in its recompute); else None.
    torch's own modes and hooks keep values (a default device, FLOP counting, fake tensors,
    save_on_cpu, checkpoint), as qca_lowmem's do and those marked by keeps_values."""
    mode = foreign_mode()
    if mode is not None:
        return mode
    pack = None if torch.compiler.is_compiling() else torch_private.saved_tensors_pack_hook()
    if pack is not None and not _keeps_values(pack):
        return f"saved-tensors hook {_name(pack)} (torch.autograd.graph.saved_tensors_hooks)"
    return None


def foreign_mode() -> Optional[str]:
    """A torch function or dispatch mode of the caller's, named (it sees each op run and may
    change its values: a perturbation, a simulated quantization), else None."""
    if torch.compiler.is_compiling():  # the compiled graph's ops are the compiler's
        return None
    for kind, modes in (("function", torch_private.function_modes()), ("dispatch", torch_private.dispatch_modes())):
        for mode in modes:
            if not _keeps_values(type(mode)):
                return f"torch {kind} mode {_name(type(mode))}"
    return None


def refuse_foreign_mode_in_backward(who: str, what: str) -> None:
    """A backward of a fused path under a mode of the caller's, which would see (and might change)
    `what`, ops stock's backward does not run, is refused naming it. Where the mode is entered
    around the forward too, the fused paths step aside for it there, and stock's layers run."""
    mode = foreign_mode()
    if mode is not None:
        raise RuntimeError(f"{who}: its backward runs under the {mode}, which would see {what}, ops stock's "
                           "backward does not run, and might change their values: enter it around the forward "
                           "too (qca_lowmem's fused paths then run the stock layers), or mark its class "
                           "@qca_lowmem.keeps_values if it changes no value (an op counter)")


def _unchanged(tensor):
    return tensor


@contextlib.contextmanager
def recomputes_unhooked():
    """Around a backward that recomputes (a rollout's): a pack hook of the caller's active on entry
    does not see what the recomputes save, as stock's backward saves nothing through it (an
    identity hook stands over it); what a recomputed step enters itself applies, as in its forward."""
    pack = torch_private.saved_tensors_pack_hook()
    if pack is None or _keeps_values(pack):
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_unchanged, _unchanged):
        yield


_KEEPS_VALUES = "qca_lowmem_keeps_values"


def keeps_values(obj):
    """Mark a mode class or saved-tensors hook of yours (a counter, a profiler, a memory measure)
    as one that hands every value on unchanged: qca_lowmem's fused paths and recomputing episodes
    then run under it as under torch's own. Your word: under one that changes values their results
    would differ from stock's. Returns `obj` (a decorator); a bound method marks its function."""
    try:
        setattr(getattr(obj, "__func__", obj), _KEEPS_VALUES, True)
    except (AttributeError, TypeError):
        raise TypeError(f"qca_lowmem.keeps_values: cannot mark {obj!r} (a {type(obj).__name__}): give the mode's "
                        "class or the hook's function") from None
    return obj


def _keeps_values(obj) -> bool:
    """Marked by keeps_values, or defined by torch or by qca_lowmem (a class: or deriving from one
    of qca_lowmem's, as a watcher does)."""
    if getattr(obj, _KEEPS_VALUES, False) is True:
        return True
    owners = obj.__mro__ if isinstance(obj, type) else (obj,)
    return (getattr(obj, "__module__", None) or "").partition(".")[0] == "torch" or any(
        (getattr(owner, "__module__", None) or "").partition(".")[0] == "qca_lowmem" for owner in owners)


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def stands_for_stock() -> bool:
    """Whether the caller's context lets a fused path stand for the stock ops: foreign_context()
    finds nothing (one read of each mode stack and of the innermost pack hook), and neither a
    torch.func transform (vmap, grad, jvp, jacrev, ...) nor a forward-mode AD level
    (torch.autograd.forward_ad), which have no rule for qca_lowmem's ops, nor torch.jit tracing
    (and the ONNX export built on it), which would record them, runs: under any, the fused block
    and U-Net and the switch's step run the stock layers, as stock would."""
    if torch.compiler.is_compiling():  # the compiled graph's ops are the compiler's (foreign_context's reads too)
        return True
    return not (torch_private.functorch_transforms_active() or torch_private.forward_ad_active()
                or torch.jit.is_tracing()) and foreign_context() is None


class _Checked(threading.local):
    by_caller = False


_checked = _Checked()


@contextlib.contextmanager
def calls_checked_by_caller():
    """Inside, the modules called are the ones the caller has just found plain
    (`torch_layers_unchanged()`, `calls_are_forwards` over all of them, `stands_for_stock()`) and
    nothing of the user's runs between that check and their calls (the fused U-Net's own wiring),
    or a recompute of such calls, which must take their forward's path (the U-Net's checkpoint);
    so they need not check again: `calls_plain` and `fused_call_stands_for` say so. Not under
    torch.compile, which traces the checks."""
    outer = _checked.by_caller
    _checked.by_caller = True
    try:
        yield
    finally:
        _checked.by_caller = outer


def calls_plain(modules: Iterable[nn.Module]) -> bool:
    """`torch_layers_unchanged()` and `calls_are_forwards(modules)`, or True at once inside
    `calls_checked_by_caller()`: about 5 us a fused block's call, 2 us a layer's, that the fused
    U-Net's calls of its blocks and layers spare."""
    return _checked.by_caller or (torch_layers_unchanged() and calls_are_forwards(modules))


def fused_call_stands_for(modules: Iterable[nn.Module]) -> bool:
    """`calls_plain(modules)` and `stands_for_stock()`, or True at once inside
    `calls_checked_by_caller()`, whose caller checked both: what a fused block asks."""
    return calls_plain(modules) and (_checked.by_caller or stands_for_stock())


def plain_torch_layer(layer: nn.Module) -> bool:
    """A stock U-Net's torch layer (MaxPool2d, Conv2d, ConvTranspose2d) whose call now is just
    torch's forward: it reads its input and parameters and writes only its output."""
    return type(layer) in _TORCH_LAYERS and calls_plain((layer,))


def _code_of(function) -> Optional[tuple]:
    """What a plain function runs, its local names, line numbers and docstring left out: bytecode
    and exception table, constants, the attribute and global names it reads, its argument counts
    and flags (CO_NESTED aside: where it was defined). None for anything else: a wrapper, a
    closure, a function with defaults, a callable object."""
    if type(function) is not types.FunctionType or hasattr(function, "__wrapped__") or function.__closure__ \
            or function.__defaults__ or function.__kwdefaults__:
        return None
    code = function.__code__
    consts = code.co_consts
    if consts and isinstance(consts[0], str) and consts[0] == function.__doc__:
        consts = (None,) + consts[1:]
    return (code.co_code, code.co_exceptiontable, consts, code.co_names, code.co_argcount, code.co_posonlyargcount,
            code.co_kwonlyargcount, code.co_flags & ~inspect.CO_NESTED, len(code.co_varnames), code.co_freevars,
            code.co_cellvars)


def same_code(function, reference) -> bool:
    """Whether `function` runs what `reference` runs, whatever its local names (both plain functions)."""
    code = _code_of(function)
    return code is not None and code == _code_of(reference)


# What a call of a module runs besides its forward: torch's call path, and the attribute lookups
# its forward makes.
_CALL_PATH = ("__call__", "_call_impl", "__getattr__", "__getattribute__")


def stock_forward_call(cls: type, reference, attributes: Tuple[str, ...], what: str) -> Optional[str]:
    """None when calling an instance of `cls` runs the code of `reference` (a stock forward): the
    forward its class resolves to has that code (checked on the running Python, not by its name),
    torch's call path is not overridden and no class defines any of `attributes` (the forward then
    reaches the submodules of those names); else why not, `what` saying what the forward should
    be. What else the class defines never runs in a call."""
    forward = inspect.getattr_static(cls, "forward", None)
    if not same_code(forward, reference):
        return f"its forward ({cls.__qualname__}.forward) is not {what}"
    for name in _CALL_PATH:
        if inspect.getattr_static(cls, name) is not inspect.getattr_static(nn.Module, name):
            return f"{cls.__qualname__} defines its own {name}"
    for attribute in attributes:
        owner = next((owner for owner in cls.__mro__ if attribute in vars(owner)), None)
        if owner is not None:
            return f"{owner.__qualname__} defines {attribute} on its class"
    return None


def stock_block_call(cls: type) -> Optional[str]:
    """None when calling an instance of `cls` runs just `self.conv_block(x)`, as stock's ConvBlock
    (`stock_forward_call`), else why not. A fused block stands in for such a module only."""
    return stock_forward_call(cls, stock.ConvBlock.forward, ("conv_block",),
                              "`return self.conv_block(x)`, which a fused block computes")
