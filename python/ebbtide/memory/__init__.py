"""ebbtide.memory — release the GPU memory of live tensors and bring it back at the same addresses.

    import ebbtide.memory as em
    with em.region("weights", backup="cpu"):
        model = build_model().cuda()         # allocations made here are pausable
    em.pause("weights")                       # GPU memory released; content kept in pinned host memory
    em.resume("weights")                      # same data_ptr()s, content restored

CPU backups default to a persistent pinned host arena (fastest; its host memory stays held while the tensors are
active: ``host_memory()`` shows it, ``release_host_memory()`` gives it back); ``host="transient"`` gives it back at
every resume (torch_memory_saver's semantics); ``backup="disk"`` writes to a file instead.

Two hook modes, one API: "torch" (in-process, PyTorch pluggable allocator + one MemPool per tag and device; the
default) and "preload" (libebbtide.so in LD_PRELOAD interposes cudaMalloc/cudaFree for the whole process; start
children with ``preload_env()`` / ``configure_subprocess()``). Architecture and state machine: memory/NOTES.md.
"""
from __future__ import annotations

from ._engine import (Pending, Report, coalescing, get_cpu_backup, get_cpu_backup_address, mark_clean,
                      memory_margin, pause, pause_async, paused_ranges, release_host_memory, reserve_host_memory,
                      resume, resume_async, set_background_pinning, set_coalescing, set_memory_margin, stats,
                      wait_background_pinning)
from ._check import check, check_paused_blocks, set_checking
from ._common import without_expandable_segments
from ._cupy import cupy_allocator
from ._hooks import (configure_subprocess, disable, graph, hook_mode, preload_env, region, set_default_region,
                     set_hook_mode)
from ._host import (HostMemory, disk_backup_dir, host_memory, host_retention, set_disk_backup_dir,
                    set_host_retention)
from ._ipc import ImportedTensor, SharedHandle, check_handle, export_tensor, import_tensor
from ._report import ReleaseReport, release_report
from .. import settings as _settings

_settings.check_component("memory")  # the engine's settings (EBBTIDE_MEM_*, TMS_*) fail at import

__all__ = [
    "region", "disable", "pause", "resume", "pause_async", "resume_async", "Pending", "Report", "stats",
    "mark_clean", "release_host_memory", "reserve_host_memory", "get_cpu_backup_address", "paused_ranges",
    "check_paused_blocks", "hook_mode", "set_hook_mode", "set_default_region", "preload_env",
    "configure_subprocess", "set_background_pinning", "wait_background_pinning", "get_cpu_backup",
    "graph", "check", "set_memory_margin", "memory_margin", "release_report", "ReleaseReport", "set_checking",
    "export_tensor", "import_tensor", "check_handle", "SharedHandle", "ImportedTensor", "cupy_allocator",
    "set_coalescing", "coalescing", "host_memory", "HostMemory", "set_host_retention", "host_retention",
    "set_disk_backup_dir", "disk_backup_dir", "without_expandable_segments",
]
