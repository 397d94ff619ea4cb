"""release(wait=False) without a SUSPEND plan: reload() does not wait for the teardowns of the detached inners, the
next release() does, and a failure surfaces there on every rank (Note [Detached teardown] in
ebbtide/comm/_teardown.py). Gloo with 2 spawned ranks, teardowns made slow (or failing) inside the ranks; bodies in
detached_workers.py."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")

import comm_spawn as _spawn  # noqa: E402  (tests/comm is on sys.path: conftest.py)

SLOW = 1.5  # seconds each inner's teardown takes; two waves (subgroups, then WORLD): 3 s for one release
DEADLINE_S = {"test_reload_does_not_wait_and_next_release_does": 120, "test_failure_raised_at_next_release": 120,
              "test_suspend_plan_is_still_joined_by_reload": 120, "test_nccl_reload_beside_teardown": 150}


def test_reload_does_not_wait_and_next_release_does():
    res = _spawn.run("reload_beside_teardown", 2, module="detached_workers", slow=SLOW, timeout=120)
    for r in res:
        # (1) reload returned well before the first wave's teardowns ended, while they still ran
        assert r["release_s"] < SLOW / 2 and r["reload_s"] < SLOW / 2 and r["pending_after_reload"], r
        assert r["future_seconds"] >= 2 * SLOW * 0.9, r  # the Report: done when both waves were
        # (3) the next release tore nothing down before the previous release's teardowns had all ended
        assert r["new_start"] >= r["old_end"], r
        assert r["old_end"] >= 2 * SLOW * 0.9 > r["second_called"], r  # it was called while they ran
        # (4) wait=True: its Report comes after its own teardowns (two more waves)
        assert r["second_returned"] >= r["new_end"] >= r["old_end"] + 2 * SLOW * 0.9, r


def test_failure_raised_at_next_release():
    res = _spawn.run("failure_at_next_release", 2, module="detached_workers", timeout=120)
    for r in res:  # every rank raises, naming the rank that failed and the cause
        assert "on ranks [1]" in r["release"] and "injected teardown failure" in r["release"], r
        assert "nothing was released" in r["release"], r
    assert "injected teardown failure" in res[1]["uninstall"] and "uninstall" not in res[0], res


def test_every_wave_is_attempted_after_a_failure():
    res = _spawn.run("every_wave_after_a_failure", 2, module="detached_workers", timeout=120)
    assert res[1]["failed"] and not res[0]["failed"], res
    for r in res:
        assert r["attempted"] == r["groups"], r  # WORLD's wave ran after its subgroups' failed
        assert "on ranks [1]" in r["raised"], r


def test_ranks_must_agree_on_wait():
    res = _spawn.run("wait_must_agree", 2, module="detached_workers", timeout=120)
    assert all("include_world/include_cpu/" in r and "wait" in r for r in res), res


def test_suspend_plan_is_still_joined_by_reload():
    res = _spawn.run("suspend_is_joined_by_reload", 2, module="detached_workers", slow=1.0, timeout=120)
    for r in res:
        assert r["running_after_release"] and r["release_s"] < 0.5, r
        assert r["reload_s"] >= 1.0 * 0.9, r  # reload waited for the background suspend
        assert r["calls"] == ["suspend", "resume"], r


@pytest.mark.multigpu
def test_nccl_reload_beside_teardown():
    """NCCL on 2 GPUs: reload() beside the running teardowns (WORLD included) gives exact collectives on every group,
    does not wait for the teardowns, and device memory does not drift over the cycles."""
    res = _spawn.run("nccl_reload_beside_teardown", 2, module="detached_workers", timeout=150, cycles=6)
    for r in res:
        rows = r["rows"]
        for row in rows:
            print(row)
        assert all(row["groups"] >= 7 for row in rows), rows
        frees = [row["free_mib"] for row in rows[1:]]
        assert max(frees) - min(frees) <= 64, frees
        detached = [row for row in rows if row["detached"]]
        assert any(row["pending_at_reload"] for row in detached), detached  # reload ran beside the teardowns
        assert all(row["reload_bytes"] is None for row in detached if row["pending_at_reload"]), detached
