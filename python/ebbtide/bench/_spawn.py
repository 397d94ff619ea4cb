"""Run a function on N spawned ranks and surface every rank's failure. Used by the comm tests and the comm benchmark
(process groups are process-global state, so every scenario gets fresh interpreters). Not part of the library's
import path: ``ebbtide.comm`` never imports it.

Contract (fail fast, never hang silently):
- Rendezvous: the launcher serves the ranks' TCPStore itself (``ebbtide.comm.serve_store``), listening on
  ``store_bind`` (loopback unless the caller names another address); each rank joins it with :func:`join_store`
  or with ``init_process_group(init_method=init)``: ranks run with ``TORCHELASTIC_USE_AGENT_STORE=True``, torch's
  switch for a store hosted by a launcher (torchrun's agent), so no rank tries to serve it.
  A port chosen by the launcher is held from the start, so no other process can take it in between.
- Each rank logs to ``<logdir>/<run>/rank<r>.log``, line-buffered and flushed: its progress lines
  (:func:`progress`), the ``ebbtide.comm`` logger at DEBUG (every release/reload step), its traceback on failure,
  and Python stacks of all its threads when it crashes (faulthandler) or when the parent asks (SIGUSR1). The rank's
  file descriptors 1 and 2 go to ``rank<r>.out`` (torch's C++ warnings, the NCCL watchdog, ``NCCL_DEBUG`` output),
  which also gets a copy of every progress line.
  ``<logdir>`` is ``$EBBTIDE_COMM_LOGDIR`` (a GPU job sets it to its output folder), else
  ``$EBBTIDE_TEST_ARTIFACTS/comm`` (set by scripts/gpu-check), else one private temporary folder per process
  (``mkdtemp``: mode 0700, kept); the error names it.
- The deadline counts from the moment every rank has started (its interpreter is up and its log is open), not
  from the spawn: a loaded machine can take seconds to start interpreters, which says nothing about the scenario.
  ``start_timeout`` bounds that start-up separately.
- The parent polls. At the deadline, or ``grace`` seconds after the first rank failed (its peers are then usually
  blocked in a collective or a communicator split waiting for it), every live rank gets SIGUSR1 (stack dump), then
  SIGKILL; the error lists which ranks had not finished, the last line each logged, and the tail of its log.
- As a backstop, each rank arms ``faulthandler.dump_traceback_later`` just before its deadline, so a stack dump
  exists even if the parent itself is killed first.
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback

from .. import settings

__all__ = ["run", "progress", "log_dir", "join_store"]

LOGDIR = settings.declare("EBBTIDE_COMM_LOGDIR", settings.parse_path, "",
                          "where the multi-process launcher keeps each rank's log and the stacks of hung ranks")
TEST_ARTIFACTS = settings.declare("EBBTIDE_TEST_ARTIFACTS", settings.parse_path, "",
                                  "where tests and benchmarks that spawn processes keep per-process logs")
_fallback_dir: str | None = None  # this process's private log folder when neither setting names one

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
    folder), else one private temporary folder per process (kept). Created if missing. Read at every call: a job
    or a test points it elsewhere between runs."""
    global _fallback_dir
    for s in (LOGDIR, TEST_ARTIFACTS):
        settings.reset(s.name)
    d = settings.get(LOGDIR)
    if not d and settings.get(TEST_ARTIFACTS):
        d = os.path.join(settings.get(TEST_ARTIFACTS), "comm")
    if not d:
        if _fallback_dir is None or not os.path.isdir(_fallback_dir):
            _fallback_dir = tempfile.mkdtemp(prefix="ebt-comm-logs-")
        d = _fallback_dir
    os.makedirs(d, exist_ok=True)
    return d


def join_store(init: str, timeout: float = 60.0):
    """Inside a rank: a client of the launcher's store. ``init`` is the address ``run`` passed to the rank function
    (``tcp://host:port``). Pass it to ``init_process_group(store=..., rank=..., world_size=...)``."""
    import torch.distributed as dist

    if not init.startswith("tcp://"):
        raise ValueError(f"not a launcher store address: {init!r}")
    host, _, port = init[len("tcp://"):].rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), None, False, timeout=datetime.timedelta(seconds=timeout))


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
    # The launcher serves the store: init_method="tcp://..." then makes every rank a client (rank 0 included).
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
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
        tail: int = 80, start_timeout: float = 120.0, store_bind: str = "127.0.0.1", **kwargs) -> list:
    """Run ``module.fn(rank, world, init, **kwargs)`` on ``world`` spawned ranks (``path`` is prepended to their
    sys.path; ``init`` is the launcher store's address, for :func:`join_store`); return each rank's JSON-able
    result. Raises AssertionError with every failing rank's traceback, or naming the ranks that had not finished
    with their last progress line and log tail.

    ``timeout``: seconds for the run, counted once every rank has started. ``start_timeout``: seconds for the
    ranks' interpreters to start. ``grace``: seconds the other ranks get after the first failure.
    ``store_bind``: the address the store listens on (loopback; name another only for ranks on other hosts)."""
    from ebbtide.comm import serve_store

    ctx = mp.get_context("spawn")
    rundir = tempfile.mkdtemp(prefix=f"{fn}-{time.strftime('%H%M%S')}-", dir=log_dir())
    # TCPStore, as torchrun uses (a FileStore polls, which would add its latency to every barrier), served here.
    store = serve_store(bind=store_bind, timeout=datetime.timedelta(seconds=timeout + start_timeout))
    init = f"tcp://{store.host}:{store.port}" if ":" not in store.host else f"tcp://[{store.host}]:{store.port}"
    dump_after = max(1.0, timeout - 5.0)
    procs = [ctx.Process(target=_entry, args=(r, world, init, rundir, module, fn, kwargs, list(path or []),
                                              dump_after), daemon=True) for r in range(world)]
    progress(f"spawn {module}.{fn} on {world} ranks, deadline {timeout:.0f} s after start-up, logs {rundir}")
    t0 = time.monotonic()
    deadline = t0 + start_timeout  # until every rank has started; then started + timeout
    started: float | None = None
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
            if started is None and all(os.path.exists(os.path.join(rundir, f"rank{r}.log")) for r in range(world)):
                started, deadline = now, now + timeout
                progress(f"spawn {fn}: all {world} ranks started in {started - t0:.1f} s")
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
                why_stopped = (f"deadline of {timeout:.0f} s reached" if started is not None else
                               f"ranks not started within {start_timeout:.0f} s")
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
        del store  # the server stops with its last reference
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
    startup = "never all started" if started is None else f"start-up {started - t0:.1f} s"
    progress(f"spawn {fn}: done in {elapsed:.1f} s ({startup}), {len(errors)} rank(s) failed")
    if errors:
        raise AssertionError(f"{fn} on {world} ranks failed after {elapsed:.1f} s ({startup}; logs: {rundir}):\n" +
                             "\n".join(errors))
    return results
