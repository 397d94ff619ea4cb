"""Rank bodies for tests/comm/test_spawn_harness.py: no torch, no process group; they only exercise how the spawn
helper reports a rank that fails and a rank that hangs."""
import time

from ebbtide.bench._spawn import progress


def _stuck_in_a_collective():
    while True:  # stands in for a rank blocked in NCCL waiting for a peer that died
        time.sleep(0.05)


def one_fails_one_hangs(rank, world, init):
    progress(f"rank {rank}: phase A")
    if rank == 0:
        raise RuntimeError("injected failure on rank 0")
    progress(f"rank {rank}: entering the collective")
    _stuck_in_a_collective()


def all_hang(rank, world, init):
    progress(f"rank {rank}: entering the collective")
    _stuck_in_a_collective()


def ok(rank, world, init, value=0):
    import os

    progress(f"rank {rank}: ok")
    os.write(1, f"fd1 from rank {rank}\n".encode())  # as a C library writes: below Python's sys.stdout
    os.write(2, f"fd2 from rank {rank}\n".encode())
    return {"rank": rank, "value": value}


def returns_then_hangs_at_exit(rank, world, init):
    """The result is written, then the process does not exit (as a native destructor stuck at exit would)."""
    import threading

    threading.Thread(target=_stuck_in_a_collective, daemon=False).start()  # joined at interpreter shutdown
    return {"rank": rank}
