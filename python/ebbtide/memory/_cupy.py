"""CuPy programs on the engine: ``cupy.cuda.set_allocator(ebbtide.memory.cupy_allocator())``.

Why an allocator and not the shim alone: CuPy (v13 on) links the CUDA runtime statically, so its ``cudaMalloc``
calls never reach an ``LD_PRELOAD``-ed symbol and the shim sees none of them (PyTorch links libcudart.so
dynamically, which is why the shim works there). CuPy does let a program replace its allocator; this one sends
every CuPy allocation through the same routing as the PyTorch pluggable allocator: the calling thread's
``region()``, else the process-wide default region (``set_default_region`` or ``EBBTIDE_MEM_DEFAULT_TAG`` when the
process runs under the shim), else tag "default" (discard). There is no CuPy memory pool on top: a pool's cached
blocks of a paused tag would lie in unmapped memory (the paused-block problem), so each CuPy allocation is one
engine allocation (granularity-rounded); allocate big arrays, not many small ones.
"""
from __future__ import annotations

import ctypes

from .. import _native
from ..errors import OutOfMemoryError, UnsupportedError

__all__ = ["cupy_allocator"]


def _runtime():
    _native.load()  # version-checked; loads libebbtide.so (already mapped when preloaded: same engine)
    lib = ctypes.CDLL(_native.runtime_library_path())
    malloc, free, last = lib.ebt_torch_malloc, lib.ebt_torch_free, lib.ebt_last_error
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    last.restype, last.argtypes = ctypes.c_char_p, []
    return malloc, free, last


def cupy_allocator():
    """An allocator function for ``cupy.cuda.set_allocator`` (size -> MemoryPointer: the ``malloc`` of a
    ``cupy.cuda.PythonFunctionAllocator``) whose memory comes from ebbtide (pausable, stable addresses). Install
    it before the first CuPy allocation: ``cupy.cuda.set_allocator(ebbtide.memory.cupy_allocator())``.
    A failed allocation raises ``ebbtide.OutOfMemoryError`` (a MemoryError) with the engine's reason."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError as e:
        raise UnsupportedError(f"ebbtide.memory.cupy_allocator needs CuPy: {e}") from e
    malloc, free, last = _runtime()

    def _malloc(size: int, device_id: int) -> int:
        ptr = malloc(size, device_id, None)
        if not ptr:
            why = (last() or b"unknown").decode(errors="replace")
            raise OutOfMemoryError(f"ebbtide could not allocate {size} bytes on device {device_id} for CuPy: {why}",
                                   needed=size)
        return ptr

    def _free(ptr: int, device_id: int) -> None:
        free(ptr, 0, device_id, None)

    return cupy.cuda.PythonFunctionAllocator(_malloc, _free).malloc  # the bound method keeps the allocator alive
