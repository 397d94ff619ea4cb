"""ebbtide.testing.spawn: the one fresh-process protocol fails fast and says where each process was.

Ranks: a failure stops the peers after the grace period, a hang stops everyone at the deadline, and hung ranks'
Python stacks and last progress lines are in the error and in the rank logs under $EBBTIDE_COMM_LOGDIR (the NCCL
tests rely on it for their reports). One process (``call``): its result, its traceback and output tail, a skip, a
crash at exit, a deadline; what it started dies with its process group. Programs (``command``/``python``): exit
status, both streams, a deadline. Runs without GPUs and without torch in the workers."""
import os
import re
import sys
import time

import pytest

from ebbtide.testing import spawn

pytest.importorskip("torch")  # the rank launcher serves a torch TCPStore


def _dead(pid: int, within: float = 5.0) -> bool:
    """Gone, or a zombie waiting for a reaper (killed: its parent, the worker, has exited), within a few seconds
    (SIGKILL is delivered asynchronously)."""
    t_end = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > t_end:
            return False
        time.sleep(0.05)


# ---- ranks ------------------------------------------------------------------------------------------------------
def test_results_and_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    res = spawn.ranks("ok", 2, module="spawn_workers", value=7)
    assert res == [{"rank": 0, "value": 7}, {"rank": 1, "value": 7}]
    (rundir,) = [p for p in tmp_path.iterdir() if p.name.startswith("ok-")]
    log = (rundir / "rank1.log").read_text()
    assert "rank 1: ok" in log and "rank1: finished" in log, log
    # What native code writes to fds 1/2 (torch's C++ warnings, NCCL_DEBUG) lands in rank<r>.out.
    out = (rundir / "rank1.out").read_text()
    assert "fd2 from rank 1" in out and "fd1 from rank 1" in out, out


def test_failure_stops_peers_after_grace(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        spawn.ranks("one_fails_one_hangs", 2, module="spawn_workers", timeout=60, grace=1)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert took < 30, took  # not the 60 s deadline
    assert "injected failure on rank 0" in msg, msg
    assert "rank 1: had not finished (still running 1 s after rank 0 failed" in msg, msg
    assert "Last progress: [ebt rank1" in msg and "rank 1: entering the collective" in msg, msg
    assert "_stuck_in_a_collective" in msg, msg  # the faulthandler stack dump reached the log tail
    assert str(tmp_path) in msg
    assert isinstance(ei.value, spawn.WorkerFailed) and [o.name for o in ei.value.outcomes] == ["rank0", "rank1"]


def test_hang_stops_at_deadline_with_stacks(tmp_path, monkeypatch):
    """The 4 s deadline counts from the moment both ranks have started (interpreter start-up on a loaded machine
    is not the scenario's time): the run stops 4 s (+ the 1 s stack-dump pause) after start-up, not later."""
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        spawn.ranks("all_hang", 2, module="spawn_workers", timeout=4)
    took = time.monotonic() - t0
    msg = str(ei.value)
    m = re.search(r"start-up (\d+\.\d) s", msg)
    assert m, msg
    after_start = took - float(m.group(1))
    assert 4 <= after_start + 0.1 and after_start < 15, (took, m.group(1))
    for r in (0, 1):
        assert f"rank {r}: had not finished (deadline of 4 s reached)" in msg, msg
    (rundir,) = [p for p in tmp_path.iterdir() if p.name.startswith("all_hang-")]
    for r in (0, 1):
        log = (rundir / f"rank{r}.log").read_text()
        assert "_stuck_in_a_collective" in log and "all_hang" in log, log
    assert not any(n.endswith(".json") and not n.endswith(".request.json") for n in os.listdir(rundir))


def test_reported_but_stuck_at_exit_is_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    t0 = time.monotonic()
    res = spawn.ranks("returns_then_hangs_at_exit", 2, module="spawn_workers", timeout=60, grace=1)
    took = time.monotonic() - t0
    assert res == [{"rank": 0}, {"rank": 1}]
    assert 1 <= took < 30, took  # waited the grace, not the deadline


def test_log_dir_falls_back_to_test_artifacts(tmp_path, monkeypatch):
    monkeypatch.delenv("EBBTIDE_COMM_LOGDIR", raising=False)
    monkeypatch.setenv("EBBTIDE_TEST_ARTIFACTS", str(tmp_path))
    assert spawn.log_dir() == str(tmp_path / "ranks") and (tmp_path / "ranks").is_dir()


# ---- one process ------------------------------------------------------------------------------------------------
def test_call_returns_the_result_and_keeps_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_TEST_ARTIFACTS", str(tmp_path))
    got = spawn.call("echo", 1, "two", (3, 4), module="spawn_workers", flag=True)
    # JSON values both ways (a tuple comes back a list); the worker did not load torch (this module does)
    assert got == {"args": [1, "two", [3, 4]], "kwargs": {"flag": True}, "torch_loaded": False}
    (rundir,) = (tmp_path / "workers").iterdir()
    out = (rundir / "worker.out").read_text()
    assert "printed by the worker" in out and "written to fd 2 by the worker" in out, out
    assert "worker: finished" in (rundir / "worker.log").read_text()


def test_call_without_artifacts_removes_a_passing_run(monkeypatch):
    monkeypatch.delenv("EBBTIDE_TEST_ARTIFACTS", raising=False)
    spawn.call("echo", module="spawn_workers")
    assert os.listdir(spawn.artifacts_dir("workers")) == []


def test_call_failure_carries_the_traceback_and_output(monkeypatch):
    monkeypatch.delenv("EBBTIDE_TEST_ARTIFACTS", raising=False)
    with pytest.raises(spawn.WorkerFailed) as ei:
        spawn.call("fails_with_diagnostics", module="spawn_workers", what="the broken scenario")
    e = ei.value
    msg = str(e)
    assert msg.startswith("the broken scenario failed after") and "ValueError: the scenario broke" in msg, msg
    assert "diagnostics: engine stats would go here" in msg, msg  # on_failure ran, its print is in the tail
    assert e.brief == "worker failed: ValueError: the scenario broke"
    assert os.path.isdir(e.rundir) and e.rundir in msg  # kept, and named, after a failure
    assert e.outcomes[0].report["type"] == "ValueError" and e.outcomes[0].exitcode == 1


@pytest.mark.parametrize("fn,reason", [("skips", "needs hardware this machine lacks"),
                                       ("pytest_skips", "skipped by pytest inside the worker")])
def test_call_skip_becomes_a_pytest_skip(fn, reason):
    with pytest.raises(pytest.skip.Exception, match=reason):
        spawn.call(fn, module="spawn_workers")


def test_call_deadline_stops_the_worker_with_its_stack():
    t0 = time.monotonic()
    with pytest.raises(spawn.WorkerFailed) as ei:
        spawn.call("hangs", module="spawn_workers", timeout=3)
    assert time.monotonic() - t0 < 20
    msg = str(ei.value)
    assert "worker: had not finished (deadline of 3 s reached)" in msg, msg
    assert "worker: about to block" in msg and "_stuck_in_a_collective" in msg, msg
    assert ei.value.brief.startswith("stopped: deadline of 3 s reached"), ei.value.brief


def test_call_a_crash_at_exit_fails_unless_told_otherwise():
    with pytest.raises(spawn.WorkerFailed) as ei:
        spawn.call("crashes_at_exit", module="spawn_workers")
    assert "worker: reported success, then exited with 3" in str(ei.value), str(ei.value)
    assert ei.value.outcomes[0].ok and ei.value.outcomes[0].result == "reported"
    assert spawn.call("crashes_at_exit", module="spawn_workers", check_exit=False) == "reported"
    assert spawn.call("skips_teardown", module="spawn_workers", teardown=False) == "fast exit"


def test_call_a_hang_at_exit_is_stopped_after_grace_and_fails():
    t0 = time.monotonic()
    with pytest.raises(spawn.WorkerFailed, match=r"reported success, then did not exit within 1 s of its report"):
        spawn.call("reports_then_hangs_at_exit", module="spawn_workers", grace=1)
    assert time.monotonic() - t0 < 20


def test_call_kills_what_the_worker_left_behind(tmp_path):
    pid = spawn.call("leaves_a_child", str(tmp_path / "pid"), module="spawn_workers")
    assert _dead(pid)


def test_call_refuses_what_json_cannot_carry():
    with pytest.raises(TypeError, match="JSON"):
        spawn.call("echo", {1, 2}, module="spawn_workers")
    with pytest.raises(spawn.WorkerFailed, match="not JSON"):
        spawn.call("not_json", module="spawn_workers")


def test_call_env_and_path(tmp_path):
    (tmp_path / "elsewhere_worker.py").write_text("import os\ndef knob():\n    return os.environ.get('EBT_KNOB')\n")
    assert spawn.call("knob", module="elsewhere_worker", path=[str(tmp_path)],
                      env=dict(os.environ, EBT_KNOB="on")) == "on"


# ---- programs ---------------------------------------------------------------------------------------------------
def test_python_returns_both_streams_and_the_status():
    p = spawn.python("""
        import sys
        print("to stdout")
        print("to stderr", file=sys.stderr)
        """)
    assert p.returncode == 0 and p.stdout == "to stdout\n" and p.stderr == "to stderr\n"
    p = spawn.python("import sys; sys.exit(4)", check=False)
    assert p.returncode == 4
    with pytest.raises(spawn.WorkerFailed, match=r"exit status 4"):
        spawn.python("import sys; print('why', file=sys.stderr); sys.exit(4)", what="four")


def test_command_deadline_kills_the_process_group(tmp_path):
    code = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(600)']); open({str(tmp_path / 'pid')!r}, 'w').write(str(c.pid)); time.sleep(600)")
    t0 = time.monotonic()
    with pytest.raises(spawn.WorkerFailed, match="timed out after 2 s"):
        spawn.command([sys.executable, "-c", code], timeout=2)
    assert time.monotonic() - t0 < 20
    assert _dead(int((tmp_path / "pid").read_text()))
