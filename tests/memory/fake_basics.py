"""What an allocation keeps across pause/resume (address, content, tag, device) and what the engine
reports about it: stats, regions, refusals, the release report, the versioned C structs.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_basics.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import warnings

import ebbtide.memory as em
from ebbtide.errors import InvalidArgumentError, NotFoundError, StateError
from ebbtide.memory._engine import Report

from _fake_driver import MiB, NATIVE, RUNTIME, alloc, assert_clean, counters, fill, free, read, tag_row, trace
from _scenario_runner import main


def va_stability_and_roundtrip():
    sizes = [5 * MiB + 123, 2 * MiB, 300]
    w = [alloc(s, "weights", "cpu") for s in sizes]
    kv = alloc(4 * MiB, "kv", "none")
    data = [fill(p, s, i) for i, (p, s) in enumerate(zip(w, sizes))]
    fill(kv, 4 * MiB, 99)
    before = counters()
    seen: set = set()  # every field the native report carries has a home in the Python Report
    native_report = Report.from_native.__func__
    Report.from_native = classmethod(lambda cls, kind, tag, d: (seen.update(d), native_report(cls, kind, tag, d))[1])
    try:
        rep = em.pause("weights")
    finally:
        Report.from_native = classmethod(native_report)
    oom = {"oom_needed", "oom_free", "oom_device"}  # carried by OutOfMemoryError, not by a report
    missing = seen - oom - {f.name for f in dataclasses.fields(Report)}
    assert seen and not missing, f"native report fields the Python Report drops: {sorted(missing)}"
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
    for bad in (lambda: em.region("t", "ssd").__enter__(), lambda: em.pause(""), lambda: em.pause("x" * 64),
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


def check_setting(expect: str):
    """EBBTIDE_MEM_CHECK (the test sets it to a value meaning on) turns the paused-block checker on from the start
    (a value that does not parse fails at the import of ebbtide.memory: test_engine_fake.py)."""
    assert expect == "on", expect
    p = alloc(2 * MiB, "t", "cpu")
    em.pause("t")
    assert em.check() == []  # no StateError: checking was on before the pause (no PyTorch GPU: nothing found)
    em.resume("t")
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


if __name__ == "__main__":
    main(globals())
