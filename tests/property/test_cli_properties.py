"""Properties of the command line's argument checks: an output path is accepted exactly when its directory exists
and it is not a directory, the probe never changes or leaves a file, and an unknown suite name is refused (exit
status 2) before anything runs."""
from __future__ import annotations

import contextlib
import io
import os
import tempfile

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ebbtide import cli  # noqa: E402
from ebbtide.bench import runner  # noqa: E402
from ebbtide.bench.registry import SUITE_MODULES  # noqa: E402

name = st.text(alphabet="abcdefgh-_.0123456789", min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))


@given(parts=st.lists(name, min_size=1, max_size=4), make_dirs=st.integers(0, 4), last_is=st.sampled_from(
    ["absent", "file", "dir"]), content=st.binary(max_size=16))
def test_output_path_probe(parts, make_dirs, last_is, content):
    with tempfile.TemporaryDirectory() as root:
        *dirs, leaf = parts
        made = min(make_dirs, len(dirs))
        if made:
            os.makedirs(os.path.join(root, *dirs[:made]), exist_ok=True)
        parent = os.path.join(root, *dirs)
        path = os.path.join(parent, leaf)
        parent_exists = made == len(dirs)
        if parent_exists and last_is == "file":
            with open(path, "wb") as f:
                f.write(content)
        elif parent_exists and last_is == "dir":
            os.makedirs(path, exist_ok=True)
        listing = sorted(os.listdir(parent)) if parent_exists else None
        problem = runner.output_problem(path)
        if not parent_exists:
            assert "does not exist" in problem
        elif last_is == "dir":
            assert problem == "is a directory"
        else:
            assert problem == ""
        if parent_exists:
            assert sorted(os.listdir(parent)) == listing  # nothing created or removed
        if parent_exists and last_is == "file":
            with open(path, "rb") as f:
                assert f.read() == content  # never truncated


@given(names=st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10), min_size=1,
                      max_size=3))
def test_unknown_suite_names_exit_2_before_running(names):
    known = set(SUITE_MODULES)
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["bench", *names, "--quick", "--json", "/nonexistent-dir/x.json"])
    err = buf.getvalue()
    assert rc == 2
    unknown = [n for n in names if n not in known and n != "all"]
    if unknown:
        assert "unknown suite(s)" in err and unknown[0] in err
    else:
        assert "does not exist" in err
    assert "== suite" not in err
