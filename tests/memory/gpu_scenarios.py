"""GPU scenarios for the memory engine, one per process: ``python gpu_scenarios.py <scenario> <preload|torch>``.

The test module starts each in a fresh interpreter (preload mode: with ebbtide.memory.preload_env()). Checks:
data_ptr() unchanged, content restored bitwise with CPU backup, the driver's free memory (torch.cuda.mem_get_info)
moving by >= 99% of the paused bytes, selective tags, the caching allocator on top, OOM at resume.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

import ebbtide.memory as em
from ebbtide.errors import OutOfMemoryError

from _scenario_runner import GiB, MiB, check_mode, free_bytes, main, tag_bytes


def basic(mode: str):
    check_mode(mode)
    with em.region("weights", backup="cpu"):
        w = torch.randn(256 * MiB // 4, device="cuda")  # 256 MiB... x4 below
        w2 = torch.arange(768 * MiB // 4, device="cuda", dtype=torch.int32)
    with em.region("kv", backup="none"):
        kv = torch.ones(512 * MiB // 2, device="cuda", dtype=torch.bfloat16)
    ptrs = (w.data_ptr(), w2.data_ptr(), kv.data_ptr())
    ref = w.cpu()
    ref2 = w2.cpu()
    assert tag_bytes("weights", "bytes_active") >= 1 * GiB, em.stats()
    f0 = free_bytes()
    rep = em.pause("weights")
    f1 = free_bytes()
    paused = tag_bytes("weights", "bytes_paused")
    assert paused >= GiB and rep.bytes == paused, (paused, rep)
    assert f1 - f0 >= 0.99 * paused, f"driver got back {f1 - f0} of {paused} paused bytes"
    assert rep.bytes_copied >= GiB and rep.gbps and rep.gbps > 1, rep
    em.pause("kv")
    f2 = free_bytes()
    assert f2 - f1 >= 0.99 * tag_bytes("kv", "bytes_paused")
    em.resume("kv")
    em.resume("weights")
    f3 = free_bytes()
    assert f2 - f3 >= 0.99 * (paused + tag_bytes("kv", "bytes_active")), (f2, f3)
    assert (w.data_ptr(), w2.data_ptr(), kv.data_ptr()) == ptrs
    assert torch.equal(w.cpu(), ref) and torch.equal(w2.cpu(), ref2), "content not restored bitwise"
    kv.fill_(3)  # discarded memory is usable again
    assert torch.all(kv == 3).item()
    y = (w * 2).sum()  # kernels on resumed memory
    assert torch.isfinite(y)


def multi_tag(mode: str):
    check_mode(mode)
    tensors = {}
    for tag in ("a", "b", "c"):
        with em.region(tag, backup="cpu"):
            tensors[tag] = torch.full((512 * MiB // 4,), float(ord(tag)), device="cuda")
    em.pause("b")  # the first pause creates the runtime's streams and events (a few MiB, once per process)
    em.resume("b")
    f0 = free_bytes()
    em.pause("b")
    f1 = free_bytes()
    paused = tag_bytes("b", "bytes_paused")
    assert f1 - f0 >= 0.99 * paused, f"driver free memory rose by {f1 - f0} bytes after pausing {paused}"
    assert torch.all(tensors["a"] == ord("a")).item()  # others untouched, usable
    em.pause(None)
    em.resume("c")
    assert tensors["c"].max().item() == ord("c")
    em.resume(None)
    for tag, t in tensors.items():
        assert torch.all(t == ord(tag)).item(), tag
    states = {r["tag"]: r["state"] for r in em.stats()["tags"]}
    assert states["a"] == states["b"] == states["c"] == "active", states


def caching_allocator(mode: str):
    """Many small tensors through the caching allocator; free, empty_cache, pause/resume, allocate again."""
    check_mode(mode)
    with em.region("act", backup="cpu"):
        xs = [torch.full((1000 + i * 37,), float(i), device="cuda") for i in range(200)]
        big = [torch.full((8 * MiB,), 7.0, device="cuda") for _ in range(4)]
    del xs[::2]
    del big[0]
    torch.cuda.empty_cache()
    em.pause("act")
    em.resume("act")
    for i, x in zip(range(1, 200, 2), xs):
        assert torch.all(x == float(i)).item()
    assert all(torch.all(b == 7.0).item() for b in big)
    with em.region("act", backup="cpu"):
        more = [torch.ones(3 * MiB, device="cuda") for _ in range(3)]
    assert all(torch.all(m == 1.0).item() for m in more)
    n_before = em.stats()["global"]["live_allocations"]
    del more, big
    torch.cuda.empty_cache()
    with em.region("act", backup="cpu"):
        torch.cuda.empty_cache()
    assert em.stats()["global"]["live_allocations"] <= n_before
    em.pause("act")
    em.resume("act")
    for i, x in zip(range(1, 200, 2), xs):
        assert torch.all(x == float(i)).item()


def oom_at_resume(mode: str):
    check_mode(mode)
    size = min(int(free_bytes() * 0.4), 8 << 30) // 4 * 4  # bounded: its CPU backup and `ref` live in host RAM
    with em.region("w", backup="cpu"):
        w = torch.randint(0, 100, (size // 4,), device="cuda", dtype=torch.int32)
    ref = w.cpu()
    em.pause("w")
    # Untracked memory from the default pool (empty_cache can give it back; private pools keep their cache),
    # leaving about half of what the resume needs.
    filler = torch.empty(free_bytes() - size // 2, dtype=torch.uint8, device="cuda")
    try:
        em.resume("w")
        raise AssertionError("resume should have run out of memory")
    except OutOfMemoryError as e:
        assert e.needed and e.needed >= w.numel() * 4 and e.free is not None and e.free < e.needed, e
        assert isinstance(e.holders, dict)
    assert [r["state"] for r in em.stats()["tags"] if r["tag"] == "w"] == ["paused"]
    del filler
    torch.cuda.empty_cache()
    em.resume("w")  # retry works
    assert torch.equal(w.cpu(), ref)


def async_overlap(mode: str):
    check_mode(mode)
    with em.region("train", backup="cpu"):
        a = torch.randn(512 * MiB // 4, device="cuda")
    with em.region("roll", backup="cpu"):
        b = torch.randn(512 * MiB // 4, device="cuda")
    ra, rb = a.cpu(), b.cpu()
    em.pause("roll")
    h1, h2 = em.pause_async("train"), em.resume_async("roll")
    r1, r2 = h1.wait(), h2.wait()
    assert r1.bytes_copied >= 512 * MiB and r2.bytes_copied >= 512 * MiB
    assert torch.equal(b.cpu(), rb)
    em.resume("train")
    assert torch.equal(a.cpu(), ra)


def backward_default_region(mode: str):
    """Gradients made by autograd's device thread land in the process default region (preload mode)."""
    check_mode(mode)
    em.set_default_region("grads", backup="cpu")
    with em.region("model", backup="cpu"):
        lin = torch.nn.Linear(4096, 4096, device="cuda")
        x = torch.randn(64, 4096, device="cuda")
        lin(x).square().sum().backward()
    grad = lin.weight.grad
    ref = grad.cpu()
    if mode == "preload":
        assert tag_bytes("grads", "bytes_active") >= grad.numel() * 4, em.stats()
    em.pause(None)
    em.resume(None)
    assert torch.equal(grad.cpu(), ref)
    em.set_default_region(None)


def unmap_runs(mode: str):
    """Many adjacent allocations: a pause unmaps each VA-contiguous run with one call where the driver accepts it
    (else one per allocation after the refused span), and the driver gets every byte back either way (the engine
    keeps no handle: the unmap alone frees). Discarded memory is usable after resume; backups come back bitwise."""
    check_mode(mode)
    n = 64
    with em.region("many", backup="none"):
        d = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(n)]
    with em.region("many_cpu", backup="cpu"):
        c = [torch.full((16 * MiB,), i, dtype=torch.uint8, device="cuda") for i in range(n)]
    ptrs = [t.data_ptr() for t in d + c]
    em.pause("many")  # warm-up: the first pause creates the runtime's streams and events
    em.resume("many")
    for tensors, tag, per_run in ((d, "many", n), (c, "many_cpu", 16)):  # CPU-backed runs close at 256 MiB
        contiguous = all(tensors[i + 1].data_ptr() == tensors[i].data_ptr() + 16 * MiB for i in range(n - 1))
        f0 = free_bytes()
        rep = em.pause(tag)
        f1 = free_bytes()
        assert rep.allocations == n and f1 - f0 >= 0.99 * rep.bytes, (tag, rep, f1 - f0)
        runs = n // per_run
        if contiguous:  # accepted: one call per run; refused: the span, then one per allocation
            assert rep.unmap_calls in (runs, runs + n), (tag, rep.unmap_calls)
        print(f"{tag}: contiguous={contiguous} unmap_calls={rep.unmap_calls} unmap_ms={rep.unmap_s * 1e3:.2f}")
        rep = em.resume(tag)
        assert f1 - free_bytes() >= 0.99 * rep.bytes
    assert [t.data_ptr() for t in d + c] == ptrs
    for i, t in enumerate(c):
        assert torch.all(t == i).item(), f"backup {i} not restored"
    for t in d:
        t.fill_(5)
    assert all(torch.all(t == 5).item() for t in d)


class _Raw:
    """A zero-copy uint8 view of raw device memory for torch.as_tensor (no ownership)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                        "version": 3}


def coalesced_discard(mode: str):
    """Coalesced resume (the default): 1024 x 16 MiB discard allocations resume as a few
    mappings (<= 4 GiB each); data_ptr() stable, >= 99% of the memory back at each pause and taken at each resume.
    Then engine allocations (CPU-backed) whose members are freed while active (zombies: memory held until the
    tag's next pause, which returns it) and while paused; content restored bitwise; the last free of a mapping
    returns it."""
    from ebbtide import _native  # noqa: PLC0415

    check_mode(mode)
    assert em.coalescing(), "coalescing is not on by default"
    n = 1024
    with em.region("many", backup="none"):
        d = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(n)]
    ptrs = [t.data_ptr() for t in d]
    for t in d:
        t.fill_(1)
    em.pause("many")  # warm-up: streams, events; this resume makes the coalesced mappings
    rep = em.resume("many")
    contiguous = all(ptrs[i + 1] == ptrs[i] + 16 * MiB for i in range(n - 1))
    handles = tag_bytes("many", "handles")
    print(f"many: contiguous={contiguous} mappings={rep.mappings} handles={handles}")
    assert handles == rep.mappings and rep.mappings <= n
    if contiguous:
        assert rep.mappings <= 16, rep  # 16 GiB in runs of at most 4 GiB (a reservation boundary may add some)
    ps_ms, rs_ms = [], []
    for _ in range(3):
        f0 = free_bytes()
        t0 = time.perf_counter()
        p = em.pause("many")
        t1 = time.perf_counter()
        f1 = free_bytes()
        assert f1 - f0 >= 0.99 * p.bytes and p.allocations == n, (p, f1 - f0)
        t2 = time.perf_counter()
        r = em.resume("many")
        t3 = time.perf_counter()
        assert f1 - free_bytes() >= 0.99 * r.bytes, (r, f1 - free_bytes())
        ps_ms.append((t1 - t0) * 1e3)
        rs_ms.append((t3 - t2) * 1e3)
    print(json.dumps({"coalesced_1024x16MiB": {"pause_ms": round(statistics.median(ps_ms), 3),
                                               "resume_ms": round(statistics.median(rs_ms), 3),
                                               "pause_mappings": p.mappings, "unmap_calls": p.unmap_calls,
                                               "unmap_ms": round(p.unmap_s * 1e3, 3),
                                               "resume_mappings": r.mappings,
                                               "create_ms": round(r.create_s * 1e3, 3),
                                               "access_ms": round(r.access_s * 1e3, 3)}}))
    assert [t.data_ptr() for t in d] == ptrs
    for t in d:
        t.fill_(5)
    assert all(torch.all(t == 5).item() for t in d[::37])
    em.pause("many")  # its memory is free for what follows
    # Members freed while active and while paused (engine allocations: a torch free would only cache the block).
    mem = _native.load().memory
    dev = torch.cuda.current_device()
    k, size = 64, 16 * MiB
    ps = [mem.malloc(size, dev, "members", 1) for _ in range(k)]
    views = [torch.as_tensor(_Raw(p, size), device=f"cuda:{dev}") for p in ps]
    assert [v.data_ptr() for v in views] == ps, "torch.as_tensor copied instead of viewing the allocation"
    for i, v in enumerate(views):
        v.fill_(i % 251)
    torch.cuda.synchronize()
    em.pause("members")
    em.resume("members")
    together = all(ps[i + 1] == ps[i] + size for i in range(k - 1))
    if together:
        assert tag_bytes("members", "handles") == 1, em.stats()["tags"]
    freed = set(range(0, k, 4))
    for i in freed:
        views[i] = None
    f0 = free_bytes()
    for i in sorted(freed):
        assert mem.free(ps[i])
    held = tag_bytes("members", "bytes_pending_free")
    if together:
        assert held == len(freed) * size and free_bytes() - f0 < held // 2, (held, free_bytes() - f0)
    for i, v in enumerate(views):
        if v is not None:
            assert torch.all(v == i % 251).item(), f"live member {i} lost its content after a neighbour's free"
    f1 = free_bytes()
    rep = em.pause("members")
    f2 = free_bytes()
    assert rep.bytes_pending_freed == held, rep
    assert f2 - f1 >= 0.99 * (rep.bytes + rep.bytes_pending_freed), (rep, f2 - f1)
    assert tag_bytes("members", "bytes_pending_free") == 0
    for i in range(1, k, 4):  # free while paused
        views[i] = None
        assert mem.free(ps[i])
        freed.add(i)
    em.resume("members")
    for i, v in enumerate(views):
        if v is not None:
            assert torch.all(v == i % 251).item(), f"member {i} not restored bitwise"
    live = [i for i in range(k) if i not in freed]
    views = None
    torch.cuda.synchronize()
    f3 = free_bytes()
    for i in live:
        assert mem.free(ps[i])
    assert free_bytes() - f3 >= 0.99 * len(live) * size, (free_bytes() - f3, len(live) * size)
    assert tag_bytes("members", "bytes_pending_free") == 0 and em.stats()["global"]["bytes_pending_free"] == 0


def zombie_reclaim(mode: str):
    """The GPU full, members of a coalesced mapping freed while active (zombies: their memory still mapped), then an
    allocation through the hooks (a tensor in a region): it runs short, the engine reclaims the zombies (live
    members copied out, the mapping rebuilt without the freed ones at the same addresses, copied back) and the
    allocation succeeds. Live members keep their addresses and content, and pause/resume cycles afterwards restore
    the CPU-backed ones bitwise."""
    from ebbtide import _native  # noqa: PLC0415
    from ebbtide.errors import OutOfMemoryError as Oom  # noqa: PLC0415

    check_mode(mode)
    assert em.coalescing(), "coalescing is not on by default"
    mem = _native.load().memory
    dev = torch.cuda.current_device()
    k, size = 16, 256 * MiB
    backups = [1 if i % 4 == 0 else 0 for i in range(k)]  # live: i % 4 == 0 CPU-backed, i % 4 == 2 discard
    ps = [mem.malloc(size, dev, "zr", backups[i]) for i in range(k)]
    views = [torch.as_tensor(_Raw(p, size), device=f"cuda:{dev}") for p in ps]
    em.pause("zr")
    rep = em.resume("zr")
    together = all(ps[i + 1] == ps[i] + size for i in range(k - 1))
    print(f"zr: contiguous={together} mappings={rep.mappings}")
    for i, v in enumerate(views):
        v.fill_(i % 251)
    torch.cuda.synchronize()
    fillers = []  # fill the device with engine allocations (no zombie yet: no reclaim on the way)
    for chunk in (GiB, 64 * MiB, 2 * MiB):
        while True:
            try:
                fillers.append(mem.malloc(chunk, dev, "filler", 0))
            except Oom:
                break
    assert em.stats()["global"]["zombie_reclaims"] == 0
    freed = [i for i in range(k) if i % 2]
    for i in freed:
        views[i] = None
        assert mem.free(ps[i])
    held = tag_bytes("zr", "bytes_pending_free")
    if together:
        assert held == len(freed) * size, held
    t0 = time.perf_counter()
    with em.region("more", backup="none"):
        more = torch.empty(GiB, dtype=torch.uint8, device="cuda")  # OOM without the reclaim
    more.fill_(9)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    g = em.stats()["global"]
    print(json.dumps({"zombie_reclaim": {"held_bytes": held, "reclaims": g["zombie_reclaims"],
                                         "bytes_reclaimed": g["bytes_reclaimed"], "alloc_ms": round(took * 1e3, 2),
                                         "live_bytes": (k - len(freed)) * size}}))
    # Mappings are reclaimed (cheapest first) until the shortfall, about 1 GiB, is covered.
    assert g["zombie_reclaims"] >= 1 and g["bytes_reclaimed"] >= GiB - 64 * MiB, g
    assert tag_bytes("zr", "bytes_pending_free") == held - g["bytes_reclaimed"]
    for p in fillers:  # room for the comparisons' temporaries
        assert mem.free(p)
    for i, v in enumerate(views):
        if v is not None:
            assert v.data_ptr() == ps[i] and torch.all(v == i % 251).item(), f"live member {i} lost by the reclaim"
    assert torch.all(more == 9).item()
    del more
    torch.cuda.empty_cache()
    for _ in range(2):
        em.pause("zr")
        em.resume("zr")
        for i, v in enumerate(views):
            if v is not None and backups[i]:
                assert torch.all(v == i % 251).item(), f"member {i} not restored after the reclaim"
    views = None
    torch.cuda.synchronize()
    for i in range(k):
        if i not in freed:
            assert mem.free(ps[i])


torch.cuda.init()  # before every scenario: this module is imported only in a scenario's own process

if __name__ == "__main__":
    main(globals())
