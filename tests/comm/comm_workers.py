"""Rank bodies for the spawned comm tests (Gloo, CPU). Each returns a JSON-able dict the test asserts on; any
failed check raises inside the rank, and the harness reports that rank's traceback.

Collective checks use values that identify the rank set: all_reduce of (global rank + 1) must equal the sum over the
group's members, so a group rebuilt with the wrong members or ranks cannot pass.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ebbtide.comm as comm
from ebbtide.testing.spawn import join_store
from ebbtide.errors import StateError, WaitTimeoutError


def _init(rank, world, init, **kw):
    comm.install(**kw)
    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _expect_sum(group, ranks, rank):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    want = float(sum(r + 1 for r in ranks))
    assert torch.equal(t, torch.full((3,), want)), (group, t, want)


def _registry_counts():
    w = c10d._world
    return [len(w.pg_map), len(w.pg_names), len(w.pg_group_ranks), sum(len(v) for v in w.tags_to_pg.values())]


def _ring_exchange(group, ranks, rank):
    """batch_isend_irecv around the group's ring; every rank must receive its predecessor's rank."""
    me = ranks.index(rank)
    nxt, prv = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    send = torch.full((4,), float(rank))
    recv = torch.empty(4)
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(recv, torch.full((4,), float(prv))), (recv, prv)


def _released_checks(groups, rank):
    """Every op on a released group raises StateError, before reaching the backend."""
    n = 0
    for _name, (g, ranks) in groups.items():
        if rank not in ranks:
            continue
        for fn in (lambda g=g: dist.all_reduce(torch.ones(1), group=g),
                   lambda g=g, ranks=ranks: dist.broadcast(torch.ones(1), src=ranks[0], group=g),
                   lambda g=g: dist.barrier(group=g),
                   lambda g=g, ranks=ranks: dist.all_gather_object([None] * len(ranks), rank, group=g)):
            try:
                fn()
            except StateError as e:
                assert "released" in str(e) and "reload()" in str(e), e
                n += 1
            else:
                raise AssertionError(f"op on released group {g} did not raise")
    return n


def overlapping(rank, world, init, cycles=3):
    """4 ranks: TP/DP/PP/embedding/singleton groups overlapping, a custom timeout, non-member creation, a
    new_subgroups call and a local-synchronization group; several release/reload generations."""
    _init(rank, world, init)
    assert world == 4
    groups = {}
    for name, ranks in (("tp0", [0, 1]), ("tp1", [2, 3]), ("dp0", [0, 2]), ("dp1", [1, 3]), ("pp", [0, 1, 2, 3]),
                        ("emb", [0, 3])):
        groups[name] = (dist.new_group(ranks), ranks)
    for r in range(world):  # singletons: every rank calls, three are non-members of each
        groups[f"one{r}"] = (dist.new_group([r]), [r])
    groups["slow"] = (dist.new_group([1, 2], timeout=datetime.timedelta(seconds=123)), [1, 2])
    sub, _ = dist.new_subgroups(group_size=2)
    groups["sub"] = (sub, [0, 1] if rank < 2 else [2, 3])
    local_ranks = [0, 1] if rank < 2 else [2, 3]
    groups["local"] = (dist.new_group(local_ranks, use_local_synchronization=True), local_ranks)
    world_g = dist.group.WORLD
    ids = {k: id(g) for k, (g, r) in groups.items() if rank in r}
    names = {k: g.group_name for k, (g, r) in groups.items() if rank in r}
    for _k, (g, r) in groups.items():
        if rank in r:
            assert isinstance(g, comm.ReloadableGroup), g
            _expect_sum(g, r, rank)
    counts0 = _registry_counts()
    out = {"released_errors": 0, "summaries": [], "noop": []}
    for cycle in range(cycles):
        include_world = cycle % 2 == 1
        rep = comm.release(include_world, include_cpu=True)
        out["summaries"].append(rep.summary())
        out["noop"].append(comm.release(include_world, include_cpu=True).noop)  # double release: no-op
        assert comm.is_released()
        out["released_errors"] += _released_checks(groups, rank)
        if include_world:
            try:
                dist.all_reduce(torch.ones(1))
            except StateError:
                out["released_errors"] += 1
            else:
                raise AssertionError("WORLD op after release(include_world=True) did not raise")
        else:
            _expect_sum(world_g, list(range(world)), rank)  # WORLD stays live
        try:
            dist.new_group([0, 1])
        except StateError:
            out["released_errors"] += 1
        else:
            raise AssertionError("new_group while released did not raise")
        rl = comm.reload(eager=(cycle % 2 == 0))
        assert not rl.noop and comm.reload().noop  # double reload: no-op
        assert comm.generation() == cycle + 1
        # Identity, names, registry sizes and timeouts survive.
        assert {k: id(g) for k, (g, r) in groups.items() if rank in r} == ids
        assert {k: g.group_name for k, (g, r) in groups.items() if rank in r} == names
        assert _registry_counts() == counts0, (_registry_counts(), counts0)
        if rank in (1, 2):
            tmo = groups["slow"][0].inner._get_backend(torch.device("cpu")).options._timeout
            assert tmo == datetime.timedelta(seconds=123), tmo
        # Collectives on every group, P2P first on the pipeline group.
        _ring_exchange(groups["pp"][0], [0, 1, 2, 3], rank)
        for _k, (g, r) in groups.items():
            if rank in r:
                _expect_sum(g, r, rank)
                assert dist.get_process_group_ranks(g) == sorted(r)
                assert dist.get_rank(g) == sorted(r).index(rank)
                assert dist.get_world_size(g) == len(r)
                assert dist.get_global_rank(g, 0) == sorted(r)[0]
                # Name lookups: the native registry reaches the live inner, Python-side lookup the wrapper.
                assert c10d._resolve_process_group(g.group_name) is g
                assert torch._C._distributed_c10d._resolve_process_group(g.group_name) is g.inner
        _expect_sum(world_g, list(range(world)), rank)
        objs = [None] * 2
        dp = groups["dp0" if rank in (0, 2) else "dp1"][0]
        dist.all_gather_object(objs, {"rank": rank, "cycle": cycle}, group=dp)
        assert [o["rank"] for o in objs] == ([0, 2] if rank in (0, 2) else [1, 3]) and objs[0]["cycle"] == cycle
        b = [rank * 10 + cycle] if rank == 0 else [None]
        dist.broadcast_object_list(b, src=0, group=groups["pp"][0])
        assert b == [cycle]
    out["counts"] = counts0
    dist.destroy_process_group()
    return out


def functional(rank, world, init):
    """Functional collectives and DeviceMesh resolve groups by name: they must work after a reload."""
    import torch.distributed._functional_collectives as fc

    _init(rank, world, init)
    g = dist.new_group(list(range(world)))
    out = {}
    for _cycle in range(2):
        r = fc.all_reduce(torch.full((2,), float(rank + 1)), "sum", g).wait()
        assert torch.equal(r, torch.full((2,), float(sum(range(1, world + 1))))), r
        ag = fc.all_gather_tensor(torch.full((1,), float(rank)), 0, g).wait()
        assert torch.equal(ag, torch.arange(world, dtype=torch.float32)), ag
        comm.release(include_cpu=True)
        try:
            fc.all_reduce(torch.ones(1), "sum", g).wait()
        except Exception as e:  # the name now resolves to the wrapper, whose ops raise StateError
            assert "released" in str(e), e
        else:
            raise AssertionError("functional collective on a released group did not raise")
        comm.reload()
    # Tensor collectives FSDP-style code uses (Python paths into the wrapper's forwarders).
    out_t = torch.empty(world * 2)
    dist.all_gather_into_tensor(out_t, torch.full((2,), float(rank)), group=g)
    assert torch.equal(out_t, torch.arange(world, dtype=torch.float32).repeat_interleave(2)), out_t
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.ones(world * 2), group=g)
    assert torch.equal(rs, torch.full((2,), float(world))), rs
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.full((world,), float(rank)), group=g)
    assert torch.equal(a2a, torch.arange(world, dtype=torch.float32)), a2a
    try:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(g, "cpu")
        comm.release(include_cpu=True)
        comm.reload()
        mg = mesh.get_group()
        assert mg is g, (mg, g)
        t = torch.full((1,), float(rank + 1))
        dist.all_reduce(t, group=mg)
        assert t.item() == sum(range(1, world + 1))
        out["device_mesh"] = True
    except ImportError:
        out["device_mesh"] = False
    dist.destroy_process_group()
    return out


def disagreement(rank, world, init):
    """Ranks that created different groups fail release() with a StateError naming the odd rank, on every rank,
    and nothing is torn down."""
    _init(rank, world, init)
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30 if rank == 0 else 31))
    try:
        comm.release(include_cpu=True)
    except StateError as e:
        msg = str(e)
    else:
        raise AssertionError("release with disagreeing journals did not raise")
    assert "ranks [1]" in msg, msg
    assert not comm.is_released()
    _expect_sum(g, [0, 1], rank)  # still live
    dist.destroy_process_group()
    return {"msg": msg}


def _without_last_rank(op, what: str, world: int) -> str:
    """Run ``op(timeout=1.5)`` on a rank whose last peer never joins: it must raise WaitTimeoutError naming that
    rank within a bound; returns the message."""
    t0 = time.monotonic()
    try:
        op(timeout=1.5)
    except WaitTimeoutError as e:
        msg = str(e)
    else:
        raise AssertionError(f"{what} without the last rank did not time out")
    assert time.monotonic() - t0 < 20
    assert f"ranks [{world - 1}]" in msg, msg
    return msg


def _wait_for_count(store, key: str, n: int) -> None:
    store.wait([key])
    while store.add(key, 0) < n:
        time.sleep(0.05)


def missing_rank(rank, world, init):
    """A rank that never joins release(): the others time out with WaitTimeoutError naming it, and their groups
    stay usable."""
    _init(rank, world, init)
    g = dist.new_group(list(range(world)))
    store = c10d._get_default_store()
    msg = ""
    if rank != world - 1:
        msg = _without_last_rank(lambda timeout: comm.release(include_cpu=True, timeout=timeout), "release", world)
        assert not comm.is_released()
        store.add("test/timed_out", 1)
    else:
        _wait_for_count(store, "test/timed_out", world - 1)
    _expect_sum(g, list(range(world)), rank)
    dist.destroy_process_group()
    return {"msg": msg}


def threads_and_fork(rank, world, init):
    """release()/reload() called from several threads at once stay consistent (one effective call each way);
    a forked child starts with an empty journal."""
    import os
    import threading

    _init(rank, world, init)
    g = dist.new_group(list(range(world)))
    gone = dist.new_group(list(range(world)))
    dist.destroy_process_group(gone)  # destroyed by the user: never released or rebuilt
    try:
        dist.all_reduce(torch.ones(1), group=gone)  # c10d refuses (unregistered group), as for plain groups
    except ValueError:
        pass
    else:
        raise AssertionError("op on a destroyed group did not raise")
    try:
        gone.allreduce([torch.ones(1)])  # the object itself says why
    except StateError as e:
        assert "destroyed" in str(e), e
    else:
        raise AssertionError("op on a destroyed wrapper did not raise")
    reports = []

    def rel():
        reports.append(comm.release(include_cpu=True))

    ths = [threading.Thread(target=rel) for _ in range(3)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert sorted(r.noop for r in reports) == [False, True, True], [r.noop for r in reports]
    assert [len(r.groups) for r in reports if not r.noop] == [1]  # g only: WORLD kept, `gone` skipped
    comm.reload()
    _expect_sum(g, list(range(world)), rank)
    pid = os.fork()
    if pid == 0:  # child: no journal, no released groups; exit without touching the parent's groups
        ok = comm.generation() == 0 and not comm.is_released()
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    dist.destroy_process_group()
    return {"noops": [r.noop for r in reports]}


def install_after_init(rank, world, init):
    """install() after init_process_group adopts WORLD (releasable) and warns about earlier groups."""
    import warnings

    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world)
    early = dist.new_group(list(range(world)))
    import os

    os.environ["NCCL_COMM_SPLIT_SHARE_RESOURCES"] = "1"  # defeats release: install() must say so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned = comm.install()
    msgs = [str(w.message) for w in caught]
    assert any("after 1 process group" in m for m in msgs), msgs
    assert "NCCL_COMM_SPLIT_SHARE_RESOURCES" in warned and any("SPLIT_SHARE" in m for m in msgs), (warned, msgs)
    late = dist.new_group(list(range(world)))
    assert isinstance(dist.group.WORLD, comm.ReloadableGroup) and isinstance(late, comm.ReloadableGroup)
    assert not isinstance(early, comm.ReloadableGroup)
    rep = comm.release(True, include_cpu=True)
    assert len(rep.groups) == 2, rep.summary()
    _expect_sum(early, list(range(world)), rank)  # unmanaged group untouched
    comm.reload()
    for g in (dist.group.WORLD, late):
        _expect_sum(g, list(range(world)), rank)
    dist.destroy_process_group()
    return {}


def megatron(rank, world, init, cycles=2):
    """Megatron-core parallel_state groups survive release/reload and collectives on them give the right sums
    (TP=2 x PP=2 on 4 ranks; PP=2 on 2 ranks, which CI uses to stay cheap)."""
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    from megatron.core import parallel_state as ps

    _init(rank, world, init)
    ps.initialize_model_parallel(tensor_model_parallel_size=world // 2, pipeline_model_parallel_size=2)
    getters = {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
               "dp": ps.get_data_parallel_group, "mp": ps.get_model_parallel_group,
               "emb": ps.get_embedding_group}
    held = {k: f() for k, f in getters.items()}
    out = {"groups": 0}
    for _cycle in range(cycles):
        rep = comm.release(include_cpu=True)
        out["groups"] = len(rep.groups)
        comm.reload()
        for k, g in held.items():
            assert getters[k]() is g  # Megatron's module globals still hold the same objects
            _expect_sum(g, dist.get_process_group_ranks(g), rank)
        _ring_exchange(held["pp"], dist.get_process_group_ranks(held["pp"]), rank)
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def megatron_like_8(rank, world, init, cycles=3):
    """The Megatron-like topology on 8 Gloo ranks: TP=2, PP=4, DP=1 plus embedding, position-embedding, model-parallel
    and singleton groups, all overlapping; release/reload cycles (WORLD included on odd cycles) with
    batch_isend_irecv as the first operation on every pipeline group after each reload."""
    _init(rank, world, init)
    assert world == 8
    tp_size = 2  # PP = world / tp_size = 4
    groups = {}

    def make(kind, ranks):
        g = dist.new_group(ranks)  # every rank calls every creation (non-members included)
        if rank in ranks:
            groups[kind] = (g, ranks)

    for i in range(world // tp_size):
        make("tp", list(range(i * tp_size, (i + 1) * tp_size)))
    pp_groups = [list(range(j, world, tp_size)) for j in range(tp_size)]
    for ranks in pp_groups:
        make("pp", ranks)
    for ranks in pp_groups:
        make("emb", [ranks[0], ranks[-1]])
        make("pos", [ranks[0]])
    make("mp", list(range(world)))
    for r in range(world):
        make("dp", [r])  # DP=1: singleton data-parallel groups
    cyc = []
    for cycle in range(cycles):
        rep = comm.release(cycle % 2 == 1, include_cpu=True)
        rl = comm.reload()
        g, ranks = groups["pp"]
        _ring_exchange(g, ranks, rank)  # P2P first after reload
        for _k, (g, ranks) in groups.items():
            _expect_sum(g, ranks, rank)
        _expect_sum(dist.group.WORLD, list(range(world)), rank)
        cyc.append([len(rep.groups), round(rep.seconds, 4), round(rl.seconds, 4)])
    dist.destroy_process_group()
    return {"cycles": cyc}



def nccl_split(rank, world, init, cycles=2):
    """dist.split_group (NCCL only: it needs a device-bound WORLD) and DeviceMesh over NCCL: split children are
    journaled (non-members' calls too) and rebuilt by splitting the rebuilt parent; the mesh hands back the same
    wrappers. (Gloo's own C++ split hangs or crashes intermittently in torch 2.13 even without ebbtide, so this
    path is tested on GPUs only.)"""
    from ebbtide.testing.spawn import progress

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm.install(timeout=60)
    dist.init_process_group("nccl", store=join_store(init), rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=60))
    progress(f"rank {rank}: WORLD bound to {dev}; splitting")
    pair = dist.split_group(split_ranks=[list(range(world))], group_desc="pair")
    solo = dist.split_group(split_ranks=[[r] for r in range(world)], group_desc="solo")
    first = dist.split_group(split_ranks=[[0]], group_desc="first")  # non-members get None
    assert isinstance(pair, comm.ReloadableGroup) and isinstance(solo, comm.ReloadableGroup)
    assert (first is None) == (rank != 0), first
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    mesh_group = mesh.get_group("dp")
    assert isinstance(mesh_group, comm.ReloadableGroup), mesh_group
    progress(f"rank {rank}: split groups and mesh made (mesh group {mesh_group.group_name})")

    def check():
        for g, ranks in ((pair, list(range(world))), (solo, [rank]), (first, [0]), (mesh_group, list(range(world)))):
            if g is not None:
                _expect_sum_dev(g, ranks, rank, dev)

    check()
    for cycle in range(cycles):
        progress(f"rank {rank}: cycle {cycle}: release(include_world={cycle % 2 == 1})")
        rep = comm.release(cycle % 2 == 1)
        progress(f"rank {rank}: cycle {cycle}: released {rep.by_strategy()}; reload")
        comm.reload()
        progress(f"rank {rank}: cycle {cycle}: reloaded; checking collectives")
        check()
        assert mesh.get_group("dp") is mesh_group
    # The last cycle rebuilt WORLD: a new split of the rebuilt WORLD (Note [A rebuilt WORLD has no rank map]),
    # then one more cycle with it in the journal.
    progress(f"rank {rank}: split_group on the rebuilt WORLD")
    late = dist.split_group(split_ranks=[list(range(world))], group_desc="late")
    _expect_sum_dev(late, list(range(world)), rank, dev)
    comm.release(True)
    comm.reload()
    check()
    _expect_sum_dev(late, list(range(world)), rank, dev)
    progress(f"rank {rank}: destroy_process_group")
    dist.destroy_process_group()
    return {"groups": len(rep.groups)}


def _expect_sum_dev(group, ranks, rank, dev):
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t, group=group)
    want = float(sum(r + 1 for r in ranks))
    assert bool((t == want).all()), (group, t, want)


def teardown_order(rank, world, init, concurrent=True):
    """release() tears groups down children first, WORLD last (as c10d's destroy_process_group does): with a
    device-bound WORLD every subgroup is an ncclCommSplit child of WORLD. Concurrent teardown runs the children in
    one wave of threads (any order among them, all finished before WORLD starts); sequential teardown keeps exact
    reverse journal order."""
    import threading

    import ebbtide.comm._backend as B

    order = []  # (event, group name, thread name)
    real = B.teardown
    lock = threading.Lock()

    def recording(inner, how):
        name = inner.group_name
        with lock:
            order.append(("start", name, threading.current_thread().name))
        real(inner, how)
        with lock:
            order.append(("end", name, threading.current_thread().name))

    B.teardown = recording
    _init(rank, world, init, concurrent_teardown=concurrent)
    names = [dist.group.WORLD.group_name]
    for _ in range(3):
        g = dist.new_group(list(range(world)))
        _expect_sum(g, list(range(world)), rank)
        names.append(g.group_name)
    rep = comm.release(True, include_cpu=True)
    assert [x.name for x in rep.groups] == names, (rep.groups, names)  # the report stays in journal order
    comm.reload()
    for g in (dist.group.WORLD,):
        _expect_sum(g, list(range(world)), rank)
    dist.destroy_process_group()
    return {"order": order, "names": names}


def split_replay_guards(rank, world, init):
    """Rebuilding a split child checks ProcessGroupNCCL::split's preconditions first and raises StateError (a
    segfault or a hang inside native code otherwise); split options are journaled as a scalar snapshot, never as
    the native object split() writes into (Note [Split options are not replayed])."""
    import ebbtide.comm._backend as B
    import ebbtide.comm._journal as J

    _init(rank, world, init)
    w = dist.group.WORLD
    errors = {}

    def attempt(key, entry):
        try:
            B.split_parent_ready(entry.parent, entry.name, set(), set())
        except StateError as err:
            errors[key] = str(err)
        else:
            raise AssertionError(f"{key}: no StateError")

    attempt("unknown", J.Entry("split", "child", (0,), {"args": (), "kwargs": {}}, None, parent=None))
    attempt("unbound", J.Entry("split", "child", (0,), {"args": (), "kwargs": {}}, None, parent=w))
    inner, w._ebt_inner = w._ebt_inner, None
    try:
        attempt("released", J.Entry("split", "child", (0,), {"args": (), "kwargs": {}}, None, parent=w))
    finally:
        w._ebt_inner = inner
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=7)
    snap = J.OptionsSnapshot.take(opts)
    fresh = dist.ProcessGroupGloo._Options()
    snap.apply(fresh)
    dist.destroy_process_group()
    return {"errors": errors, "snap_fields": sorted(snap.fields), "applied_timeout": fresh._timeout.total_seconds()}


def nccl_baseline_handshake(rank, world, init):
    """The scenario's NCCL-loaded baseline either runs on every rank or on none: here (no NCCL in the CPU build)
    every rank reports it cannot, and no rank is left waiting for the others."""
    from ebbtide.testing.scenarios.comm import nccl_process_state

    lines = []
    free = nccl_process_state(rank, world, join_store(init), torch.device("cpu"), torch.zeros(4), lines.append)
    return {"free": free, "lines": lines}


def destroyed_while_released(rank, world, init):
    """A group destroyed with dist.destroy_process_group while released stays destroyed across reload (on every
    rank: `both` by all its members, `one` by rank 0 only), and every use of it afterwards is a StateError naming
    it; the other groups and later cycles are unaffected."""
    _init(rank, world, init)
    ranks = list(range(world))
    both, one, kept = (dist.new_group(ranks) for _ in range(3))
    for g in (both, one, kept):
        _expect_sum(g, ranks, rank)
    comm.release(include_cpu=True)
    dist.destroy_process_group(both)
    if rank == 0:
        dist.destroy_process_group(one)
    rl = comm.reload()
    assert not comm.is_released()
    assert {x.name for x in rl.groups} == {kept.group_name}, rl.groups
    out = {"errors": {}}
    for label, g in (("both", both), ("one", one)):
        assert g.inner is None and not g.released and "destroyed" in repr(g), (label, g)
        try:
            g.allreduce([torch.ones(1)])
        except StateError as e:
            out["errors"][label] = str(e)
        else:
            raise AssertionError(f"op on destroyed group {label} did not raise")
    try:
        dist.all_reduce(torch.ones(1), group=one)
    except (StateError, ValueError) as e:
        out["dist_error"] = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("dist.all_reduce on a group destroyed on a peer did not raise")
    _expect_sum(kept, ranks, rank)
    for _ in range(2):  # later cycles neither rebuild nor trip over the destroyed groups
        rep = comm.release(include_cpu=True)
        assert [x.name for x in rep.groups] == [kept.group_name], rep.groups
        comm.reload()
        _expect_sum(kept, ranks, rank)
        assert both.inner is None and one.inner is None
    out["names"] = {"both": both.group_name, "one": one.group_name}
    dist.destroy_process_group()
    return out


def background_release(rank, world, init, cycles=3):
    """release(wait=False): the groups are released when it returns (ops raise StateError), the teardown finishes
    in the background (its Future holds the Report), a second release() joins it, reload() goes ahead beside it
    (Note [Detached teardown]); a teardown that fails in the background is raised by the next release() on every
    rank, naming the cause, and nothing is released then (detached_workers.py: the timing and order)."""
    from concurrent.futures import Future

    from ebbtide.comm import _teardown

    _init(rank, world, init)
    groups = {"pair": (dist.new_group([0, 1]), [0, 1])}
    for r in range(world):  # singletons: every rank calls each creation
        groups[f"one{r}"] = (dist.new_group([r]), [r])
    mine = [(g, r) for g, r in groups.values() if rank in r]
    for g, r in mine:
        _expect_sum(g, r, rank)
    out = {"released_errors": 0, "reports": []}
    for cycle in range(cycles):
        fut = comm.release(cycle % 2 == 1, include_cpu=True, wait=False)
        assert isinstance(fut, Future) and comm.is_released()
        out["released_errors"] += _released_checks(groups, rank)
        if cycle == 0:  # a second release joins the first and is a no-op
            again = comm.release(True, include_cpu=True, wait=False)
            assert fut.done() and again.done() and again.result().noop
        if cycle == 1:  # reload needs nothing extra (whether the teardown is done yet or not)
            rl = comm.reload()
            assert not rl.noop and not fut.result(timeout=60).noop
        else:
            rep = fut.result(timeout=60)
            assert not rep.noop and len(rep.groups) >= 2, rep.summary()
            out["reports"].append(rep.summary())
            comm.reload(eager=cycle % 2 == 0)
        for g, r in mine:
            _expect_sum(g, r, rank)
    # A teardown that fails in the background: the Future holds the error, reload() goes ahead, the next release()
    # raises it as StateError on every rank and releases nothing; a retry releases.
    real = _teardown.B.teardown_concurrently

    def broken(*a, **k):
        raise RuntimeError("injected teardown failure")

    _teardown.B.teardown_concurrently = broken
    try:
        fut = comm.release(include_cpu=True, wait=False)
        err = fut.exception(timeout=60)
        assert isinstance(err, RuntimeError) and "injected" in str(err), err
    finally:
        _teardown.B.teardown_concurrently = real
    comm.reload()
    for g, r in mine:
        _expect_sum(g, r, rank)
    try:
        comm.release(include_cpu=True)
    except StateError as e:
        assert "background teardown" in str(e) and "injected" in str(e) and "ranks [0, 1]" in str(e), e
        out["failure"] = str(e)
    else:
        raise AssertionError("release() after a failed background teardown did not raise")
    assert not comm.is_released()
    for g, r in mine:
        _expect_sum(g, r, rank)
    assert not comm.release(include_cpu=True).noop
    comm.reload()
    for g, r in mine:
        _expect_sum(g, r, rank)
    return out


def missing_rank_reload(rank, world, init):
    """After a release every rank agreed on, a rank that never joins reload() (dead or stuck): the others time out
    with WaitTimeoutError naming it and stay RELEASED with nothing rebuilt; the rank arriving late finds the step
    abandoned (an error, never a reload alone); a retry on every rank works."""
    _init(rank, world, init)
    g = dist.new_group(list(range(world)))
    store = c10d._get_default_store()
    comm.release(include_cpu=True)
    msg = ""
    if rank != world - 1:
        msg = _without_last_rank(comm.reload, "reload", world)
        assert comm.is_released()
        try:
            dist.all_reduce(torch.ones(1), group=g)
        except StateError:
            pass
        else:
            raise AssertionError("a released group ran a collective")
        store.add("test/reload_timed_out", 1)
    else:
        _wait_for_count(store, "test/reload_timed_out", world - 1)
        try:  # the latecomer finds the step abandoned and does not act alone
            comm.reload()
        except WaitTimeoutError as e:
            msg = str(e)
        else:
            raise AssertionError("a latecomer's reload went ahead alone")
        assert "gave up" in msg and comm.is_released(), msg
    comm.reload()  # every rank retries: the retry is a fresh step
    _expect_sum(g, list(range(world)), rank)
    dist.destroy_process_group()
    return {"msg": msg}


def nccl_in_flight(rank, world, init):
    """release() while a collective is in flight on a side stream and can never finish (rank 0 launched it, its
    peers did not): every rank gets the same StateError within the timeout (rank 0's device did not drain), nothing
    is released, and once the peers join the collective it completes
    with the exact sum and a release/reload cycle works."""
    from ebbtide.testing.spawn import progress

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm.install(timeout=60)
    dist.init_process_group("nccl", store=join_store(init), rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    g = dist.new_group(list(range(world)))
    _expect_sum_dev(g, list(range(world)), rank, dev)
    store = c10d._get_default_store()
    side = torch.cuda.Stream(dev)
    t = torch.full((1 << 20,), float(rank + 1), device=dev)
    work = None
    if rank == 0:
        with torch.cuda.stream(side):
            work = dist.all_reduce(t, group=g, async_op=True)  # waits on the device for peers that are not coming
    progress(f"rank {rank}: releasing with {'a collective in flight' if rank == 0 else 'nothing in flight'}")
    t0 = time.monotonic()
    try:
        comm.release(timeout=5)
    except (StateError, WaitTimeoutError) as e:
        msg, kind = str(e), type(e).__name__
    else:
        raise AssertionError("release with a collective in flight that cannot finish did not fail")
    took = time.monotonic() - t0
    progress(f"rank {rank}: release failed after {took:.1f} s: {kind}: {msg[:200]}")
    assert took < 30, took
    assert not comm.is_released()
    assert kind == "StateError" and "on ranks [0]" in msg and "did not finish" in msg, msg
    store.add("test/in_flight_failed", 1)
    _wait_for_count(store, "test/in_flight_failed", world)
    if rank != 0:
        with torch.cuda.stream(side):
            dist.all_reduce(t, group=g)  # the peers join: rank 0's collective completes
    torch.cuda.synchronize(dev)
    want = float(sum(r + 1 for r in range(world)))
    assert torch.equal(t, torch.full_like(t, want)), t[:4]
    if work is not None:
        work.wait()
    comm.release()
    comm.reload()
    _expect_sum_dev(g, list(range(world)), rank, dev)
    dist.destroy_process_group()
    return {"msg": msg, "kind": kind, "took_s": took}
