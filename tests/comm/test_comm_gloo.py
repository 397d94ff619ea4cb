"""ebbtide.comm on the Gloo backend with 2-4 spawned ranks (CPU; runs in CI). See comm_workers.py for each scenario."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")

import torch  # noqa: E402

from ebbtide.testing import spawn  # noqa: E402

W = "comm_workers"  # tests/comm is on sys.path (conftest.py)


def test_overlapping_groups_several_generations():
    res = spawn.ranks("overlapping", 4, module=W, timeout=150)
    for r in res:
        assert r["noop"] == [True, True, True]
        assert r["released_errors"] > 0
    # Rank 0 is in tp0, dp0, pp, emb, one0, sub, local: 7 groups x 4 ops, plus WORLD once, plus new_group x3.
    assert res[0]["released_errors"] == 7 * 4 * 3 + 1 + 3


def test_functional_collectives_and_device_mesh():
    res = spawn.ranks("functional", 2, module=W)
    assert all("device_mesh" in r for r in res)


def test_disagreeing_journals_are_refused():
    res = spawn.ranks("disagreement", 2, module=W)
    assert all("ranks [1]" in r["msg"] for r in res)


def test_barrier_timeout_names_missing_rank():
    res = spawn.ranks("missing_rank", 2, module=W)
    assert "ranks [1]" in res[0]["msg"]


def test_reload_timeout_names_missing_rank_and_stays_released():
    res = spawn.ranks("missing_rank_reload", 2, module=W)
    assert "ranks [1]" in res[0]["msg"] and "gave up" in res[1]["msg"]


def test_threads_and_fork():
    spawn.ranks("threads_and_fork", 2, module=W)


def test_background_release_is_joined_by_the_next_call():
    res = spawn.ranks("background_release", 2, module=W, timeout=150)
    for r in res:
        assert r["released_errors"] > 0 and len(r["reports"]) == 2
        assert "injected teardown failure" in r["failure"]


def test_install_after_init_adopts_world():
    spawn.ranks("install_after_init", 2, module=W)


def test_megatron_parallel_state():
    pytest.importorskip("megatron.core.parallel_state")
    res = spawn.ranks("megatron", 2, module=W, timeout=150)  # PP=2; the 8-rank test below covers wider overlap
    assert all(r["groups"] >= 4 for r in res), res


def test_megatron_like_topology_8_ranks():
    res = spawn.ranks("megatron_like_8", 8, module=W, timeout=170, cycles=2)
    assert all(len(r["cycles"]) == 2 for r in res)


def test_teardown_children_before_world():
    """Concurrent (default): the children in one wave of threads, each finished before WORLD's teardown starts."""
    res = spawn.ranks("teardown_order", 2, module=W)
    for r in res:
        world, children = r["names"][0], set(r["names"][1:])
        events = [tuple(x) for x in r["order"]]
        world_start = events.index(("start", world, "MainThread"))
        assert {n for ev, n, _t in events[:world_start] if ev == "end"} == children, r
        assert {t for _ev, n, t in events if n in children} != {"MainThread"}, r  # ran on worker threads
        assert events[-1][:2] == ("end", world), r


def test_teardown_sequential_reverse_order():
    res = spawn.ranks("teardown_order", 2, module=W, concurrent=False)
    for r in res:
        starts = [n for ev, n, _t in (tuple(x) for x in r["order"]) if ev == "start"]
        assert starts == list(reversed(r["names"])), r


def test_split_replay_guards():
    (r,) = spawn.ranks("split_replay_guards", 1, module=W)
    assert "parent group is unknown" in r["errors"]["unknown"], r
    assert "no bound device" in r["errors"]["unbound"], r
    assert "is not live" in r["errors"]["released"], r
    assert "_timeout" in r["snap_fields"] and r["applied_timeout"] == 7.0, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check: with CUDA the baseline really runs (GPU tests)")
def test_nccl_baseline_all_or_none():
    res = spawn.ranks("nccl_baseline_handshake", 2, module=W, timeout=60)
    for r in res:
        assert r["free"] is None and "not measured" in r["lines"][0], r


def test_group_destroyed_while_released_stays_destroyed():
    res = spawn.ranks("destroyed_while_released", 2, module=W)
    for r in res:
        for label in ("both", "one"):
            msg = r["errors"][label]
            assert f"'{r['names'][label]}'" in msg and "destroyed" in msg, msg
        assert "peer" in r["errors"]["one"] or "dist.destroy_process_group" in r["errors"]["one"]
    assert "on a peer rank" in res[1]["errors"]["one"], res[1]
    assert "StateError" in res[1]["dist_error"], res[1]  # rank 1 did not destroy it: c10d still knows it
