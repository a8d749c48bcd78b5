"""What each forward step the probe did not run reads and writes besides its state.

The probe (probe.py) sees the first steps only; a later step may reach a parameter they did not
(a branch on psi's values) or write a tensor they did not (a BatchNorm on that branch). So every
other step of the forward runs under a `StepWatch`: a dispatch mode that sees each op below
autograd, so a step run without grad still shows them. It reports
- the leaves requiring grad the step's ops read: they become inputs of the episode's Function
  like the probe's, so their gradients reach `.grad` only where the caller's backward asks, in
  one accumulation;
- the tensors it writes whose storage no op of the step made (buffers.py then keeps their values
  for the recomputes), with their values before the step's first write. A write is what the op's
  schema declares (`add_`, `copy_`, `out=`), or a batch norm's running statistics in training,
  which its kernels update without declaring;
- the tensors its ops made (weak references), so that one outliving the step is found
  (escapes.py).
No copies but of what is written. A fused block, this package's QCA and noise ops, and the fused
U-Net's `cat` and torch layers run hidden from the watch and tell it what they read and made
(`ran_unseen`), and a weight read through the episode's cached cast is told (`read`): the
watcher's contract, ops/watchers.py, reached through the dispatch-mode stack alone.
"""

import weakref
from typing import Dict, List, Tuple

import torch

from .. import _torch_private as torch_private
from ..ops.watchers import WatchingDispatchMode
from .buffers import kept_by_value, storage_key, whole_storage

_aten = torch.ops.aten
# Ops that update running statistics (arguments 3 and 4) when `training` (argument 5), undeclared.
_BATCH_NORMS = (_aten.native_batch_norm.default, _aten.cudnn_batch_norm.default, _aten.miopen_batch_norm.default)
_schemas: Dict[object, tuple] = {}  # op -> _schema_info(op)


def _schema_info(func) -> Tuple[Tuple[int, ...], Tuple[str, ...], bool]:
    """(positions of the written arguments, names of written keyword-only ones, whether every
    output is freshly made: no return aliases an input)."""
    positions, names = [], []
    for i, arg in enumerate(torch_private.op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            (names if arg.kwarg_only else positions).append(arg.name if arg.kwarg_only else i)
    fresh = all(ret.alias_info is None for ret in torch_private.op_schema(func).returns)
    return tuple(positions), tuple(names), fresh


class StepWatch(WatchingDispatchMode):
    def __init__(self, known_leaves: dict, known_writes: set, inputs: set):
        super().__init__()
        self.known_leaves = known_leaves  # id -> leaf, of the leaves the episode already has
        self.known_writes = known_writes  # the storages (buffers.storage_key) whose values it already keeps
        self.inputs = inputs  # ids of the step's state tensors
        self.fresh = set()  # data pointers of the storages the step's ops made
        self.made: List[weakref.ref] = []  # the tensors they made (escapes.Leftovers)
        self.leaves: List[torch.Tensor] = []
        self.writes: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (its whole storage, its bytes before the step)

    def read(self, tensor) -> None:
        key = id(tensor)
        if key not in self.known_leaves and key not in self.inputs and tensor.requires_grad and tensor.is_leaf \
                and tensor.untyped_storage().data_ptr() not in self.fresh:  # not a leaf the step made itself
            self.known_leaves[key] = tensor
            self.leaves.append(tensor)

    def ran_unseen(self, read, made) -> None:
        """A computation ran hidden from the watch (ops/watchers.py): what it read, what it made;
        it writes nothing it did not make."""
        for tensor in read:
            if tensor.requires_grad:
                self.read(tensor)
        for tensor in made:
            self.fresh.add(tensor.untyped_storage().data_ptr())
            self.made.append(weakref.ref(tensor))

    def _written(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or id(tensor) in self.inputs:
            return
        if self._a_leafs_memory(tensor):
            raise RuntimeError(
                f"rollout: step_fn changed a tensor requiring grad in place (shape {tuple(tensor.shape)}; a parameter "
                "changed under torch.no_grad() or through .data): the recompute in backward would run the step on "
                "another value than its forward did, and plain autograd refuses it too once an op saved it (or, "
                "through .data, computes with the changed value unseen). Change it outside the episode (as an "
                "optimizer step does), or compute a new tensor from it inside the step")
        if not kept_by_value(tensor) or tensor.numel() == 0 or tensor.untyped_storage().data_ptr() in self.fresh \
                or storage_key(tensor) in self.known_writes:
            return
        self.known_writes.add(storage_key(tensor))
        whole = whole_storage(tensor)
        self.writes.append((whole, whole.clone()))

    def _a_leafs_memory(self, tensor) -> bool:
        """Whether a written tensor is a leaf requiring grad the step did not make, or an alias of a
        leaf the episode has (`param.data`)."""
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return False
        if tensor.requires_grad:
            return tensor.is_leaf and tensor.untyped_storage().data_ptr() not in self.fresh
        return any(storage_key(tensor) == storage_key(leaf) for leaf in self.known_leaves.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _schemas.get(func)
        if info is None:
            info = _schemas[func] = _schema_info(func)
        positions, names, fresh = info
        for value in torch_private.argument_tensors(args, kwargs):
            if value.requires_grad:
                self.read(value)
        for i in positions:
            if i < len(args):
                self._written(args[i])
        for name in names:
            self._written(kwargs.get(name))
        if func in _BATCH_NORMS and len(args) > 5 and args[5]:
            self._written(args[3])
            self._written(args[4])
        out = func(*args, **kwargs)
        if fresh:
            for value in torch_private.result_tensors(out):
                if value.device.type != "meta":
                    self.fresh.add(value.untyped_storage().data_ptr())
                    self.made.append(weakref.ref(value))
        return out
