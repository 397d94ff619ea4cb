"""GPU scenarios for the adoption features, one per process: ``python adopt_scenarios.py <scenario> <preload|torch>``.

graph(): capture into a tagged pool, pause, resume, replay. The paused-block guard and check() (with a negative
control that places a block in paused memory on purpose). Poison of discarded memory. The memory margin. The
release report. expandable_segments (refused in preload mode, supported in torch mode). Every step prints the
device memory in use; a failure prints ebbtide's stats and release report.
"""
from __future__ import annotations

import os
import sys

import torch

import ebbtide.memory as em
from ebbtide.errors import InvalidArgumentError, OutOfMemoryError, StateError, UnsupportedError

import _scenario_runner
from _scenario_runner import GiB, MiB, check_mode, free_bytes, main

MODE = sys.argv[2] if len(sys.argv) > 2 else "?"


def say(label: str) -> int:
    return _scenario_runner.say(label, f"[{MODE}]")


def graph_replay(mode: str):
    """graph(): the capture's memory is pausable in both modes; with backup="cpu" the static output survives a
    pause without a replay, with "none" replay recomputes it."""
    check_mode(mode)
    n = 32 * MiB // 4
    with em.region("inputs", backup="cpu"):
        x = torch.randn(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.relu(x * 3 - 1).repeat(4).sum()
    torch.cuda.current_stream().wait_stream(side)
    graphs = {}
    for tag, backup in (("g_scratch", "none"), ("g_kept", "cpu")):
        g = torch.cuda.CUDAGraph()
        # torch.cuda.graph() empties the cache on entry: measure after that, or the warm-up's cached blocks
        # (about as large as the capture) given back there hide the capture's growth.
        torch.cuda.empty_cache()
        before = say(f"before capture into {tag}")
        with em.graph(g, tag=tag, backup=backup):
            y = torch.relu(x * 3 - 1).repeat(4).view(4, -1).sum(0)
        rows = [r for r in em.stats()["tags"] if r["tag"] == tag]
        assert rows and sum(r["bytes_active"] for r in rows) >= 128 * MiB, f"{tag}: capture not in the engine: {rows}"
        assert say(f"after capture into {tag}") - before >= 128 * MiB
        g.replay()
        graphs[tag] = (g, y, y.clone())
    u0 = say("before pause")
    em.pause(None)
    u1 = say("after pause(None)")
    assert u0 - u1 >= 2 * 128 * MiB, f"pausing the graphs freed {(u0 - u1) / MiB:.1f} MiB"
    em.resume(None)
    g, y, ref = graphs["g_kept"]
    assert torch.equal(y, ref), "CPU-backed graph output not restored"
    for tag, (g, y, ref) in graphs.items():
        g.replay()
        assert torch.equal(y, ref), f"{tag}: replay after resume differs"
    x.fill_(1.0)
    for tag, (g, y, ref) in graphs.items():
        g.replay()
        assert torch.all(y == 8.0).item(), f"{tag}: replay with new input"


def _check_diagnostics(found: list) -> str:
    """What check() saw against what the pause recorded, around each reported block."""
    from ebbtide.memory import _check  # noqa: PLC0415

    lines = [f"check() reported {found}"]
    for b in found[:4]:
        near = sorted(a for a in _check._baseline if abs(a - b["address"]) < 4 * MiB)
        lines.append(f"  baseline near {b['address']:#x}: {[hex(a) for a in near]}")
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= b["address"] < seg["address"] + seg["total_size"]:
                lines.append(f"  segment {seg['address']:#x}+{seg['total_size']} pool {seg.get('segment_pool_id')}: "
                             + str([{k: v for k, v in blk.items() if k != "frames"} for blk in seg["blocks"]]))
    return "\n".join(lines)


def paused_block_guard(mode: str):
    """While a tag is paused its pool's cached free blocks lie in unmapped memory: new allocations into the tag
    must come from a pool of their own (and check() finds none inside paused memory). Negative control: an
    allocation forced through the paused main pool is found by check() (it is never touched)."""
    check_mode(mode)
    em.set_checking(True)
    with em.region("t", backup="cpu"):
        xs = [torch.full((128 * 1024,), float(i), device="cuda") for i in range(16)]  # 512 KiB: small blocks
    del xs[1::2]  # free blocks inside segments that stay in use
    keep = {i: t for i, t in zip(range(0, 16, 2), xs)}
    em.pause("t")
    assert em.check() == [], _check_diagnostics(em.check())
    with em.region("t", backup="cpu"):
        ys = [torch.full((64 * 1024,), 5.0, device="cuda") for _ in range(6)]  # would fit the freed holes
    assert em.check() == [], f"new blocks inside paused memory: {em.check()}"
    paused = em.paused_ranges()
    for y in ys:
        assert not any(s <= y.data_ptr() < s + n for s, n in paused), "a new tensor lies in paused memory"
        y.add_(1)
        assert torch.all(y == 6.0).item()
    # Negative control: bypass the guard (the main pool, as a plain use_mem_pool would do).
    from ebbtide.memory import _hooks  # noqa: PLC0415

    main = _hooks._pools[(_hooks.region_pool_kind(mode, 1), "t", torch.cuda.current_device(), "main")]
    token = em._hooks._mem().region_push("t", 1)
    try:
        with torch.cuda.use_mem_pool(main):
            bad = torch.empty((64 * 1024,), device="cuda")  # reuses a cached free block of a paused segment
    finally:
        em._hooks._mem().region_pop(token)
    found = em.check()
    assert any(b["address"] == bad.data_ptr() for b in found), f"check() missed the planted block: {found}"
    try:
        em.check(raise_on_error=True)
        raise AssertionError("check(raise_on_error=True) did not raise")
    except StateError:
        pass
    del bad  # never touched: freeing a block is bookkeeping only
    em.resume("t")
    for i, t in keep.items():
        assert torch.all(t == float(i)).item(), f"tensor {i} lost its content"
    em.pause("t")  # second epoch: ys' pool is paused now too, a new region gets yet another pool
    with em.region("t", backup="cpu"):
        z = torch.full((64 * 1024,), 2.0, device="cuda")
    assert em.check() == [] and torch.all(z == 2.0).item()
    em.resume("t")
    assert all(torch.all(y == 6.0).item() for y in ys) and torch.all(z == 2.0).item()


def poison(mode: str):
    """EBBTIDE_MEM_POISON=1: discarded memory reads 0xA5 after resume (stale reads show up in tests)."""
    check_mode(mode)
    assert os.environ.get("EBBTIDE_MEM_POISON") == "1"
    with em.region("scratch", backup="none"):
        x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    with em.region("kept", backup="cpu"):
        k = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    em.pause(None)
    em.resume(None)
    assert torch.all(x == 0xA5).item(), "discarded memory was not poisoned"
    assert torch.all(k == 0).item(), "CPU-backed memory must be restored, not poisoned"


def memory_margin(mode: str):
    """An allocation that would leave less than the margin free fails as OOM (PyTorch frees its cache, retries,
    then raises); a resume that would leave less fails before touching anything and can be retried."""
    check_mode(mode)
    with em.region("r", backup="cpu"):
        w = torch.randint(0, 100, (256 * MiB,), dtype=torch.int32, device="cuda")  # 1 GiB
    ref_sum = int(w.sum().item())
    em.set_memory_margin(free_bytes() - GiB)
    print(f"margin {em.memory_margin() / GiB:.3f} GiB, free {free_bytes() / GiB:.3f} GiB", flush=True)
    try:
        with em.region("m"):
            torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        raise AssertionError("an allocation under the margin succeeded")
    except torch.OutOfMemoryError as e:
        print(f"refused as expected: {str(e)[:200]}")
    with em.region("m"):
        ok = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # leaves more than the margin
    del ok
    em.set_memory_margin(0)
    em.pause("r")
    em.set_memory_margin(free_bytes() - GiB // 2)  # the resume needs 1 GiB: would leave less than the margin
    try:
        em.resume("r")
        raise AssertionError("a resume under the margin succeeded")
    except OutOfMemoryError as e:
        assert e.needed and e.free is not None, e
    assert [r["state"] for r in em.stats()["tags"] if r["tag"] == "r"] == ["paused"]
    em.set_memory_margin(0)
    em.resume("r")
    assert int(w.sum().item()) == ref_sum


def release_report(mode: str):
    """After a pause the report accounts for the memory: what came back, what PyTorch still holds outside paused
    memory, what bypassed the runtime (forwarded cudaMalloc calls in preload mode), the rest (context)."""
    check_mode(mode)
    with em.region("warm"):  # the first pause creates the runtime's copy streams and events: not part of this
        t = torch.ones(MiB, device="cuda")
    em.pause("warm")
    em.resume("warm")
    del t
    with em.region("w", backup="cpu"):
        w = torch.ones(GiB // 4, device="cuda")
    other = torch.ones(256 * MiB // 4, device="cuda")  # outside any region: untracked
    rep = em.pause("w")
    rr = em.release_report(rep)
    print(rr, flush=True)
    assert rr.bytes_paused >= GiB and rr.driver_freed is not None and rr.driver_freed >= 0.99 * rr.bytes_paused, rr
    assert rr.missing is not None and rr.missing <= 0.01 * rr.bytes_paused
    assert rr.torch_allocated_unpaused >= 256 * MiB, "the untracked tensor should show as PyTorch memory"
    assert rr.other_bytes is not None and rr.other_bytes > 0, "the CUDA context holds memory"
    assert "w" not in rr.active_tags
    if mode == "preload":
        assert rr.shim_active and rr.forwarded_allocs >= 1 and rr.forwarded_bytes >= 256 * MiB, rr
    em.resume("w")
    assert torch.all(w == 1).item() and torch.all(other == 1).item()


def expandable_segments(mode: str):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: refused with a clear error in preload mode (that memory
    bypasses cudaMalloc); supported in torch mode (a region's pool uses ebbtide's allocator, never segments)."""
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    check_mode(mode)
    if mode == "preload":
        try:
            with em.region("e"):
                pass
            raise AssertionError("preload mode accepted expandable segments")
        except UnsupportedError as e:
            assert "expandable_segments" in str(e), e
        try:
            em.set_default_region("e")
            raise AssertionError("preload mode accepted a default region with expandable segments")
        except UnsupportedError:
            pass
        return
    with em.region("e", backup="cpu"):
        x = torch.arange(128 * MiB, dtype=torch.int32, device="cuda")  # 512 MiB
    ref = x.cpu()
    rows = [r for r in em.stats()["tags"] if r["tag"] == "e"]
    assert sum(r["bytes_active"] for r in rows) >= 512 * MiB, f"region memory not in the engine: {rows}"
    u0 = say("after 512 MiB in region 'e'")
    rep = em.pause("e")
    u1 = say("after pause('e')")
    assert u0 - u1 >= 0.9 * 512 * MiB, "pause did not free the region's memory"
    assert em.release_report(rep).expandable_segments
    em.resume("e")
    assert torch.equal(x.cpu(), ref)


def shareable_ipc(mode: str):
    """A tensor of a shareable region exported as a POSIX fd, sent over a Unix socket to a second process, which
    maps it, checks the bytes and writes; the writer's change is visible here (a handle claiming more than the
    mapping is refused there first). Then pause/resume still work."""
    import pickle  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    check_mode(mode)
    with em.region("s", backup="cpu", shareable=True):
        x = torch.arange(64 * MiB, dtype=torch.int32, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    fd, handle = em.export_tensor(x)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, __file__, "_ipc_child", mode, str(child.fileno())],
                            pass_fds=[child.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.close()
    socket.send_fds(parent, [pickle.dumps(handle)], [fd])
    os.close(fd)
    reply = parent.recv(16)
    out, err = proc.communicate(timeout=240)
    print(out[-3000:], err[-3000:], sep="\n")
    assert proc.returncode == 0 and reply == b"written", f"child failed ({proc.returncode}, {reply!r})"
    assert torch.all(x[:8] == -1).item(), "the child's write is not visible here"
    assert torch.equal(x[8:], torch.arange(8, 64 * MiB, dtype=torch.int32, device="cuda"))
    em.pause("s")
    em.resume("s")
    assert torch.all(x[:8] == -1).item()


def _ipc_child(mode: str, sock_fd: str):
    import dataclasses  # noqa: PLC0415
    import pickle  # noqa: PLC0415
    import socket  # noqa: PLC0415

    sock = socket.socket(fileno=int(sock_fd))
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    handle = pickle.loads(msg)
    em.check_handle(handle)
    # A handle whose tensor runs past the mapping is refused before anything is mapped.
    lie = dataclasses.replace(handle, nbytes=handle.size, shape=(handle.size // 4,), offset=handle.offset + 4)
    try:
        em.import_tensor(lie, os.dup(fds[0]))
        raise AssertionError("import_tensor accepted a handle beyond the mapping")
    except InvalidArgumentError:
        pass
    with em.import_tensor(handle, fds[0]) as imp:
        t = imp.tensor
        assert t.shape == (64 * MiB,) and t.dtype == torch.int32, (t.shape, t.dtype)
        assert torch.equal(t, torch.arange(64 * MiB, dtype=torch.int32, device="cuda")), "imported bytes differ"
        t[:8] = -1
        torch.cuda.synchronize()
    sock.sendall(b"written")


torch.cuda.init()  # before every scenario: this module is imported only in a scenario's own process

if __name__ == "__main__":
    main(globals())  # by hand, and _ipc_child (which also takes its socket fd)
