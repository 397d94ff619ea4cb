"""Coalesced resume (the default; EBBTIDE_MEM_COALESCE=0 / em.set_coalescing(False) turns it off): one physical
allocation per VA-contiguous run of a tag, zombies of members freed while active, and rollback with coalesced
mappings.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_coalesce.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import ctypes
import os

import ebbtide.memory as em
from ebbtide.errors import DriverError, InvalidArgumentError, NotFoundError, OutOfMemoryError

import _fake_driver
from _fake_driver import (CUDA_ERROR_INVALID_VALUE, FAKE, MiB, NATIVE, alloc, assert_clean, counters, fault, fill,
                          free, read, tag_row, trace)
from _scenario_runner import main


def _mappings_row(tag: str) -> tuple:
    r = tag_row(tag)
    return r["handles"], r["allocations"], r["bytes_active"], r["bytes_pending_free"]


def coalesce_runs_and_zombies():
    """A resume maps a VA-contiguous run of a tag's allocations as ONE physical allocation (create, map, release,
    set-access: one call each); the next pause unmaps it with one call. A member freed while active is a zombie:
    gone from lookups and stats at once, its memory and VA held (no driver call) until the mapping is unmapped at
    the next pause or the last live member's free. A paused member's free returns its VA at once. reset() with a
    zombie outstanding leaks nothing. The fake refuses to unmap a sub-range of a mapping, as the real driver does."""
    assert em.coalescing() == (os.environ.get("EBBTIDE_MEM_COALESCE") != "0")
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
    _fake_driver.DELIBERATE_SUBRANGE_UNMAPS = 3  # read by assert_clean
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
    try:  # out of memory while zombies hold too little to cover it: no reclaim; the error says what they hold
        NATIVE.malloc(60 * MiB, 0, "other", 0)
        raise AssertionError("allocation beyond the fake device succeeded")
    except OutOfMemoryError as e:
        assert "coalesced" in str(e) and str(4 * MiB) in str(e), e
    assert em.stats()["global"]["zombie_reclaims"] == 0
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
    assert em.coalescing() == (os.environ.get("EBBTIDE_MEM_COALESCE") != "0"), "coalescing must be on by default"
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
    rep = em.pause("f")  # the first live member is not at the mapping's base: still one unmap of the whole
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
    """Rollback with coalesced mappings (the test sets EBBTIDE_MEM_COALESCE_MAX_BYTES=8
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


if __name__ == "__main__":
    main(globals())
