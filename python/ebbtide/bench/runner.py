"""`ebbtide bench`: resolve suites, run them with shared limit probes, print a table, write JSON and a chart.

Every argument is checked before any suite runs (unknown suite names, an output path that cannot be written, a
chart without matplotlib or not named .png: exit status 2), so a long run never ends by losing its results. Exit status 1: a
suite failed, or an output file could not be written after all (the JSON then goes to a temporary file, named).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
import traceback

from .. import __version__
from . import report
from .limits import Limits
from .registry import SUITE_MODULES, Context, Skip, registered

NEEDS_GPUS = {"cpu": 0, "gpu": 1, "multigpu": 2}


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_suites() -> dict[str, str]:
    """Import every suite module; return {suite: reason} for the ones that could not load."""
    broken = {}
    for name, module in SUITE_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # a capability's missing dependency costs only its own suite
            broken[name] = f"{type(e).__name__}: {e}"
    return broken


def output_problem(path: str) -> str:
    """Why ``path`` cannot receive an output file ("" if it can), found by trying: an existing file is opened for
    appending (not truncated), a new one is created and removed. Permission bits alone would mislead (root, or
    file systems such as /proc that refuse new files)."""
    if not path:
        return "the path is empty"
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    try:
        if os.path.lexists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(path)
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    return ""


def _write_json(doc: dict, path: str) -> bool:
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {path}")
        return True
    except OSError as e:
        fd, spare = tempfile.mkstemp(prefix="ebbtide-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
        _err(f"ebbtide bench: could not write --json {path} ({e.strerror or e}); the results are in {spare}")
        return False


def _gpu_count() -> tuple[int, str]:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return 0, "torch not installed"
    if not torch.cuda.is_available():
        return 0, "no CUDA GPU visible to torch"
    return torch.cuda.device_count(), ""


def environment() -> dict:
    """What the numbers were measured on (recorded with every result)."""
    from .. import info  # noqa: PLC0415

    env: dict = {"ebbtide": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        data = info.collect()
        env.update({k: data[k] for k in ("python", "platform", "cpu", "driver", "gpus", "torch", "build")})
    except Exception as e:
        env["info_error"] = str(e)
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    return env


def main(names: list[str], *, quick: bool, json_path: str | None, plot_path: str | None,
         list_only: bool = False) -> int:
    broken = _load_suites()
    suites = registered()
    known = sorted(set(suites) | set(broken))
    if list_only:
        for n in known:
            if n in suites:
                print(f"{n:10s} [{suites[n].needs}] {suites[n].description}")
            else:
                print(f"{n:10s} unavailable: {broken[n]}")
        return 0
    wanted = known if not names or "all" in names else list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in known]
    if unknown:
        _err(f"ebbtide bench: unknown suite(s) {', '.join(unknown)}; available: {', '.join(known)}")
        return 2
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        problem = output_problem(path) if path is not None else ""
        if problem:
            _err(f"ebbtide bench: {flag} {path}: {problem}; nothing was run")
            return 2
    if json_path and plot_path and os.path.abspath(json_path) == os.path.abspath(plot_path):
        _err(f"ebbtide bench: --json and --plot name the same file ({json_path}); nothing was run")
        return 2
    if plot_path:
        problem = report.plot_unavailable(plot_path)
        if problem:
            _err(f"ebbtide bench: --plot {plot_path}: {problem}; nothing was run")
            return 2

    from .. import settings  # noqa: PLC0415

    bad = settings.problems()  # every component's settings, so a bad one stops the run before its first suite
    if bad:
        for e in bad:
            _err(f"ebbtide bench: {e}")
        _err("ebbtide bench: nothing was run")
        return 2

    gpus, gpu_note = _gpu_count()
    limits = Limits(quick=quick, log=_err)
    ctx = Context(quick=quick, gpus=gpus, limits=limits, log=_err)
    rows, skipped, failed = [], [], []
    for name in wanted:
        if name in broken:
            skipped.append((name, f"could not load: {broken[name]}"))
            continue
        s = suites[name]
        if gpus < NEEDS_GPUS[s.needs]:
            need = "a CUDA GPU" if s.needs == "gpu" else "2+ CUDA GPUs"
            skipped.append((name, f"needs {need} ({gpu_note or f'{gpus} found'})"))
            continue
        _err(f"== suite {name}{' (quick)' if quick else ''}")
        t0 = time.perf_counter()
        try:
            for row in s.fn(ctx):
                rows.append(row)
                _err(f"   {row.name}: {report.fmt(row.ours)} {row.unit}")
        except Skip as e:
            skipped.append((name, str(e)))
        except Exception as e:
            failed.append((name, f"{type(e).__name__}: {e}"))
            traceback.print_exc(file=sys.stderr)
        _err(f"   ({time.perf_counter() - t0:.1f} s)")

    print(report.table(rows))
    skipped += ctx.skipped
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    for name, why in failed:
        print(f"FAILED {name}: {why}")
    ok = True
    env = environment() if json_path is not None or plot_path else {}
    if json_path is not None:
        doc = {"environment": env, "quick": quick, "limits": limits.measured(),
               "rows": [r.to_json() for r in rows], "skipped": dict(skipped), "failed": dict(failed)}
        ok = _write_json(doc, json_path)
    if plot_path and rows:
        try:
            report.plot(rows, plot_path, env=env, skipped=skipped)
            print(f"wrote {plot_path}")
        except OSError as e:
            _err(f"ebbtide bench: could not write --plot {plot_path} ({e.strerror or e})")
            ok = False
    return 1 if failed or not ok else 0
