"""The disk tier (backup="disk"): a pause writes each allocation to a file of its own in the disk-backup directory
through pinned staging, a resume checks and reads it back and removes the file; refusals leave the tag as it was.

Engine scenarios against the host-memory fake driver, one per process, with a real directory on disk (the test
passes it as EBT_TEST_DISK_DIR): ``python fake_disk.py <scenario> [args...]`` (test_host_tiers_fake.py runs them).
Exit status 0 and "OK" = pass.
"""
from __future__ import annotations

import os
import resource
import shutil
import signal

import ebbtide.memory as em
from ebbtide.errors import DriverError, InvalidArgumentError, StateError, SystemCallError

from _fake_driver import MiB, NATIVE, assert_clean, expect_failure, fault, fill, free, read, tag_row
from _scenario_runner import Skip, main

DIR = os.environ.get("EBT_TEST_DISK_DIR", "")
DISK = NATIVE.BACKUP_DISK
HEADER = 4096


def _alloc(size: int, tag: str, code: int = DISK) -> int:
    return NATIVE.malloc(size, 0, tag, code)


def _files() -> dict:
    return {f: os.path.getsize(os.path.join(DIR, f)) for f in os.listdir(DIR)}


def _expected_size(n: int) -> int:
    return HEADER + -(-n // 4096) * 4096


def _setup(sizes, tag="d"):
    em.set_disk_backup_dir(DIR)
    assert em.disk_backup_dir() == DIR
    ps = [_alloc(s, tag) for s in sizes]
    return ps, [fill(p, s, i + 1) for i, (p, s) in enumerate(zip(ps, sizes))]


def _check(ps, sizes, data):
    for p, s, d in zip(ps, sizes, data):
        assert read(p, s) == d, "content lost"


def roundtrip_and_files():
    """One file per allocation while paused (header + data padded to 4 KiB), none after the resume; the chunked
    pipeline (EBBTIDE_MEM_DISK_CHUNK_BYTES=1 MiB, 3 I/O threads, odd tails) restores every byte, three cycles with
    the same disk use; the stats and the report count it."""
    sizes = [13 * MiB + 12345, 7, 2 * MiB, 1 * MiB + 4096]
    ps, data = _setup(sizes)
    none = _alloc(3 * MiB, "d", NATIVE.BACKUP_NONE)
    seen = set()
    for _ in range(3):
        em.pause("d")
        files = _files()
        assert sorted(files.values()) == sorted(_expected_size(s) for s in sizes), files
        assert all(f.startswith(f"ebbtide-{os.getpid()}-") and f.endswith(".bak") for f in files), files
        seen.add(sum(files.values()))
        h = em.host_memory()
        assert h.disk_files == len(sizes) and h.disk_bytes == sum(files.values()) and h.disk_staging > 0, h
        assert em.get_cpu_backup_address(ps[0]) == (0, 0)  # a disk backup has no host copy
        em.resume("d")
        assert _files() == {} and em.host_memory().disk_files == 0
        _check(ps, sizes, data)
    assert len(seen) == 1
    row = tag_row("d")
    assert row["last_pause"]["bytes_disk"] == sum(sizes) == row["last_resume"]["bytes_disk"]
    assert row["last_pause"]["disk_s"] > 0
    for p in ps + [none]:
        free(p)
    assert em.release_host_memory() > 0  # the staging goes back when idle
    assert_clean()


def mixed_cpu_and_disk_in_one_pause():
    """pause(None) over discard, CPU (arena and transient) and disk allocations of several tags."""
    em.set_disk_backup_dir(DIR)
    d = _alloc(5 * MiB + 1, "a")
    c = _alloc(5 * MiB, "a", NATIVE.BACKUP_CPU)
    t = _alloc(5 * MiB, "b", NATIVE.BACKUP_CPU | NATIVE.HOST_TRANSIENT)
    n = _alloc(5 * MiB, "b", NATIVE.BACKUP_NONE)
    data = {p: fill(p, s, i) for i, (p, s) in enumerate(((d, 5 * MiB + 1), (c, 5 * MiB), (t, 5 * MiB)))}
    em.pause()
    assert len(_files()) == 1
    em.resume()
    for p, dd in data.items():
        assert read(p, len(dd)) == dd
    assert _files() == {}
    for p in (d, c, t, n):
        free(p)
    assert_clean()


def tmpfs_refused():
    """A directory on tmpfs is refused by name, set explicitly or taken from the environment at the first pause;
    the tag stays resident and intact."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.statvfs(shm).f_fsid == os.statvfs(DIR).f_fsid:
        raise Skip("/dev/shm is not a separate tmpfs here")
    with open("/proc/mounts") as f:
        if not any(line.split()[1] == shm and line.split()[2] == "tmpfs" for line in f):
            raise Skip("/dev/shm is not tmpfs here")
    target = os.path.join(shm, f"ebbtide-test-{os.getpid()}")
    try:
        expect_failure(lambda: em.set_disk_backup_dir(target), InvalidArgumentError, "tmpfs", target)
        os.environ["EBBTIDE_MEM_DISK_DIR"] = target  # read at the first use of the disk tier, below
        p = _alloc(3 * MiB, "d")
        data = fill(p, 3 * MiB, 4)
        expect_failure(lambda: em.pause("d"), InvalidArgumentError, "tmpfs")
        assert tag_row("d")["state"] == "active" and read(p, 3 * MiB) == data
        assert not os.path.exists(target) or os.listdir(target) == []
        free(p)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    assert_clean()


def disk_full_keeps_the_tag_resident():
    """The file cannot be had (RLIMIT_FSIZE below its size: the kernel refuses the allocation, as a full disk
    does): the pause fails before anything is released, no file is left, the content is intact; once there is room
    the pause works."""
    sizes = [6 * MiB, 6 * MiB]
    ps, data = _setup(sizes)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the call fails with EFBIG instead of killing the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * MiB, hard))
    try:
        expect_failure(lambda: em.pause("d"), SystemCallError, "nothing was released")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert tag_row("d")["state"] == "active" and _files() == {}
    _check(ps, sizes, data)
    em.pause("d")
    em.resume("d")
    _check(ps, sizes, data)
    for p in ps:
        free(p)
    assert_clean()


def directory_gone_keeps_the_tag_resident():
    """The directory turned into a regular file after it was set: the files cannot be created, the pause fails,
    the tag stays resident."""
    sizes = [3 * MiB]
    ps, data = _setup(sizes)
    shutil.rmtree(DIR)
    with open(DIR, "w") as f:
        f.write("not a directory")
    try:
        expect_failure(lambda: em.pause("d"), SystemCallError, "cannot create")
    finally:
        os.unlink(DIR)
        os.makedirs(DIR)
    assert tag_row("d")["state"] == "active"
    _check(ps, sizes, data)
    free(ps[0])
    assert_clean()


def copy_failure_at_pause_releases_nothing():
    """A device copy into the staging fails: no file is left, nothing released."""
    sizes = [5 * MiB, 5 * MiB]
    ps, data = _setup(sizes)
    fault("cuMemcpyDtoHAsync", 3)
    expect_failure(lambda: em.pause("d"), DriverError, "nothing was released")
    assert tag_row("d")["state"] == "active" and _files() == {}
    _check(ps, sizes, data)
    for p in ps:
        free(p)
    assert_clean()


def _crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli), as the header carries it (fields before offset 64)."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _tamper_and_retry(ps, sizes, data, change, expect):
    """Pause, change a file, check the resume refuses it (tag paused, files kept), undo the change, resume."""
    em.pause("d")
    names = sorted(_files())
    saved = {n: open(os.path.join(DIR, n), "rb").read() for n in names}
    change(names)
    expect_failure(lambda: em.resume("d"), StateError, expect, "stays paused")
    assert tag_row("d")["state"] == "paused" and sorted(_files()) == names
    for n, blob in saved.items():
        with open(os.path.join(DIR, n), "wb") as f:
            f.write(blob)
    em.resume("d")  # retryable
    _check(ps, sizes, data)
    assert _files() == {}


def truncated_or_foreign_file_refused():
    """A truncated file, another allocation's file, a file from an earlier process (another nonce), a damaged
    header or a changed chunk: refused at resume, the tag stays paused with its files, and the resume works once
    the files are as written."""
    sizes = [3 * MiB + 5, 3 * MiB + 5]  # same size: swapping them is caught by the allocation id
    ps, data = _setup(sizes)

    def path(n):
        return os.path.join(DIR, n)

    def truncate(names):
        os.truncate(path(names[0]), HEADER + MiB)

    def swap(names):
        a, b = (open(path(n), "rb").read() for n in names)
        open(path(names[0]), "wb").write(b)
        open(path(names[1]), "wb").write(a)

    def other_process(names):
        # What an earlier run's file carries: a whole, valid header with another process's nonce.
        blob = bytearray(open(path(names[0]), "rb").read())
        blob[16] ^= 0xFF
        blob[64:68] = _crc32c(bytes(blob[:64])).to_bytes(4, "little")
        open(path(names[0]), "wb").write(bytes(blob))

    def header_damaged(names):
        blob = bytearray(open(path(names[0]), "rb").read())
        blob[40] ^= 0x01  # inside the header's fields, under its checksum
        open(path(names[0]), "wb").write(bytes(blob))

    def chunk_changed(names):
        with open(path(names[1]), "r+b") as f:
            f.seek(HEADER + 2 * MiB + 17)
            b = f.read(1)
            f.seek(HEADER + 2 * MiB + 17)
            f.write(bytes([b[0] ^ 0x40]))

    for change, expect in ((truncate, "truncated"), (swap, "another allocation"),
                           (other_process, "another process"), (header_damaged, "damaged"),
                           (chunk_changed, "CRC32C")):
        _tamper_and_retry(ps, sizes, data, change, expect)
    for p in ps:
        free(p)
    assert_clean()


def free_while_paused_removes_the_file():
    sizes = [2 * MiB, 2 * MiB]
    ps, _ = _setup(sizes)
    em.pause("d")
    assert len(_files()) == 2
    free(ps[0])
    assert len(_files()) == 1
    free(ps[1])
    assert _files() == {}
    assert_clean()


def exit_while_paused():
    """Paused at exit: the process's files are removed by its exit handler (the test checks the directory)."""
    ps, _ = _setup([2 * MiB, 1 * MiB])
    em.pause("d")
    assert len(_files()) == 2
    return {"paused": len(ps)}


if __name__ == "__main__":
    main(globals())
