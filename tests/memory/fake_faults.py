"""Failures roll back: out of memory at resume (pre-flight and from the driver), every injected driver fault
in malloc, pause and resume, and the memory margin.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_faults.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations


import ebbtide.memory as em
from ebbtide.errors import DriverError, InvalidArgumentError, NotFoundError, OutOfMemoryError

from _fake_driver import (CUDA_ERROR_OUT_OF_MEMORY, FAKE, MiB, NATIVE, RUNTIME, alloc, assert_clean, counters, fault,
                          fill, free, read, tag_row, trace)
from _scenario_runner import main


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
    for what, call in (("tag state", lambda: NATIVE.tag_state("never-named")),
                       ("pause", lambda: em.pause("never-named")), ("resume", lambda: em.resume("never-named"))):
        try:
            call()
            raise AssertionError(f"{what} of an unknown tag succeeded")
        except NotFoundError as e:  # the user's words: the tag, the tags there are, no native call in the message
            msg = str(e)
            assert msg.startswith(f"{what}: no region has used tag 'never-named' (tags: ") and "w" in msg, msg
            assert f"{what}: {what}" not in msg and "ebt_" not in msg and "(&" not in msg, msg
    for bad in (-1, 1.5, True):
        try:
            em.set_memory_margin(bad)
            raise AssertionError(f"margin {bad!r} accepted")
        except InvalidArgumentError:
            pass
    free(a)
    free(b)
    assert_clean()


if __name__ == "__main__":
    main(globals())
