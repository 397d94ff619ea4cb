"""Run a function on N spawned ranks (TCPStore rendezvous on loopback) and surface every rank's failure. Used by
the comm tests and the comm benchmark (process groups are process-global state, so every scenario gets fresh
interpreters).

Contract (fail fast, never hang silently):
- Each rank logs to ``<logdir>/<run>/rank<r>.log``, line-buffered and flushed: its progress lines
  (:func:`progress`), the ``ebbtide.comm`` logger at DEBUG (every release/reload step), its traceback on failure,
  and Python stacks of all its threads when it crashes (faulthandler) or when the parent asks (SIGUSR1). The rank's
  file descriptors 1 and 2 go to ``rank<r>.out`` (torch's C++ warnings, the NCCL watchdog, ``NCCL_DEBUG`` output),
  which also gets a copy of every progress line.
  ``<logdir>`` is ``$EBBTIDE_COMM_LOGDIR`` (a GPU job sets it to its output folder), else
  ``$EBBTIDE_TEST_ARTIFACTS/comm`` (set by scripts/gpu-check), else a kept temporary folder; the error names it.
- The parent polls. At the deadline, or ``grace`` seconds after the first rank failed (its peers are then usually
  blocked in a collective or a communicator split waiting for it), every live rank gets SIGUSR1 (stack dump), then
  SIGKILL; the error lists which ranks had not finished, the last line each logged, and the tail of its log.
- As a backstop, each rank arms ``faulthandler.dump_traceback_later`` just before the deadline, so a stack dump
  exists even if the parent itself is killed first.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

__all__ = ["run", "progress", "log_dir"]

_RANK_LOG = None  # this process's rank log (a file object) when it is a spawned rank
_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One progress line to stderr and, inside a spawned rank, to the rank's log file (flushed at once, so the
    last line survives a kill). Cheap enough to call at every phase boundary."""
    line = f"[ebt-comm pid {os.getpid()} +{time.monotonic() - _T0:7.2f}s] {msg}\n"
    for f in (_RANK_LOG, sys.stderr):
        if f is None:
            continue
        try:
            f.write(line)
            f.flush()
        except (OSError, ValueError):
            pass


def log_dir() -> str:
    """Where rank logs go: $EBBTIDE_COMM_LOGDIR, else $EBBTIDE_TEST_ARTIFACTS/comm (scripts/gpu-check collects that
    folder), else one kept temporary folder per process. Created if missing."""
    d = os.environ.get("EBBTIDE_COMM_LOGDIR")
    if not d and os.environ.get("EBBTIDE_TEST_ARTIFACTS"):
        d = os.path.join(os.environ["EBBTIDE_TEST_ARTIFACTS"], "comm")
    if not d:
        d = os.environ.setdefault("EBBTIDE_COMM_LOGDIR", tempfile.mkdtemp(prefix="ebt-comm-logs-"))
    os.makedirs(d, exist_ok=True)
    return d


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tee:
    """A text stream writing to the rank log and the inherited stderr (the logging handler's target)."""

    def write(self, s):
        for f in (_RANK_LOG, sys.__stderr__):
            try:
                f.write(s)
                f.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def flush(self):
        pass


def _entry(rank: int, world: int, init: str, rundir: str, module: str, fn: str, kwargs: dict, path: list,
           dump_after: float) -> None:
    global _RANK_LOG, _T0
    _T0 = time.monotonic()
    sys.path[:0] = path
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    native = os.open(os.path.join(rundir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(native, 1)  # native code writes to the fds, not to sys.stdout/sys.stderr
    os.dup2(native, 2)
    os.close(native)
    _RANK_LOG = open(os.path.join(rundir, f"rank{rank}.log"), "a", buffering=1)
    # Native crashes and the parent's SIGUSR1 dump every thread's Python stack into the log (raw fd writes).
    faulthandler.enable(file=_RANK_LOG, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_RANK_LOG, all_threads=True, chain=False)
    if dump_after > 0:
        faulthandler.dump_traceback_later(dump_after, repeat=False, file=_RANK_LOG, exit=False)
    handler = logging.StreamHandler(_Tee())
    handler.setFormatter(logging.Formatter(f"[rank{rank} %(relativeCreated)9.0fms %(name)s] %(message)s"))
    lg = logging.getLogger("ebbtide.comm")
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    out = os.path.join(rundir, f"rank{rank}.json")
    progress(f"rank {rank}/{world}: {module}.{fn}({kwargs}) starting")
    try:
        import importlib

        mod = importlib.import_module(module)
        result = getattr(mod, fn)(rank, world, init, **kwargs)
        with open(out + ".tmp", "w") as f:
            json.dump({"ok": True, "result": result}, f)
        os.replace(out + ".tmp", out)
        progress(f"rank {rank}: finished")
    except BaseException:  # report everything, including SystemExit from a worker
        tb = traceback.format_exc()
        progress(f"rank {rank}: FAILED\n{tb}")
        with open(out + ".tmp", "w") as f:
            json.dump({"ok": False, "error": tb}, f)
        os.replace(out + ".tmp", out)
        raise SystemExit(1) from None
    finally:
        faulthandler.cancel_dump_traceback_later()


def _tail(path: str, lines: int) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    | " + s for s in text[-lines:]) or "(empty log)"


def _last_progress(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            marks = [s for s in f.read().splitlines() if s.startswith(("[ebt-comm", "[rank"))]
    except OSError:
        return "(no log)"
    return marks[-1] if marks else "(nothing logged)"


def _stop(procs, alive: list[int], rundir: str) -> None:
    """SIGUSR1 (each rank's faulthandler dumps its stacks into its log), a moment to write, then SIGKILL."""
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)  # faulthandler writes from the signal handler at once; this is only for the disk
    for r in alive:
        procs[r].kill()
    for r in alive:
        procs[r].join(5)


def run(fn: str, world: int, *, module: str, timeout: float = 90.0, grace: float = 20.0, path: list | None = None,
        tail: int = 80, **kwargs) -> list:
    """Run ``module.fn(rank, world, init_method, **kwargs)`` on ``world`` spawned ranks (``path`` is prepended to
    their sys.path); return each rank's JSON-able result. Raises AssertionError with every failing rank's
    traceback, or naming the ranks that had not finished with their last progress line and log tail.

    ``timeout``: seconds for the whole run. ``grace``: seconds the other ranks get after the first failure."""
    ctx = mp.get_context("spawn")
    rundir = tempfile.mkdtemp(prefix=f"{fn}-{time.strftime('%H%M%S')}-", dir=log_dir())
    # TCPStore, as torchrun uses (a FileStore polls, which would add its latency to every barrier).
    init = f"tcp://127.0.0.1:{_free_port()}"
    dump_after = max(1.0, timeout - 5.0)
    procs = [ctx.Process(target=_entry, args=(r, world, init, rundir, module, fn, kwargs, list(path or []),
                                              dump_after), daemon=True) for r in range(world)]
    progress(f"spawn {module}.{fn} on {world} ranks, deadline {timeout:.0f} s, logs {rundir}")
    t0 = time.monotonic()
    deadline = t0 + timeout
    first_fail: tuple[int, float] | None = None
    alive: list[int] = []
    all_reported: float | None = None
    why_stopped = ""
    try:
        for p in procs:
            p.start()
        while True:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            if not alive:
                break
            now = time.monotonic()
            if first_fail is None:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    first_fail = (failed[0], now)
            reported = [r for r in range(world) if os.path.exists(os.path.join(rundir, f"rank{r}.json"))]
            if len(reported) == world and all_reported is None:
                all_reported = now
            if all_reported is not None and now >= all_reported + grace:
                # Every rank returned its result but some process does not exit (a native destructor at exit):
                # nothing is lost by stopping it; say so without failing the run.
                progress(f"spawn {fn}: ranks {alive} reported but did not exit within {grace:.0f} s; stopping them")
                _stop(procs, alive, rundir)
                break
            if now >= deadline:
                why_stopped = f"deadline of {timeout:.0f} s reached"
            elif first_fail is not None and now >= first_fail[1] + grace:
                why_stopped = (f"still running {grace:.0f} s after rank {first_fail[0]} failed "
                               f"(at +{first_fail[1] - t0:.1f} s)")
            if why_stopped:
                progress(f"spawn {fn}: stopping ranks {alive}: {why_stopped}")
                _stop(procs, alive, rundir)
                break
            time.sleep(0.05)
    finally:  # also on KeyboardInterrupt / a pytest-timeout exception: never leave ranks behind
        left = [r for r, p in enumerate(procs) if p.pid is not None and p.is_alive()]
        if left:
            _stop(procs, left, rundir)
    hung = set(alive) if why_stopped else set()
    results, errors = [], []
    for r in range(world):
        rpath = os.path.join(rundir, f"rank{r}.json")
        lpath = os.path.join(rundir, f"rank{r}.log")
        if not os.path.exists(rpath):
            if r in hung:
                why = f"had not finished ({why_stopped}); killed. Last progress: {_last_progress(lpath)}"
            else:
                why = f"died without a report (exit code {procs[r].exitcode})"
            errors.append(f"rank {r}: {why}\n  log tail ({lpath}):\n{_tail(lpath, tail)}\n"
                          f"  native output tail ({lpath[:-4]}.out):\n{_tail(lpath[:-4] + '.out', tail // 4)}")
            results.append(None)
            continue
        with open(rpath) as f:
            rec = json.load(f)
        if not rec["ok"]:
            errors.append(f"rank {r}:\n{rec['error']}\n  native output tail ({lpath[:-4]}.out):\n"
                          f"{_tail(lpath[:-4] + '.out', tail // 4)}")
        results.append(rec.get("result"))
    elapsed = time.monotonic() - t0
    progress(f"spawn {fn}: done in {elapsed:.1f} s, {len(errors)} rank(s) failed")
    if errors:
        raise AssertionError(f"{fn} on {world} ranks failed after {elapsed:.1f} s (logs: {rundir}):\n" +
                             "\n".join(errors))
    return results
