"""``torch_memory_saver.utils`` served by ebbtide: the helpers that package's own tests import from it
(``change_env``, ``is_xpu``) and the library lookup its ``configure_subprocess`` uses."""
from __future__ import annotations

import contextlib
import functools
import os

from ebbtide import _native

__all__ = ["change_env", "is_xpu", "get_binary_path_from_package"]


@functools.lru_cache(maxsize=1)
def is_xpu() -> bool:
    """Whether torch runs on an Intel XPU (ebbtide serves CUDA only: then nothing here applies)."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def get_binary_path_from_package(stem: str):
    """The library that serves both of the original's hook modes here: libebbtide.so."""
    return _native.runtime_library_path()


@contextlib.contextmanager
def change_env(key: str, value: str):
    """os.environ[key] = value inside; the previous value (or its absence) is restored on exit."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
