"""What every module of ebbtide.memory shares: the native engine, argument checks, and whether torch is in play.

Nothing here imports another module of this package, so every other module can import it (the package's modules
form no import cycle; tests/core/test_import_cycles.py checks that).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from .. import _native
from ..errors import InvalidArgumentError

__all__ = ["BACKUPS", "HOSTS", "mem", "backup_code", "check_tag", "torch_cuda", "expandable_segments_requested",
           "without_expandable_segments", "ALLOC_CONF_VARS"]

BACKUPS = {"none": 0, "cpu": 1, "disk": 2}
# Where a CPU backup's host copy lives (memory/ebbtide_memory.h): the persistent pinned arena (ebbtide's default),
# a transient copy made by each pause and given back by the resume (torch_memory_saver's semantics), or the same
# kept pageable while paused (its "mmap" backend).
HOSTS = {"arena": 0, "transient": 0x200, "pageable": 0x200 | 0x400}


def mem():
    """The native memory engine (``ebbtide._C.memory``): one per process, inside libebbtide.so."""
    return _native.load().memory


def backup_code(backup: str, host: str = "arena") -> int:
    """The native code of a backup policy: ``backup`` ("none", "cpu", "disk") and, for "cpu", where the host copy
    lives (``host``: "arena", "transient", "pageable")."""
    if backup not in BACKUPS:
        raise InvalidArgumentError(f"backup must be one of {sorted(BACKUPS)}, not {backup!r}")
    if host not in HOSTS:
        raise InvalidArgumentError(f"host must be one of {sorted(HOSTS)}, not {host!r}")
    if host != "arena" and backup != "cpu":
        raise InvalidArgumentError(f"host={host!r} applies to backup='cpu' only (backup is {backup!r})")
    return BACKUPS[backup] | HOSTS[host]


def check_tag(tag: Optional[str], *, allow_none: bool) -> None:
    if tag is None and allow_none:
        return
    limit = mem().TAG_MAX  # EBT_MEM_TAG_MAX (memory/ebbtide_memory.h), the engine's own bound
    if not isinstance(tag, str) or not tag or len(tag.encode()) > limit or "\0" in tag:
        raise InvalidArgumentError(f"tag must be a non-empty string of at most {limit} bytes, not {tag!r}")


def torch_cuda():
    """torch, if the program imported it and it sees a GPU; else None (native routing only: a program that never
    imported torch has no caching allocator to route, and importing it here would cost seconds)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch if torch.cuda.is_available() else None


# PyTorch's allocator settings: comma-separated "key:value" entries, in either variable (the second is the newer name)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _alloc_conf(value: str) -> list:
    """(entry as written, key, value) of each non-empty entry of an allocator setting; key and value without spaces,
    lower-cased (how PyTorch reads "expandable_segments: True")."""
    out = []
    for entry in value.split(","):
        if entry.strip():
            key, _, val = entry.partition(":")
            out.append((entry, key.replace(" ", "").lower(), val.replace(" ", "").lower()))
    return out


def expandable_segments_requested(env: Optional[dict] = None) -> bool:
    """Whether PyTorch's allocator is configured for expandable segments in ``env`` (default os.environ): their
    memory is mapped with cuMemCreate, around cudaMalloc, so the preload shim sees none of it."""
    env = os.environ if env is None else env
    return any(key == "expandable_segments" and val == "true"
               for var in ALLOC_CONF_VARS for _, key, val in _alloc_conf(env.get(var, "")))


def without_expandable_segments(env: dict) -> dict:
    """A copy of ``env`` without any ``expandable_segments`` entry in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF
    (the other entries kept as written; a variable left empty is removed): for a child started under the preload
    shim (``preload_env``), which refuses regions under expandable segments; the child then uses the plain caching
    allocator. ``env`` itself is not modified."""
    out = dict(env)
    for var in ALLOC_CONF_VARS:
        if var not in out:
            continue
        keep = [entry for entry, key, _ in _alloc_conf(out[var]) if key != "expandable_segments"]
        if keep:
            out[var] = ",".join(keep)
        else:
            del out[var]
    return out
