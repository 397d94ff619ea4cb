"""What host memory and disk the memory engine holds now (``host_memory()``), and the controls of where CPU and disk
backups live: host retention (``set_host_retention``) and the disk-backup directory (``set_disk_backup_dir``)."""
from __future__ import annotations

import dataclasses
import os

from ..errors import InvalidArgumentError
from ._common import mem as _mem

__all__ = ["HostMemory", "host_memory", "set_host_retention", "host_retention", "set_disk_backup_dir",
           "disk_backup_dir"]

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """Host memory held by the engine (bytes) and its disk backups.

    - ``arena_reserved`` / ``arena_used``: the persistent pinned arena (``region(..., backup="cpu")``'s default
      ``host="arena"``: kept while the tensors are active, so warm cycles copy only; also the disk tier's staging and
      reclaim staging). ``release_host_memory()`` gives back what holds no paused content.
    - ``transient_*``: transient host copies (``host="transient"``/``"pageable"``, torch_memory_saver's semantics):
      how many are held, their resident bytes, how many of those are pinned, and how many bytes active tensors
      hold because host retention is on.
    - ``disk_files`` / ``disk_bytes``: disk backups on disk now; ``disk_staging``: the pinned staging the disk tier
      keeps (inside ``arena_reserved``); ``disk_direct``: the last disk op used direct I/O.
    """

    arena_reserved: int
    arena_used: int
    transient_copies: int
    transient_mapped: int
    transient_pinned: int
    transient_retained: int
    host_retention: bool
    disk_files: int
    disk_bytes: int
    disk_staging: int
    disk_direct: bool

    @property
    def held(self) -> int:
        """Host bytes the engine holds now (arena + transient copies)."""
        return self.arena_reserved + self.transient_mapped

    def __str__(self) -> str:
        g = GiB
        lines = [f"host memory held by ebbtide: {self.held / g:.3f} GiB",
                 f"  pinned arena: {self.arena_reserved / g:.3f} GiB reserved, {self.arena_used / g:.3f} GiB in use"
                 f" (kept across cycles; release_host_memory() gives back what holds no paused content)",
                 f"  transient copies: {self.transient_copies}, {self.transient_mapped / g:.3f} GiB resident, "
                 f"{self.transient_pinned / g:.3f} GiB pinned; retained by active tensors: "
                 f"{self.transient_retained / g:.3f} GiB (host retention {'on' if self.host_retention else 'off'})"]
        if self.disk_files or self.disk_staging:
            lines.append(f"  disk backups: {self.disk_files} files, {self.disk_bytes / g:.3f} GiB; staging "
                         f"{self.disk_staging / g:.3f} GiB pinned ({'direct' if self.disk_direct else 'buffered'} I/O)")
        return "\n".join(lines)


def host_memory() -> HostMemory:
    """The host memory and disk the engine holds now (see :class:`HostMemory`)."""
    g = _mem().global_stats()
    return HostMemory(arena_reserved=g["host_reserved"], arena_used=g["host_used"],
                      transient_copies=g["transient_copies"], transient_mapped=g["transient_mapped"],
                      transient_pinned=g["transient_pinned"], transient_retained=g["transient_retained"],
                      host_retention=g["host_retention"], disk_files=g["disk_files"], disk_bytes=g["disk_bytes"],
                      disk_staging=g["disk_staging"], disk_direct=g["disk_direct"])


def set_host_retention(on: bool) -> None:
    """Whether a resume keeps the transient host copies it restored from (same address, reused by the next pause)
    instead of giving them back: torch_memory_saver's ``retain_cpu_backup``. Off by default; TMS_RETAIN_CPU_BACKUP=1
    turns it on at process start. Read by each resume when it starts."""
    if not isinstance(on, bool):
        raise InvalidArgumentError(f"on must be a bool, not {on!r}")
    _mem().set_host_retention(on)


def host_retention() -> bool:
    """See set_host_retention."""
    return bool(_mem().host_retention())


def set_disk_backup_dir(path) -> None:
    """The directory ``backup="disk"`` writes to (one file per allocation, removed at resume, free and exit).
    Created if missing; refused (InvalidArgumentError, naming it) when it is on tmpfs or ramfs or not writable.
    Default: EBBTIDE_MEM_DISK_DIR, else TMS_DISK_BACKUP_DIR, else /tmp."""
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"path must be a non-empty path, not {path!r}")
    _mem().set_disk_dir(os.path.abspath(path))


def disk_backup_dir() -> str:
    """The directory disk backups go to (see set_disk_backup_dir)."""
    return _mem().disk_dir()
