"""The launcher's child processes: each trainer rank leads a process group of its own (with its rollout child), so
killing a rank kills what it started; waiting for a variant's ranks stops at the deadline, or a grace period after
the first rank failed (its peers would otherwise wait for it in a collective until NCCL's own timeout)."""
from __future__ import annotations

import os
import signal
import time


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def _kill_group(p) -> None:
    """Kill ``p`` and, when it leads its own process group (started with start_new_session), the group: a trainer
    rank takes its rollout child with it."""
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
            return
    except (ProcessLookupError, PermissionError):
        pass
    if p.poll() is None:
        p.kill()


def _reap_group(pgid: int) -> None:
    """What is left of a finished rank's process group (a rollout whose trainer exited without closing it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


PEER_GRACE_S = 60  # after one rank failed, how long the others get to finish before they are killed


def _wait_all(procs: list, timeout: float, grace: float = PEER_GRACE_S) -> dict:
    """Wait for every process; kill the rest at the deadline, or ``grace`` seconds after one exits non-zero (its
    peers would wait for it in a collective until NCCL's own timeout). Returns {index: why it was killed}."""
    deadline = time.monotonic() + timeout
    first_failure = None  # (time, index)
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_failure is None:
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                first_failure = (now, bad[0])
        why = None
        if now > deadline:
            why = f"timed out after {timeout} s"
        elif first_failure is not None and now > first_failure[0] + grace:
            why = f"killed {grace:.0f} s after rank {first_failure[1]} failed"
        if why:
            killed = {}
            for i, p in enumerate(procs):
                if p.poll() is None:
                    _kill_group(p)
                    killed[i] = why
            return killed
        time.sleep(0.2)
    return {}
