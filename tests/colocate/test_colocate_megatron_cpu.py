"""The Megatron colocated loop's pieces that run without CUDA: the rollout's copy of Megatron's GPT against
Megatron's own forward, its decode paths, the weight-sync plan and names through ebbtide.sync's host transport,
argument handling and refusals, the report and the bench rows. The loop itself (Megatron's DDP, CUDA IPC, memory
pause/resume) is tests/colocate/test_colocate_megatron_gpu.py."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from ebbtide.bench.colocate import launcher  # noqa: E402
from ebbtide.bench.colocate.config import MEGATRON_MODEL, MEGATRON_QUICK, RunConfig  # noqa: E402
from ebbtide.bench.colocate.launcher import parse_args  # noqa: E402
from ebbtide.bench.colocate.measure import MEGATRON_PHASES, format_report, summarize  # noqa: E402
from ebbtide.bench.colocate.options import NEEDS_TMS  # noqa: E402
from ebbtide.bench.colocate.sync import megatron_plan  # noqa: E402
from ebbtide.integrations.names import served_names as megatron_names  # noqa: E402
from ebbtide.testing.models import (GraphDecoder, KVCache, MegatronGPT, ModelConfig, MoEConfig,  # noqa: E402
                                    greedy_decode)
from ebbtide.errors import InvalidArgumentError, UnsupportedError  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
TINY = ModelConfig(vocab=256, d_model=128, n_layers=2, n_heads=4, d_ff=512, max_seq=128)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize("moe", [(), ("4", "2"), ("4", "2", "fp32")], ids=["dense", "moe-4x-top2", "moe-fp32-router"])
def test_rollout_model_equals_megatrons_own_forward(moe):
    # a fresh process: Megatron's parallel state and the CPU redirections stay out of the test session
    p = subprocess.run([sys.executable, str(HERE / "megatron_gpt_cpu.py"), "2", "128", "4", "512", "256", "128",
                        *moe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["names_equal"] and res["plan_equal"], res  # whatever order each model lists its parameters in
    assert res["max_abs_diff"] <= 1e-5 * max(1.0, res["max_abs_logit"]), res  # fp32, same weights
    assert res["decode_vs_megatron_max_abs"] <= 1e-5 * max(1.0, res["max_abs_logit"]), res
    if moe:  # the comparison sees the routing: another top-k is far off
        assert res["other_topk_max_abs_diff"] > 1e3 * max(res["max_abs_diff"], 1e-7), res


def test_moe_rollout_decodes_like_its_full_forward_and_refuses_bad_configs():
    m = MegatronGPT.random(TINY, seed=3, dtype=torch.float32, moe=MoEConfig(4, 2))
    assert sum(".mlp.experts.local_experts." in n for n, _ in m.named_parameters()) == 2 * 4 * 4  # layers x experts
    prompt = torch.randint(TINY.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    ref_seq, ref_last = greedy_decode(m, prompt, 8)
    dec = GraphDecoder(m, KVCache(TINY, 2, 24, device="cpu", dtype=torch.float32), 2, capture=False)
    seq, last = dec.generate(prompt, 8)
    assert torch.equal(seq, ref_seq) and torch.allclose(last, ref_last, atol=1e-5)
    for bad in (MoEConfig(1, 1), MoEConfig(4, 5), MoEConfig(4, 0), MoEConfig(True, 1)):
        with pytest.raises(InvalidArgumentError, match="moe"):
            MegatronGPT(TINY, moe=bad)


def test_cached_and_static_decode_equal_the_full_forward():
    m = MegatronGPT.random(TINY, seed=3, dtype=torch.float32)
    prompt = torch.randint(TINY.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    seq, last = greedy_decode(m, prompt, 8, KVCache(TINY, 2, 24, device="cpu", dtype=torch.float32))
    ref_seq, ref_last = greedy_decode(m, prompt, 8)  # no cache: the full sequence every token
    assert torch.equal(seq, ref_seq) and torch.allclose(last, ref_last, atol=1e-5)
    dec = GraphDecoder(m, KVCache(TINY, 2, 24, device="cpu", dtype=torch.float32), 2, capture=False)
    g_seq, g_last = dec.generate(prompt, 8)
    assert torch.equal(g_seq, ref_seq) and torch.allclose(g_last, ref_last, atol=1e-5)
    assert not list(m.buffers())  # parameters only: nothing a discarded weights region could lose


def test_names_strip_the_wrappers_and_the_model_has_megatrons_shapes():
    m = MegatronGPT(TINY)
    named = dict(m.named_parameters())
    assert megatron_names((f"module.module.{n}", p) for n, p in named.items()).keys() == named.keys()
    assert named["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (3 * 128, 128)
    assert named["decoder.layers.0.mlp.linear_fc2.weight"].shape == (128, 512)
    assert named["output_layer.weight"].shape == (256, 128) and "output_layer.bias" not in named
    with pytest.raises(InvalidArgumentError, match="exceed max_seq"):
        m(torch.zeros(1, 129, dtype=torch.long))


def test_plan_kinds_and_a_sync_through_ebbtide_sync_on_cpu():
    from ebbtide.sync import HostReceiver, HostSender, Receiver, Sender, SharedHostBuffer, expected

    trainer = MegatronGPT.random(TINY, seed=1)
    rollout = MegatronGPT.random(TINY, seed=2)
    plan = megatron_plan(megatron_names((f"module.module.{n}", p) for n, p in trainer.named_parameters()))
    kinds = {it.source: it.kind for it in plan.items}
    assert kinds["decoder.layers.0.self_attention.linear_qkv.weight"] == "fp8"
    assert kinds["decoder.layers.1.mlp.linear_fc1.weight"] == "fp8"
    for raw in ("output_layer.weight", "embedding.word_embeddings.weight", "decoder.final_layernorm.bias",
                "decoder.layers.0.self_attention.linear_qkv.bias"):
        assert kinds[raw] == "raw", raw
    assert plan.signature == megatron_plan(rollout.named_parameters()).signature  # both sides build the same
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        named = {n: p.detach() for n, p in trainer.named_parameters()}
        Sender(named, HostSender(buf), plan=plan).push(1)
        HostReceiver(buf).receive(Receiver(rollout, plan), 1)
        want = expected(plan, named)
        got = dict(rollout.named_parameters())
        assert all(torch.equal(got[n], want[n]) for n in want)
    finally:
        buf.close()


def test_arguments_pick_the_megatron_loop_and_its_sizes():
    cfg = parse_args(["--trainer", "megatron"])
    assert cfg.model == MEGATRON_MODEL and cfg.variants == ("ebbtide", "slime", "slime-ebbtide", "gpu-tms")
    assert cfg.worker_spec("slime")["trainer"] == "megatron"
    q = parse_args(["--trainer", "megatron", "--quick", "--variants", "ebbtide,slime"])
    assert q.model == MEGATRON_QUICK and q.variants == ("ebbtide", "slime") and q.steps == 5
    assert parse_args([]).trainer == "toy" and parse_args([]).variants == ("ebbtide", "anchor")
    assert RunConfig(trainer="megatron").validate().variants == ("ebbtide", "slime", "slime-ebbtide", "gpu-tms")
    assert cfg.worker_spec("ebbtide")["groups"] == "lazy"
    assert parse_args(["--trainer", "megatron", "--groups", "eager"]).worker_spec("ebbtide")["groups"] == "eager"
    # the drop-in variant runs on ebbtide alone: it is not skipped where the torch_memory_saver package is missing
    assert "slime-ebbtide" not in NEEDS_TMS and {"slime", "gpu-tms", "anchor"} <= set(NEEDS_TMS)
    with pytest.raises(InvalidArgumentError, match="groups must be one of"):
        RunConfig(trainer="megatron", groups="sometimes").validate()
    # slime's anchors run with --use-precision-aware-optimizer unless told not to
    assert cfg.worker_spec("slime")["anchor_precision_aware"] is True
    off = parse_args(["--trainer", "megatron", "--anchor-precision-aware", "off"])
    assert off.worker_spec("slime")["anchor_precision_aware"] is False
    with pytest.raises(InvalidArgumentError, match="option of --trainer megatron"):
        RunConfig(anchor_precision_aware="off").validate()


def test_slime_offload_config_carries_the_precision_aware_fields_without_transformer_engine():
    pytest.importorskip("megatron.core.optimizer")
    from ebbtide.anchors.megatron import slime_offload_config

    cfg = slime_offload_config(lr=1e-4)
    assert cfg.use_distributed_optimizer and cfg.optimizer_cpu_offload and cfg.overlap_cpu_optimizer_d2h_h2d
    assert cfg.optimizer_offload_fraction == 1.0 and cfg.lr == 1e-4
    # what Megatron's __post_init__ derives with CPU offload: the optimizer, not the DistributedOptimizer, owns the
    # fp32 master (no fp32 main-param shard on the GPU)
    assert cfg.use_precision_aware_optimizer and cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    plain = slime_offload_config(precision_aware=False)
    assert not plain.use_precision_aware_optimizer and not plain.use_precision_aware_optimizer_no_fp8_or_ds_fp8


@pytest.mark.parametrize("argv, msg", [
    (["--trainer", "megatron", "--device", "cpu"], "needs CUDA"),
    (["--trainer", "megatron", "--gpus", "3", "--tp", "2"], "must divide --gpus"),
    (["--trainer", "megatron", "--gpus", "3", "--tp", "3", "--quick"], "must divide the model.s n_heads"),
    (["--gpus", "2", "--tp", "2"], "option of --trainer megatron"),
    (["--gpus", "2", "--ep", "2", "--moe-experts", "4"], "option of --trainer megatron"),
    (["--trainer", "megatron", "--gpus", "2", "--ep", "2"], "needs a MoE model"),
    (["--trainer", "megatron", "--gpus", "2", "--ep", "2", "--moe-experts", "6", "--moe-topk", "2", "--quick",
      "--gpus", "4", "--ep", "4"], "must divide --gpus 4 and --moe-experts 6"),
    (["--trainer", "megatron", "--gpus", "2", "--tp", "2", "--moe-experts", "4"], "sequence parallelism"),
    (["--trainer", "megatron", "--moe-experts", "4", "--moe-topk", "5"], "moe-experts must be >= 2 and >= --moe-topk"),
    (["--trainer", "megatron", "--moe-experts", "4"], "needs --ep 2 or more"),
    (["--trainer", "megatron", "--moe-experts", "-1"], "moe_experts must be an int >= 0"),
    (["--trainer", "megatron", "--tp", "0"], "tp must be an int >= 1"),
    (["--trainer", "megatron", "--variants", "ebbtide,anchor"], "variants must be distinct names from"),
    (["--variants", "ebbtide,slime"], "variants must be distinct names from"),
    (["--trainer", "megatron", "--quick", "--d-model", "1000"], "multiple of 128"),
])
def test_megatron_refusals(argv, msg):
    with pytest.raises(InvalidArgumentError, match=msg):
        parse_args(argv)


def test_unknown_trainer_is_a_usage_error_and_cpu_is_refused_from_the_command_line():
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--trainer", "deepspeed"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--trainer" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", "--trainer", "megatron", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs CUDA" in p.stderr and "Traceback" not in p.stderr
    with pytest.raises(InvalidArgumentError, match="trainer must be one of"):
        RunConfig(trainer="nemo").validate()


def test_missing_megatron_core_is_a_clear_error(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda n, *a: None if n == "megatron" else real(n, *a))
    with pytest.raises(UnsupportedError, match="needs megatron-core"):
        launcher.run(RunConfig(trainer="megatron", out=str(tmp_path)))


@pytest.mark.parametrize("key, world, msg", [("tp", "3", "does not divide the world of 3"),
                                            ("ep", "2", "needs a MoE model")], ids=["tp-world", "ep-dense"])
def test_the_megatron_rank_refuses_a_parallel_size_it_cannot_run(tmp_path, key, world, msg):
    out = tmp_path / "r.json"
    spec = RunConfig(trainer="megatron", model=MEGATRON_QUICK).validate().worker_spec("ebbtide")
    spec[key] = 2
    env = dict(os.environ, RANK="0", WORLD_SIZE=world)
    p = subprocess.run([sys.executable, "-m", "ebbtide.bench.colocate.mtrainer", json.dumps(spec), str(out)], env=env,
                       capture_output=True, text=True, timeout=120)
    res = json.loads(out.read_text())
    assert p.returncode == 1 and not res["ok"] and msg in res["error"]


def test_two_gpu_shapes_parse():
    cfg = parse_args(["--trainer", "megatron", "--gpus", "2", "--tp", "2", "--quick"])
    assert cfg.worker_spec("ebbtide")["tp"] == 2 and cfg.gpus == 2 and cfg.worker_spec("ebbtide")["moe"] is None
    assert parse_args(["--trainer", "megatron", "--gpus", "2", "--quick"]).worker_spec("slime")["tp"] == 1
    moe = parse_args(["--trainer", "megatron", "--gpus", "2", "--ep", "2", "--moe-experts", "8", "--d-ff", "2048"])
    spec = moe.worker_spec("slime")
    assert spec["ep"] == 2 and spec["moe"] == {"experts": 8, "topk": 2} and spec["model"]["d_ff"] == 2048


def _rank(step_s: dict, steps: int, ctx=1e9, held=1.5e9) -> dict:
    phases, mem = [], []
    for s in range(steps):
        for ph in MEGATRON_PHASES:
            phases.append({"step": s, "phase": ph, "t0": 0.0, "t1": step_s[ph], "s": step_s[ph],
                           **({"loss": 5.0 - s} if ph == "train" else {})})
            mem.append({"step": s, "phase": ph, "nvml": {"trainer": held if ph == "generate" else 3e9},
                        "device_used": 10e9})
    return {"phases": phases, "memory": mem, "setup": {"context_bytes": ctx, "params": 120_000_000,
                                                         "device_name": "test"}}


def test_report_and_bench_rows_of_three_variants():
    from ebbtide.bench.suites.megatron import colocated_rows

    ours = _rank({p: 0.01 for p in MEGATRON_PHASES}, 3)
    slime = _rank({p: 0.04 for p in MEGATRON_PHASES}, 3, held=4e9)
    res = {"config": {"decode": "cuda-graph", "steps": 3, "warmup": 1}, "variants": {
        "ebbtide": {"ranks": [ours], "summary": summarize([ours], 1), "checks": {"correct": True, "verify": []}},
        "slime": {"ranks": [slime], "summary": summarize([slime], 1)},
        "gpu-tms": {"why": "not installed (torch_memory_saver)"}}}
    assert list(res["variants"]["ebbtide"]["summary"]["phase_s"]) == list(MEGATRON_PHASES)  # step order kept
    text = format_report(res)
    assert "speed-up" in text and "4.00x" in text and "onload" in text and "gpu-tms: not measured" in text
    assert "losses (every step, rank 0): 5.0000, 4.0000, 3.0000" in text
    assert "0.500 GB above its CUDA context" in text
    rows = list(colocated_rows(res, "out"))
    by = {r.name.split(", Megatron")[0]: r for r in rows}
    step = by["colocated loop: RL step (vs slime)"]
    assert step.ours == pytest.approx(0.1) and step.anchor == pytest.approx(0.4) and step.vs_anchor() == 4.0
    assert by["colocated loop: RL step (vs gpu-tms)"].anchor is None
    assert "not installed" in by["colocated loop: RL step (vs gpu-tms)"].anchor_note
    assert by["colocated loop: step overhead (all but train and generate) (vs slime)"].ours == pytest.approx(0.08)
    assert by["colocated loop: process groups release + reload (vs slime)"].anchor == pytest.approx(0.08)
    mem = by["colocated loop: trainer GPU memory while the rollout generates, above its CUDA context (vs slime)"]
    assert mem.ours == pytest.approx(0.5) and mem.anchor == pytest.approx(3.0) and mem.unit == "GB"
    # three anchors: step and overhead against each, the phases against slime, memory against each
    assert len(rows) == 3 * 2 + 9 + 3
    assert by["colocated loop: RL step (vs slime-ebbtide)"].anchor_note == "not measured"


def test_critical_paths_and_their_goals_in_the_report():
    """update = optimizer + rollout_resume + sync, restart = onload + comm_reload: per step, the slowest rank,
    median over the measured steps; the report prints them beside the optimizer step and the host floor."""
    phases = {p: 0.001 for p in MEGATRON_PHASES}
    phases.update(optimizer=0.300, rollout_resume=0.005, sync=0.020, onload=0.015, comm_reload=0.002)
    ours = _rank(phases, 3)
    ours["setup"].update(moments="bf16", optimizer_floor_s=0.250, host_triad_gbps=100.0)
    ours["phases"][-1]["s"] = 9.0  # the last step's comm_reload (its last phase) is slow
    slime = _rank({p: 0.04 for p in MEGATRON_PHASES}, 3)
    s = summarize([ours], 1)
    assert s["paths_s"]["update"] == pytest.approx(0.325)
    assert s["paths_s"]["restart"] == pytest.approx((0.017 + 9.015) / 2)  # median of the two measured steps
    res = {"config": {"decode": "cuda-graph", "steps": 3, "warmup": 1}, "variants": {
        "ebbtide": {"ranks": [ours], "summary": s, "checks": {"correct": True, "verify": []}},
        "slime": {"ranks": [slime], "summary": summarize([slime], 1)}}}
    text = format_report(res)
    assert "== critical paths" in text and "moments bf16" in text and "1.08x the optimizer step" in text
    assert "    250.0" in text  # the floor column
    from ebbtide.bench.colocate.measure import steady_check

    assert all(c["ok"] for c in steady_check(res) if c["phase"] == "train")  # equal phases here
    ours["setup"]["onload_overlaps_train"] = True
    slow = {**res, "variants": {**res["variants"], "slime": {
        "ranks": [slime], "summary": summarize([_rank({p: 0.0001 for p in MEGATRON_PHASES}, 3)], 1)}}}
    train = [c for c in steady_check(slow) if c["phase"] == "train"][0]
    assert train["ok"] and not train["guarded"]  # 10x slower train, but it holds the upload's tail: reported only
    assert "not guarded" in format_report(slow)
    goals = launcher._goals(res)
    assert goals["backward done -> rollout holds the new weights (goal <= 1.1x the optimizer step)"].startswith(
        "1.08x (met")


def test_moments_option():
    assert parse_args(["--trainer", "megatron", "--moments", "bf16"]).moments == "bf16"
    assert parse_args(["--trainer", "megatron"]).moments == "fp32"
    assert RunConfig(trainer="megatron", moments="bf16").worker_spec("ebbtide")["moments"] == "bf16"
    with pytest.raises(InvalidArgumentError, match="option of --trainer megatron"):
        parse_args(["--moments", "bf16"])
    with pytest.raises(InvalidArgumentError, match="moments must be one of"):
        RunConfig(trainer="megatron", moments="fp16").validate()


def test_comm_teardown_option():
    assert parse_args(["--trainer", "megatron"]).comm_teardown == "background"
    cfg = parse_args(["--trainer", "megatron", "--comm-teardown", "joined"])
    assert cfg.comm_teardown == "joined" and cfg.worker_spec("ebbtide")["comm_teardown"] == "joined"
    with pytest.raises(InvalidArgumentError, match="comm_teardown must be one of"):
        RunConfig(trainer="megatron", comm_teardown="later").validate()
    with pytest.raises(InvalidArgumentError, match="option of --trainer megatron"):
        parse_args(["--comm-teardown", "joined"])


def test_cache_trim_option():
    assert parse_args(["--trainer", "megatron"]).cache_trim == "auto"
    cfg = parse_args(["--trainer", "megatron", "--cache-trim", "offload"])
    assert cfg.cache_trim == "offload" and cfg.worker_spec("ebbtide")["cache_trim"] == "offload"
    with pytest.raises(InvalidArgumentError, match="cache_trim must be one of"):
        RunConfig(trainer="megatron", cache_trim="never").validate()
    with pytest.raises(InvalidArgumentError, match="option of --trainer megatron"):
        parse_args(["--cache-trim", "step"])


def test_sync_fill_and_memory_history_options():
    cfg = parse_args(["--trainer", "megatron"])
    assert cfg.sync_fill == "auto" and cfg.memory_history is False
    cfg = parse_args(["--trainer", "megatron", "--sync-fill", "after", "--memory-history"])
    spec = cfg.worker_spec("ebbtide")
    assert spec["sync_fill"] == "after" and spec["memory_history"] is True
    with pytest.raises(InvalidArgumentError, match="sync_fill must be one of"):
        RunConfig(trainer="megatron", sync_fill="early").validate()
    with pytest.raises(InvalidArgumentError, match="needs one GPU and a dense model"):
        parse_args(["--trainer", "megatron", "--gpus", "2", "--sync-fill", "streamed"])
    with pytest.raises(InvalidArgumentError, match="option of --trainer megatron"):
        parse_args(["--sync-fill", "after"])
    with pytest.raises(InvalidArgumentError, match="option of --trainer megatron"):
        parse_args(["--memory-history"])
    with pytest.raises(InvalidArgumentError, match="memory_history must be a bool"):
        RunConfig(trainer="megatron", memory_history="yes").validate()


def test_groups_used_mode_reaches_the_worker():
    cfg = parse_args(["--trainer", "megatron", "--groups", "used"])
    assert cfg.groups == "used" and cfg.worker_spec("ebbtide")["groups"] == "used"
    with pytest.raises(InvalidArgumentError, match="groups must be one of"):
        RunConfig(trainer="megatron", groups="some").validate()
