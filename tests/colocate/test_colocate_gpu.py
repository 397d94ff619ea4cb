"""The colocated loop on real GPUs (short --quick runs): correctness, no growth, memory handed over, the anchor.
Run by the lead on an H100/H200: ``pytest -m gpu tests/colocate`` (1 GPU) and ``pytest -m multigpu
tests/colocate`` (2 GPUs). The graph-decode runs (the default) check the captured decode too: the graph is used in
both loops, ebbtide's graph memory is in the engine and released by the rollout pause, the decode after many
pause/resume cycles still matches a full forward."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest


def _run(tmp_path, gpus: int, *extra):
    # results.json, timeline.png and the logs go where scripts/gpu-check collects artifacts, if it does
    art = os.environ.get("EBBTIDE_TEST_ARTIFACTS")
    if art:
        tmp_path = pathlib.Path(art) / (f"colocate-{gpus}gpu" + "".join("-" + x for x in extra[1::2]))
        tmp_path.mkdir(parents=True, exist_ok=True)
    # 3 steps (2 measured): both variants fit gpu-check's 240 s per-test deadline with room to spare
    cmd = [sys.executable, "-m", "ebbtide", "colocate", "--quick", "--steps", "3", "--warmup", "1", "--gpus",
           str(gpus), "--out", str(tmp_path), "--timeout", "180",
           # correctness runs: the steady-phase comparison is the bench's (2 quick steps are too few to judge it)
           "--steady-guard", "warn", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = "".join(f"\n--- {f.name}\n{f.read_text()[-6000:]}" for f in sorted(tmp_path.glob("*.log")))
    print(p.stdout)  # the table, shown with -s or on failure
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}{logs}"
    return json.loads((tmp_path / "results.json").read_text()), f"{p.stdout}{logs}"


def _used(summary: dict, phase: str, role: str):
    m = summary["memory"].get(phase, {})
    return m.get(f"{role}_nvml", m.get("device_used"))


def _check_variant(res: dict, name: str, gpus: int, diag: str):
    v = res["variants"][name]
    assert v.get("summary"), f"{name}: {v.get('why')}\n{diag}"
    ck = v["checks"]
    assert ck["correct"] is True, f"{name}: {ck['verify']}\n{diag}"
    assert ck["no_growth"] is True, f"{name}: {ck['growth']}\n{diag}"
    if gpus > 1:
        assert ck["ranks_in_sync"] is True, f"{name}: {ck['verify']}"
    s = v["summary"]
    # the memory really changes hands: the trainer holds less after its pause than after training, the rollout
    # less after its pause than while generating (per process with NVML, else the device total)
    assert _used(s, "trainer_pause", "trainer") < _used(s, "train", "trainer"), (name, s["memory"])
    assert _used(s, "rollout_pause", "rollout") < _used(s, "generate", "rollout"), (name, s["memory"])


@pytest.mark.gpu
def test_quick_loop_one_gpu_eager_decode(tmp_path):
    res, diag = _run(tmp_path, 1, "--decode", "eager")  # the default is the graph decode (tested below)
    assert res["config"]["decode"] == "eager"
    _check_variant(res, "ebbtide", 1, diag)
    if importlib.util.find_spec("torch_memory_saver") is not None:
        _check_variant(res, "anchor", 1, diag)
    else:
        assert res["variants"]["anchor"]["why"].startswith("not installed")


@pytest.mark.multigpu
def test_quick_loop_two_gpus(tmp_path):
    res, diag = _run(tmp_path, 2)
    _check_variant(res, "ebbtide", 2, diag)
    _check_graph_decode(res, "ebbtide", diag)
    if importlib.util.find_spec("torch_memory_saver") is not None:
        _check_variant(res, "anchor", 2, diag)


def _check_graph_decode(res: dict, name: str, diag: str):
    """--decode cuda-graph: the rollout captured and replayed; the decode agrees with a full forward (bf16, two
    attention kernels: loose bound, a wrong position or mask is off by O(1)); ebbtide's graph is pausable."""
    v = res["variants"][name]
    ro = v["ranks"][0]["setup"]["rollout"]
    assert ro.get("decode_used") == "cuda-graph", (name, ro, diag)
    assert ro.get("graph_bytes", 0) > 0 and ro.get("graph_pausable") is (name == "ebbtide"), (name, ro)
    for e in v["checks"]["verify"]:
        assert e["decode"] == "cuda-graph" and e["decode_vs_full_rel"] <= 2.0 ** -4, (name, e)
        assert "decode_vs_eager_tokens_equal" in e, (name, e)  # reported (a bf16 near-tie may flip a token)
    if name == "ebbtide":
        assert ro["graph_engine_bytes"] >= ro["graph_bytes"], (ro, diag)  # captured into the engine's tag
        # nothing the rollout holds in the engine (the graph included) stays on the device while it is paused
        assert v["summary"]["memory"]["rollout_pause"].get("rollout_self") == 0, v["summary"]["memory"]


@pytest.mark.gpu
def test_quick_loop_one_gpu_cuda_graph_decode(tmp_path):
    res, diag = _run(tmp_path, 1)  # the default
    assert res["config"]["decode"] == "cuda-graph"
    _check_variant(res, "ebbtide", 1, diag)
    _check_graph_decode(res, "ebbtide", diag)
    if importlib.util.find_spec("torch_memory_saver") is not None:
        _check_variant(res, "anchor", 1, diag)
        _check_graph_decode(res, "anchor", diag)
    assert "rollout decode: cuda-graph" in diag


@pytest.mark.gpu
def test_graph_decoder_replays_the_eager_decode():
    # the captured step against the eager cached decode on the GPU (fp32: both attention paths agree to ~1e-6),
    # the graph reused for a second prompt over the stale cache
    import torch

    from ebbtide.testing.models import GraphDecoder, KVCache, ModelConfig, TinyLM, greedy_decode

    cfg = ModelConfig(vocab=256, d_model=128, n_layers=2, n_heads=4, d_ff=256, max_seq=128)
    m = TinyLM.random(cfg, seed=0, device="cuda", dtype=torch.float32)
    dec = GraphDecoder(m, KVCache(cfg, 3, 40, device="cuda", dtype=torch.float32), 3)
    assert dec.mode == "cuda-graph"
    g = torch.Generator().manual_seed(1)
    for P, n in ((7, 20), (11, 25)):
        prompt = torch.randint(cfg.vocab, (3, P), generator=g).cuda()
        ref_seq, ref_last = greedy_decode(m, prompt, n, KVCache(cfg, 3, P + n, device="cuda", dtype=torch.float32))
        seq, last = dec.generate(prompt, n)
        assert dec.graph is not None and dec.graph_bytes > 0
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(last, ref_last, atol=1e-3, rtol=0)
        if P == 7:
            first_last, first_ref = last, ref_last
    # the logits a generate returned are the caller's: the later replays (another prompt) did not rewrite them
    torch.testing.assert_close(first_last, first_ref, atol=1e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("poison", [False, True])
def test_graph_decode_pauses_and_replays_under_the_shim(poison):
    # the ebbtide rollout's setup in isolation (graph_decode_scenario.py): capture into the kv_cache tag, pause
    # releases it, replay after resume equals the eager decode, no growth over cycles
    from ebbtide.memory import preload_env

    base = {k: v for k, v in os.environ.items()
            if k != "LD_PRELOAD" and not k.startswith(("EBBTIDE_MEM_", "TMS_", "PYTORCH_CUDA_ALLOC_CONF"))}
    env = preload_env(base, default_tag="scratch", default_backup="cpu")
    if poison:
        env["EBBTIDE_MEM_POISON"] = "1"
    script = pathlib.Path(__file__).resolve().parent / "graph_decode_scenario.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    print(p.stdout)
    out = p.stdout.strip()
    assert p.returncode == 0 and out.endswith("OK"), f"exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-8000:]}"
