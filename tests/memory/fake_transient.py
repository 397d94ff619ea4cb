"""Transient host copies (host="transient"/"pageable": torch_memory_saver's semantics): made by each pause in fresh
host memory, registered piece by piece while the copies run, given back by the resume unless host retention is on.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_transient.py <scenario> [args...]`` (test_host_tiers_fake.py runs them; _fake_driver.py holds what
they share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import ctypes

import ebbtide.memory as em
from ebbtide.errors import DriverError, HostOutOfMemoryError

from _fake_driver import FAKE, MiB, NATIVE, assert_clean, counters, expect_failure, fault, fill, free, read, tag_row
from _scenario_runner import main

TRANSIENT = NATIVE.BACKUP_CPU | NATIVE.HOST_TRANSIENT
PAGEABLE = TRANSIENT | NATIVE.HOST_PAGEABLE


def _alloc(size: int, tag: str, code: int = TRANSIENT) -> int:
    return NATIVE.malloc(size, 0, tag, code)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _held() -> tuple:
    h = em.host_memory()
    return h.transient_copies, h.transient_mapped, h.transient_pinned


def roundtrip_gives_host_back():
    """Content survives; the host copy exists only while paused: get_cpu_backup is None after the resume, the
    registrations and the process's RSS are back where they were before the pause."""
    sizes = [48 * MiB + 123, 5 * MiB, 1000]
    ps = [_alloc(s, "t") for s in sizes]
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(ps, sizes))]
    assert _held() == (0, 0, 0) and counters()["registered"] == 0  # nothing pinned ahead (no background pinning)
    for cycle in range(3):
        before = _rss()
        em.pause("t")
        h = em.host_memory()
        assert h.transient_copies == 3 and h.transient_pinned == h.transient_mapped >= sum(sizes), h
        assert counters()["registered"] == h.transient_pinned
        for p, s, d in zip(ps, sizes, data):
            host, after = em.get_cpu_backup_address(p)
            assert host and after == s and ctypes.string_at(host, s) == d
        em.resume("t")
        for p, s, d in zip(ps, sizes, data):
            assert read(p, s) == d, f"cycle {cycle}: content lost"
            assert em.get_cpu_backup_address(p) == (0, 0)
        assert _held() == (0, 0, 0) and counters()["registered"] == 0
        assert tag_row("t")["bytes_backed_up"] == 0
        grew = _rss() - before
        assert abs(grew) < 8 * MiB, f"cycle {cycle}: RSS {grew / MiB:.1f} MiB above its level before the pause"
    last = tag_row("t")["last_resume"]
    assert last["host_release_s"] >= 0 and last["bytes_copied"] == sum(sizes)
    for p in ps:
        free(p)
    assert_clean()


def pieces_pipelined_on_threads():
    """EBBTIDE_MEM_SHADOW_PIECE_BYTES=2 MiB, EBBTIDE_MEM_REGISTER_THREADS=4: one registration per piece, made by
    several runtime threads; every copy lies inside one registered piece (the fake counts copies from
    unregistered memory); one unregistration per piece at the resume."""
    n = 20 * MiB + 77
    p = _alloc(n, "t")
    d = fill(p, n, 5)
    FAKE.ebt_fake_set_delay(b"cuMemHostRegister", 3000)  # slow pinning: the other workers take pieces too
    em.pause("t")
    FAKE.ebt_fake_set_delay(b"cuMemHostRegister", 0)
    pieces = -(-n // (2 * MiB))
    assert FAKE.ebt_fake_calls(b"cuMemHostRegister") == pieces
    assert FAKE.ebt_fake_call_threads(b"cuMemHostRegister") >= 2
    em.resume("t")
    assert FAKE.ebt_fake_calls(b"cuMemHostUnregister") == pieces
    assert read(p, n) == d and counters()["unpinned"] == 0
    free(p)
    assert_clean()


def retention_keeps_the_same_copy():
    """With host retention on, the resume keeps the copy (same address), the next pause copies into it again, and a
    resume without retention gives it back; release_host_memory() drops a retained copy of an active tensor."""
    n = 9 * MiB + 5
    p = _alloc(n, "t")
    d1 = fill(p, n, 1)
    em.set_host_retention(True)
    assert em.host_retention() and NATIVE.global_stats()["host_retention"]
    em.pause("t")
    first = em.get_cpu_backup_address(p)[0]
    em.resume("t")
    assert em.get_cpu_backup_address(p)[0] == first and read(p, n) == d1
    assert em.host_memory().transient_retained >= n
    d2 = fill(p, n, 2)
    em.pause("t")
    host = em.get_cpu_backup_address(p)[0]
    assert host == first and ctypes.string_at(host, n) == d2
    registrations = FAKE.ebt_fake_calls(b"cuMemHostRegister")
    em.set_host_retention(False)
    em.resume("t")
    assert FAKE.ebt_fake_calls(b"cuMemHostRegister") == registrations  # nothing pinned again for the restore
    assert em.get_cpu_backup_address(p) == (0, 0) and read(p, n) == d2 and _held() == (0, 0, 0)
    em.set_host_retention(True)
    em.pause("t")
    em.resume("t")
    assert em.host_memory().transient_copies == 1
    assert em.release_host_memory() >= 0 and _held() == (0, 0, 0)
    assert em.get_cpu_backup_address(p) == (0, 0)
    em.set_host_retention(False)
    free(p)
    assert_clean()


def pageable_copy_is_not_pinned_while_paused():
    """host="pageable" (torch_memory_saver's "mmap" backend): registered while the copies run, resident but not
    pinned while paused, registered again for the copies back (none from unregistered memory), unmapped after."""
    n = 11 * MiB + 3
    p = _alloc(n, "t", PAGEABLE)
    d = fill(p, n, 7)
    em.pause("t")
    copies, mapped, pinned = _held()
    assert copies == 1 and mapped >= n and pinned == 0 and counters()["registered"] == 0, _held()
    host, _ = em.get_cpu_backup_address(p)
    assert ctypes.string_at(host, n) == d
    em.resume("t")
    assert read(p, n) == d and counters()["unpinned"] == 0 and _held() == (0, 0, 0)
    em.set_host_retention(True)  # retained and pageable: kept resident, unregistered again after the copies
    em.pause("t")
    em.resume("t")
    copies, mapped, pinned = _held()
    assert copies == 1 and mapped >= n and pinned == 0, _held()
    em.set_host_retention(False)
    free(p)
    assert _held() == (0, 0, 0)
    assert_clean()


def host_memory_unavailable_at_pause():
    """A pause whose transient copies need more host memory than MemAvailable (or the cgroup) leaves: refused with
    HostOutOfMemoryError (an OutOfMemoryError) before anything is touched; the tag stays active, content intact."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    big = (avail * 2 + (2 * MiB - 1)) // (2 * MiB) * (2 * MiB)
    FAKE.ebt_fake_set_device_bytes(ctypes.c_size_t(big + 64 * MiB))
    p = _alloc(big, "huge")
    q = _alloc(4 * MiB, "huge")
    dq = fill(q, 4 * MiB, 3)
    ctypes.memmove(p, b"head", 4)
    expect_failure(lambda: em.pause("huge"), HostOutOfMemoryError, "available", "nothing was released")
    assert tag_row("huge")["state"] == "active" and read(q, 4 * MiB) == dq and ctypes.string_at(p, 4) == b"head"
    assert _held() == (0, 0, 0) and counters()["registered"] == 0
    free(p)
    em.pause("huge")  # the small one alone fits
    em.resume("huge")
    assert read(q, 4 * MiB) == dq
    free(q)
    assert_clean()


def register_failure_rolls_back(nth: str):
    """A piece that cannot be pinned (cuMemHostRegister fails with out-of-memory on call `nth`): the pause fails
    with HostOutOfMemoryError, what it released is mapped back and restored, no host copy is left; a retry works."""
    sizes = [6 * MiB, 6 * MiB + 9, 3 * MiB]
    ps = [_alloc(s, "t") for s in sizes]
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(ps, sizes))]
    fault("cuMemHostRegister", int(nth), 2)  # CUDA_ERROR_OUT_OF_MEMORY
    expect_failure(lambda: em.pause("t"), HostOutOfMemoryError)
    assert tag_row("t")["state"] == "active"
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    assert _held() == (0, 0, 0) and counters()["registered"] == 0
    em.pause("t")
    em.resume("t")
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    for p in ps:
        free(p)
    assert_clean()


def resume_copy_failure_keeps_the_copy():
    """A copy back that cannot be issued: the resume rolls back (tag paused) with the host copy intact, nothing given
    back; the retry restores everything and then gives the copy back."""
    sizes = [4 * MiB + 1, 4 * MiB]
    ps = [_alloc(s, "t") for s in sizes]
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(ps, sizes))]
    em.pause("t")
    held = _held()
    fault("cuMemcpyHtoDAsync", 2)
    expect_failure(lambda: em.resume("t"), DriverError, "rolled back")
    assert tag_row("t")["state"] == "paused" and _held() == held
    em.resume("t")
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d
    assert _held() == (0, 0, 0)
    for p in ps:
        free(p)
    assert_clean()


def free_gives_the_copy_back():
    """Freeing an allocation while paused (or while its copy is retained) unregisters and unmaps its copy."""
    p = _alloc(5 * MiB, "t")
    q = _alloc(5 * MiB, "u")
    em.pause("t")
    assert _held()[0] == 1
    free(p)
    assert _held() == (0, 0, 0) and counters()["registered"] == 0
    em.set_host_retention(True)
    em.pause("u")
    em.resume("u")
    assert _held()[0] == 1
    free(q)
    assert _held() == (0, 0, 0) and counters()["registered"] == 0
    em.set_host_retention(False)
    assert_clean()


def mixed_with_the_arena():
    """One pause of arena-backed, transient, pageable and discard allocations: each kind keeps its rules (the
    arena keeps its block, the transient copies go)."""
    a = _alloc(3 * MiB, "m", NATIVE.BACKUP_CPU)
    t = _alloc(3 * MiB, "m", TRANSIENT)
    g = _alloc(3 * MiB, "m", PAGEABLE)
    z = _alloc(3 * MiB, "m", NATIVE.BACKUP_NONE)
    data = {p: fill(p, 3 * MiB, i) for i, p in enumerate((a, t, g))}
    em.wait_background_pinning()
    em.pause("m")
    em.resume("m")
    for p, d in data.items():
        assert read(p, 3 * MiB) == d
    assert em.get_cpu_backup_address(a)[0] != 0  # the arena keeps its copy
    assert em.get_cpu_backup_address(t) == (0, 0) and em.get_cpu_backup_address(g) == (0, 0)
    assert _held() == (0, 0, 0)
    for p in (a, t, g, z):
        free(p)
    assert_clean()


if __name__ == "__main__":
    main(globals())
