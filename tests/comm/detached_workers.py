"""Rank bodies for the detached-teardown tests (Gloo, CPU; Note [Detached teardown] in ebbtide/comm/_teardown.py).

The teardowns are made slow for real: ``_backend.teardown`` (what every teardown path calls for each inner group)
is replaced inside the rank process by one that sleeps, then calls the original, and records when each inner's
teardown started and ended. Inners are told apart by identity (each release/reload generation has new ones).
"""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

import ebbtide.comm as comm
import ebbtide.comm._backend as B
from ebbtide.errors import StateError

from comm_workers import _expect_sum, _init


class _Recorder:
    """Replace ``B.teardown``: sleep ``slow`` seconds (or raise, where ``fail`` says so), then tear down; record
    (inner, start, end)."""

    def __init__(self, slow: float = 0.0):
        self.real, self.slow, self.fail = B.teardown, slow, False
        self.events: list = []
        self.calls = 0
        self.lock = threading.Lock()
        B.teardown = self

    def __call__(self, inner, how):
        start = time.monotonic()
        with self.lock:
            self.calls += 1
        if self.fail:
            raise RuntimeError("injected teardown failure")
        time.sleep(self.slow)
        self.real(inner, how)
        with self.lock:
            self.events.append((inner, start, time.monotonic()))

    def of(self, inners: list) -> list:
        return [(s, e) for x, s, e in self.events if any(x is i for i in inners)]


def _groups(rank, world):
    groups = {"world": (dist.group.WORLD, list(range(world))), "pair": (dist.new_group([0, 1]), [0, 1])}
    for r in range(world):  # singletons: every rank calls each creation
        groups[f"one{r}"] = (dist.new_group([r]), [r])
    return [(g, r) for g, r in groups.values() if rank in r]


def _check(mine, rank):
    for g, r in mine:
        _expect_sum(g, r, rank)


def reload_beside_teardown(rank, world, init, slow=1.5):
    """release(include_world=True, wait=False) with teardowns that take ``slow`` s each (two waves: the subgroups,
    then WORLD): reload() returns long before they end, the groups work, the Future gives the Report afterwards.
    Then the next release() (wait=True) starts none of its teardowns before every one of the previous release's
    has ended, and returns its Report after its own have ended (wait=True unchanged)."""
    _init(rank, world, init)
    mine = _groups(rank, world)
    _check(mine, rank)
    rec = _Recorder(slow)
    first = [g.inner for g, _ in mine]
    t0 = time.monotonic()
    fut = comm.release(True, include_cpu=True, wait=False)
    t_release = time.monotonic() - t0
    rl = comm.reload()
    t_reload = time.monotonic() - t0
    pending_after_reload = not fut.done()
    assert not rl.noop and not comm.is_released()
    _check(mine, rank)  # the rebuilt groups work while the old ones are still being torn down
    assert all(g.inner is not None and g.inner not in first for g, _ in mine)
    # The next release joins the outstanding teardown before tearing anything down itself.
    second = [g.inner for g, _ in mine]
    t1 = time.monotonic()
    rep2 = comm.release(True, include_cpu=True)
    t_second = time.monotonic()
    assert fut.done() and not isinstance(rep2, type(fut)) and not rep2.noop
    rep = fut.result(timeout=0)
    names = sorted(x.name for x in rep.groups)
    assert names == sorted(g.group_name for g, _ in mine), (names, mine)
    assert all(x.seconds >= slow * 0.9 and x.strategy == "destroy" for x in rep.groups), rep.groups
    old, new = rec.of(first), rec.of(second)
    assert len(old) == len(new) == len(mine), (old, new)
    comm.reload()
    _check(mine, rank)
    return {"release_s": t_release, "reload_s": t_reload, "pending_after_reload": pending_after_reload,
            "old_end": max(e for _s, e in old) - t0, "new_start": min(s for s, _e in new) - t0,
            "new_end": max(e for _s, e in new) - t0, "second_returned": t_second - t0, "second_called": t1 - t0,
            "future_seconds": rep.seconds, "summary": rep.summary()}


def failure_at_next_release(rank, world, init):
    """A detached teardown that fails on rank 1 only: the Future holds the error, reload() and the groups are
    unaffected, the next release() raises StateError on every rank naming rank 1 and the cause, and releases
    nothing; a retry works. uninstall() joins an outstanding teardown and raises its failure too."""
    _init(rank, world, init)
    mine = _groups(rank, world)
    rec = _Recorder()
    rec.fail = rank == 1
    fut = comm.release(include_cpu=True, wait=False)
    comm.reload()  # goes ahead: the failure is not its business
    _check(mine, rank)
    err = fut.exception(timeout=60)
    rec.fail = False
    assert (err is not None) == (rank == 1), err
    out = {}
    try:
        comm.release(include_cpu=True)
    except StateError as e:
        out["release"] = str(e)
    else:
        raise AssertionError("release() after a failed detached teardown did not raise")
    assert not comm.is_released()
    _check(mine, rank)  # nothing was released: every group is live
    assert not comm.release(include_cpu=True).noop  # the failure was raised once; a retry releases
    comm.reload()
    _check(mine, rank)
    rec.fail = rank == 1
    fut = comm.release(include_cpu=True, wait=False)
    comm.reload()
    try:
        comm.uninstall()
    except StateError as e:
        out["uninstall"] = str(e)
    assert fut.done() and (("uninstall" in out) == (rank == 1)), out
    rec.fail = False
    comm.uninstall()  # raised once: now it uninstalls
    _check(mine, rank)
    return out


def nccl_reload_beside_teardown(rank, world, init, cycles=6, rollout_s=0.2, mode="alternate"):
    """NCCL, one GPU per rank, WORLD bound (subgroups are ncclCommSplit children of WORLD) plus split_group
    children: cycles of release(include_world=True, wait=False), a ``rollout_s`` pause, reload(), a 1 MiB
    all_reduce checked exactly on every group. ``mode`` "alternate": even cycles wait for the Future before reload
    (the joined behaviour, for comparison), odd cycles reload beside the running teardowns; "joined" / "detached":
    every cycle so. Free device memory is taken after
    every cycle once both ranks' teardowns are done (a collective after each rank's Future): no drift."""
    import datetime

    import torch

    from ebbtide.testing.spawn import join_store, progress

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm.install(timeout=60)
    dist.init_process_group("nccl", store=join_store(init), rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=60))
    everyone = list(range(world))
    groups = [(dist.group.WORLD, everyone)]
    groups += [(dist.new_group(everyone, group_desc=f"g{i}"), everyone) for i in range(4)]
    for r in range(world):
        g = dist.new_group([r])
        if r == rank:
            groups.append((g, [r]))
    groups.append((dist.split_group(split_ranks=[everyone], group_desc="split"), everyone))

    def check():
        for g, ranks in groups:
            x = torch.full((1 << 18,), float(rank + 1), device=dev)
            dist.all_reduce(x, group=g)
            want = float(sum(r + 1 for r in ranks))
            assert bool((x == want).all()), (g, x[:4], want)
        torch.cuda.synchronize()

    check()
    rows = []
    for cycle in range(cycles):
        detached = cycle % 2 == 1 if mode == "alternate" else mode == "detached"
        t0 = time.perf_counter()
        fut = comm.release(True, wait=False)
        t_release = time.perf_counter() - t0
        time.sleep(rollout_s)
        t1 = time.perf_counter()
        if not detached:
            fut.result(timeout=60)
        pending = not fut.done()
        rl = comm.reload()
        t_reload = time.perf_counter() - t1
        pending = pending and not fut.done()  # still running after reload: it was beside all of it
        check()
        t_first = time.perf_counter() - t1
        rep = fut.result(timeout=60)
        dist.all_reduce(torch.ones(1, device=dev))  # both ranks' teardowns are done
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        rows.append({"detached": detached, "pending_at_reload": pending, "release_s": t_release,
                     "reload_s": t_reload, "reload_and_check_s": t_first, "reload_report_s": rl.seconds,
                     "teardown_s": rep.seconds, "groups": len(rep.groups), "free_mib": free / 2**20,
                     "reload_bytes": rl.bytes_freed, "warmup_s": rl.warmup_seconds})
        progress(f"rank {rank}: cycle {cycle}: {rows[-1]}")
    # wait=True still behaves as before on NCCL, the Future of the last cycle long done.
    rep = comm.release(True)
    comm.reload()
    check()
    dist.destroy_process_group()
    return {"rows": rows, "wait_true_release_s": rep.seconds, "groups": len(groups)}


def every_wave_after_a_failure(rank, world, init):
    """WORLD released too (a later wave than its subgroups): on rank 1 every teardown fails, and still every wave is
    attempted (a peer's finalize of WORLD would wait for this rank's forever); the next release() raises on both
    ranks and a retry releases."""
    _init(rank, world, init)
    mine = _groups(rank, world)
    rec = _Recorder()
    rec.fail = rank == 1
    fut = comm.release(True, include_cpu=True, wait=False)
    err = fut.exception(timeout=60)
    attempted = rec.calls
    rec.fail = False
    comm.reload()
    _check(mine, rank)
    try:
        comm.release(True, include_cpu=True)
    except StateError as e:
        raised = str(e)
    else:
        raise AssertionError("release() after a failed detached teardown did not raise")
    comm.release(True, include_cpu=True)
    comm.reload()
    _check(mine, rank)
    return {"failed": err is not None, "attempted": attempted, "groups": len(mine), "raised": raised}


def wait_must_agree(rank, world, init):
    """Ranks passing different ``wait`` take different forms (the detached one has no trailing barrier): refused on
    every rank by the agreement, nothing released."""
    _init(rank, world, init)
    mine = _groups(rank, world)
    try:
        comm.release(True, include_cpu=True, wait=rank == 0)
    except StateError as e:
        out = str(e)
    else:
        raise AssertionError("release() with disagreeing wait did not raise")
    assert not comm.is_released()
    _check(mine, rank)
    return out
