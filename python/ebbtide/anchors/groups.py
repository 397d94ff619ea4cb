"""Process groups as a plain torch user frees NCCL's memory between phases: ``destroy_process_group``, then
``init_process_group`` again on a kept rendezvous store (a fresh key prefix per generation) and a barrier."""
from __future__ import annotations

from datetime import timedelta

__all__ = ["DestroyRecreate"]


class DestroyRecreate:
    """WORLD over NCCL on ``device``, made at construction; ``release()`` destroys it, ``reload()`` makes it again
    and waits for every rank (the first collective after a reload pays no connect in the timed phase that follows).
    ``store``: a client of the ranks' store, kept across generations."""

    def __init__(self, store, rank: int, world: int, device, *, timeout: timedelta = timedelta(minutes=10)):
        import torch.distributed as dist

        self.dist, self.store, self.timeout = dist, store, timeout
        self.rank, self.world, self.device = rank, world, device
        self.generation = 0
        self._init()

    def _init(self) -> None:
        self.dist.init_process_group("nccl", store=self.dist.PrefixStore(f"gen{self.generation}", self.store),
                                     rank=self.rank, world_size=self.world, device_id=self.device,
                                     timeout=self.timeout)

    def all_reduce(self, t) -> None:
        self.dist.all_reduce(t)

    def release(self) -> dict:
        self.dist.destroy_process_group()
        return {}

    def reload(self) -> dict:
        self.generation += 1
        self._init()
        self.dist.barrier(device_ids=[self.device.index])
        return {}

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
