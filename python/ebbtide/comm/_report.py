"""Reports returned by release() and reload(), and the device-memory probe they use."""
from __future__ import annotations

import dataclasses

__all__ = ["GroupReport", "Report", "device_free_bytes"]


def device_free_bytes() -> int | None:
    """Free bytes on the current CUDA device (``cudaMemGetInfo``; counts NCCL's own allocations, which the caching
    allocator never sees). None without CUDA or before CUDA is initialised (probing must not create a context)."""
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    except Exception:  # a probe never fails the operation it measures
        return None


@dataclasses.dataclass
class GroupReport:
    """One group's part of a release or reload."""

    name: str
    desc: str
    ranks: list[int]  # global ranks
    strategy: str  # "destroy" (kept groups are not released, so not reported)
    reason: str  # why that strategy
    seconds: float  # time this rank spent on the group
    bytes: int | None  # device bytes freed (release) or taken back (reload); None where not measurable
    connected: bool = False  # reload: the communicator was created eagerly


@dataclasses.dataclass
class Report:
    """What release() or reload() did on this rank. ``noop`` is True for a repeated call (nothing happened)."""

    action: str  # "release" or "reload"
    noop: bool
    generation: int  # reload count so far (0 before the first reload)
    seconds: float  # wall time of the whole call on this rank, barriers included
    barrier_seconds: float  # time spent waiting on the CPU control plane
    free_before: int | None  # device free bytes before / after (cudaMemGetInfo)
    free_after: int | None
    groups: list[GroupReport] = dataclasses.field(default_factory=list)
    reload: "Report | None" = None  # set by the released() context manager on exit
    warmup_seconds: float = 0.0  # reload: the concurrent transport warm-up of the rebuilt groups (part of seconds)

    @property
    def bytes_freed(self) -> int | None:
        """Device bytes released (release) or, negative, taken back (reload); None without a CUDA device."""
        if self.free_before is None or self.free_after is None:
            return None
        return self.free_after - self.free_before

    def by_strategy(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.strategy] = out.get(g.strategy, 0) + 1
        return out

    def summary(self) -> str:
        if self.noop:
            return f"ebbtide.comm {self.action}: no-op (already {'released' if self.action == 'release' else 'live'})"
        mem = "" if self.bytes_freed is None else f", device free {self.bytes_freed / 2**20:+.0f} MiB"
        warm = f", warm-up {self.warmup_seconds * 1e3:.1f} ms" if self.warmup_seconds else ""
        return (f"ebbtide.comm {self.action}: {len(self.groups)} groups {self.by_strategy()} in "
                f"{self.seconds * 1e3:.1f} ms (barriers {self.barrier_seconds * 1e3:.1f} ms{warm}){mem}, "
                f"generation {self.generation}")
