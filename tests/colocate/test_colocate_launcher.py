"""The harness's launcher (``ebbtide colocate``): arguments, and the whole loop's orchestration on the CPU (real
trainer and rollout processes, the shared buffer, FP8 sync, decode, the checks; 2 ranks through ebbtide.comm on
Gloo). Memory pause/resume and NVML need a GPU: test_colocate_gpu.py."""
import json
import math
import subprocess
import sys

import pytest

from ebbtide.bench.colocate.config import QUICK_MODEL, RunConfig
from ebbtide.bench.colocate.launcher import parse_args
from ebbtide.errors import InvalidArgumentError

TINY_ARGS = ["--device", "cpu", "--variants", "ebbtide", "--vocab", "256", "--d-model", "128", "--n-layers", "2",
             "--n-heads", "4", "--d-ff", "256", "--max-seq", "128", "--steps", "3", "--warmup", "1", "--batch", "2",
             "--seq", "32", "--gen-batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--kv-reserve-gb", "0",
             "--verify-batch", "2", "--verify-len", "8", "--timeout", "240"]


def test_defaults_and_quick():
    cfg = parse_args([])
    assert cfg == RunConfig().validate() and cfg.variants == ("ebbtide", "anchor")
    q = parse_args(["--quick", "--steps", "7"])
    assert q.model == QUICK_MODEL and q.steps == 7 and q.new_tokens == 32  # explicit flags win over --quick
    assert parse_args(["--quick", "--d-model", "256"]).model.d_model == 256
    assert cfg.decode == "cuda-graph" and cfg.worker_spec("anchor")["decode"] == "cuda-graph"  # both loops
    e = parse_args(["--quick", "--decode", "eager"])
    assert e.decode == "eager" and e.worker_spec("ebbtide")["decode"] == "eager"


@pytest.mark.parametrize("bad", ["graph", "", None, "CUDA-GRAPH"])
def test_decode_mode_is_validated(bad):
    with pytest.raises(InvalidArgumentError, match="decode must be one of"):
        RunConfig(decode=bad).validate()


def test_bad_decode_flag_exits_with_usage():
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--decode", "graphs"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--decode" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("argv, msg", [
    (["--steps", "2", "--warmup", "2"], "nothing would be measured"),
    (["--d-model", "1000"], "multiple of 128"),
    (["--prompt-len", "1000", "--new-tokens", "100"], "exceeds max_seq"),
    (["--seq", "2048"], "exceeds the model's max_seq"),
    (["--variants", "ebbtide,vllm"], "variants"),
    (["--variants", "ebbtide,ebbtide"], "variants"),
    (["--device", "cpu", "--variants", "ebbtide,anchor"], "ebbtide variant only"),
    (["--gpus", "0"], "gpus"),
    (["--kv-reserve-gb", "-1"], "kv_reserve_gb"),
    (["--lr", "0"], "lr"),
    (["--steady-tolerance", "-0.01"], "steady_tolerance"),
    (["--steady-tolerance", "2"], "steady_tolerance"),
])
def test_argument_errors(argv, msg):
    with pytest.raises(InvalidArgumentError, match=msg):
        parse_args(argv)


def test_steady_guard_settings():
    cfg = parse_args([])
    assert cfg.steady_guard == "error" and cfg.steady_tolerance == pytest.approx(0.03)
    cfg = parse_args(["--steady-guard", "warn", "--steady-tolerance", "0.05"])
    assert cfg.steady_guard == "warn" and cfg.steady_tolerance == pytest.approx(0.05)
    with pytest.raises(InvalidArgumentError, match="steady_guard"):
        RunConfig(steady_guard="ignore").validate()
    with pytest.raises(InvalidArgumentError, match="steady_tolerance"):
        RunConfig(steady_tolerance=True).validate()


def test_main_exits_3_when_a_steady_phase_is_slower(monkeypatch, capsys):
    """The guard decides the exit status once every variant was correct: 3 with --steady-guard error, 0 with warn."""
    import ebbtide.bench.colocate.launcher as L

    def fake_run(cfg, log=print):
        s = lambda gen: {"phase_s": {"train": 0.1, "generate": gen}, "step_s": 1.0, "memory": {}, "bytes": {},
                         "detail": {}}  # noqa: E731
        res = {"config": {"warmup": 1}, "timeline": "-", "variants": {
            "ebbtide": {"summary": s(0.110), "checks": {"correct": True}},
            "anchor": {"summary": s(0.100), "checks": {"correct": True}}}}
        res["steady"] = L.steady_check(res, cfg.steady_tolerance)  # as run() records it
        return res

    monkeypatch.setattr(L, "run", fake_run)
    monkeypatch.setattr(L, "format_report", lambda res: "report")
    assert L.main([]) == 3
    assert "generate 1.100x anchor's" in capsys.readouterr().err
    assert L.main(["--steady-guard", "warn"]) == 0
    assert L.main(["--steady-tolerance", "0.2"]) == 0


def test_store_listens_on_loopback_unless_asked(monkeypatch, tmp_path):
    """The ranks' rendezvous store is served by the launcher on --store-bind (loopback by default); ranks only
    connect to it. The variant's store address reaches the ranks through MASTER_ADDR/MASTER_PORT."""
    import ebbtide.bench.colocate.launcher as L
    import ebbtide.comm

    assert parse_args([]).store_bind == "127.0.0.1"
    assert parse_args(["--store-bind", "0.0.0.0"]).store_bind == "0.0.0.0"
    with pytest.raises(InvalidArgumentError, match="store_bind"):
        RunConfig(store_bind=" ").validate()
    binds, envs = [], []
    real = ebbtide.comm.serve_store

    def serve(**kw):
        binds.append(kw["bind"])
        return real(**kw)

    class _Done:  # a rank that exits at once, recording its environment
        def __init__(self, argv, env, **kw):
            envs.append((env["MASTER_ADDR"], env["MASTER_PORT"]))
            self.pid, self.returncode = -1, 0

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(ebbtide.comm, "serve_store", serve)
    monkeypatch.setattr(L.subprocess, "Popen", _Done)
    monkeypatch.setattr(L, "_reap_group", lambda pgid: None)
    cfg = parse_args(["--device", "cpu", "--variants", "ebbtide", "--gpus", "2", "--out", str(tmp_path)])
    L.run_variant(cfg, "ebbtide", log=lambda *a: None)
    assert binds == ["127.0.0.1"] and [a for a, _p in envs] == ["127.0.0.1", "127.0.0.1"], (binds, envs)
    assert len({p for _a, p in envs}) == 1


def test_argument_error_exit_code_and_message():
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--steps", "1", "--warmup", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "nothing would be measured" in p.stderr and "Traceback" not in p.stderr


def test_ebbtide_colocate_command_runs_the_harness(tmp_path):
    # `ebbtide colocate ARGS` hands every argument to the harness (ebbtide.bench.colocate): it runs the loop, a bad
    # argument is the harness's own usage error, and --help names the command the user typed
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", *TINY_ARGS, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads((tmp_path / "results.json").read_text())["variants"]["ebbtide"]["checks"]["correct"] is True
    bad = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--steps", "1", "--warmup", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nothing would be measured" in bad.stderr and "Traceback" not in bad.stderr
    helped = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "--trainer" in helped.stdout
    assert helped.stdout.startswith("usage: ebbtide colocate "), helped.stdout[:200]


def test_what_runs_is_picked_for_the_hardware_present():
    said = []
    cfg = parse_args([], cuda_devices=0, log=said.append)  # no GPU: the CPU, and what runs there
    assert (cfg.device, cfg.variants, cfg.decode) == ("cpu", ("ebbtide",), "eager")
    assert said == ["ebbtide colocate: picked device cpu (no CUDA GPU visible: the orchestration check); variants "
                    "ebbtide (the anchors need a GPU); decode eager (a CUDA graph needs a GPU)"]
    said.clear()
    cfg = parse_args([], cuda_devices=2, log=said.append)
    assert (cfg.device, cfg.variants, cfg.decode) == ("cuda", ("ebbtide", "anchor"), "cuda-graph")
    assert said == ["ebbtide colocate: picked device cuda (2 CUDA GPU(s) visible)"]
    said.clear()  # flags the user gave are kept
    cfg = parse_args(["--device", "cpu", "--decode", "cuda-graph"], cuda_devices=0, log=said.append)
    assert (cfg.device, cfg.variants, cfg.decode) == ("cpu", ("ebbtide",), "cuda-graph")
    assert said == ["ebbtide colocate: picked variants ebbtide (the anchors need a GPU)"]
    assert parse_args(["--trainer", "megatron"], cuda_devices=0).device == "cuda"  # it has no CPU run
    with pytest.raises(InvalidArgumentError, match="ebbtide variant only"):
        parse_args(["--variants", "anchor"], cuda_devices=0)


def test_an_out_that_cannot_be_a_directory_fails_before_the_run(tmp_path, capsys):
    from ebbtide.bench.colocate.launcher import main

    (tmp_path / "file").write_text("x")
    assert main([*TINY_ARGS, "--out", str(tmp_path / "file")]) == 2
    out = capsys.readouterr()
    assert f"--out {tmp_path / 'file'}: cannot be made a directory" in out.err, out.err
    assert "colocate: ebbtide on" not in out.out + out.err  # no variant started


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_loop_runs_on_cpu(tmp_path, ranks):
    import torch

    # one rank with no flag naming device or variants: on a machine without a GPU they are picked (and said)
    picked = ranks == 1 and not torch.cuda.is_available()
    args = TINY_ARGS[4:] if picked else TINY_ARGS
    assert not picked or args[0] == "--vocab"
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", *args, "--gpus", str(ranks), "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n" + "".join(
        f.read_text() for f in tmp_path.glob("*.log"))
    if picked:
        assert p.stdout.startswith("ebbtide colocate: picked device cpu "), p.stdout[:300]
        for misleading in ("cuda-graph", "static-eager", "tokens equal"):  # a CPU run decodes eagerly, says so
            assert misleading not in p.stdout, (misleading, p.stdout)
    res = json.loads((tmp_path / "results.json").read_text())
    v = res["variants"]["ebbtide"]
    assert not v["failed"] and v["checks"]["correct"] is True
    assert len(v["checks"]["verify"]) == 2 * ranks  # first and last step on every rank
    assert all(e["weights_bitwise_equal"] and e["decode_vs_full_argmax_equal"] for e in v["checks"]["verify"])
    assert v["checks"]["ranks_in_sync"] is (True if ranks == 2 else None)
    phases = set(v["summary"]["phase_s"])
    want = {"train", "optimizer", "sync_pack", "trainer_pause", "rollout_resume", "sync_load", "generate",
            "rollout_pause", "trainer_resume"} | ({"comm_release", "comm_reload"} if ranks == 2 else set())
    assert phases == want
    losses = [ph["loss"] for ph in v["ranks"][0]["phases"] if ph["phase"] == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "step" in p.stdout and "per-phase time" in p.stdout
    if ranks == 2:
        rel = [ph for ph in v["ranks"][0]["phases"] if ph["phase"] == "comm_release"]
        assert rel and "ebbtide.comm release" in rel[0]["report"]
    # the bench suite's rows from the same results
    from ebbtide.bench.suites.colocate import _rows

    rows = list(_rows(res, ranks, {"out": str(tmp_path)}))
    assert rows[0].name.startswith("RL step") and rows[0].ours == pytest.approx(v["summary"]["step_s"])
    assert rows[0].anchor is None and rows[0].anchor_note == "n/a"
    assert len(rows) == (7 if ranks == 2 else 6) and rows[-1].unit == "GB" and rows[-1].ours is None
    resume = [r for r in rows if r.name.startswith("rollout resume")]
    assert len(resume) == 1 and resume[0].ours == pytest.approx(v["summary"]["phase_s"]["rollout_resume"])


def test_the_loop_runs_on_cpu_with_the_static_decode(tmp_path):
    # --decode cuda-graph on the CPU: the same GraphDecoder path without capture; the rollout reports what it ran
    # and the untimed check against the eager decode runs on the verified steps
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", *TINY_ARGS, "--decode", "cuda-graph", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n" + "".join(f.read_text() for f in tmp_path.glob("*.log"))
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["decode"] == "cuda-graph"
    v = res["variants"]["ebbtide"]
    assert v["checks"]["correct"] is True and len(v["checks"]["verify"]) == 2
    for e in v["checks"]["verify"]:
        assert e["decode"] == "static-eager" and e["decode_vs_eager_tokens_equal"] is True, e
        assert e["decode_vs_full_argmax_equal"] is True and e["decode_vs_full_rel"] <= 2.0 ** -6, e
    assert v["ranks"][0]["setup"]["rollout"]["decode_used"] == "static-eager"
    assert "rollout decode: cuda-graph" in p.stdout and "ebbtide rollout decode: static-eager" in p.stdout


def test_wait_all_kills_the_peers_of_a_failed_rank_and_stragglers():
    from ebbtide.bench.colocate._procs import _wait_all

    def spawn(code):
        return subprocess.Popen([sys.executable, "-c", code])

    procs = [spawn("import sys; sys.exit(3)"), spawn("import time; time.sleep(60)")]
    killed = _wait_all(procs, timeout=50, grace=1)
    assert killed == {1: "killed 1 s after rank 0 failed"} and procs[0].returncode == 3
    procs = [spawn("pass"), spawn("import time; time.sleep(60)")]
    assert _wait_all(procs, timeout=1) == {1: "timed out after 1 s"}
    procs = [spawn("pass"), spawn("pass")]
    assert _wait_all(procs, timeout=50) == {} and all(p.returncode == 0 for p in procs)


def _alive(pid: int) -> bool:
    """A zombie counts as dead: it is not ours to reap, and PID 1 in a container may never do it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_rank_takes_its_rollout_child_with_it(tmp_path):
    # a trainer rank that hangs while its child (the rollout) is alive: the deadline kills both, so nothing keeps
    # holding the GPU into the next variant
    import os
    import time

    from ebbtide.bench.colocate._procs import _wait_all

    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(120)']); open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    t0 = time.monotonic()
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < t0 + 30:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert _wait_all([proc], timeout=0.5) == {0: "timed out after 0.5 s"}
    proc.wait()
    for _ in range(100):
        if not _alive(child):
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        raise AssertionError("the rollout child survived its rank's kill")


def test_rank_and_rollout_die_with_their_parent(tmp_path):
    # the launcher killed from outside (pytest-timeout kills the process it started, nothing else): what it
    # started must not keep running on the GPU
    import os
    import signal
    import time

    pidfile = tmp_path / "child.pid"
    child = ("import os, sys, time; from ebbtide.bench.colocate.rank import die_with_parent; "
             f"die_with_parent({{ppid}}); open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    parent = ("import os, subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}.replace('{{ppid}}', str(os.getpid()))]); "
              "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    t0 = time.monotonic()
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < t0 + 60:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the child outlived its parent")


def test_more_gpus_than_visible_is_a_clear_error():
    import torch

    n = torch.cuda.device_count()
    # --device cuda named: without it a machine with no GPU runs the CPU check instead (the device is picked)
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--gpus", str(n + 1), "--quick", "--device",
                        "cuda"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"{n} CUDA device(s) are visible" in p.stderr and "Traceback" not in p.stderr
    assert n or "--device cpu runs the orchestration check without one" in p.stderr


def test_a_run_cut_short_keeps_the_variants_that_finished(tmp_path, monkeypatch):
    # results.json is rewritten after each variant: a time limit or Ctrl-C during the next loses only that one
    import ebbtide.bench.colocate.launcher as L

    done = {"ranks": [], "failed": [{"rank": 0, "rc": 1, "why": "a finished variant", "log": ""}]}

    def run_variant(cfg, variant, log=print):
        if variant == "anchor":
            raise KeyboardInterrupt
        return dict(done)

    monkeypatch.setattr(L, "run_variant", run_variant)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)  # two variants are a GPU run's; none starts here
    monkeypatch.setattr(L, "NEEDS_TMS", ())  # the anchor "runs" whether or not torch_memory_saver is here
    cfg = parse_args(["--device", "cuda", "--variants", "ebbtide,anchor", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        L.run(cfg, log=lambda *a: None)
    kept = json.loads((tmp_path / "results.json").read_text())
    assert list(kept["variants"]) == ["ebbtide"] and "after ebbtide" in kept["incomplete"]
    assert kept["variants"]["ebbtide"]["why"] == "rank 0: a finished variant"
    assert not (tmp_path / "results.json.tmp").exists()
