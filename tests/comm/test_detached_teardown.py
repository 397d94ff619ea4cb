"""release(wait=False): reload() does not wait for the teardowns of the detached inners, the next release() does,
and a failure surfaces there on every rank (Note [Detached teardown] in ebbtide/comm/_teardown.py). Gloo with 2
spawned ranks, teardowns made slow (or failing) inside the ranks; bodies in detached_workers.py."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")

from ebbtide.testing import spawn  # noqa: E402

SLOW = 1.5  # seconds each inner's teardown takes; two waves (subgroups, then WORLD): 3 s for one release
DEADLINE_S = {"test_reload_does_not_wait_and_next_release_does": 120, "test_failure_raised_at_next_release": 120,
              "test_nccl_reload_beside_teardown": 150, "test_nccl_one_gpu_reload_beside_teardown": 150}


def test_reload_does_not_wait_and_next_release_does():
    res = spawn.ranks("reload_beside_teardown", 2, module="detached_workers", slow=SLOW, timeout=120)
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
    res = spawn.ranks("failure_at_next_release", 2, module="detached_workers", timeout=120)
    for r in res:  # every rank raises, naming the rank that failed and the cause
        assert "on ranks [1]" in r["release"] and "injected teardown failure" in r["release"], r
        assert "nothing was released" in r["release"], r
    assert "injected teardown failure" in res[1]["uninstall"] and "uninstall" not in res[0], res


def test_every_wave_is_attempted_after_a_failure():
    res = spawn.ranks("every_wave_after_a_failure", 2, module="detached_workers", timeout=120)
    assert res[1]["failed"] and not res[0]["failed"], res
    for r in res:
        assert r["attempted"] == r["groups"], r  # WORLD's wave ran after its subgroups' failed
        assert "on ranks [1]" in r["raised"], r


def test_ranks_must_agree_on_wait():
    res = spawn.ranks("wait_must_agree", 2, module="detached_workers", timeout=120)
    assert all("include_world/include_cpu/" in r and "wait" in r for r in res), res


@pytest.mark.multigpu
def test_nccl_reload_beside_teardown():
    """NCCL on 2 GPUs: reload() beside the running teardowns (WORLD included) gives exact collectives on every group,
    does not wait for the teardowns, and device memory does not drift over the cycles."""
    res = spawn.ranks("nccl_reload_beside_teardown", 2, module="detached_workers", timeout=150, cycles=6)
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


@pytest.mark.gpu
def test_nccl_one_gpu_reload_beside_teardown():
    """NCCL on one GPU (one rank; WORLD, four groups, a singleton and a split_group child): the one background form
    of release on real communicators. reload() beside the detached teardowns gives exact collectives on every group,
    its memory figures are None while they run and measured when they were joined first, wait=True still works,
    and device memory does not drift over the cycles."""
    (r,) = spawn.ranks("nccl_reload_beside_teardown", 1, module="detached_workers", timeout=150, cycles=6)
    rows = r["rows"]
    for row in rows:
        print(row)
    assert r["groups"] >= 7 and all(row["groups"] >= 7 for row in rows), rows
    frees = [row["free_mib"] for row in rows[1:]]
    assert max(frees) - min(frees) <= 64, frees
    assert all(row["reload_bytes"] is None for row in rows if row["pending_at_reload"]), rows
    assert all(row["reload_bytes"] is not None for row in rows if not row["detached"]), rows  # joined: measured
