"""``torch_memory_saver.testing_utils`` served by ebbtide: the device helpers that package's own tests import
(``get_device``, ``empty_cache``, ``get_and_print_gpu_memory``), so its suite runs unchanged against ebbtide."""
from __future__ import annotations

import torch

from torch_memory_saver.utils import is_xpu  # noqa: F401 (the suite imports it from here)

__all__ = ["get_device", "empty_cache", "get_and_print_gpu_memory", "is_xpu"]


def get_device() -> str:
    return "cuda"


def empty_cache() -> None:
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Device memory in use on ``gpu_id`` as NVML reports it (ROCm: the driver's free-memory figure), printed."""
    if torch.version.hip:
        free, total = torch.cuda.mem_get_info(gpu_id)
        mem = total - free
    else:
        mem = torch.cuda.device_memory_used(gpu_id)
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem
