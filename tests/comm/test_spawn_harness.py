"""The spawn helper fails fast and says where each rank was: a failure stops the peers after the grace period,
a hang stops everyone at the deadline, and hung ranks' Python stacks and last progress lines are in the error and
in the rank logs under $EBBTIDE_COMM_LOGDIR. (Runs without GPUs; the NCCL tests rely on it for their reports.)"""
import os
import re
import time

import pytest

import comm_spawn

pytest.importorskip("torch")


def test_results_and_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    res = comm_spawn.run("ok", 2, module="spawn_workers", value=7)
    assert res == [{"rank": 0, "value": 7}, {"rank": 1, "value": 7}]
    (rundir,) = [p for p in tmp_path.iterdir() if p.name.startswith("ok-")]
    log = (rundir / "rank1.log").read_text()
    assert "rank 1: ok" in log and "rank 1: finished" in log, log
    # What native code writes to fds 1/2 (torch's C++ warnings, NCCL_DEBUG) lands in rank<r>.out.
    out = (rundir / "rank1.out").read_text()
    assert "fd2 from rank 1" in out and "fd1 from rank 1" in out, out


def test_failure_stops_peers_after_grace(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        comm_spawn.run("one_fails_one_hangs", 2, module="spawn_workers", timeout=60, grace=1)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert took < 30, took  # not the 60 s deadline
    assert "injected failure on rank 0" in msg, msg
    assert "rank 1: had not finished (still running 1 s after rank 0 failed" in msg, msg
    assert "Last progress: [ebt-comm" in msg and "rank 1: entering the collective" in msg, msg
    assert "_stuck_in_a_collective" in msg, msg  # the faulthandler stack dump reached the log tail
    assert str(tmp_path) in msg


def test_hang_stops_at_deadline_with_stacks(tmp_path, monkeypatch):
    """The 4 s deadline counts from the moment both ranks have started (interpreter start-up on a loaded machine
    is not the scenario's time): the run stops 4 s (+ the 1 s stack-dump pause) after start-up, not later."""
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        comm_spawn.run("all_hang", 2, module="spawn_workers", timeout=4)
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
    assert not any(n.endswith(".json") for n in os.listdir(rundir))


def test_reported_but_stuck_at_exit_is_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_LOGDIR", str(tmp_path))
    t0 = time.monotonic()
    res = comm_spawn.run("returns_then_hangs_at_exit", 2, module="spawn_workers", timeout=60, grace=1)
    took = time.monotonic() - t0
    assert res == [{"rank": 0}, {"rank": 1}]
    assert 1 <= took < 30, took  # waited the grace, not the deadline


def test_log_dir_falls_back_to_test_artifacts(tmp_path, monkeypatch):
    from ebbtide.bench._spawn import log_dir

    monkeypatch.delenv("EBBTIDE_COMM_LOGDIR", raising=False)
    monkeypatch.setenv("EBBTIDE_TEST_ARTIFACTS", str(tmp_path))
    assert log_dir() == str(tmp_path / "comm") and (tmp_path / "comm").is_dir()
