"""The shape of the driver calls of a pause and a resume: one unmap per VA-contiguous run, one set-access over
several mappings, drain before unmap, and the per-allocation fallbacks when the driver refuses a span.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_driver_calls.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import os

import ebbtide.memory as em

from _fake_driver import FAKE, MiB, NATIVE, alloc, assert_clean, counters, fault, fill, free, read, trace
from _scenario_runner import main


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


if __name__ == "__main__":
    main(globals())
