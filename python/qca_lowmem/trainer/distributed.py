"""Data parallelism of the reference trainer: rank, world size and the few collectives it uses
(gradient sum, row gather, broadcast, barrier); a single process when torch.distributed is off."""

import os
from typing import List

import torch

from .errors import UsageError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' (this rank's GPU when CUDA is available, else the CPU) or a device that must exist."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch.cuda.is_available() is False (torch {torch.__version__})")
    return device


class Distributed:
    """Rank, world size and gradient averaging; a single process when torch.distributed is off."""

    def __init__(self, enabled: bool, device: str = "auto"):
        self.enabled = enabled
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        if enabled:
            import torch.distributed as dist

            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise UsageError("--ddp needs torchrun's environment (RANK, WORLD_SIZE, ...): "
                                   "torchrun --nproc_per_node=N -m qca_lowmem train --ddp ...")
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if not dist.is_initialized():
                # The run's device picks the backend: a CPU run on a GPU machine stays on gloo.
                on_cuda = resolve_device(device, self.local_rank).type == "cuda"
                if on_cuda:
                    visible = torch.cuda.device_count()
                    if self.local_rank >= visible:
                        raise UsageError(f"--ddp: local rank {self.local_rank} has no GPU ({visible} visible): "
                                           f"use --nproc_per_node <= {visible}, or --device cpu")
                    torch.cuda.set_device(self.local_rank)
                # Imported before the group exists: its functions bind group.WORLD as default
                # arguments at import, and a later import (check_run's meta-device model pulls it
                # in) would keep the group alive past destroy_process_group, its gloo threads still
                # running into interpreter exit, where they abort the process (std::terminate).
                # Bound to a name of its own: `import torch.distributed.nn` would make torch local here.
                import torch.distributed.nn as distributed_nn  # noqa: F401
                dist.init_process_group("nccl" if on_cuda else "gloo")
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def refuse_other_settings(self, settings: dict) -> None:
        """Every rank's run settings are rank 0's: a seed, grid or episode count of a rank's own
        trained other replicas silently, aborted inside gloo or hung at the last step. Else every
        rank refuses, naming what differs."""
        if not (self.enabled and self.world_size > 1):
            return
        import torch.distributed as dist

        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, settings)
        differ = [f"{name} is {value!r} on rank {rank}, {gathered[0][name]!r} on rank 0"
                  for rank, other in enumerate(gathered[1:], 1) for name, value in other.items() if value != gathered[0][name]]
        if differ:
            raise UsageError(f"--ddp: every rank must run rank 0's settings: {'; '.join(differ)}")

    def all_reduce_(self, tensor, op="sum"):
        if self.enabled and self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def all_gather_rows(self, rows: torch.Tensor) -> List[torch.Tensor]:
        if not (self.enabled and self.world_size > 1):
            return [rows]
        import torch.distributed as dist

        out = [torch.empty_like(rows) for _ in range(self.world_size)]
        dist.all_gather(out, rows)
        return out

    def broadcast_(self, tensor):
        if self.enabled and self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast(tensor, 0)
        return tensor

    def barrier(self):
        if self.enabled and self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self):
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
