"""A measurement worker in a process of its own: ``python -m MODULE ARGS...`` whose last stdout line starting
with "{" is its JSON result. Suites run each side of a comparison this way, so neither inherits the other's GPU
pools, pinned memory or hooks."""
from __future__ import annotations

import json
import subprocess
import sys

__all__ = ["run_json_worker"]


def run_json_worker(module: str, args: list, env: dict, timeout: float) -> tuple[dict | None, str]:
    """(the worker's JSON, "") or (None, why it failed: timed out, or its exit status and last lines)."""
    try:
        p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return None, f"worker failed ({p.returncode}): {' | '.join(tail)}"
    return json.loads(lines[-1]), ""
