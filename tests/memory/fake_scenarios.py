"""Engine scenarios against the host-memory fake driver (libebbtide_fake_cuda.so), one per process.

Run as ``python fake_scenarios.py <scenario> [args...]`` with EBBTIDE_LIBCUDA pointing at the fake (the test
module does this). Device memory of the fake is host memory, so content is read and written with ctypes while
mapped. Every scenario ends with no leaked handle, mapping or host block (``assert_clean``). Exit status 0 = pass.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings

import ebbtide.memory as em
from ebbtide import _native
from ebbtide.errors import (DriverError, EbbtideError, InvalidArgumentError, NotFoundError, OutOfMemoryError,
                            StateError, WaitTimeoutError)

MiB = 1 << 20
FAKE = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
FAKE.ebt_fake_calls.restype = ctypes.c_long
FAKE.ebt_fake_call_threads.restype = ctypes.c_long
FAKE.ebt_fake_trace.restype = ctypes.c_size_t
NATIVE = _native.load().memory
RUNTIME = ctypes.CDLL(_native.runtime_library_path())
RUNTIME.ebt_torch_malloc.restype = ctypes.c_void_p
RUNTIME.ebt_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
RUNTIME.ebt_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2


def counters() -> dict:
    a = (ctypes.c_longlong * 8)()
    FAKE.ebt_fake_counters(a)
    keys = ["handles", "phys", "mappings", "reservations", "reserved", "registered", "registrations", "unpinned"]
    return dict(zip(keys, a))


def fault(name: str, nth: int = 1, err: int = CUDA_ERROR_INVALID_VALUE) -> None:
    FAKE.ebt_fake_set_fault(name.encode(), nth, err)


def trace(clear: bool = True) -> list:
    buf = ctypes.create_string_buffer(1 << 16)
    FAKE.ebt_fake_trace(buf, len(buf), 1 if clear else 0)
    return buf.value.decode().split(",") if buf.value else []


def alloc(size: int, tag: str, backup: str = "none") -> int:
    """An allocation through the pluggable-allocator entry point inside a region (the torch-mode path)."""
    with em.region(tag, backup):
        p = RUNTIME.ebt_torch_malloc(size, 0, None)
    assert p, f"ebt_torch_malloc({size}) failed: {_native.load().last_error()}"
    return p


def free(p: int) -> None:
    assert NATIVE.free(p), hex(p)


def fill(p: int, size: int, seed: int) -> bytes:
    data = bytes((seed + i * 7) & 0xFF for i in range(256)) * (size // 256) + bytes(size % 256)
    ctypes.memmove(p, data, size)
    return data


def read(p: int, size: int) -> bytes:
    return ctypes.string_at(p, size)


def tag_row(tag: str) -> dict:
    rows = [r for r in em.stats()["tags"] if r["tag"] == tag]
    assert rows, tag
    return rows[0]


DELIBERATE_SUBRANGE_UNMAPS = 0  # sub-range unmaps a scenario made itself (to check that the fake refuses them)


def assert_clean() -> None:
    """After freeing everything: no handle, mapping or host block left; arena releasable to zero; the engine never
    tried to unmap or grant access to part of a mapping."""
    assert FAKE.ebt_fake_calls(b"cuMemUnmap:subrange") == DELIBERATE_SUBRANGE_UNMAPS
    assert FAKE.ebt_fake_calls(b"cuMemSetAccess:subrange") == 0
    em.wait_background_pinning()
    c = counters()
    assert c["handles"] == 0 and c["mappings"] == 0 and c["phys"] == 0, c
    assert em.stats()["global"]["host_used"] == 0, em.stats()["global"]
    em.release_host_memory()
    c = counters()
    assert c["registered"] == 0 and c["registrations"] == 0, c
    assert c["unpinned"] == 0, f"copies from unregistered host memory: {c}"
    NATIVE.reset_for_testing()
    c = counters()
    assert c["reservations"] == 0, c


# ---- scenarios ----------------------------------------------------------------------------------------------

def va_stability_and_roundtrip():
    sizes = [5 * MiB + 123, 2 * MiB, 300]
    w = [alloc(s, "weights", "cpu") for s in sizes]
    kv = alloc(4 * MiB, "kv", "none")
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(w, sizes))]
    fill(kv, 4 * MiB, 99)
    before = counters()
    rep = em.pause("weights")
    assert rep.allocations == 3 and rep.bytes_copied == sum(sizes), rep
    assert rep.bytes == 6 * MiB + 2 * MiB + 2 * MiB, rep
    assert rep.driver_delta == rep.bytes, rep
    after = counters()
    assert after["handles"] == before["handles"] - 3 and after["phys"] == before["phys"] - rep.bytes, after
    assert all(NATIVE.lookup(p)[3] for p in w) and not NATIVE.lookup(kv)[3]
    assert read(kv, 16) == bytes((99 + i * 7) & 0xFF for i in range(16))  # untouched tag still readable
    rep = em.resume("weights")
    assert rep.bytes_copied == sum(sizes) and rep.allocations == 3
    for p, s, d in zip(w, sizes, data):
        assert NATIVE.lookup(p)[0] == p and not NATIVE.lookup(p)[3]
        assert read(p, s) == d, "content changed across pause/resume"
    # discard mode: memory comes back (writable), content not kept; poison (EBBTIDE_MEM_POISON=1) shows it
    em.pause("kv")
    em.resume("kv")
    expect = b"\xa5" * 64 if os.environ.get("EBBTIDE_MEM_POISON") == "1" else bytes(64)
    assert read(kv, 64) == expect
    fill(kv, 4 * MiB, 5)
    for p in w + [kv]:
        free(p)
    assert_clean()


def selective_tags_and_stats():
    a = alloc(2 * MiB, "a", "cpu")
    b = alloc(2 * MiB, "b", "none")
    fill(a, 2 * MiB, 1)
    em.pause("b")
    assert tag_row("a")["state"] == "active" and tag_row("b")["state"] == "paused"
    assert tag_row("b")["bytes_paused"] == 2 * MiB and tag_row("b")["handles"] == 0
    assert tag_row("a")["bytes_active"] == 2 * MiB and tag_row("a")["handles"] == 1
    rep = em.pause(None)  # pauses what is still active: a
    assert rep.allocations == 1, rep
    assert tag_row("a")["bytes_backed_up"] >= 2 * MiB
    assert tag_row("a")["last_pause"]["bytes_copied"] == 2 * MiB
    rep = em.resume(None)
    assert rep.allocations == 2, rep
    assert tag_row("a")["state"] == tag_row("b")["state"] == "active"
    free(a)
    free(b)
    assert_clean()


def state_errors():
    p = alloc(2 * MiB, "t", "cpu")
    em.pause("t")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert em.pause("t").noop
        em.resume("t")
        assert em.resume("t").noop
    assert len([x for x in w if "already" in str(x.message)]) == 2, [str(x.message) for x in w]
    for bad in (lambda: em.pause("never-used"), lambda: em.resume("never-used"), lambda: em.mark_clean("nope")):
        try:
            bad()
            raise AssertionError("expected NotFoundError")
        except NotFoundError:
            pass
    for bad in (lambda: em.region("t", "disk").__enter__(), lambda: em.pause(""), lambda: em.pause("x" * 64),
                lambda: NATIVE.region_pop(5), lambda: em.reserve_host_memory(0)):
        try:
            bad()
            raise AssertionError("expected InvalidArgumentError")
        except InvalidArgumentError:
            pass
    assert tag_row("t")["state"] == "active"
    free(p)
    assert not NATIVE.free(12345)  # not the engine's: reported, nothing changed
    assert_clean()


def regions_and_threads():
    """Regions nest and are thread-scoped; the default region covers threads without one."""
    with em.region("outer", "cpu"):
        assert NATIVE.current_region() == ("outer", 1, 0)
        with em.region("inner"):
            p_inner = RUNTIME.ebt_torch_malloc(MiB, 0, None)
        p_outer = RUNTIME.ebt_torch_malloc(MiB, 0, None)
        seen = {}

        def other():  # another thread: no region here
            seen["region"] = NATIVE.current_region()
            seen["p"] = RUNTIME.ebt_torch_malloc(MiB, 0, None)
            em.set_default_region("grads", "cpu")
            seen["p2"] = RUNTIME.ebt_torch_malloc(MiB, 0, None)
            em.set_default_region(None)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        with em.disable():
            assert NATIVE.current_region()[2] == 1
    assert NATIVE.current_region() == ("", 0, 0)
    assert NATIVE.lookup(p_inner)[2] == "inner" and NATIVE.lookup(p_outer)[2] == "outer"
    assert seen["region"] == ("", 0, 0)
    assert NATIVE.lookup(seen["p"])[2] == "default"  # ebt_torch_malloc outside any region
    assert NATIVE.lookup(seen["p2"])[2] == "grads"
    for p in (p_inner, p_outer, seen["p"], seen["p2"]):
        RUNTIME.ebt_torch_free(p, 0, 0, None)
    assert_clean()


def oom_at_resume():
    a = alloc(40 * MiB, "a", "cpu")
    data = fill(a, 40 * MiB, 3)
    em.pause("a")
    b = alloc(40 * MiB, "b", "none")  # the fake has 64 MiB: a no longer fits
    try:
        em.resume("a")
        raise AssertionError("expected OutOfMemoryError")
    except OutOfMemoryError as e:
        assert e.needed == 40 * MiB and e.free == 24 * MiB, (e.needed, e.free)
        assert e.holders == {"b": 40 * MiB}, e.holders
    assert tag_row("a")["state"] == "paused" and counters()["handles"] == 1
    free(b)
    em.resume("a")  # retry works, content intact
    assert read(a, 40 * MiB) == data
    # OOM from the driver itself half-way (pre-flight passed): rolled back, retryable.
    c = alloc(4 * MiB, "c", "cpu")
    d = alloc(4 * MiB, "c", "cpu")
    fill(c, 4 * MiB, 8)
    em.pause("c")
    fault("cuMemCreate", 2, CUDA_ERROR_OUT_OF_MEMORY)
    try:
        em.resume("c")
        raise AssertionError("expected OutOfMemoryError")
    except OutOfMemoryError as e:
        assert e.needed == 4 * MiB, e.needed
    assert tag_row("c")["state"] == "paused" and tag_row("c")["handles"] == 0
    em.resume("c")
    assert read(c, 64) == bytes((8 + i * 7) & 0xFF for i in range(64))
    for p in (a, c, d):
        free(p)
    assert_clean()


def fault_injection(op: str, spec: str):
    name, nth = spec.split(":")
    sizes = [3 * MiB, 2 * MiB + 5, 6 * MiB]
    if op == "malloc":
        fault(name, int(nth))  # the first allocation exercises every step (VA reservation included)
        with em.region("w", "cpu"):
            assert not RUNTIME.ebt_torch_malloc(MiB, 0, None)
        c = counters()
        assert (c["handles"], c["mappings"], c["phys"]) == (0, 0, 0), c
        assert em.stats()["global"]["live_allocations"] == 0
        p = alloc(MiB, "w", "cpu")  # the retry succeeds
        fill(p, MiB, 1)
        free(p)
        assert_clean()
        return
    ps = [alloc(s, "w", "cpu") for s in sizes]
    ps.append(alloc(2 * MiB, "w", "none"))
    data = [fill(p, s, i + 1) for i, (p, s) in enumerate(zip(ps, sizes))]
    if name == "cuMemUnmap":  # see fake_scenarios_spec.FAULTS: per-allocation unmaps after the refused run
        aligned = [4 * MiB, 4 * MiB, 6 * MiB]  # sizes rounded up to the fake's 2 MiB granularity
        assert all(ps[i + 1] == ps[i] + aligned[i] for i in range(3)), "the allocations are one VA-contiguous run"
        FAKE.ebt_fake_set_exact_unmap(1)
    if op == "resume":
        em.pause("w")
    state_before = tag_row("w")["state"]
    handles_before = counters()["handles"]
    fault(name, int(nth))
    trace()
    try:
        (em.pause if op == "pause" else em.resume)("w")
        raise AssertionError(f"{op} with {spec} failing did not raise")
    except DriverError:
        pass
    calls = trace()
    fault(name, 0)  # clear a persistent fault before the retry
    if op == "resume" and "cuMemUnmap" in calls:  # drain before unmap: no H2D copy may still be in flight
        first_unmap = calls.index("cuMemUnmap")
        copies = [i for i, c in enumerate(calls[:first_unmap]) if c == "cuMemcpyHtoDAsync"]
        if copies:
            between = calls[copies[-1]:first_unmap]
            assert "cuStreamSynchronize" in between or "cuCtxSynchronize" in between, (spec, calls)
    if op == "pause" and name == "cuMemcpyDtoHAsync":  # chunks issued before the failing one have no event:
        last_copy = max(i for i, c in enumerate(calls) if c == "cuMemcpyDtoHAsync")  # the stream is drained
        assert "cuStreamSynchronize" in calls[last_copy:], (spec, calls)
    row = tag_row("w")
    assert row["state"] == state_before, (spec, row["state"], state_before)
    assert counters()["handles"] == handles_before, (spec, counters(), handles_before)
    if op == "pause":  # rolled back: every CPU-backed allocation readable with its content
        for p, s, d in zip(ps, sizes, data):
            assert read(p, s) == d, f"content lost after failed pause ({spec})"
        em.pause("w")
    em.resume("w")  # the retry succeeds
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d, f"content lost ({spec})"
    for p in ps:
        free(p)
    assert_clean()


def free_while_paused():
    p = alloc(8 * MiB, "t", "cpu")
    q = alloc(2 * MiB, "t", "none")
    fill(p, 8 * MiB, 4)
    em.pause("t")
    assert em.stats()["global"]["host_used"] >= 8 * MiB
    free(p)  # paused: nothing mapped; VA and host block go back
    free(q)
    assert em.stats()["global"]["live_allocations"] == 0 and em.stats()["global"]["host_used"] == 0
    assert tag_row("t")["allocations"] == 0
    # The freed VA is reused and the tag still works (resume of an empty paused tag: a no-op that activates it).
    em.resume("t")
    r = alloc(8 * MiB, "t", "cpu")
    assert r == p, (hex(r), hex(p))
    free(r)
    assert_clean()


def soak(cycles: str = "100"):
    sizes = [2 * MiB, 3 * MiB + 17, 1000, 9 * MiB, 64, 2 * MiB]
    ps = [alloc(s, "w", "cpu") for s in sizes]
    kv = [alloc(4 * MiB, "kv", "none") for _ in range(3)]
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(ps, sizes))]
    em.pause("w")
    em.pause("kv")
    em.resume(None)
    steady = (counters(), em.stats()["global"])
    for i in range(int(cycles)):
        em.pause("w" if i % 2 else None)
        em.resume(None)
        if i % 25 == 0:
            for p, s, d in zip(ps, sizes, data):
                assert read(p, s) == d, f"cycle {i}"
    c, g = counters(), em.stats()["global"]
    assert c == steady[0], (c, steady[0])  # no handle, mapping, VA or registration growth
    assert g["host_reserved"] == steady[1]["host_reserved"] and g["host_used"] == steady[1]["host_used"], g
    assert g["va_reserved"] == steady[1]["va_reserved"], g
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    for p in ps + kv:
        free(p)
    assert_clean()


def async_overlap():
    a = [alloc(4 * MiB, "train", "cpu") for _ in range(4)]
    b = [alloc(4 * MiB, "roll", "cpu") for _ in range(4)]
    da = [fill(p, 4 * MiB, i) for i, p in enumerate(a)]
    db = [fill(p, 4 * MiB, 50 + i) for i, p in enumerate(b)]
    em.pause("roll")
    h1 = em.pause_async("train")
    h2 = em.resume("roll", wait=False)
    second = None
    try:  # the tag is owned by h1 until it finishes: a second op must be refused, not interleaved
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "already paused", when h1 won the race
            second = em.pause("train")
    except StateError:
        pass
    r1, r2 = h1.wait(timeout=30), h2.wait()
    assert h1.done() and h2.done() and r1.allocations == 4 and r2.allocations == 4
    # refused while h1 ran; accepted only after h1 had finished, and then it found nothing to do
    assert second is None or (second.noop and second.allocations == 0), second
    assert tag_row("train")["state"] == "paused" and tag_row("roll")["state"] == "active"
    for p, d in zip(b, db):
        assert read(p, 4 * MiB) == d
    h = em.resume_async("train")
    h.wait()
    for p, d in zip(a, da):
        assert read(p, 4 * MiB) == d
    # a failing async op reports its error at wait(), and the tag stays as it was
    fault("cuMemcpyDtoHAsync", 1)
    h = em.pause_async("train")
    try:
        h.wait()
        raise AssertionError("expected DriverError")
    except DriverError:
        pass
    assert tag_row("train")["state"] == "active"
    for p in a + b:
        free(p)
    assert_clean()


def mark_clean_skips_copy():
    p = alloc(4 * MiB, "weights", "cpu")
    d = fill(p, 4 * MiB, 6)
    em.pause("weights")
    em.resume("weights")
    em.mark_clean("weights")
    rep = em.pause("weights")
    assert rep.bytes_copied == 0 and rep.bytes_skipped_clean == 4 * MiB, rep
    em.resume("weights")
    assert read(p, 4 * MiB) == d
    rep = em.pause("weights")  # clean is cleared by resume: copies again
    assert rep.bytes_copied == 4 * MiB
    em.resume("weights")
    free(p)
    assert_clean()


def batched_set_access_and_drain_order():
    ps = [alloc(2 * MiB, "t", "none") for _ in range(8)]
    assert all(ps[i + 1] == ps[i] + 2 * MiB for i in range(7)), "allocations are VA-contiguous"
    trace()
    em.pause("t")
    calls = trace()
    assert calls.index("cuCtxSynchronize") < calls.index("cuMemUnmap"), calls  # drain before unmap
    em.resume("t")
    calls = trace()
    assert calls.count("cuMemSetAccess") == 1 and calls.count("cuMemCreate") == 8, calls
    NATIVE.free(ps[0])
    calls = trace()
    assert calls.index("cuCtxSynchronize") < calls.index("cuMemUnmap"), calls  # free drains too
    for p in ps[1:]:
        free(p)
    assert_clean()


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


def multi_device():
    """Allocations remember their device: each device is drained in its own context, copies and maps run there,
    and stats split per (tag, device). Runs with EBT_FAKE_DEVICES=2."""
    with em.region("w", "cpu"):
        a = RUNTIME.ebt_torch_malloc(3 * MiB, 0, None)
        b = RUNTIME.ebt_torch_malloc(5 * MiB, 1, None)
    da, db = fill(a, 3 * MiB, 1), fill(b, 5 * MiB, 2)
    rows = {r["device"]: r for r in em.stats()["tags"] if r["tag"] == "w"}
    assert rows[0]["bytes_active"] == 4 * MiB and rows[1]["bytes_active"] == 6 * MiB, rows
    trace()
    em.pause("w")
    assert trace().count("cuCtxSynchronize") == 2  # both devices drained, not just the current one
    rows = {r["device"]: r for r in em.stats()["tags"] if r["tag"] == "w"}
    assert rows[0]["bytes_paused"] == 4 * MiB and rows[1]["bytes_paused"] == 6 * MiB, rows
    em.resume("w")
    assert read(a, 3 * MiB) == da and read(b, 5 * MiB) == db
    trace()
    free(b)
    assert trace().count("cuCtxSynchronize") == 1
    free(a)
    assert_clean()


def set_access_fallback():
    """A driver that refuses one cuMemSetAccess over several mappings: resume grants access per allocation."""
    ps = [alloc(2 * MiB, "t", "cpu") for _ in range(3)]
    data = [fill(p, 2 * MiB, i) for i, p in enumerate(ps)]
    em.pause("t")
    trace()
    fault("cuMemSetAccess", 1)
    em.resume("t")
    assert trace().count("cuMemSetAccess") == 4
    for p, d in zip(ps, data):
        assert read(p, 2 * MiB) == d
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


def fork_child_disabled():
    p = alloc(2 * MiB, "t", "cpu")
    fill(p, 2 * MiB, 1)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            em.pause("t")
            code = 3  # must not reach
        except StateError:
            pass
        except BaseException:  # noqa: BLE001
            code = 4
        if RUNTIME.ebt_torch_malloc(MiB, 0, None):
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
    em.pause("t")  # the parent is unaffected
    em.resume("t")
    free(p)
    assert_clean()


def thread_safety():
    errors = []
    base = [alloc(2 * MiB, "cycled", "cpu") for _ in range(4)]
    data = [fill(p, 2 * MiB, i) for i, p in enumerate(base)]

    def churn(k):
        try:
            for i in range(30):
                with em.region(f"worker{k}", "cpu" if i % 2 else "none"):
                    p = RUNTIME.ebt_torch_malloc(MiB + i, 0, None)
                assert p
                RUNTIME.ebt_torch_free(p, 0, 0, None)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(20):
        em.pause("cycled")
        em.resume("cycled")
    for t in threads:
        t.join()
    assert not errors, errors
    for p, d in zip(base, data):
        assert read(p, 2 * MiB) == d
        free(p)
    assert_clean()


def timeout_wait():
    p = alloc(2 * MiB, "t", "none")
    h = em.pause_async("t")
    h.wait()
    try:  # waiting again returns the same report
        assert h.wait(0).allocations == 1
    except WaitTimeoutError:
        raise AssertionError("finished op reported a timeout")
    em.resume("t")
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


def memory_margin_and_tag_epochs():
    """The memory margin refuses allocations (both entry points) and resumes that would leave less than it free;
    rollback of a failed pause ignores it. tag_state counts pauses begun (the epoch behind the paused-block guard)."""
    from ebbtide.memory._hooks import pool_epoch  # noqa: PLC0415

    assert em.memory_margin() == 0
    a = alloc(16 * MiB, "w", "cpu")  # 64 MiB device: 48 left
    em.wait_background_pinning()  # the pinning thread runs in relaxed capture mode (never breaks a graph capture)
    # the pinning thread sets relaxed once; each arena growth reads the caller's mode to hand it to its workers
    assert FAKE.ebt_fake_calls(b"cuThreadExchangeStreamCaptureMode") >= 1
    data = fill(a, 16 * MiB, 3)
    em.set_memory_margin(40 * MiB)
    assert em.memory_margin() == 40 * MiB
    b = alloc(8 * MiB, "w", "none")  # leaves 40: allowed (not under the margin)
    with em.region("w", "none"):
        assert RUNTIME.ebt_torch_malloc(2 * MiB, 0, None) is None  # would leave 38: NULL (torch frees cache, retries)
    try:
        NATIVE.malloc(2 * MiB, 0, "w", 0)
        raise AssertionError("allocation under the margin succeeded")
    except OutOfMemoryError as e:
        assert "margin" in str(e), e
    assert counters()["handles"] == 2, counters()  # the refused ones left nothing behind
    assert pool_epoch("w") == "main" and NATIVE.tag_state("w") == ("active", 0)
    em.set_memory_margin(0)
    em.pause("w")
    assert NATIVE.tag_state("w") == ("paused", 1) and pool_epoch("w") == ("paused", 1)
    em.set_memory_margin(56 * MiB)  # resume needs 24 of 64 free: 40 would be left, under 56
    try:
        em.resume("w")
        raise AssertionError("resume under the margin succeeded")
    except OutOfMemoryError as e:
        assert e.needed == 24 * MiB + 56 * MiB and e.free == 64 * MiB, (e.needed, e.free)
    assert NATIVE.tag_state("w") == ("paused", 1) and counters()["handles"] == 0
    em.set_memory_margin(40 * MiB)  # exactly 40 left: allowed
    em.resume("w")
    assert read(a, 16 * MiB) == data
    assert NATIVE.tag_state("w") == ("active", 1) and pool_epoch("w") == "main"
    # A pause that fails after releasing some allocations maps them back even when the margin would refuse it.
    em.set_memory_margin(60 * MiB)
    FAKE.ebt_fake_set_exact_unmap(1)  # the run's one unmap is refused: per allocation, the second one fails
    fault("cuMemUnmap", 3 if b == a + 16 * MiB else 2)
    try:
        em.pause("w")
        raise AssertionError("pause with an injected unmap failure succeeded")
    except DriverError:
        pass
    # pauses are counted when they begin (a region opened during a pause must not reuse the previous paused
    # period's pool), so the failed one moved the epoch on too
    assert NATIVE.tag_state("w") == ("active", 2), NATIVE.tag_state("w")
    assert read(a, 16 * MiB) == data
    FAKE.ebt_fake_set_exact_unmap(0)
    em.set_memory_margin(0)
    em.pause("w")
    assert NATIVE.tag_state("w") == ("paused", 3) and pool_epoch("w") == ("paused", 3)
    try:
        NATIVE.tag_state("never-named")
        raise AssertionError("tag_state of an unknown tag succeeded")
    except NotFoundError:
        pass
    for bad in (-1, 1.5, True):
        try:
            em.set_memory_margin(bad)
            raise AssertionError(f"margin {bad!r} accepted")
        except InvalidArgumentError:
            pass
    free(a)
    free(b)
    assert_clean()


def partial_span_unmap():
    """A driver that unmaps part of a multi-mapping span and then refuses it: the per-allocation fallback finds the
    allocation it already lost no longer mapped and books it as paused (not as a failure that would leave the tag
    unpausable); the pause succeeds, every byte is back, content of CPU-backed ones survives the round trip."""
    ps = [alloc(2 * MiB, "t", "cpu") for _ in range(4)]
    data = [fill(p, 2 * MiB, 30 + i) for i, p in enumerate(ps)]
    FAKE.ebt_fake_set_partial_unmap(1)
    try:
        rep = em.pause("t")
    finally:
        FAKE.ebt_fake_set_partial_unmap(0)
    assert rep.allocations == 4 and rep.unmap_calls == 5, rep  # the span, then one per allocation
    assert counters()["phys"] == 0 and counters()["mappings"] == 0, counters()
    em.resume("t")
    for p, d in zip(ps, data):
        assert read(p, 2 * MiB) == d
    for p in ps:
        free(p)
    assert_clean()


def unmap_runs_and_handle_release():
    """No handle is kept: malloc and resume release each handle right after mapping it, so pause is unmap only
    (one call per VA-contiguous run; per allocation when the driver refuses the span) and frees the memory."""
    ps = [alloc(2 * MiB, "t", "none") for _ in range(8)]
    assert all(ps[i + 1] == ps[i] + 2 * MiB for i in range(7)), "allocations are VA-contiguous"
    assert FAKE.ebt_fake_calls(b"cuMemRelease") == 8  # each right after its map
    c = counters()
    assert (c["handles"], c["mappings"], c["phys"]) == (8, 8, 16 * MiB), c
    trace()
    rep = em.pause("t")
    calls = trace()
    assert calls.count("cuMemUnmap") == 1 and "cuMemRelease" not in calls, calls
    assert rep.unmap_calls == 1 and rep.allocations == 8 and rep.bytes == 16 * MiB, rep
    c = counters()
    assert (c["handles"], c["mappings"], c["phys"]) == (0, 0, 0), c  # the unmap freed the memory
    rep = em.resume("t")
    calls = trace()
    assert [calls.count(f) for f in ("cuMemCreate", "cuMemMap", "cuMemRelease", "cuMemSetAccess")] == [8, 8, 8, 1]
    if os.environ.get("EBBTIDE_MEM_CREATE_AHEAD", "0") != "0":  # creates on the helper, maps here
        assert FAKE.ebt_fake_call_threads(b"cuMemCreate") >= 2 and FAKE.ebt_fake_call_threads(b"cuMemMap") == 1
    assert rep.create_s > 0 and rep.map_s >= rep.create_s + rep.access_s, rep
    # A driver error on the span (injected): the pause falls back to one unmap per allocation and succeeds.
    fault("cuMemUnmap", 1)
    rep = em.pause("t")
    assert rep.unmap_calls == 9 and trace().count("cuMemUnmap") == 9, rep
    assert counters()["phys"] == 0
    em.resume("t")
    # A driver that wants one mapping per call (exact-unmap mode): same fallback; resume and free still clean.
    FAKE.ebt_fake_set_exact_unmap(1)
    for i, p in enumerate(ps):
        fill(p, 2 * MiB, i)
    rep = em.pause("t")
    assert rep.unmap_calls == 9 and counters()["phys"] == 0, rep
    em.resume("t")
    assert counters()["phys"] == 16 * MiB
    FAKE.ebt_fake_set_exact_unmap(0)
    # A run of CPU-backed allocations closes at EBBTIDE_MEM_UNMAP_RUN_BYTES of copies (when the test sets it).
    run_bytes = int(os.environ.get("EBBTIDE_MEM_UNMAP_RUN_BYTES", 256 * MiB))
    qs = [alloc(2 * MiB, "c", "cpu") for _ in range(4)]
    cdata = [fill(q, 2 * MiB, 10 + i) for i, q in enumerate(qs)]
    rep = em.pause("c")
    per_run = max(1, -(-run_bytes // (2 * MiB)))
    assert all(qs[i + 1] == qs[i] + 2 * MiB for i in range(3)), "allocations are VA-contiguous"
    assert rep.unmap_calls == -(-4 // per_run) and rep.bytes_copied == 8 * MiB, (rep, per_run)
    em.resume("c")
    assert [read(q, 2 * MiB) for q in qs] == cdata
    trace()
    free(ps[0])  # free of an active allocation: drain, one unmap (which frees it), no release
    calls = trace()
    assert calls.count("cuMemUnmap") == 1 and "cuMemRelease" not in calls, calls
    assert counters()["phys"] == (7 + 4) * 2 * MiB  # ps[1:] and qs
    for p in ps[1:] + qs:
        free(p)
    assert_clean()


def release_report_without_torch():
    """The release report from the engine's own view (no PyTorch GPU here): paused bytes vs the driver's free
    memory delta, active tags; check() refuses to judge without its pause records."""
    a = alloc(8 * MiB, "w", "cpu")
    b = alloc(4 * MiB, "kv", "none")
    rep = em.pause("w")
    rr = em.release_report(rep)
    assert rr.bytes_paused == 8 * MiB and rr.driver_freed == 8 * MiB and rr.missing == 0, rr
    assert rr.active_tags == {"kv": 4 * MiB}, rr.active_tags
    assert rr.driver_free_now is None and any("torch" in n for n in rr.notes), rr.notes
    assert not rr.shim_active and rr.forwarded_allocs == 0
    text = str(rr)
    assert "paused 0.008 GiB" in text and "kv=" in text, text
    now = em.release_report()  # no report: the current state
    assert now.bytes_paused == 8 * MiB and now.driver_freed is None and now.missing is None
    try:
        em.check()
        raise AssertionError("check() without pause records did not raise")
    except StateError as e:
        assert "set_checking" in str(e)
    em.set_checking(True)
    assert em.check() == []  # no PyTorch GPU: nothing to judge
    em.resume("w")
    free(a)
    free(b)
    assert_clean()


def shareable_ipc():
    """A shareable allocation exported as a POSIX fd, sent to a second process (SCM_RIGHTS), mapped there: both see
    the same bytes. Refusals: not shareable, paused. An import in this process is closed without leaks."""
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    size = 4 * MiB + 100
    p = NATIVE.malloc(size, 0, "s", NATIVE.SHAREABLE | 1)
    data = fill(p, size, 11)
    plain = alloc(2 * MiB, "plain", "cpu")
    try:
        NATIVE.export_fd(plain)
        raise AssertionError("export of a non-shareable allocation succeeded")
    except InvalidArgumentError:
        pass
    fd, off, mapped = NATIVE.export_fd(p + 4096)
    assert off == 4096 and mapped == 6 * MiB, (off, mapped)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, __file__, "_ipc_child", str(child.fileno()), str(mapped), str(off)],
                            pass_fds=[child.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.close()
    socket.send_fds(parent, [data[4096:4096 + 100]], [fd])
    os.close(fd)
    reply = parent.recv(16)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and reply == b"written", f"child failed: {reply!r}\n{out}\n{err}"
    assert read(p, 8) == b"IMPORTED", "the child's write through its mapping is not visible here"
    # import in this process too; close it; counters return
    fd2, _, _ = NATIVE.export_fd(p)
    base = NATIVE.import_fd(fd2, mapped, 0)
    os.close(fd2)
    assert base != p and read(base, 8) == b"IMPORTED" and read(base + 4096, 100) == data[4096:4196]
    NATIVE.close_import(base)
    try:
        NATIVE.close_import(base)
        raise AssertionError("double close_import succeeded")
    except NotFoundError:
        pass
    em.pause("s")
    try:
        NATIVE.export_fd(p)
        raise AssertionError("export of a paused allocation succeeded")
    except StateError:
        pass
    em.resume("s")  # resumed memory is created shareable again
    fd3, _, _ = NATIVE.export_fd(p)
    os.close(fd3)
    assert read(p, 8) == b"IMPORTED"  # CPU backup restored the child's write
    free(p)
    free(plain)
    assert_clean()


def cupy_allocator_routing():
    """ebbtide.memory.cupy_allocator's entry points (CuPy itself is not needed here): an allocation lands in the
    calling thread's region, else the process-wide default region, else tag "default"; a refused one is NULL and
    leaves the engine's reason for the typed error."""
    from ebbtide.memory import _cupy  # noqa: PLC0415

    malloc, free_, last = _cupy._runtime()
    with em.region("arrays", "cpu"):
        a = malloc(4 * MiB, 0, None)
    em.set_default_region("proc", "cpu")
    b = malloc(4 * MiB, 0, None)
    em.set_default_region(None)
    c = malloc(2 * MiB, 0, None)
    assert a and b and c
    tags = [NATIVE.lookup(p)[2] for p in (a, b, c)]
    assert tags == ["arrays", "proc", "default"], tags
    em.set_memory_margin(60 * MiB)
    assert not malloc(4 * MiB, 0, None) and b"margin" in last(), last()
    em.set_memory_margin(0)
    for p in (a, b, c):
        free_(p, 0, 0, None)
    assert_clean()


# ---- coalesced resume (EBBTIDE_MEM_COALESCE=1 / em.set_coalescing(True)) -------------------------------------

def _mappings_row(tag: str) -> tuple:
    r = tag_row(tag)
    return r["handles"], r["allocations"], r["bytes_active"], r["bytes_pending_free"]


def coalesce_runs_and_zombies():
    """A resume maps a VA-contiguous run of a tag's allocations as ONE physical allocation (create, map, release,
    set-access: one call each); the next pause unmaps it with one call. A member freed while active is a zombie:
    gone from lookups and stats at once, its memory and VA held (no driver call) until the mapping is unmapped at
    the next pause or the last live member's free. A paused member's free returns its VA at once. reset() with a
    zombie outstanding leaks nothing. The fake refuses to unmap a sub-range of a mapping, as the real driver does."""
    global DELIBERATE_SUBRANGE_UNMAPS
    assert em.coalescing() == (os.environ.get("EBBTIDE_MEM_COALESCE") == "1")
    em.set_coalescing(True)
    assert em.coalescing()
    n = 8
    ps = [alloc(2 * MiB, "t", "cpu" if i % 2 else "none") for i in range(n)]
    assert all(ps[i + 1] == ps[i] + 2 * MiB for i in range(n - 1)), "allocations are VA-contiguous"
    data = {i: fill(ps[i], 2 * MiB, i) for i in range(1, n, 2)}
    assert counters()["mappings"] == n  # malloc maps each allocation on its own
    em.pause("t")
    trace()
    rep = em.resume("t")
    calls = trace()
    one_each = [calls.count(f) for f in ("cuMemCreate", "cuMemMap", "cuMemRelease", "cuMemSetAccess")]
    assert one_each == [1, 1, 1, 1], calls
    assert rep.mappings == 1 and rep.allocations == n and rep.bytes == n * 2 * MiB, rep
    c = counters()
    assert (c["handles"], c["mappings"], c["phys"]) == (1, 1, n * 2 * MiB), c
    assert _mappings_row("t") == (1, n, n * 2 * MiB, 0), tag_row("t")
    assert em.stats()["global"]["coalesced_mappings"] == 1
    for i, d in data.items():
        assert read(ps[i], 2 * MiB) == d, f"content of {i} not restored into the coalesced mapping"
    # The driver (and the fake) cannot unmap part of a mapping: the engine never tries.
    FAKE.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    assert FAKE.cuMemUnmap(ps[0], 2 * MiB) == CUDA_ERROR_INVALID_VALUE
    assert FAKE.cuMemUnmap(ps[1], 2 * MiB) == CUDA_ERROR_INVALID_VALUE
    assert FAKE.cuMemUnmap(ps[1], (n - 1) * 2 * MiB) == CUDA_ERROR_INVALID_VALUE
    DELIBERATE_SUBRANGE_UNMAPS = 3
    assert FAKE.ebt_fake_calls(b"cuMemUnmap:subrange") == 3
    assert counters()["mappings"] == 1 and read(ps[1], 2 * MiB) == data[1]
    # Free of active members: zombies (no drain, no unmap), unlisted at once, memory held.
    host_before = em.stats()["global"]["host_used"]
    trace()
    free(ps[2])
    free(ps[3])
    calls = trace()
    assert "cuMemUnmap" not in calls and "cuCtxSynchronize" not in calls, calls
    for p in (ps[2], ps[3], ps[3] + 4096):
        try:
            NATIVE.lookup(p)
            raise AssertionError("a freed member is still listed")
        except NotFoundError:
            pass
    assert host_before - em.stats()["global"]["host_used"] == 2 * MiB  # its backup goes back at once
    assert _mappings_row("t") == (1, n - 2, (n - 2) * 2 * MiB, 4 * MiB), tag_row("t")
    g = em.stats()["global"]
    assert g["bytes_pending_free"] == 4 * MiB and g["live_allocations"] == n - 2, g
    rr = em.release_report()
    assert rr.pending_free == 4 * MiB and any("coalesced" in note for note in rr.notes), rr
    assert counters()["phys"] == n * 2 * MiB
    other = alloc(2 * MiB, "other", "none")
    assert not ps[0] <= other < ps[0] + n * 2 * MiB, "a zombie's VA was handed out while still mapped"
    try:  # out of memory while zombies hold some: the error says so
        NATIVE.malloc(60 * MiB, 0, "other", 0)
        raise AssertionError("allocation beyond the fake device succeeded")
    except OutOfMemoryError as e:
        assert "coalesced" in str(e) and str(4 * MiB) in str(e), e
    for i in (5, 7):
        assert read(ps[i], 2 * MiB) == data[i]
    # The tag's pause unmaps the whole mapping with one call; the zombies go with it.
    trace()
    rep = em.pause("t")
    calls = trace()
    assert calls.count("cuMemUnmap") == 1, calls
    assert (rep.unmap_calls, rep.mappings, rep.allocations) == (1, 1, n - 2), rep
    assert rep.bytes == (n - 2) * 2 * MiB and rep.bytes_pending_freed == 4 * MiB, rep
    assert rep.driver_delta == n * 2 * MiB, rep  # members and zombies: all of it back
    assert counters()["phys"] == 2 * MiB  # `other` only
    g = em.stats()["global"]
    assert g["bytes_pending_free"] == 0 and g["coalesced_mappings"] == 0, g
    z = alloc(4 * MiB, "z", "none")
    assert z == ps[2], "the zombies' VA did not come back with the unmap"
    free(z)
    free(ps[4])  # a paused member: nothing mapped, VA back at once
    z = alloc(2 * MiB, "z", "none")
    assert z == ps[2]
    free(z)
    # Resume: the hole [2, 5) splits the run in two mappings.
    trace()
    rep = em.resume("t")
    assert rep.mappings == 2 and trace().count("cuMemCreate") == 2, rep
    assert counters()["mappings"] == 3 and tag_row("t")["handles"] == 2
    for i in (1, 5, 7):
        assert read(ps[i], 2 * MiB) == data[i], i
    # Freeing every member of a mapping: the last free drains the device and unmaps the whole range.
    free(ps[5])
    free(ps[6])
    assert tag_row("t")["bytes_pending_free"] == 4 * MiB
    trace()
    free(ps[7])
    calls = trace()
    assert calls.count("cuMemUnmap") == 1 and calls.index("cuCtxSynchronize") < calls.index("cuMemUnmap"), calls
    assert counters()["phys"] == 4 * MiB + 2 * MiB and tag_row("t")["bytes_pending_free"] == 0
    z = alloc(12 * MiB, "z", "none")  # first fit: the hole [2, 5) and the mapping's [5, 8), merged
    assert z == ps[2], "the mapping's VA did not come back with its last member"
    free(z)
    # reset() with a zombie outstanding: every mapping unmapped whole, nothing leaked.
    free(ps[0])
    assert tag_row("t")["bytes_pending_free"] == 2 * MiB
    NATIVE.reset_for_testing()
    c = counters()
    assert (c["handles"], c["mappings"], c["phys"], c["reservations"]) == (0, 0, 0, 0), c
    assert_clean()


def coalesce_tags_and_shareable():
    """Runs never cross a tag or include a shareable allocation (its export must expose exactly it); a pause of
    one tag unmaps only its mappings; allocations made while the tag is paused stay separate mappings and its
    resume leaves them alone; pause(None)/resume(None), async ops and the set-access fallback work on coalesced
    mappings; turning coalescing off makes the next resume map one allocation per mapping again."""
    assert not em.coalescing(), "coalescing must be off by default"
    for bad in (1, "yes", None):
        try:
            em.set_coalescing(bad)
            raise AssertionError(f"set_coalescing({bad!r}) accepted")
        except InvalidArgumentError:
            pass
    em.set_coalescing(True)
    a = [alloc(2 * MiB, "a", "cpu") for _ in range(3)]
    b = [alloc(2 * MiB, "b", "none") for _ in range(3)]
    a += [alloc(2 * MiB, "a", "cpu") for _ in range(2)]
    s = NATIVE.malloc(2 * MiB, 0, "a", NATIVE.SHAREABLE | 1)
    order = a[:3] + b + a[3:] + [s]
    assert all(order[i + 1] == order[i] + 2 * MiB for i in range(len(order) - 1)), "allocations are VA-contiguous"
    data = [fill(p, 2 * MiB, i) for i, p in enumerate(a + [s])]
    em.pause(None)
    trace()
    rep = em.resume(None)
    assert rep.mappings == 4 and trace().count("cuMemCreate") == 4, rep  # [a0-a2] [b0-b2] [a3 a4] [s]
    assert counters()["mappings"] == 4 and tag_row("a")["handles"] == 3 and tag_row("b")["handles"] == 1
    fd, off, mapped = NATIVE.export_fd(s)
    os.close(fd)
    assert (off, mapped) == (0, 2 * MiB), (off, mapped)
    try:
        NATIVE.export_fd(a[0])
        raise AssertionError("export of a non-shareable allocation succeeded")
    except InvalidArgumentError:
        pass
    for p, d in zip(a + [s], data):
        assert read(p, 2 * MiB) == d
    trace()
    rep = em.pause("b")
    assert rep.mappings == 1 and trace().count("cuMemUnmap") == 1, rep
    assert all(read(p, 2 * MiB) == d for p, d in zip(a + [s], data)), "another tag's mapping was touched"
    n1 = alloc(2 * MiB, "b", "none")  # made while b is paused: its own mapping, active
    rep = em.resume("b")
    assert rep.allocations == 3 and rep.mappings == 1, rep
    assert tag_row("b")["handles"] == 2
    rep = em.pause("b")
    assert rep.allocations == 4 and rep.mappings == 2, rep
    rep = em.resume("b")
    assert rep.mappings == 2, rep  # n1 is not adjacent to b's run
    # a driver refusing set-access over several mappings: one call per mapping instead (one span:
    # [a0-a2] [b0-b2] [a3 a4] [s] [n1])
    em.pause(None)
    trace()
    fault("cuMemSetAccess", 1)
    rep = em.resume(None)
    assert trace().count("cuMemSetAccess") == 1 + rep.mappings, rep
    assert all(read(p, 2 * MiB) == d for p, d in zip(a + [s], data))
    # async pause/resume of coalesced mappings; a free of a member while the pause is in flight waits for it and
    # then frees a paused allocation (no zombie)
    h = em.pause_async("a")
    free(a[4])
    rep = h.wait()
    assert rep.allocations == 6 and rep.mappings == 3 and rep.bytes_pending_freed == 0, rep
    assert counters()["mappings"] == 2 and em.stats()["global"]["bytes_pending_free"] == 0
    em.resume_async("a").wait()
    a, data = a[:4], data[:4] + data[5:]
    assert all(read(p, 2 * MiB) == d for p, d in zip(a + [s], data))
    em.set_coalescing(False)
    em.pause("a")
    rep = em.resume("a")
    assert rep.mappings == rep.allocations == 5, rep
    assert all(read(p, 2 * MiB) == d for p, d in zip(a + [s], data))
    for p in a + b + [s, n1]:
        free(p)
    assert_clean()


def coalesce_first_member_freed():
    """A coalesced mapping whose lowest-address member was freed while active (a zombie at the mapping's base):
    the tag's next pause still unmaps the whole mapping with one call (the first LIVE member is not at the
    mapping's base: that is no inconsistency), gives the zombie back and restores the live members at resume; the
    last free of a mapping whose base and end members are zombies unmaps the whole range."""
    em.set_coalescing(True)
    n = 4
    ps = [alloc(2 * MiB, "f", "cpu") for _ in range(n)]
    assert all(ps[i + 1] == ps[i] + 2 * MiB for i in range(n - 1)), "allocations are VA-contiguous"
    data = [fill(p, 2 * MiB, i + 3) for i, p in enumerate(ps)]
    em.pause("f")
    assert em.resume("f").mappings == 1
    free(ps[0])  # the member at the mapping's base: a zombie
    assert tag_row("f")["bytes_pending_free"] == 2 * MiB
    trace()
    rep = em.pause("f")  # the first live member is not at the base: still one unmap, no error
    assert trace().count("cuMemUnmap") == 1, rep
    assert (rep.mappings, rep.allocations, rep.bytes_pending_freed) == (1, n - 1, 2 * MiB), rep
    assert counters()["phys"] == 0 and tag_row("f")["state"] == "paused"
    rep = em.resume("f")
    assert rep.mappings == 1 and counters()["mappings"] == 1, rep
    for p, d in zip(ps[1:], data[1:]):
        assert read(p, 2 * MiB) == d
    free(ps[1])  # base again, then the end: both zombies; the middle one is the last live member
    free(ps[3])
    trace()
    free(ps[2])
    assert trace().count("cuMemUnmap") == 1
    assert counters()["phys"] == 0 and counters()["mappings"] == 0
    z = alloc(8 * MiB, "z", "none")
    assert z == ps[0], "the mapping's VA did not come back with its last member"
    free(z)
    assert_clean()


def coalesce_fault_injection(op: str, spec: str):
    """Rollback with coalesced mappings (the test sets EBBTIDE_MEM_COALESCE=1 and EBBTIDE_MEM_COALESCE_MAX_BYTES=8
    MiB: the tag's 16 MiB resumes as two mappings). A failed resume unmaps what it mapped and leaves the tag paused
    and retryable; a failed pause maps back (coalesced again) what it unmapped and restores its content."""
    name, nth = spec.split(":")
    sizes = [3 * MiB, 2 * MiB + 5, 6 * MiB]  # aligned 4 + 4 | 6 + 2 (the discard one below)
    ps = [alloc(sz, "w", "cpu") for sz in sizes]
    ps.append(alloc(2 * MiB, "w", "none"))
    data = [fill(p, sz, i + 1) for i, (p, sz) in enumerate(zip(ps, sizes))]
    em.pause("w")
    rep = em.resume("w")
    assert rep.mappings == 2 and counters()["mappings"] == 2 and tag_row("w")["handles"] == 2, rep
    if name == "cuMemUnmap":  # the span over both mappings (call 1) is refused: calls 2, 3 unmap one mapping each
        FAKE.ebt_fake_set_exact_unmap(1)
    if op == "resume":
        em.pause("w")
    state_before = tag_row("w")["state"]
    handles_before = counters()["handles"]
    fault(name, int(nth))
    try:
        (em.pause if op == "pause" else em.resume)("w")
        raise AssertionError(f"{op} with {spec} failing did not raise")
    except DriverError:
        pass
    fault(name, 0)
    row = tag_row("w")
    assert row["state"] == state_before, (spec, row["state"], state_before)
    c = counters()
    assert c["handles"] == c["mappings"] == handles_before, (spec, c, handles_before)
    if op == "pause":
        for p, sz, d in zip(ps, sizes, data):
            assert read(p, sz) == d, f"content lost after failed pause ({spec})"
        assert row["handles"] == 2, row
        em.pause("w")
    rep = em.resume("w")  # the retry succeeds
    assert rep.mappings == 2 and counters()["mappings"] == 2, rep
    for p, sz, d in zip(ps, sizes, data):
        assert read(p, sz) == d, f"content lost ({spec})"
    FAKE.ebt_fake_set_exact_unmap(0)
    for p in ps:
        free(p)
    assert_clean()


def versioned_stats():
    """ebt_mem_stats / ebt_mem_global_stats take the caller's struct size: rows are laid out with that stride
    (a caller built against a newer, larger header still reads each row's start), and a size smaller than any
    released struct is refused without writing anything."""
    a, b = alloc(4 * MiB, "first"), alloc(2 * MiB, "second")
    stride, n = 4096, ctypes.c_size_t()
    buf = ctypes.create_string_buffer(b"\xff" * (stride * 4), stride * 4)
    assert RUNTIME.ebt_mem_stats(buf, ctypes.c_size_t(stride), ctypes.c_size_t(4), ctypes.byref(n)) == 0
    assert n.value == 2, n.value
    assert all(buf.raw[i * stride + stride - 64:(i + 1) * stride] == bytes(64) for i in range(2)), \
        "fields unknown to the library must read as zero"
    tags = sorted(ctypes.string_at(ctypes.addressof(buf) + i * stride).decode() for i in range(2))
    assert tags == ["first", "second"], tags
    assert RUNTIME.ebt_mem_stats(buf, ctypes.c_size_t(8), ctypes.c_size_t(4), ctypes.byref(n)) != 0
    g = ctypes.create_string_buffer(8)
    assert RUNTIME.ebt_mem_global_stats(g, ctypes.c_size_t(8)) != 0
    big = ctypes.create_string_buffer(b"\xff" * 4096, 4096)
    assert RUNTIME.ebt_mem_global_stats(big, ctypes.c_size_t(4096)) == 0
    assert big.raw[-64:] == bytes(64), "fields unknown to the library must read as zero"
    # The last reports come separately, each versioned by its own struct_size (a caller with an older, shorter
    # report gets exactly its prefix; struct_size says how much was written).
    em.pause("first")
    old_report = (ctypes.c_size_t * 4)(4 * ctypes.sizeof(ctypes.c_size_t), 7, 7, 7)
    assert RUNTIME.ebt_mem_tag_reports(b"first", old_report, None) == 0
    assert old_report[0] == 4 * ctypes.sizeof(ctypes.c_size_t), list(old_report)
    assert RUNTIME.ebt_mem_tag_reports(b"never-named", None, None) != 0
    row = [r for r in em.stats()["tags"] if r["tag"] == "first"][0]
    assert row["last_pause"]["allocations"] == 1 and row["last_pause"]["bytes"] >= 4 * MiB, row["last_pause"]
    em.resume("first")
    free(a)
    free(b)
    assert_clean()


def _ipc_child(sock_fd: str, mapped: str, off: str):
    import socket  # noqa: PLC0415

    sock = socket.socket(fileno=int(sock_fd))
    expect, fds, _, _ = socket.recv_fds(sock, 100, 1)
    base = NATIVE.import_fd(fds[0], int(mapped), 0)
    os.close(fds[0])
    assert read(base + int(off), 100) == expect, "imported memory differs from the exporter's"
    ctypes.memmove(base, b"IMPORTED", 8)
    NATIVE.close_import(base)
    sock.sendall(b"written")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
    print("OK")
