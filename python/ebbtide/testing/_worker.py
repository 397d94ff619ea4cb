"""The worker side of :mod:`ebbtide.testing.spawn`: the child entry that runs one request and writes its report,
and what a worker calls (``progress``, ``on_failure``, ``join_store``, ``Skip``; spawn re-exports them). Imports
nothing but the standard library at import: programs that must not load torch (a CuPy program under the shim)
run here too."""
from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import logging
import os
import signal
import sys
import time
import traceback

__all__ = ["progress", "on_failure", "join_store", "Skip"]

_T0 = time.monotonic()
_LOG = None  # inside a worker: its log file
_NAME = ""  # inside a worker: "rank1", "worker"
_ON_FAILURE: list = []


class Skip(Exception):
    """Raised inside a worker whose scenario does not apply here; the parent skips (pytest) with the reason."""


def progress(msg: str) -> None:
    """One progress line to stderr and, inside a worker, to its log (flushed at once, so it survives a kill).
    Cheap enough to call at every phase boundary."""
    who = f"{_NAME} " if _NAME else ""
    line = f"[ebt {who}pid {os.getpid()} +{time.monotonic() - _T0:7.2f}s] {msg}\n"
    for f in (_LOG, sys.stderr):
        if f is None:
            continue
        try:
            f.write(line)
            f.flush()
        except (OSError, ValueError):
            pass


def on_failure(callback) -> None:
    """Inside a worker: call ``callback()`` after the scenario raised, before the report is written (what it prints
    lands in the output tail, e.g. an engine's stats). Failures of the callback are printed, not raised."""
    _ON_FAILURE.append(callback)


def join_store(init: str, timeout: float = 60.0):
    """Inside a rank: a client of the launcher's store. ``init`` is the address ``spawn.ranks`` passed to the rank
    function (``tcp://host:port``). Pass it to ``init_process_group(store=..., rank=..., world_size=...)``."""
    import torch.distributed as dist  # noqa: PLC0415

    if not init.startswith("tcp://"):
        raise ValueError(f"not a launcher store address: {init!r}")
    host, _, port = init[len("tcp://"):].rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), None, False, timeout=datetime.timedelta(seconds=timeout))


class _Tee:
    """A text stream writing to the worker's log and its stderr (the logging handler's target)."""

    def write(self, s):
        for f in (_LOG, sys.__stderr__):
            try:
                f.write(s)
                f.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def flush(self):
        pass


def _is_skip(e: BaseException) -> bool:
    outcomes = sys.modules.get("_pytest.outcomes")  # pytest.skip() inside a worker: only if pytest is loaded
    return isinstance(e, Skip) or (outcomes is not None and isinstance(e, outcomes.Skipped))


def child(request_path: str) -> None:
    """The worker's entry: run the request's function and write its report (ebbtide.testing.spawn's contract)."""
    global _LOG, _NAME, _T0
    _T0 = time.monotonic()
    with open(request_path) as f:
        req = json.load(f)
    sys.path[:0] = req["path"]
    sys.path += [p for p in req["parent_path"] if p not in sys.path]
    _NAME = req["name"]
    _LOG = open(req["log"], "a", buffering=1)
    faulthandler.enable(file=_LOG, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_LOG, all_threads=True, chain=False)
    if req["dump_after"] > 0:
        faulthandler.dump_traceback_later(req["dump_after"], repeat=False, file=_LOG, exit=False)
    handler = logging.StreamHandler(_Tee())
    handler.setFormatter(logging.Formatter(f"[{_NAME} %(relativeCreated)9.0fms %(name)s] %(message)s"))
    for name in req["log_names"]:
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    module, fn, args, kwargs = req["module"], req["fn"], req["args"], req["kwargs"]
    sys.argv = [module, fn, *(str(a) for a in args)]  # as ``python -m module fn args...`` would read
    progress(f"{_NAME}: {module}.{fn}{_call_text(args, kwargs)} starting")
    report, code = {"ok": False}, 1
    try:
        result = getattr(importlib.import_module(module), fn)(*args, **kwargs)
        try:
            text = json.dumps({"ok": True, "result": result})
        except (TypeError, ValueError) as e:
            raise TypeError(f"{module}.{fn} returned a value that is not JSON ({e}): {result!r:.300}") from None
        code = 0
        progress(f"{_NAME}: finished")
    except BaseException as e:  # report everything, SystemExit and KeyboardInterrupt included
        if _is_skip(e):
            report, code = {"ok": False, "skip": str(e) or type(e).__name__}, 0
            progress(f"{_NAME}: skipped: {report['skip']}")
        else:
            tb = traceback.format_exc()
            progress(f"{_NAME}: FAILED\n{tb}")
            for cb in _ON_FAILURE:
                try:
                    cb()
                except Exception as cb_error:  # noqa: BLE001 (diagnostics must not hide the failure)
                    print(f"(on_failure callback {cb!r} failed: {cb_error})", flush=True)
            report = {"ok": False, "error": tb, "type": type(e).__name__}
        text = json.dumps(report)
    finally:
        faulthandler.cancel_dump_traceback_later()
    with open(req["report"] + ".tmp", "w") as f:
        f.write(text)
    os.replace(req["report"] + ".tmp", req["report"])
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    if not req["teardown"]:
        os._exit(code)
    sys.exit(code)


def _call_text(args, kwargs) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return f"({text if len(text) <= 200 else text[:200] + '...'})"
