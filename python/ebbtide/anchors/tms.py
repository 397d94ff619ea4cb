"""torch_memory_saver as its users configure it (slime, SGLang): the package's singleton in torch hook mode, the
trainer's pinned backup retained across cycles (its best setting), and a pause that gives torch's cached blocks
outside its regions back too. ``dropin``: ``ebbtide.compat.torch_memory_saver`` in its place (ebbtide as a plain
drop-in: the one import swapped, nothing else changes)."""
from __future__ import annotations

import importlib.util

__all__ = ["torch_memory_saver", "pause", "preload_library"]


def torch_memory_saver(*, dropin: bool = False, retain_cpu_backup: bool = False):
    """The singleton, hook mode "torch" (the package's default is "preload": LD_PRELOAD of its own shim);
    ``retain_cpu_backup``: keep the pinned backup across pause/resume cycles (a fresh one is pinned every pause
    otherwise). In a process that uses Megatron-core, import ``megatron.core.models.gpt`` first: that import sets
    the hook mode, which the package refuses to change once initialised (``anchors.megatron.torch_memory_saver``)."""
    if dropin:
        from ..compat.torch_memory_saver import torch_memory_saver as tms
    else:
        from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = "torch"
    if retain_cpu_backup:
        tms.retain_cpu_backup = True
    return tms


def pause(tms, *, empty_cache_first: bool = True) -> None:
    """Pause every region; torch's cached free blocks outside them go back to the driver with ``empty_cache``
    (``empty_cache_first``: also before the pause, so the pause copies no cached block of a region's pool)."""
    import torch

    if empty_cache_first:
        torch.cuda.empty_cache()
    tms.pause()
    torch.cuda.empty_cache()


def preload_library() -> str | None:
    """Path of torch_memory_saver's LD_PRELOAD library as the package picks it for a subprocess (its
    ``configure_subprocess``: the build for torch's CUDA major, ``..._cu12`` or ``..._cu13``), or None where the
    package is not installed. RuntimeError (the package's) where no build matches the CUDA runtime."""
    if importlib.util.find_spec("torch_memory_saver") is None:
        return None
    from torch_memory_saver.utils import get_binary_path_from_package  # noqa: PLC0415

    return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
