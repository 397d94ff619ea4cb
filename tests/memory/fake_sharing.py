"""Memory used outside this process's PyTorch: shareable allocations exported to another process, and the
CuPy allocator entry points.

Engine scenarios against the host-memory fake driver, one per process:
``python fake_sharing.py <scenario> [args...]`` (test_engine_fake.py runs them; _fake_driver.py holds what they
share). Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import ctypes
import os
import sys

import ebbtide.memory as em
from ebbtide.errors import InvalidArgumentError, NotFoundError, StateError

from _fake_driver import MiB, NATIVE, alloc, assert_clean, counters, fill, free, read
from _scenario_runner import main


def shareable_ipc():
    """A shareable allocation exported as a POSIX fd, sent to a second process (SCM_RIGHTS), mapped there: both see
    the same bytes. Refusals: not shareable, paused. An import in this process is closed without leaks."""
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    size = 4 * MiB + 100
    p = NATIVE.malloc(size, 0, "s", NATIVE.SHAREABLE | 1)
    data = fill(p, size, 11)
    plain = alloc(2 * MiB, "plain", "cpu")
    try:
        NATIVE.export_fd(plain)
        raise AssertionError("export of a non-shareable allocation succeeded")
    except InvalidArgumentError:
        pass
    fd, off, mapped = NATIVE.export_fd(p + 4096)
    assert off == 4096 and mapped == 6 * MiB, (off, mapped)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, __file__, "_ipc_child", str(child.fileno()), str(mapped), str(off)],
                            pass_fds=[child.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.close()
    socket.send_fds(parent, [data[4096:4096 + 100]], [fd])
    os.close(fd)
    reply = parent.recv(16)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and reply == b"written", f"child failed: {reply!r}\n{out}\n{err}"
    assert read(p, 8) == b"IMPORTED", "the child's write through its mapping is not visible here"
    # import in this process too; close it; counters return
    fd2, _, _ = NATIVE.export_fd(p)
    base = NATIVE.import_fd(fd2, mapped, 0)
    os.close(fd2)
    assert base != p and read(base, 8) == b"IMPORTED" and read(base + 4096, 100) == data[4096:4196]
    NATIVE.close_import(base)
    try:
        NATIVE.close_import(base)
        raise AssertionError("double close_import succeeded")
    except NotFoundError:
        pass
    em.pause("s")
    try:
        NATIVE.export_fd(p)
        raise AssertionError("export of a paused allocation succeeded")
    except StateError:
        pass
    em.resume("s")  # resumed memory is created shareable again
    fd3, _, _ = NATIVE.export_fd(p)
    os.close(fd3)
    assert read(p, 8) == b"IMPORTED"  # CPU backup restored the child's write
    free(p)
    free(plain)
    assert_clean()


def _ipc_child(sock_fd: str, mapped: str, off: str):
    import socket  # noqa: PLC0415

    sock = socket.socket(fileno=int(sock_fd))
    expect, fds, _, _ = socket.recv_fds(sock, 100, 1)
    base = NATIVE.import_fd(fds[0], int(mapped), 0)
    os.close(fds[0])
    assert read(base + int(off), 100) == expect, "imported memory differs from the exporter's"
    ctypes.memmove(base, b"IMPORTED", 8)
    NATIVE.close_import(base)
    sock.sendall(b"written")


def import_handle_checks():
    """import_tensor trusts nothing in the peer's handle: a handle whose tensor would lie outside the mapping, or
    whose shape, dtype and byte count disagree, is refused before anything is mapped (and its fd is still closed).
    A good handle maps; when viewing it fails afterwards (no CUDA torch here) the mapping is closed again."""
    import dataclasses  # noqa: PLC0415

    from ebbtide.memory import SharedHandle  # noqa: PLC0415

    p = NATIVE.malloc(4 * MiB, 0, "s", NATIVE.SHAREABLE | 1)
    fd, off, mapped = NATIVE.export_fd(p + 4096)
    good = SharedHandle(offset=off, size=mapped, nbytes=1024 * 4, shape=(32, 32), dtype="float32", device=0)
    em.check_handle(good)
    bad = [dataclasses.replace(good, offset=mapped - 1024),          # runs past the mapping
           dataclasses.replace(good, offset=off + 2),                # misaligned for float32
           dataclasses.replace(good, nbytes=4097),                   # disagrees with shape x itemsize
           dataclasses.replace(good, shape=(32, 33)),
           dataclasses.replace(good, shape=(-32, -32)),
           dataclasses.replace(good, shape=[32, 32]),
           dataclasses.replace(good, dtype="complex128"),
           dataclasses.replace(good, size=0, offset=0),
           dataclasses.replace(good, offset=-4096),
           dataclasses.replace(good, device=True),
           dataclasses.replace(good, size=mapped, offset=0, nbytes=mapped + 4, shape=((mapped + 4) // 4,)),
           {"offset": off, "size": mapped}]
    mappings = counters()["mappings"]
    for h in bad:
        try:
            em.check_handle(h)
            raise AssertionError(f"check_handle accepted {h}")
        except InvalidArgumentError:
            pass
        dup = os.dup(fd)
        try:
            em.import_tensor(h, dup)
            raise AssertionError(f"import_tensor accepted {h}")
        except InvalidArgumentError:
            pass
        assert counters()["mappings"] == mappings, f"a refused handle mapped memory: {h}"
        try:
            os.fstat(dup)
            raise AssertionError("import_tensor left the fd open")
        except OSError:
            pass
    try:
        em.import_tensor(good, os.dup(fd), device=-1)
        raise AssertionError("import_tensor accepted device=-1")
    except InvalidArgumentError:
        pass
    try:  # maps, then cannot view the mapping as a CUDA tensor here: the mapping is closed again
        em.import_tensor(good, os.dup(fd))
        raise AssertionError("import_tensor made a CUDA tensor without CUDA")
    except (AssertionError, RuntimeError) as e:
        assert "CUDA" in str(e), e
    assert counters()["mappings"] == mappings
    os.close(fd)
    free(p)
    assert_clean()


def cupy_allocator_routing():
    """ebbtide.memory.cupy_allocator's entry points (CuPy itself is not needed here): an allocation lands in the
    calling thread's region, else the process-wide default region, else tag "default"; a refused one is NULL and
    leaves the engine's reason for the typed error."""
    from ebbtide.memory import _cupy  # noqa: PLC0415

    malloc, free_, last = _cupy._runtime()
    with em.region("arrays", "cpu"):
        a = malloc(4 * MiB, 0, None)
    em.set_default_region("proc", "cpu")
    b = malloc(4 * MiB, 0, None)
    em.set_default_region(None)
    c = malloc(2 * MiB, 0, None)
    assert a and b and c
    tags = [NATIVE.lookup(p)[2] for p in (a, b, c)]
    assert tags == ["arrays", "proc", "default"], tags
    em.set_memory_margin(60 * MiB)
    assert not malloc(4 * MiB, 0, None) and b"margin" in last(), last()
    em.set_memory_margin(0)
    for p in (a, b, c):
        free_(p, 0, 0, None)
    assert_clean()


if __name__ == "__main__":
    main(globals())
