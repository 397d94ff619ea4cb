"""The store-based control plane, with ranks as threads over one in-memory store."""
from __future__ import annotations

import datetime
import threading

import pytest

dist = pytest.importorskip("torch.distributed")

from ebbtide.comm._control import ControlPlane  # noqa: E402
from ebbtide.errors import WaitTimeoutError  # noqa: E402

T = datetime.timedelta(seconds=20)


def _run_ranks(n, body):
    store = dist.HashStore()
    results, errors = [None] * n, []

    def run(r):
        try:
            results[r] = body(ControlPlane.create(store, r, n), r)
        except Exception as e:  # collected and re-raised in the test thread
            errors.append((r, e))

    ths = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    return store, results, errors


def test_allgather_orders_by_rank_and_cleans_up():
    def body(cp, r):
        out = [cp.allgather("x", f"v{r}-{i}".encode(), T) for i in range(5)]
        return cp.namespace, out

    store, results, errors = _run_ranks(3, body)
    assert not errors
    namespaces = {ns for ns, _ in results}
    assert len(namespaces) == 1
    for _ns, out in results:
        assert out == [[f"v{r}-{i}".encode() for r in range(3)] for i in range(5)]
    ns = namespaces.pop()
    # Only the last call's keys are left (each rank deletes its previous key once the next call completes).
    left = [f"{ns}/{s}/x/{r}" for s in range(5) for r in range(3) if store.check([f"{ns}/{s}/x/{r}"])]
    assert left == [f"{ns}/4/x/{r}" for r in range(3)]


def test_second_creation_gets_a_fresh_namespace():
    store = dist.HashStore()
    a = [ControlPlane.create(store, r, 2).namespace for r in range(2)]
    b = [ControlPlane.create(store, r, 2).namespace for r in range(2)]
    assert a[0] == a[1] and b[0] == b[1] and a[0] != b[0]


def test_timeout_names_the_missing_ranks():
    def body(cp, r):
        if r in (1, 3):
            return None  # never arrives
        with pytest.raises(WaitTimeoutError) as ei:
            cp.barrier("release", datetime.timedelta(seconds=0.5))
        return str(ei.value)

    _store, results, errors = _run_ranks(4, body)
    assert not errors
    for r in (0, 2):
        assert "ranks [1, 3] never arrived" in results[r], results[r]
        assert "'release'" in results[r]


def test_latecomer_does_not_act_alone():
    gave_up = threading.Event()

    def body(cp, r):
        if r == 0:
            with pytest.raises(WaitTimeoutError):
                cp.barrier("release", datetime.timedelta(seconds=0.3))
            gave_up.set()
            return "timed out"
        gave_up.wait(10)  # arrives after rank 0 abandoned the step: every key is there, but it must not proceed
        with pytest.raises(WaitTimeoutError) as ei:
            cp.barrier("release", datetime.timedelta(seconds=5))
        return str(ei.value)

    _store, results, errors = _run_ranks(2, body)
    assert not errors
    assert "rank 0 gave up waiting" in results[1], results[1]
