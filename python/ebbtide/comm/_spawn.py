"""Run a function on N spawned ranks (TCPStore rendezvous on loopback) and surface every rank's failure. Used by
the comm tests and the comm benchmark (process groups are process-global state, so every scenario gets fresh
interpreters).

A rank that raises writes its traceback; a rank that hangs is killed at the deadline and reported as hung.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback

__all__ = ["run"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, init: str, tmpdir: str, module: str, fn: str, kwargs: dict,
           path: list) -> None:
    sys.path[:0] = path
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = os.path.join(tmpdir, f"rank{rank}.json")
    try:
        import importlib

        mod = importlib.import_module(module)
        result = getattr(mod, fn)(rank, world, init, **kwargs)
        with open(out, "w") as f:
            json.dump({"ok": True, "result": result}, f)
    except BaseException:  # report everything, including SystemExit from a worker
        with open(out, "w") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
        raise SystemExit(1) from None


def run(fn: str, world: int, *, module: str, timeout: float = 90.0, path: list | None = None, **kwargs) -> list:
    """Run ``module.fn(rank, world, init_method, **kwargs)`` on ``world`` spawned ranks (``path`` is prepended to
    their sys.path); return each rank's JSON-able result. Raises AssertionError with every failing rank's
    traceback, or naming the ranks that hung."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ebt-comm-") as tmpdir:
        # TCPStore, as torchrun uses (a FileStore polls, which would add its latency to every barrier).
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs = [ctx.Process(target=_entry, args=(r, world, init, tmpdir, module, fn, kwargs, list(path or [])),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        results, errors = [], []
        for r in range(world):
            rpath = os.path.join(tmpdir, f"rank{r}.json")
            if not os.path.exists(rpath):
                why = f"hung (killed after {timeout:.0f} s)" if r in hung else f"died (exit code {procs[r].exitcode})"
                errors.append(f"rank {r}: {why}")
                results.append(None)
                continue
            try:
                with open(rpath) as f:
                    rec = json.load(f)
            except ValueError:  # the rank died while writing its result
                errors.append(f"rank {r}: crashed while reporting (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            if not rec["ok"]:
                errors.append(f"rank {r}:\n{rec['error']}")
            results.append(rec.get("result"))
        if errors:
            raise AssertionError(f"{fn} on {world} ranks failed:\n" + "\n".join(errors))
        return results
