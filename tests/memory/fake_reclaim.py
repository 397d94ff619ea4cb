"""Zombie reclaim: memory that members freed inside a coalesced mapping still hold is given back when an
allocation (or a resume's pre-flight) on their device runs short, so PyTorch's out-of-memory answer (free the
cached blocks, retry cudaMalloc) works with coalescing on as it does without it. The live members keep their
addresses and content; a driver failure in the middle rolls back completely.

Engine scenarios against the host-memory fake driver (64 MiB per device), one per process:
``python fake_reclaim.py <scenario> [args...]`` (test_engine_fake.py runs them). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import ebbtide.memory as em
from ebbtide.errors import DriverError, OutOfMemoryError

from _fake_driver import FAKE, MiB, NATIVE, alloc, assert_clean, counters, fault, fill, free, read, tag_row, trace
from _scenario_runner import main


def _coalesced_tag(tag: str, backups: list, size: int = 4 * MiB) -> tuple:
    """Allocations of `tag` (one per backup), paused and resumed as ONE coalesced mapping, then filled."""
    ps = [alloc(size, tag, b) for b in backups]
    assert all(ps[i + 1] == ps[i] + size for i in range(len(ps) - 1)), "allocations are VA-contiguous"
    em.pause(tag)
    rep = em.resume(tag)
    assert rep.mappings == 1, rep
    return ps, [fill(p, size, i + 11) for i, p in enumerate(ps)]


def _check(ps: list, data: list, alive: list, size: int = 4 * MiB, what: str = "") -> None:
    for i in alive:
        assert read(ps[i], size) == data[i], f"content of member {i} lost {what}"
        base, length, tag, paused = NATIVE.lookup(ps[i] + 4096)
        assert base == ps[i] and length == size, (hex(base), length)


def reclaim_on_oom():
    """OOM with zombies holding enough to cover it: the allocation (torch-mode entry point and C API) reclaims the
    zombies — device drained first, the live members copied out, the whole mapping unmapped, the live runs mapped
    again at the same addresses, copied back — and succeeds. Content and addresses survive, the live runs stay
    coalesced, stats count the reclaim, later cycles work. A resume short of memory reclaims another tag's
    zombies the same way (reclaim_at_resume). A shortfall the zombies cannot cover reclaims nothing."""
    assert em.coalescing(), "coalescing must be on by default"
    backups = ["cpu", "none", "none", "cpu", "none", "cpu", "none", "none"]
    ps, data = _coalesced_tag("kv", backups)  # 32 MiB in one mapping
    for i in (1, 2, 5, 7):  # zombies: 16 MiB held; live runs [0] [3 4] [6]
        free(ps[i])
    alive = [0, 3, 4, 6]
    assert em.stats()["global"]["bytes_pending_free"] == 16 * MiB
    filler = alloc(30 * MiB, "fill", "none")  # 2 MiB left on the 64 MiB device
    try:  # 2 free + 16 held < 20: reclaiming cannot help, so nothing is moved
        NATIVE.malloc(20 * MiB, 0, "other", 0)
        raise AssertionError("an allocation beyond the device succeeded")
    except OutOfMemoryError as e:
        assert "coalesced" in str(e), e
    assert em.stats()["global"]["zombie_reclaims"] == 0 and counters()["mappings"] == 2
    trace()
    p = alloc(12 * MiB, "other", "none")  # the torch-mode path: NULL would make PyTorch free its cache and retry
    calls = trace()
    assert p, "allocation failed although zombies held enough"
    assert calls.index("cuCtxSynchronize") < calls.index("cuMemcpyDtoHAsync") < calls.index("cuMemUnmap"), calls
    assert calls.count("cuMemUnmap") == 1 and calls.count("cuMemMap") == 3 + 1, calls  # 3 live runs + the retry
    g = em.stats()["global"]
    assert g["zombie_reclaims"] == 1 and g["bytes_reclaimed"] == 16 * MiB, g
    assert g["bytes_pending_free"] == 0 and g["coalesced_mappings"] == 1, g  # the run [3 4]
    row = tag_row("kv")
    assert (row["handles"], row["allocations"], row["bytes_active"]) == (3, 4, 16 * MiB), row
    _check(ps, data, alive, what="by the reclaim")
    for i in alive:
        assert not ps[i] <= p < ps[i] + 4 * MiB, "VA of a live member handed out"
    # Cycles after the reclaim: same addresses; CPU-backed content restored each time.
    for _ in range(2):
        rep = em.pause("kv")
        assert rep.allocations == 4 and rep.mappings == 3 and rep.bytes_pending_freed == 0, rep
        rep = em.resume("kv")
        assert rep.mappings == 3, rep  # [0] [3 4] [6]: the reclaimed zombies' holes split the runs
        _check(ps, data, [0, 3])
    for x in (p, filler, *[ps[i] for i in alive]):
        free(x)
    assert_clean()


def reclaim_at_resume():
    """A resume whose pre-flight finds too little free memory, while another tag's zombies hold enough to cover the
    shortfall: the zombies are reclaimed first and the resume succeeds; without enough held it fails with the tag
    still paused and nothing moved."""
    q, qdata = _coalesced_tag("q", ["cpu"] * 4)  # 16 MiB
    em.pause("q")
    r, rdata = _coalesced_tag("r", ["cpu", "none", "cpu", "cpu"])  # 16 MiB, one mapping
    free(r[1])  # 4 MiB zombie; live runs [0] [2 3]
    filler = alloc(38 * MiB, "fill", "none")  # r 16 + fill 38 = 54: 10 MiB free, q needs 16, 10 + 4 < 16
    try:
        em.resume("q")
        raise AssertionError("resume beyond the device succeeded")
    except OutOfMemoryError:
        pass
    assert tag_row("q")["state"] == "paused" and em.stats()["global"]["zombie_reclaims"] == 0
    free(filler)
    filler = alloc(34 * MiB, "fill", "none")  # 14 MiB free: 14 + 4 >= 16 -> reclaim, then resume
    rep = em.resume("q")
    assert rep.allocations == 4 and em.stats()["global"]["zombie_reclaims"] == 1, rep
    _check(q, qdata, range(4))
    _check(r, rdata, [0, 2, 3])
    assert tag_row("r")["handles"] == 2 and tag_row("r")["bytes_pending_free"] == 0
    for p in q + [r[0], r[2], r[3], filler]:
        free(p)
    assert_clean()


# Faults (fake_scenarios_spec.RECLAIM_FAULTS) count calls from the failing allocation's start: its own cuMemCreate
# is call 1 (out of memory), so the reclaim's creates are calls 2 (live run [0 1]) and 3 (run [3 4]); its copies
# out are cuMemcpyDtoHAsync 1.. (one per member), back cuMemcpyHtoDAsync 1..; cuMemUnmap 1 is the whole mapping.
# These two fail the rollback's own mapping too:
LOST = ["cuMemSetAccess:-1", "cuMemMap:-1"]


def reclaim_fault_injection(spec: str):
    """A driver failure in the middle of a reclaim. Before the unmap: nothing changed. After it: the new mappings
    are unmapped and the whole range mapped again as one mapping, content copied back — the mapping, its zombies
    and every live member's content are as before, and a retry succeeds. If the rollback's own mapping fails too,
    the live members are left paused (tag PAUSED), CPU-backed content restored by the next resume."""
    name, nth = spec.split(":")
    backups = ["cpu", "none", "cpu", "cpu", "none", "cpu"]
    ps, data = _coalesced_tag("w", backups)  # 24 MiB
    filler = alloc(38 * MiB, "fill", "none")  # 2 MiB free
    free(ps[2])
    free(ps[5])  # zombies: 8 MiB; live runs [0 1] [3 4]
    alive = [0, 1, 3, 4]
    if name == "cuMemHostRegister":  # no host block left to reuse: the reclaim must pin staging memory
        em.release_host_memory()
    before = counters()
    fault(name, int(nth))
    try:
        NATIVE.malloc(8 * MiB, 0, "other", 0)
        raise AssertionError(f"allocation succeeded although {spec} failed the reclaim")
    except OutOfMemoryError as e:
        assert "freed members" in str(e), e
    except DriverError as e:
        raise AssertionError(f"the allocation's error is the shortfall, not the reclaim's: {e}") from e
    fault(name, 0)
    g = em.stats()["global"]
    assert g["zombie_reclaims"] == 0, g
    if spec in LOST:
        row = tag_row("w")
        assert row["state"] == "paused" and row["bytes_pending_free"] == 0, row
        assert counters()["mappings"] == 1 and counters()["phys"] == 38 * MiB, counters()  # the filler alone
        em.resume("w")
        _check(ps, data, [i for i in alive if backups[i] == "cpu"], what=f"(rollback failed: {spec})")
    else:
        assert g["bytes_pending_free"] == 8 * MiB, g
        c = counters()
        assert (c["mappings"], c["phys"], c["handles"]) == (before["mappings"], before["phys"], before["handles"]), c
        _check(ps, data, alive, what=f"after the failed reclaim ({spec})")
        p = NATIVE.malloc(8 * MiB, 0, "other", 0)  # the retry reclaims
        assert em.stats()["global"]["zombie_reclaims"] == 1
        _check(ps, data, alive, what=f"by the retried reclaim ({spec})")
        free(p)
    em.pause("w")
    em.resume("w")
    _check(ps, data, [i for i in alive if backups[i] == "cpu"], what="after a cycle")
    for i in alive:
        free(ps[i])
    free(filler)
    assert_clean()


def reclaim_orders_with_ops():
    """A pause of the tag that arrives while a reclaim moves its members waits for it (then pauses the rebuilt
    mappings, no zombie left), and a free() of a member being moved waits too; neither sees a half-moved mapping.
    The fake sleeps in the reclaim's drain (cuCtxSynchronize) to hold the window open."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    ps, data = _coalesced_tag("kv", ["cpu", "none", "cpu", "cpu", "cpu"])
    free(ps[1])  # zombie: live groups [0] [2 3 4]
    filler = alloc(40 * MiB, "fill", "none")  # 20 + 40 = 60: 4 MiB free
    done = {}

    def allocate():
        done["ptr"] = alloc(8 * MiB, "other", "none")  # ctypes: the GIL is released while it reclaims
        done["t"] = time.perf_counter()

    def free_member():
        free(ps[4])  # a member being moved: waits for the reclaim's commit
        done["freed_after_reclaim"] = em.stats()["global"]["zombie_reclaims"] == 1

    FAKE.ebt_fake_set_delay(b"cuCtxSynchronize", 300_000)
    infos = FAKE.ebt_fake_calls(b"cuMemGetInfo")
    t = threading.Thread(target=allocate)
    t.start()
    deadline = time.monotonic() + 30
    while FAKE.ebt_fake_calls(b"cuMemGetInfo") == infos and time.monotonic() < deadline:
        time.sleep(0.005)  # the allocation ran short and measured the device: the reclaim's drain comes next
    time.sleep(0.05)
    f = threading.Thread(target=free_member)
    f.start()
    rep = em.pause("kv")
    reclaimed_before_pause_returned = em.stats()["global"]["zombie_reclaims"] == 1
    f.join()
    t.join()
    FAKE.ebt_fake_set_delay(b"cuCtxSynchronize", 0)
    assert reclaimed_before_pause_returned and done["freed_after_reclaim"], done
    # The pause began after the reclaim gave ps[1]'s memory back: the only zombie it can meet is ps[4], freed
    # inside the rebuilt mapping [2 3 4] if the free ran first.
    assert rep.allocations in (3, 4), rep
    assert rep.bytes_pending_freed == (4 * MiB if rep.allocations == 3 else 0), rep
    em.resume("kv")
    _check(ps, data, [0, 2, 3])
    for x in (done["ptr"], filler, ps[0], ps[2], ps[3]):
        free(x)
    assert_clean()


def reclaim_picks_cheapest():
    """Of two mappings holding zombies, the reclaim moves the one with the fewest live bytes per zombie byte and
    stops once the shortfall is covered: the other keeps its zombie (and its live members are not copied)."""
    a, adata = _coalesced_tag("a", ["cpu"] * 4)  # 16 MiB
    b, bdata = _coalesced_tag("b", ["none"] * 2)  # 8 MiB
    free(a[1])  # a: 12 MiB live per 4 MiB zombie
    free(b[0])  # b: 4 MiB live per 4 MiB zombie
    filler = alloc(38 * MiB, "fill", "none")  # 2 MiB free
    trace()
    p = NATIVE.malloc(4 * MiB, 0, "other", 0)  # short by 2 MiB: one reclaim covers it
    calls = trace()
    assert calls.count("cuMemcpyDtoHAsync") == 1, calls  # b's one live member only
    g = em.stats()["global"]
    assert (g["zombie_reclaims"], g["bytes_reclaimed"]) == (1, 4 * MiB), g
    assert tag_row("a")["bytes_pending_free"] == 4 * MiB and tag_row("b")["bytes_pending_free"] == 0
    _check(a, adata, [0, 2, 3])
    _check(b, bdata, [1])
    for x in (p, filler, a[0], a[2], a[3], b[1]):
        free(x)
    assert_clean()


# reclaim_on_device's faults (fake_scenarios_spec.RECLAIM_DEVICE_FAULTS), counted from the failing allocation's
# start: its own cuMemCreate is call 1; the staging mapping is cuMemCreate 2 / cuMemMap 1; copies out are
# cuMemcpyDtoDAsync 1-3 (one per live member), back 4-6; the live members' mappings cuMemCreate 3-4.
DEVICE_FALLS_BACK_TO_HOST = ["cuMemCreate:2", "cuMemMap:1"]  # no staging mapping: the host path, which succeeds
DEVICE_UNCHANGED = ["cuMemcpyDtoDAsync:-1", "cuMemcpyDtoDAsync:2"]  # a copy out fails: nothing changed


def reclaim_on_device(spec: str = "none"):
    """When the device has room for the live bytes (not for the request), the reclaim stages them in a spare
    device mapping (device-to-device both ways, no host memory pinned) and gives that mapping back at the end. A
    failure of the staging mapping falls back to host staging; a failure after the unmap rolls back (the whole
    mapping again, content copied back from the device staging); a failed copy out changes nothing."""
    backups = ["cpu", "none", "none", "cpu", "none"]
    ps, data = _coalesced_tag("kv", backups)  # 20 MiB
    free(ps[1])
    free(ps[2])  # zombies 8 MiB; live [0] [3 4]: 12 MiB
    alive = [0, 3, 4]
    filler = alloc(30 * MiB, "fill", "none")  # 64 - 50: 14 MiB free >= 12 live, < 16 asked
    host_before = em.stats()["global"]["host_reserved"]
    mappings_before = counters()["mappings"]
    if spec != "none":
        name, nth = spec.split(":")
        fault(name, int(nth))
    trace()
    try:
        p = NATIVE.malloc(16 * MiB, 0, "other", 0)
    except OutOfMemoryError as e:
        p = None
        assert spec not in ("none", *DEVICE_FALLS_BACK_TO_HOST), f"{spec}: {e}"
        assert "freed members" in str(e), e
    calls = trace()
    if spec != "none":
        fault(spec.split(":")[0], 0)
    g = em.stats()["global"]
    if p is not None:
        assert g["zombie_reclaims"] == 1 and g["bytes_reclaimed"] == 8 * MiB, g
        if spec == "none":
            assert "cuMemcpyDtoDAsync" in calls and "cuMemcpyDtoHAsync" not in calls, calls
            assert em.stats()["global"]["host_reserved"] == host_before, "host memory pinned for a device reclaim"
        else:
            assert "cuMemcpyDtoHAsync" in calls, calls
        assert tag_row("kv")["handles"] == 2  # [0] and [3 4]
        free(p)
    else:  # rolled back or unchanged: the mapping with its zombies, the content, no staging left behind
        assert g["zombie_reclaims"] == 0 and g["bytes_pending_free"] == 8 * MiB, g
        assert counters()["mappings"] == mappings_before, counters()
        if spec not in DEVICE_UNCHANGED:
            assert calls.count("cuMemUnmap") >= 2, calls  # the old mapping and the staging
        p = NATIVE.malloc(16 * MiB, 0, "other", 0)  # a clean retry reclaims
        assert em.stats()["global"]["zombie_reclaims"] == 1
        free(p)
    _check(ps, data, alive, what=f"({spec})")
    for x in (filler, *[ps[i] for i in alive]):
        free(x)
    assert_clean()


def reclaim_with_coalescing_off():
    """With coalescing turned off after the mapping was made, a reclaim maps every live member on its own."""
    ps, data = _coalesced_tag("a", ["none", "cpu", "cpu", "none"])
    free(ps[0])
    em.set_coalescing(False)
    filler = alloc(44 * MiB, "fill", "none")  # 16 + 44 = 60: 4 MiB free
    p = NATIVE.malloc(8 * MiB, 0, "other", 0)  # 4 free + 4 held: reclaim, per-member mappings
    assert tag_row("a")["handles"] == 3 and em.stats()["global"]["coalesced_mappings"] == 0
    _check(ps, data, [1, 2, 3])
    em.set_coalescing(True)
    for x in (p, filler, ps[1], ps[2], ps[3]):
        free(x)
    assert_clean()


if __name__ == "__main__":
    main(globals())
