"""AReaL's FSDP2 offload, reproduced from its source (inclusionAI/AReaL at 4aef98d8): the trainer process runs under
torch_memory_saver's preload hook with every allocation captured and backed up to the CPU
(``areal/utils/offload.py`` ``get_tms_env_vars``: ``LD_PRELOAD`` of the package's preload library,
``TMS_INIT_ENABLE=1``, ``TMS_INIT_ENABLE_CPU_BACKUP=1``; the engine
sets ``torch_memory_saver.hook_mode = "preload"``), and ``areal/engine/fsdp_engine.py`` ``offload`` / ``onload``
are ``clear_memory()`` (gc + ``empty_cache``) then ``torch_memory_saver.pause()``, a device synchronize and a
barrier, and ``resume()``, a synchronize and a barrier.

AReaL names the unsuffixed ``torch_memory_saver_hook_mode_preload.abi3.so``; torch_memory_saver 0.0.10 builds that
one against CUDA 12 and ships ``..._cu12`` / ``..._cu13`` beside it, so the library here is the one the package itself
picks for torch's CUDA major (``anchors.tms.preload_library``): AReaL's setting on a CUDA 13 machine.
"""
from __future__ import annotations

import contextlib
import gc
import os

__all__ = ["tms_env", "saver", "offload", "onload", "outside_hook", "PRELOAD_INIT_VARS"]

# what tms_env sets beside LD_PRELOAD (a process started from the trainer, as AReaL's rollout is not, drops them)
PRELOAD_INIT_VARS = ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP")


def tms_env(env: dict | None = None) -> dict:
    """A copy of ``env`` (default os.environ) that starts a process as AReaL starts its trainer under
    torch_memory_saver. RuntimeError where the package or its preload library is missing."""
    from .tms import preload_library  # noqa: PLC0415

    lib = preload_library()
    if lib is None:
        raise RuntimeError("torch_memory_saver is not installed (pip install torch_memory_saver)")
    out = dict(os.environ if env is None else env)
    out.update(LD_PRELOAD=lib, **dict.fromkeys(PRELOAD_INIT_VARS, "1"))
    return out


def saver():
    """torch_memory_saver set to the preload hook, as AReaL's engine sets it before it builds the model. The
    package's singleton takes its hook only until its first use (a later assignment fails: "Cannot configure after
    initialization"), so it is set once, on the first call."""
    from torch_memory_saver import torch_memory_saver  # noqa: PLC0415

    if getattr(torch_memory_saver, "_impl", None) is None:
        torch_memory_saver.hook_mode = "preload"
    return torch_memory_saver


def offload(group=None) -> None:
    import torch  # noqa: PLC0415

    gc.collect()
    torch.cuda.empty_cache()
    saver().pause()
    torch.cuda.synchronize()
    if group is not None:
        torch.distributed.barrier(group=group)


def onload(group=None) -> None:
    import torch  # noqa: PLC0415

    saver().resume()
    torch.cuda.synchronize()
    if group is not None:
        torch.distributed.barrier(group=group)


@contextlib.contextmanager
def outside_hook():
    """Allocations that bypass the preload hook (``torch_memory_saver.disable()``), from a cache emptied first so
    no block the hook mapped is handed out again: what a CUDA IPC export needs (the driver refuses to export memory
    the hook maps)."""
    import torch  # noqa: PLC0415

    torch.cuda.empty_cache()
    with saver().disable():
        yield
