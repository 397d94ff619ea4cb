"""The pinned host arena behind CPU backups: background pinning, exact and chunked copies, registration
workers in the caller's capture mode, zero-copy views of a backup.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_backup.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import ctypes
import os

import ebbtide.memory as em
from ebbtide.errors import EbbtideError, NotFoundError

from _fake_driver import FAKE, MiB, NATIVE, alloc, assert_clean, counters, fault, fill, free, read, tag_row, trace
from _scenario_runner import main


def background_pinning():
    """CPU-backed allocations get pinned blocks on the runtime thread; the first pause then registers nothing. A
    failed background batch costs nothing but time: the pause pins for itself."""
    fault("cuMemHostRegister", 1)  # the first background batch fails
    q = alloc(4 * MiB, "w2", "cpu")
    em.wait_background_pinning()
    assert tag_row("w2")["bytes_backed_up"] == 0 and em.stats()["global"]["host_reserved"] == 0
    dq = fill(q, 4 * MiB, 9)
    em.pause("w2")  # pins its own block (exactly the shortfall)
    em.resume("w2")
    assert read(q, 4 * MiB) == dq
    assert em.stats()["global"]["host_reserved"] == 4 * MiB
    sizes = [3 * MiB, 5 * MiB + 1]
    ps = [alloc(s, "w", "cpu") for s in sizes]
    alloc_none = alloc(2 * MiB, "kv", "none")
    em.wait_background_pinning()
    g = em.stats()["global"]
    assert g["host_used"] == 4 * MiB + sum(sizes) + 255, g
    assert g["host_reserved"] == 4 * MiB + 64 * MiB, g  # background growth is at least 64 MiB
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(ps, sizes))]
    trace()
    em.pause("w")
    assert "cuMemHostRegister" not in trace()
    em.resume("w")
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    # a block pinned for an allocation freed meanwhile goes back to the arena
    r = alloc(2 * MiB, "w3", "cpu")
    free(r)
    em.wait_background_pinning()
    for p in ps + [q, alloc_none]:
        free(p)
    assert_clean()


def host_arena_exact_and_chunked():
    # EBBTIDE_MEM_CHUNK_BYTES is set small by the test: copies are cut into many chunks with odd tails.
    em.set_background_pinning(False)  # this scenario checks the shape a pause gives the arena
    sizes = [1000, 3 * MiB + 7, 256, 5 * MiB]
    ps = [alloc(s, "t", "cpu") for s in sizes]
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(ps, sizes))]
    trace()
    em.pause("t")
    copies = trace().count("cuMemcpyDtoHAsync")
    assert copies >= sum(-(-s // (1 << 20)) for s in sizes), copies
    g = em.stats()["global"]
    assert g["host_used"] == sum((s + 255) // 256 * 256 for s in sizes), g  # exact sizes, 256-byte aligned
    assert g["host_segments"] == 1 and g["host_reserved"] == 10 * MiB, g  # one segment sized to the shortfall
    em.resume("t")
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    em.pause("t")
    assert em.release_host_memory() == 0  # paused content is never dropped
    em.resume("t")
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    assert em.release_host_memory() == 10 * MiB  # active: backups dropped, segment returned
    assert counters()["registered"] == 0
    em.pause("t")  # next pause copies again into a fresh segment
    em.resume("t")
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    em.reserve_host_memory(4 * MiB)
    assert em.stats()["global"]["host_segments"] == 2
    for p in ps:
        free(p)
    assert_clean()


def register_workers_keep_capture_mode():
    """Arena growth registers its 256 MiB pieces on worker threads, which must run in the caller's stream-capture
    mode: the background pinning thread is relaxed so that it never breaks a graph another thread captures in
    global mode, and fresh (global-mode) workers would break it anyway."""
    os.environ["EBBTIDE_MEM_REGISTER_THREADS"] = "2"
    FAKE.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
    FAKE.ebt_fake_set_foreign_global_capture(1)
    try:
        try:  # a global-mode caller is refused (as the real driver refuses it)
            em.reserve_host_memory(300 * MiB)
            raise AssertionError("registration during a foreign global capture succeeded in global mode")
        except EbbtideError:
            pass
        mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED for this thread, as the pinning thread sets it
        assert FAKE.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
        try:
            em.reserve_host_memory(300 * MiB)  # two pieces: the second is registered by a worker thread
        finally:
            assert FAKE.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0  # back to global
    finally:
        FAKE.ebt_fake_set_foreign_global_capture(0)
    assert em.stats()["global"]["host_reserved"] >= 300 * MiB
    em.release_host_memory()
    assert_clean()


def cpu_backup_view():
    """get_cpu_backup(tensor): a torch view of fake device memory (host-addressable) and its pinned backup."""
    import torch  # noqa: PLC0415

    n = 3 * MiB
    p = alloc(n, "w", "cpu")
    dev = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
    dev.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8))
    t = dev[1024:].view(torch.int32).view(-1, 4)  # a view into the allocation, not at its base
    ref = t.clone()
    em.pause("w")
    copy, view = em.get_cpu_backup(t), em.get_cpu_backup(t, zero_copy=True)
    assert torch.equal(copy, ref) and torch.equal(view, ref) and view.dtype == torch.int32
    host, _ = em.get_cpu_backup_address(p + 1024)
    assert view.data_ptr() == host
    try:
        NATIVE.get_cpu_backup(12345)
        raise AssertionError("expected NotFoundError")
    except NotFoundError:
        pass
    em.resume("w")
    del copy, view, t, dev
    free(p)
    assert_clean()


if __name__ == "__main__":
    main(globals())
