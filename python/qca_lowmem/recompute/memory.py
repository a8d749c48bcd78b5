"""Memory in bytes, counted in one place for the rollout's "auto" schedule, `qca-lowmem plan` and
the OOM guard, so they agree: what an autograd graph keeps for backward (a device-independent
measure), one step's full graph, a state, the model state, and byte sizes written for people and
read from them."""

import contextlib
import weakref
from typing import Callable, List, Optional

import torch

from .intermediates import keep_block_intermediates
from .policy import Policy
from .sizes import format_bytes, parse_bytes, size_text  # noqa: F401 (the units of every figure here)
from .state import State, signature

# Allocator rounding, fragmentation and library workspaces: what `qca-lowmem plan` adds to a
# predicted peak, and what budget="free" leaves unused.
SAFETY = 1.10
# fp32 weights (4 B), gradients (4 B) and AdamW's two moments (8 B) per parameter: a floor no
# policy removes.
MODEL_STATE_BYTES_PER_PARAMETER = 16
# psi-sized tensors the stock loss keeps besides the rollout's states (psi_T, |psi_T|, psi0
# terms); measured with saved_bytes: 2.3 psi at grid 8, 2.0 psi at grid 64.
LOSS_STATES = 3

_step_graph_bytes = weakref.WeakKeyDictionary()  # step_fn -> {configuration: bytes}


def saved_bytes(fn, *args, **kwargs) -> int:
    """Run `fn(*args, **kwargs)` and return the unique bytes its autograd graph saves for backward.

    Every tensor saved for backward (by autograd, custom Functions or `save_for_backward`) is
    counted by its storage, once however many views of it are saved; nn.Parameters are excluded,
    since they live whether or not a graph exists.
    """
    return sum(saved_storage_sizes(fn, *args, **kwargs))


def saved_storage_sizes(fn, *args, **kwargs) -> List[int]:
    """Run `fn(*args, **kwargs)` and return the size in bytes of each distinct storage its autograd
    graph saves for backward (parameters excluded), as `saved_bytes` counts them.

    Storages are held until `fn` returns so that a freed address reused by a later allocation
    cannot be mistaken for the same storage.
    """
    storages = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                storages[(tensor.device, storage.data_ptr())] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args, **kwargs)
    return [storage.nbytes() for storage in storages.values()]


@contextlib.contextmanager
def counted_and_dropped(sizes: Optional[list]):
    """Tensors saved for backward inside are dropped (the graph is only walked, never
    differentiated); with `sizes`, the bytes of their storages, each counted once as saved_bytes
    counts them, are appended to it on exit (the storages live until then)."""
    storages = {}

    def pack(tensor):
        if sizes is not None and not isinstance(tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        yield
    if sizes is not None:
        sizes.append(sum(storage.nbytes() for storage in storages.values()))


def kept_bytes(policy: Policy, steps: int, state_bytes: int, step_bytes: Optional[int] = None) -> int:
    """What a recomputing episode of `steps` steps keeps across them, and the loss's states: the
    policy's states, or with a budget in bytes what it allows, never more than every step's full
    graph when `step_bytes` (one step's, with its output state) is known."""
    kept = policy.kept_states(steps) * state_bytes
    if policy.byte_budget is not None:
        kept = max(kept, policy.byte_budget)
        if step_bytes is not None:
            kept = min(kept, steps * max(step_bytes, state_bytes))
    return kept + LOSS_STATES * state_bytes


def model_state_bytes(parameters: int) -> int:
    return MODEL_STATE_BYTES_PER_PARAMETER * parameters


def psi_bytes(batch: int, grid: int, d_state: int) -> int:
    """One complex64 state of this batch and square grid."""
    return batch * grid * grid * d_state * 8


def free_bytes(device: torch.device) -> int:
    """What new tensors on this CUDA device can still get: the device's free memory, within this
    process's cap (set_per_process_memory_fraction: the small-GPU emulation on a large card), plus
    what the caching allocator holds reserved but unused outside private pools (a captured
    graph's pool keeps its free blocks for the graph's replays)."""
    device = torch.device(device)
    if device.index is None:  # the per-process fraction is asked for by index
        device = torch.device("cuda", torch.cuda.current_device())
    device_free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cap = torch.cuda.get_per_process_memory_fraction(device) * total
    unused = reserved - torch.cuda.memory_allocated(device) - private_pool_free_bytes(device)
    return max(0, int(min(device_free, cap - reserved))) + max(0, unused)


def private_pool_free_bytes(device: torch.device) -> int:
    """Reserved bytes of private pools (CUDA graphs') on this device that no tensor holds: the
    pool keeps them for its graphs, so other allocations cannot get them."""
    return sum(segment["total_size"] - segment["active_size"] for segment in torch.cuda.memory_snapshot()
               if segment.get("device") == device.index and tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))


def free_budget(device: torch.device, step_bytes: int) -> int:
    """budget="free": the device's free memory after plan's margin and one step's working set."""
    return max(0, int(free_bytes(device) / SAFETY) - step_bytes)


def step_graph_bytes(step_fn: Callable, psi: torch.Tensor, carry: Optional[tuple] = None):
    """(bytes one step's full graph keeps (blocks keeping their intermediates) plus its output
    state, bytes of that state); measured once per step_fn, psi and carry type and autocast state.
    A carry not made yet (None entries) is measured as the first step leaves it."""
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in sorted({"cpu", psi.device.type}))
    key = (signature(psi), None if carry is None else tuple(map(signature, carry)), autocast)
    try:
        known = _step_graph_bytes.setdefault(step_fn, {})
    except TypeError:  # not weakly referenceable: measured every time
        known = {}
    if key not in known:
        with torch.enable_grad(), keep_block_intermediates():
            if carry is None:
                known[key] = saved_bytes(step_fn, psi.detach().requires_grad_(True)) + psi.nbytes, psi.nbytes
            else:
                if any(c is None for c in carry):
                    with torch.no_grad():
                        carry = step_fn(psi, carry)[1]
                probe = State(psi, tuple(carry)).as_inputs(True)
                known[key] = saved_bytes(step_fn, *probe) + probe.nbytes(), probe.nbytes()
    return known[key]
