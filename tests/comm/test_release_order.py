"""Release order of ``_teardown.waves`` + ``Teardown.run``: every child before the group it was split from, one at a
time in reverse journal order with install(concurrent_teardown=False), every wave attempted after a failure, and
device-free probes only where asked for. No NCCL on the CPU: the per-group work is recorded instead of done (the
order is what is under test; the Gloo and NCCL tests run the real teardowns)."""
from __future__ import annotations

import datetime
import logging
import threading
import time

import pytest

pytest.importorskip("torch")

from ebbtide.comm import _backend as B  # noqa: E402
from ebbtide.comm import _teardown as T  # noqa: E402
from ebbtide.comm._journal import Entry  # noqa: E402
from ebbtide.comm._report import GroupReport  # noqa: E402

NAMES = ("world", "pp", "tp", "tp.sub")


def _journal():
    """WORLD -> split child 'tp' -> split grandchild 'tp.sub', plus a new_group 'pp' (groups stand in by name)."""
    world, tp, sub, pp = (object() for _ in NAMES)
    return [Entry("world", "world", (), {}, world), Entry("group", "pp", (0, 1), {}, pp),
            Entry("split", "tp", (0, 1), {}, tp, parent=world),
            Entry("split", "tp.sub", (0,), {}, sub, parent=tp)]


def _teardown(concurrent, tmo=datetime.timedelta(seconds=60)):
    """The Teardown the runtime would make for releasing the whole journal: the "inner" of each group is its name."""
    journal = _journal()
    todo = list(reversed(journal))
    slot = {e: i for i, e in enumerate(todo)}
    plan = [(level, [(slot[e], e.name) for e in wave]) for level, wave in T.waves(journal, todo, concurrent)]
    groups = [GroupReport(e.name, e.name, [], "destroy", "", 0.0, None) for e in todo]
    return todo, T.Teardown(plan, "shutdown", tmo, groups, [], 0, time.perf_counter(), 0.0)


@pytest.fixture
def order(monkeypatch):
    """Record each teardown (inner name, thread) instead of doing it."""
    done, lock = [], threading.Lock()

    def timed_teardown(inner, how, device=None):
        with lock:
            done.append((inner, threading.current_thread().name))
        return 0.0

    monkeypatch.setattr(B, "timed_teardown", timed_teardown)
    return done


@pytest.mark.parametrize("concurrent", [True, False])
def test_children_before_parents(order, concurrent):
    todo, work = _teardown(concurrent)
    work.run(measure=False)
    done = [name for name, _thread in order]
    assert sorted(done) == sorted(NAMES), order
    assert done.index("tp.sub") < done.index("tp") < done.index("world"), order
    assert done.index("pp") < done.index("world"), order
    if not concurrent:  # exactly the reverse journal order, one at a time, on the caller's thread
        assert done == [e.name for e in todo], order
        assert {t for _n, t in order} == {threading.current_thread().name}, order
    assert all(not wave for _level, wave in work.waves)  # the inners' last references are dropped
    rep = work.report()
    assert [g.name for g in rep.groups] == list(NAMES)  # the report in journal order


def test_a_slow_teardown_is_named_in_the_log(order, monkeypatch, caplog):
    # an abort cannot be interrupted: release keeps waiting, but says which groups are stuck every timeout period
    def slow_for_pp(inner, how, device=None):
        if inner == "pp":
            time.sleep(0.5)
        order.append((inner, "destroy"))
        return 0.0

    monkeypatch.setattr(B, "timed_teardown", slow_for_pp)
    _todo, work = _teardown(True, datetime.timedelta(seconds=0.1))
    with caplog.at_level(logging.ERROR, logger=T.log.name):
        work.run(measure=False)
    slow = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert slow and all("'pp'" in m and "'tp'" not in m for m in slow), caplog.text
    assert [n for n, _ in order][-1] == "world"


@pytest.mark.parametrize("concurrent", [True, False])
def test_every_wave_runs_after_a_failure(order, monkeypatch, concurrent):
    # A finalize waits for the same communicator on the peers: a rank that stopped at its first failed wave would
    # leave its peers' later waves (WORLD) waiting forever. The first failure is raised once every wave ran.
    real = B.teardown_concurrently

    def failing(work, how, tmo, names):
        if "tp.sub" in names.values() or "pp" in names.values():
            order.extend((inner, "failed") for inner in work.values())
            raise RuntimeError("injected teardown failure")
        return real(work, how, tmo, names)

    monkeypatch.setattr(B, "teardown_concurrently", failing)
    _todo, work = _teardown(concurrent)
    with pytest.raises(RuntimeError, match="injected"):
        work.run(measure=True)
    assert sorted(n for n, _ in order) == sorted(NAMES) and order[-1][0] == "world", order


def test_a_background_teardown_takes_no_device_free_probes(order, monkeypatch):
    # Beside the caller's own work (an offload freeing gigabytes) a probe would credit the teardown with that
    # memory and mark groups as having had a communicator, which reload would then connect.
    free = iter(range(1 << 30, 1 << 40, 1 << 30))  # every probe sees 1 GiB more free: someone else is freeing
    monkeypatch.setattr(T, "device_free_bytes", lambda: next(free))
    for measure in (False, True):
        _todo, work = _teardown(True)
        freed = work.run(measure=measure)
        if measure:  # single-group waves get a figure (here the other work's)
            assert freed and all(work.groups[slot].bytes == b for slot, b in freed.items()), freed
            assert len(freed) < len(NAMES)  # the wave of pp and tp (split level 1) is not separable
        else:
            assert not freed and all(g.bytes is None for g in work.groups)


def test_the_background_form_reports_and_raises(order, monkeypatch):
    _todo, work = _teardown(True)
    rep = T.detach(work, None).result(timeout=30)
    assert [g.name for g in rep.groups] == list(NAMES) and rep.free_before is None and rep.free_after is None
    monkeypatch.setattr(B, "teardown_concurrently", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    _todo, work = _teardown(True)
    err = T.detach(work, None).exception(timeout=30)
    assert isinstance(err, RuntimeError) and "injected" in T.failure_text(err)
