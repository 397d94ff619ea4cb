"""Worker bodies for tests/testing/test_spawn.py: no torch, no process group; they only exercise how the spawn
protocol reports a worker that returns, fails, skips, hangs, crashes at exit or leaves a process behind."""
import os
import subprocess
import sys
import time

from ebbtide.testing.spawn import Skip, on_failure, progress


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


# ---- one process (spawn.call) ----------------------------------------------------------------------------------
def echo(*args, **kwargs):
    print("printed by the worker")
    os.write(2, b"written to fd 2 by the worker\n")
    return {"args": list(args), "kwargs": kwargs, "torch_loaded": "torch" in sys.modules}


def fails_with_diagnostics():
    on_failure(lambda: print("diagnostics: engine stats would go here", flush=True))
    raise ValueError("the scenario broke")


def skips():
    raise Skip("needs hardware this machine lacks")


def pytest_skips():
    import pytest

    pytest.skip("skipped by pytest inside the worker")


def hangs():
    progress("worker: about to block")
    _stuck_in_a_collective()


def crashes_at_exit():
    import atexit

    atexit.register(lambda: os._exit(3))  # as a native destructor that fails at interpreter teardown
    return "reported"


def leaves_a_child(pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    return child.pid


def not_json():
    return {1, 2}


def skips_teardown():
    import atexit

    atexit.register(lambda: os._exit(5))  # never runs: teardown=False leaves with os._exit right after the report
    return "fast exit"


def reports_then_hangs_at_exit():
    import threading

    threading.Thread(target=_stuck_in_a_collective, daemon=False).start()  # joined at interpreter shutdown
    return "reported"
