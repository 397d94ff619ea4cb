"""Release order of ``_teardown.release_all``: every child before the group it was split from, whatever the two plans
(suspend / destroy) are, and one-at-a-time reverse journal order with install(concurrent_teardown=False). No NCCL
on the CPU: the per-group work is recorded instead of done (the order is what is under test; the Gloo and NCCL
tests run the real teardowns)."""
from __future__ import annotations

import datetime
import logging
import threading
import time

import pytest

pytest.importorskip("torch")

from ebbtide.comm import _backend as B  # noqa: E402
from ebbtide.comm import _runtime as R  # noqa: E402
from ebbtide.comm import _strategy as S  # noqa: E402
from ebbtide.comm import _teardown as T  # noqa: E402
from ebbtide.comm._journal import Entry  # noqa: E402


class _Group:
    def __init__(self, name):
        self._ebt_name, self._ebt_desc = name, name
        self._ebt_released_by = None

    def _ebt_mark_released(self, plan):
        self._ebt_released_by = plan


def _setup(monkeypatch, concurrent, plans):
    """WORLD -> split child 'tp' -> split grandchild 'tp.sub', plus a new_group 'pp'; plans by name."""
    world, tp, sub, pp = (_Group(n) for n in ("world", "tp", "tp.sub", "pp"))
    journal = [Entry("world", "world", (), {}, world), Entry("group", "pp", (0, 1), {}, pp),
               Entry("split", "tp", (0, 1), {}, tp, parent=world),
               Entry("split", "tp.sub", (0,), {}, sub, parent=tp)]
    for e in journal:
        e.plan = plans[e.name]
    rt = R.Runtime()
    rt.journal = journal
    rt.concurrent_teardown = concurrent
    order, lock = [], threading.Lock()

    def release_one(rt_, e, inner, measure=True):
        with lock:
            order.append((e.name, e.plan))
        return e.name

    def timed_teardown(inner, how, device=None):
        with lock:
            order.append((inner, "destroy"))
        return 0.0

    monkeypatch.setattr(T, "_release_one", release_one)
    monkeypatch.setattr(B, "timed_teardown", timed_teardown)
    monkeypatch.setattr(T, "_global_ranks", lambda g: [])
    todo = list(reversed(journal))
    detached = {e: e.name for e in journal}  # the "inner" handed to the teardown: its name, for the record
    return rt, todo, detached, order


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("plans", [
    {"world": S.SUSPEND, "pp": S.DESTROY, "tp": S.DESTROY, "tp.sub": S.DESTROY},  # child not created yet
    {"world": S.SUSPEND, "pp": S.SUSPEND, "tp": S.SUSPEND, "tp.sub": S.DESTROY},
    {"world": S.DESTROY, "pp": S.DESTROY, "tp": S.SUSPEND, "tp.sub": S.DESTROY},
    {"world": S.DESTROY, "pp": S.DESTROY, "tp": S.DESTROY, "tp.sub": S.DESTROY},
])
def test_children_before_parents_whatever_the_plans(monkeypatch, concurrent, plans):
    rt, todo, detached, order = _setup(monkeypatch, concurrent, plans)
    T.release_all(rt, todo, detached)
    done = [name for name, _ in order]
    assert sorted(done) == sorted(plans), order
    assert done.index("tp.sub") < done.index("tp") < done.index("world"), order
    assert done.index("pp") < done.index("world"), order
    if not concurrent:  # exactly the reverse journal order, one at a time
        assert done == [e.name for e in todo], order


def test_a_slow_teardown_is_named_in_the_log(monkeypatch, caplog):
    # an abort cannot be interrupted: release keeps waiting, but says which groups are stuck every timeout period
    plans = {"world": S.DESTROY, "pp": S.DESTROY, "tp": S.DESTROY, "tp.sub": S.DESTROY}
    rt, todo, detached, order = _setup(monkeypatch, True, plans)

    def slow_for_pp(inner, how, device=None):
        if inner == "pp":
            time.sleep(0.5)
        order.append((inner, "destroy"))
        return 0.0

    monkeypatch.setattr(B, "timed_teardown", slow_for_pp)
    with caplog.at_level(logging.ERROR, logger=R.log.name):
        T.release_all(rt, todo, detached, datetime.timedelta(seconds=0.1))
    slow = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert slow and all("'pp'" in m and "'tp'" not in m for m in slow), caplog.text
    assert [n for n, _ in order][-1] == "world"


def test_a_background_teardown_takes_no_device_free_probes(monkeypatch):
    # Beside the caller's own work (an offload freeing gigabytes) a probe would credit the teardown with that
    # memory and mark groups as having had a communicator, which reload would then connect.
    plans = {"world": S.DESTROY, "pp": S.DESTROY, "tp": S.DESTROY, "tp.sub": S.DESTROY}
    free = iter(range(1 << 30, 1 << 40, 1 << 30))  # every probe sees 1 GiB more free: someone else is freeing
    monkeypatch.setattr(T, "device_free_bytes", lambda: next(free))
    for measure in (False, True):
        rt, todo, detached, _order = _setup(monkeypatch, True, plans)
        reports = T.release_all(rt, todo, detached, measure=measure)
        if measure:  # single-group waves get a figure (here the other work's), and the entry counts as connected
            assert any(r.bytes for r in reports) and any(e.initialized for e in todo)
        else:
            assert all(r.bytes is None for r in reports) and not any(e.initialized for e in todo)
