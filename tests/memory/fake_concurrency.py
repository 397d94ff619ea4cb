"""Operations from several threads and processes: async pause/resume and their ownership of a tag, allocation
churn during pause/resume, waits, a forked child, and a long soak without growth.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_concurrency.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import os
import threading
import warnings

import ebbtide.memory as em
from ebbtide.errors import DriverError, StateError, WaitTimeoutError

from _fake_driver import MiB, RUNTIME, alloc, assert_clean, counters, fault, fill, free, read, tag_row
from _scenario_runner import main


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


if __name__ == "__main__":
    main(globals())
