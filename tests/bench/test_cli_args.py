"""`ebbtide` command-line argument checks: output paths are checked before any suite runs (exit status 2, one
line on stderr, no traceback), and an output that fails after the run still keeps the results (exit status 1)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def ebbtide(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ebbtide", *args], capture_output=True, text=True, env=e,
                          timeout=300)


def _refused_before_running(p, needle: str):
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert needle in p.stderr and "nothing was run" in p.stderr, p.stderr
    assert "== suite" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_output_in_a_missing_directory_is_refused_before_running(tmp_path, flag):
    path = tmp_path / "no" / "such" / "out.x"
    _refused_before_running(ebbtide("bench", "limits", "--quick", flag, str(path)), "does not exist")


def test_output_on_a_file_system_that_refuses_new_files_is_refused_before_running():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    _refused_before_running(ebbtide("bench", "--quick", "--json", "/proc/ebbtide-x.json"), "cannot be written")
    assert not os.path.exists("/proc/ebbtide-x.json")


def test_output_that_is_a_directory_or_shared_is_refused(tmp_path):
    _refused_before_running(ebbtide("bench", "limits", "--quick", "--json", str(tmp_path)), "is a directory")
    same = str(tmp_path / "x")
    _refused_before_running(ebbtide("bench", "limits", "--quick", "--json", same, "--plot", same), "same file")
    assert not os.path.exists(same)  # the probe leaves nothing behind


def test_an_existing_output_file_is_probed_without_truncating_it(tmp_path):
    path = tmp_path / "keep.json"
    path.write_text("old")
    p = ebbtide("bench", "nosuch", "--json", str(path))
    assert p.returncode == 2 and "unknown suite" in p.stderr
    assert path.read_text() == "old"


def test_a_write_that_fails_after_the_run_keeps_the_results_and_exits_1():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    p = ebbtide("bench", "limits", "--quick", "--json", "/dev/full")
    assert p.returncode == 1, p.stderr
    m = re.search(r"could not write --json /dev/full \(.*\); the results are in (\S+)", p.stderr)
    assert m, p.stderr
    try:
        doc = json.loads(open(m.group(1)).read())
        assert doc["rows"] and doc["quick"] is True
    finally:
        os.unlink(m.group(1))


def test_usage_errors_exit_2_and_info_exits_0():
    assert ebbtide("bench", "--no-such-flag").returncode == 2
    assert ebbtide("nosuchcommand").returncode == 2
    p = ebbtide("info", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["cpu"]["isa_reason"]
