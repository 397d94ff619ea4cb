"""The GPU loop tests' one way to run ``ebbtide colocate``: in a subprocess, its output folder under
``$EBBTIDE_TEST_ARTIFACTS`` (kept by gpu-check) or the test's ``tmp_path``; the table printed (shown with -s or on
failure), the results read back, the logs' tails gathered for the failure message."""
import json
import os
import pathlib
import subprocess
import sys


def run_colocate(tmp_path, name: str, argv: list, timeout: float = 600):
    """(completed process, results.json, diagnostics) of ``ebbtide colocate *argv --out DIR``."""
    art = os.environ.get("EBBTIDE_TEST_ARTIFACTS")
    if art:
        tmp_path = pathlib.Path(art) / name
        tmp_path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", *argv, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=timeout)
    logs = "".join(f"\n--- {f.name}\n{f.read_text()[-6000:]}" for f in sorted(tmp_path.glob("*.log")))
    print(p.stdout)
    res = json.loads((tmp_path / "results.json").read_text())
    return p, res, f"{p.stdout}\n{p.stderr}{logs}"
