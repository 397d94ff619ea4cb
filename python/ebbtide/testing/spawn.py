"""Fresh processes for tests and benchmarks: one protocol, three forms.

Process groups, allocator hooks, ``LD_PRELOAD``, a CUDA context, paused pools and fault injection are
process-global, so every scenario that touches them runs in interpreters of its own:
- :func:`ranks` runs ``module.fn(rank, world, init, **kwargs)`` on ``world`` processes and returns every rank's
  result; ``init`` is the address of a TCPStore the launcher serves (join it with :func:`join_store`);
- :func:`call` runs ``module.fn(*args, **kwargs)`` in one process and returns its result;
- :func:`command` runs a program (:func:`python`: a code snippet) and returns its exit status and output, for
  tests that read what a program prints or how it exits.

Contract (fail fast, never hang silently, lose no evidence):
- A worker (``ranks``, ``call``) is ``python -c`` running the child entry (``_worker.child``): it opens its log, imports
  ``module`` (``path`` first on its ``sys.path``, the parent's ``sys.path`` after its own, so the folders pytest put
  there resolve; ``sys.argv`` reads ``[module, fn, *args]`` as text, as ``python -m module fn args...`` would),
  calls ``fn`` and writes a JSON report: the result, or the traceback, or a skip (``fn`` raised :class:`Skip` or
  pytest's skip). Arguments and results are JSON values (tuples come back as lists).
- Every process is started in a session of its own; stopping one kills its whole process group, so nothing it
  started outlives it. After every run the groups are killed, whatever happened.
- Per-process artifacts in one run folder: ``<name>.log`` (progress lines from :func:`progress`, the loggers named
  by ``log`` at DEBUG, the traceback, Python stacks of every thread on a crash (faulthandler) or when the parent
  asks (SIGUSR1)), ``<name>.out`` (file descriptors 1 and 2: prints, native warnings, ``NCCL_DEBUG``), the request
  and the report. The folder is under ``$EBBTIDE_TEST_ARTIFACTS`` (``ranks/``, ``workers/``, ``commands/``;
  ranks: ``$EBBTIDE_COMM_LOGDIR`` first) and kept; without that setting it is a private temporary folder, removed
  after a run that passed and kept, and named in the error, after one that failed.
- Deadlines: ``timeout`` counts from the moment every worker has started (its log is open), not from the spawn: a
  loaded machine can take seconds to start interpreters; ``start_timeout`` bounds that start-up. ``grace`` seconds
  after the first worker failed, or after every worker reported but some did not exit, the rest are stopped:
  SIGUSR1 (stack dump into the log), a moment to write, then SIGKILL to the process group. As a backstop each
  worker arms ``faulthandler.dump_traceback_later`` just before its deadline.
- A failure raises :class:`WorkerFailed` (an AssertionError) naming each worker that failed: its traceback, or
  that it had not finished with its last progress line and log tail, or that it died without a report with its
  exit status, and the tail of its output. A worker of :func:`call` that reported and then exited with a
  non-zero status (a crash at interpreter teardown) fails too (``check_exit``); ranks are judged by their reports.
- ``teardown=False``: the worker leaves with ``os._exit`` right after its report, skipping interpreter teardown
  (a measurement process holding paused pools or communicators: they go back with the process).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from .. import settings
from ._worker import Skip, join_store, on_failure, progress

__all__ = ["ranks", "call", "command", "python", "progress", "join_store", "on_failure", "log_dir", "artifacts_dir",
           "Skip", "WorkerFailed", "Outcome", "TEST_ARTIFACTS"]

LOGDIR = settings.declare("EBBTIDE_COMM_LOGDIR", settings.parse_path, "",
                          "where the multi-process launcher keeps each rank's log and the stacks of hung ranks")
TEST_ARTIFACTS = settings.declare("EBBTIDE_TEST_ARTIFACTS", settings.parse_path, "",
                                  "where tests and benchmarks that spawn processes keep per-process logs")

_STOP_PAUSE_S = 1.0  # after SIGUSR1: faulthandler writes from the signal handler at once; this is for the disk
_BOOT = "import sys; sys.path.append(sys.argv[1]); from ebbtide.testing._worker import child; child(sys.argv[2])"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds the ebbtide package

_private_dir: str | None = None  # this process's temporary folder when EBBTIDE_TEST_ARTIFACTS is unset


class WorkerFailed(AssertionError):
    """A spawned run failed. ``outcomes``: one :class:`Outcome` per process; ``brief``: one line saying why (for
    a benchmark row's note); ``rundir``: the folder with every log."""

    def __init__(self, message: str, outcomes: list, rundir: str, brief: str):
        super().__init__(message)
        self.outcomes, self.rundir, self.brief = outcomes, rundir, brief


@dataclasses.dataclass
class Outcome:
    """How one spawned process ended."""

    name: str
    exitcode: int | None  # negative: killed by that signal (-9: stopped here); None: would not even die
    report: dict | None  # the worker's JSON report; None if it wrote none (died, killed, or a command)
    log: str
    out: str
    stopped: str = ""  # why the parent stopped it, if it did

    @property
    def ok(self) -> bool:
        return bool(self.report and self.report.get("ok"))

    @property
    def result(self):
        return self.report.get("result") if self.report else None

    @property
    def skipped(self) -> str | None:
        return self.report.get("skip") if self.report else None

    def output(self) -> str:
        """Everything the process wrote to its file descriptors 1 and 2."""
        return _read(self.out)


# ---- the parent -------------------------------------------------------------------------------------------------

def artifacts_dir(kind: str) -> str:
    """``$EBBTIDE_TEST_ARTIFACTS/<kind>`` (scripts/gpu-check packs that folder), else ``<kind>`` in one private
    temporary folder per process. Created if missing. Read at every call: a job or a test points it elsewhere
    between runs."""
    global _private_dir
    settings.reset(TEST_ARTIFACTS.name)
    base = settings.get(TEST_ARTIFACTS)
    if not base:
        if _private_dir is None or not os.path.isdir(_private_dir):
            _private_dir = tempfile.mkdtemp(prefix="ebt-spawn-")
        base = _private_dir
    d = os.path.join(base, kind)
    os.makedirs(d, exist_ok=True)
    return d


def log_dir() -> str:
    """Where rank logs go: ``$EBBTIDE_COMM_LOGDIR``, else :func:`artifacts_dir` ``("ranks")``. Created if missing."""
    settings.reset(LOGDIR.name)
    d = settings.get(LOGDIR)
    if not d:
        return artifacts_dir("ranks")
    os.makedirs(d, exist_ok=True)
    return d


def _kept(rundir: str) -> bool:
    """Whether a run folder is somewhere a person asked for (kept after a passing run too)."""
    return _private_dir is None or not os.path.realpath(rundir).startswith(os.path.realpath(_private_dir) + os.sep)


def _new_rundir(parent: str, label: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:60] or "run"
    return tempfile.mkdtemp(prefix=f"{safe}-{time.strftime('%H%M%S')}-", dir=parent)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str, lines: int) -> str:
    if not os.path.exists(path):
        return "    (none)"
    text = _read(path).splitlines()
    return "\n".join("    | " + s for s in text[-lines:]) or "    (empty)"


def _last_progress(path: str) -> str:
    marks = [s for s in _read(path).splitlines() if s.startswith(("[ebt ", "[rank", "[worker"))]
    return marks[-1] if marks else "(nothing logged)"


def _killpg(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(p.pid, sig)  # the child leads its own session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list, started) -> None:
    """SIGUSR1 to the workers that have started (their faulthandler dumps every thread's stack into the log), a
    moment to write, then SIGKILL to each process group."""
    live = [p for p in procs if p.poll() is None]
    asked = False
    for p in live:
        if started(p):
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked = True
            except OSError:
                pass
    if asked:
        time.sleep(_STOP_PAUSE_S)
    for p in live:
        _killpg(p)
    for p in live:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _env(env: dict | None, extra_env: dict | None) -> dict:
    """``env`` (default: this process's environment) with ``extra_env`` set on top."""
    out = dict(os.environ if env is None else env)
    out.update({k: str(v) for k, v in (extra_env or {}).items()})
    return out


def _child_env(env: dict, defaults: dict) -> dict:
    out = dict(env)
    out.setdefault("PYTHONUNBUFFERED", "1")  # a killed worker's last prints reach its output file
    for k, v in defaults.items():
        out.setdefault(k, v)
    return out


def _json_arg(value, what: str):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON values (numbers, strings, lists, dicts): {e}") from None


def _workers(label: str, specs: list, rundir: str, *, env: dict, timeout: float, grace: float,
             start_timeout: float) -> tuple:
    """Start one worker per spec ((name, module, fn, args, kwargs, path, log_names, teardown)), wait under the
    contract's deadlines; (each one's Outcome, start-up seconds or None, elapsed seconds). Raises nothing about
    the workers: the callers judge."""
    names = [spec[0] for spec in specs]
    bases = [os.path.join(rundir, name) for name in names]
    logs, reports = [b + ".log" for b in bases], [b + ".json" for b in bases]
    dump_after = max(1.0, timeout - 5.0)
    procs = []
    t0 = time.monotonic()
    try:
        for base, (name, module, fn, args, kwargs, path, log_names, teardown) in zip(bases, specs):
            req = {"name": name, "module": module, "fn": fn, "args": args, "kwargs": kwargs, "path": list(path),
                   "parent_path": [p for p in sys.path if p], "log": base + ".log", "report": base + ".json",
                   "dump_after": dump_after, "log_names": list(log_names), "teardown": teardown}
            with open(base + ".request.json", "w") as f:
                json.dump(req, f, indent=1)
            with open(base + ".out", "ab") as out:
                procs.append(subprocess.Popen([sys.executable, "-c", _BOOT, _ROOT, base + ".request.json"],
                                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True))
        startup, stopped = _wait(label, procs, logs, reports, t0, timeout=timeout, grace=grace,
                                 start_timeout=start_timeout)
    finally:  # also on KeyboardInterrupt / a pytest-timeout exception: never leave a process behind
        _stop(procs, lambda p: os.path.exists(logs[procs.index(p)]))
        for p in procs:
            _killpg(p)  # what a worker started and left behind
    outcomes = []
    for i, p in enumerate(procs):
        report = None
        if os.path.exists(reports[i]):
            with open(reports[i]) as f:
                report = json.load(f)
        outcomes.append(Outcome(names[i], p.returncode, report, logs[i], logs[i][:-4] + ".out",
                                stopped.get(i, "")))
    return outcomes, startup, time.monotonic() - t0


def _wait(label, procs, logs, reports, t0, *, timeout, grace, start_timeout):
    """Poll until every worker has exited or the contract says to stop the rest. Returns (start-up seconds or
    None, {index: why it was stopped})."""
    n = len(procs)
    deadline = t0 + start_timeout  # until every worker has started; then started + timeout
    started = None
    first_fail = None
    all_reported = None
    stopped: dict = {}
    while True:
        alive = [i for i, p in enumerate(procs) if p.poll() is None]
        if not alive:
            break
        now = time.monotonic()
        if started is None and all(os.path.exists(x) for x in logs):
            started, deadline = now, now + timeout
            if n > 1:
                progress(f"spawn {label}: all {n} processes started in {started - t0:.1f} s")
        if first_fail is None:
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                first_fail = (failed[0], now)
        if all_reported is None and all(os.path.exists(x) for x in reports):
            all_reported = now
        why = ""
        if all_reported is not None and now >= all_reported + grace:
            # every worker reported but some process does not exit (a native destructor at exit)
            progress(f"spawn {label}: {[procs[i].pid for i in alive]} reported but did not exit within "
                     f"{grace:.0f} s; stopping them")
            for i in alive:
                stopped[i] = f"did not exit within {grace:.0f} s of its report"
            _stop([procs[i] for i in alive], lambda p: True)
            break
        if now >= deadline:
            why = (f"deadline of {timeout:.0f} s reached" if started is not None else
                   f"not started within {start_timeout:.0f} s")
        elif first_fail is not None and now >= first_fail[1] + grace:
            why = f"still running {grace:.0f} s after {_name_of(logs[first_fail[0]])} failed " \
                  f"(at +{first_fail[1] - t0:.1f} s)"
        if why:
            progress(f"spawn {label}: stopping {', '.join(_name_of(logs[i]) for i in alive)}: {why}")
            for i in alive:
                stopped[i] = why
            _stop([procs[i] for i in alive], lambda p: os.path.exists(logs[procs.index(p)]))
            break
        time.sleep(0.05)
    return (None if started is None else started - t0), stopped


def _name_of(log_path: str) -> str:
    name = os.path.basename(log_path)[:-4]
    return f"rank {name[4:]}" if name.startswith("rank") and name[4:].isdigit() else name


def _failures(outcomes: list, tail: int, out_lines: int, check_exit: bool) -> list:
    errors = []
    for o in outcomes:
        who = _name_of(o.log)
        out_tail = f"  output tail ({o.out}):\n{_tail(o.out, out_lines)}"
        if o.report is None:
            if o.stopped:
                why = f"had not finished ({o.stopped}); killed. Last progress: {_last_progress(o.log)}"
            else:
                why = f"died without a report (exit code {o.exitcode})"
            errors.append(f"{who}: {why}\n  log tail ({o.log}):\n{_tail(o.log, tail)}\n{out_tail}")
        elif o.report.get("error"):
            errors.append(f"{who}:\n{o.report['error']}\n{out_tail}")
        elif check_exit and o.exitcode != 0:
            why = o.stopped or f"exited with {o.exitcode}"
            errors.append(f"{who}: reported {'success' if o.ok else 'a skip'}, then {why}\n{out_tail}")
    return errors


def _brief(outcomes: list, check_exit: bool) -> str:
    """One line: why the first failing process failed."""
    for o in outcomes:
        if o.report is None:
            last = [s for s in o.output().strip().splitlines() if s.strip()][-3:]
            return (f"stopped: {o.stopped}" if o.stopped else f"died (exit code {o.exitcode})") + (
                f": {' | '.join(last)}" if last else "")
        if o.report.get("error"):
            lines = o.report["error"].strip().splitlines()
            return f"{o.name} failed: {lines[-1] if lines else o.report.get('type')}"
        if check_exit and o.exitcode != 0:
            return f"{o.name} reported, then {o.stopped or f'exited with {o.exitcode}'}"
    return ""


def _finish(outcomes, rundir, header, elapsed, startup, tail, out_lines, check_exit):
    errors = _failures(outcomes, tail, out_lines, check_exit)
    start = "never all started" if startup is None else f"start-up {startup:.1f} s"
    if errors:
        raise WorkerFailed(f"{header} failed after {elapsed:.1f} s ({start}; logs: {rundir}):\n" + "\n".join(errors),
                           outcomes, rundir, _brief(outcomes, check_exit))
    if not _kept(rundir):
        shutil.rmtree(rundir, ignore_errors=True)
    skips = [o.skipped for o in outcomes if o.skipped]
    if skips:
        _skip(skips[0])


def _skip(reason: str):
    try:
        import pytest  # noqa: PLC0415
    except ImportError:
        raise Skip(reason) from None
    pytest.skip(reason)


def ranks(fn: str, world: int, *, module: str, timeout: float = 90.0, grace: float = 20.0,
          start_timeout: float = 120.0, env: dict | None = None, extra_env: dict | None = None,
          path: list | tuple = (), tail: int = 80, store_bind: str = "127.0.0.1", log: tuple = ("ebbtide.comm",),
          **kwargs) -> list:
    """Run ``module.fn(rank, world, init, **kwargs)`` on ``world`` fresh processes; return each rank's JSON
    result (rank order). ``init`` is the address of the store this launcher serves (:func:`join_store`; or
    ``init_process_group(init_method=init)``: ranks run with ``TORCHELASTIC_USE_AGENT_STORE=True``, torch's switch
    for a store hosted by a launcher, so no rank tries to serve it; the port is held from the start).
    ``store_bind``: the address the store listens on (loopback; name another only for ranks on other hosts).
    Raises :class:`WorkerFailed` per the module's contract."""
    from ebbtide.comm import serve_store  # noqa: PLC0415

    kwargs = _json_arg(kwargs, f"{fn}'s keyword arguments")
    rundir = _new_rundir(log_dir(), fn)
    # TCPStore, as torchrun uses (a FileStore polls, which would add its latency to every barrier), served here.
    store = serve_store(bind=store_bind, timeout=datetime.timedelta(seconds=timeout + start_timeout))
    init = f"tcp://{store.host}:{store.port}" if ":" not in store.host else f"tcp://[{store.host}]:{store.port}"
    child_env = _child_env(_env(env, extra_env), {"GLOO_SOCKET_IFNAME": "lo"})
    child_env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    specs = [(f"rank{r}", module, fn, [r, world, init], kwargs, path, log, True) for r in range(world)]
    progress(f"spawn {module}.{fn} on {world} ranks, deadline {timeout:.0f} s after start-up, logs {rundir}")
    try:
        outcomes, startup, elapsed = _workers(fn, specs, rundir, env=child_env, timeout=timeout, grace=grace,
                                              start_timeout=start_timeout)
    finally:
        del store  # the server stops with its last reference
    failed = sum(1 for o in outcomes if not o.ok and not o.skipped)
    progress(f"spawn {fn}: done in {elapsed:.1f} s, {failed} rank(s) failed")
    _finish(outcomes, rundir, f"{fn} on {world} ranks", elapsed, startup, tail, max(tail // 4, 10), check_exit=False)
    return [o.result for o in outcomes]


def call(fn: str, *args, module: str, timeout: float = 300.0, grace: float = 60.0, start_timeout: float = 120.0,
         env: dict | None = None, extra_env: dict | None = None, path: list | tuple = (), tail: int = 80,
         what: str | None = None, teardown: bool = True, check_exit: bool = True, log: tuple = (), **kwargs):
    """Run ``module.fn(*args, **kwargs)`` in one fresh process and return its JSON result. ``env``: the process's
    whole environment (default: this one's); ``extra_env``: variables set on top of it. ``grace``: how long it may
    take to exit after its report (interpreter teardown; then it is stopped). ``tail``: lines of its log and of its
    output in a failure's message. ``what``: how messages and the run folder name it. A worker that
    raised :class:`Skip` (or pytest's skip) makes the caller skip with its reason. Raises :class:`WorkerFailed`
    per the module's contract."""
    args = _json_arg(list(args), f"{fn}'s arguments")
    kwargs = _json_arg(kwargs, f"{fn}'s keyword arguments")
    label = what or fn
    rundir = _new_rundir(artifacts_dir("workers"), label)
    spec = ("worker", module, fn, args, kwargs, path, log, teardown)
    outcomes, startup, elapsed = _workers(label, [spec], rundir, env=_child_env(_env(env, extra_env), {}),
                                          timeout=timeout, grace=grace, start_timeout=start_timeout)
    _finish(outcomes, rundir, label if what else f"{module}.{fn}", elapsed, startup, tail, tail, check_exit)
    return outcomes[0].result


def command(argv: list, *, env: dict | None = None, extra_env: dict | None = None, timeout: float = 300.0,
            check: bool = True, what: str | None = None, pass_fds: tuple = (), cwd: str | None = None,
            tail: int = 8000) -> subprocess.CompletedProcess:
    """Run the program ``argv`` in a session of its own and return its exit status and output (text). ``env``: its
    whole environment (default: this process's); ``extra_env``: variables set on top of it. ``check``:
    a non-zero exit raises :class:`WorkerFailed` with the tails (``tail`` characters) of both streams. Past
    ``timeout`` seconds its process group is killed and WorkerFailed raised whatever ``check`` says."""
    label = what or os.path.basename(str(argv[0]))
    rundir = _new_rundir(artifacts_dir("commands"), label)
    paths = {k: os.path.join(rundir, k) for k in ("stdout", "stderr")}
    with open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
        p = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             env=_env(env, extra_env), cwd=cwd, pass_fds=pass_fds, start_new_session=True)
    timed_out = False
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _killpg(p)  # past the deadline: the program; always: what it left behind
        p.wait()
    res = subprocess.CompletedProcess(argv, p.returncode, _read(paths["stdout"]), _read(paths["stderr"]))
    if timed_out or (check and p.returncode != 0):
        why = f"timed out after {timeout:.0f} s; killed" if timed_out else f"exit status {p.returncode}"
        tails = f"--- stdout\n{res.stdout[-tail:]}\n--- stderr\n{res.stderr[-tail:]}"
        last = [s for s in (res.stderr or res.stdout).strip().splitlines() if s.strip()][-3:]
        raise WorkerFailed(f"{label} failed ({why}; output in {rundir})\n{tails}",
                           [Outcome(label, p.returncode, None, "", paths["stdout"], why if timed_out else "")],
                           rundir, f"{why}: {' | '.join(last)}" if last else why)
    if not _kept(rundir):
        shutil.rmtree(rundir, ignore_errors=True)
    return res


def python(code: str, **options) -> subprocess.CompletedProcess:
    """:func:`command` for a Python snippet (dedented) in a fresh interpreter: tests that set environment knobs,
    ``LD_PRELOAD`` or hooks that must not leak into the test process."""
    return command([sys.executable, "-c", textwrap.dedent(code)], **options)
