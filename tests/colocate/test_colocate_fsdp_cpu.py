"""The FSDP2 colocated loop (``ebbtide colocate --trainer fsdp``) without CUDA: the whole loop at two Gloo ranks
on a CPU mesh (FSDP2 trains there; the rollout takes its weights through the shared host buffer), the rollout's
Qwen3 against transformers' own forward, argument handling and the variants' refusals. The loop on a GPU, every
variant: tests/colocate/test_colocate_fsdp_gpu.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

from ebbtide.bench.colocate.config import FSDP_MODEL, FSDP_QUICK, RunConfig  # noqa: E402
from ebbtide.bench.colocate.launcher import parse_args  # noqa: E402
from ebbtide.bench.colocate.measure import MEGATRON_PHASES, path_lines  # noqa: E402
from ebbtide.bench.colocate.sync import hf_plan  # noqa: E402
from ebbtide.errors import InvalidArgumentError  # noqa: E402
from ebbtide.testing import qwen3  # noqa: E402
from ebbtide.testing.models import ModelConfig, greedy_decode  # noqa: E402

TINY = ModelConfig(vocab=512, d_model=128, n_layers=2, n_heads=4, d_ff=256, max_seq=128)
TINY_ARGS = ["--trainer", "fsdp", "--device", "cpu", "--variants", "ebbtide", "--vocab", "512", "--d-model", "128",
             "--n-layers", "2", "--n-heads", "4", "--d-ff", "256", "--max-seq", "128", "--steps", "2", "--warmup", "1",
             "--batch", "2", "--seq", "32", "--gen-batch", "2", "--prompt-len", "8", "--new-tokens", "4",
             "--kv-reserve-gb", "0", "--verify-batch", "2", "--verify-len", "8", "--timeout", "240"]


def test_the_fsdp_loop_runs_on_two_cpu_ranks(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ebbtide", "colocate", *TINY_ARGS, "--gpus", "2", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n" + "".join(f.read_text() for f in tmp_path.glob("*.log"))
    res = json.loads((tmp_path / "results.json").read_text())
    v = res["variants"]["ebbtide"]
    assert not v["failed"] and v["checks"]["correct"] is True and v["checks"]["ranks_in_sync"] is True
    assert len(v["checks"]["verify"]) == 4  # first and last step on each rank
    for e in v["checks"]["verify"]:  # the rollout's weights are the trainer's gathered bf16 ones, bit for bit
        assert e["weights_bitwise_equal"] and not e["mismatching_weights"], e
        assert e["logits_bitwise_equal"] and e["decode_vs_full_argmax_equal"], e
    assert tuple(v["summary"]["phase_s"]) == MEGATRON_PHASES  # the Megatron loop's phases, in its order
    losses = [ph["loss"] for ph in v["ranks"][0]["phases"] if ph["phase"] == "train"]
    other = [ph["loss"] for ph in v["ranks"][1]["phases"] if ph["phase"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses != other  # each rank its data
    gens = [ph for ph in v["ranks"][0]["phases"] if ph["phase"] == "generate"]
    assert gens and all(0 < ph["host_cpu_s"] <= ph["s"] * 1.05 + 0.01 and ph["switches_voluntary"] >= 0
                        and ph["switches_involuntary"] >= 0 for ph in gens), gens  # the decode thread's own usage
    setup = v["ranks"][0]["setup"]
    assert setup["trainer"] == "fsdp" and setup["mesh"] == [2] and setup["params"] == sum(
        t.numel() for t in qwen3.build(TINY, seed=0, device="meta").parameters())
    assert setup["sync_bytes"] == 2 * setup["params"] and setup["rollout"]["arch"] == "qwen3"
    assert setup["optimizer"].startswith("ShardedAdam")
    rel = [ph for ph in v["ranks"][0]["phases"] if ph["phase"] == "comm_release"]
    assert rel and all("teardown in the background" in ph["report"] for ph in rel)  # Gloo groups released
    assert set(v["summary"]["paths_s"]) == {"update", "restart"}
    assert "== critical paths" in p.stdout and "per-phase time" in p.stdout
    header = path_lines(res["variants"], ["ebbtide"])[2]
    assert header.split() == ["variant", "update", "restart", "optimizer", "floor"]


def test_the_rollouts_qwen3_decodes_like_transformers_full_forward():
    hf = qwen3.build(TINY, seed=3, dtype=torch.float32)
    lm = qwen3.Qwen3LM(hf)
    # the HF model's names and order (a tied lm_head.weight not listed): what the trainer's plan sends
    assert [n for n, _ in lm.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert hf_plan(lm).nbytes == 2 * sum(p.numel() for p in hf.parameters())
    prompt = torch.randint(TINY.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = hf(input_ids=prompt).logits[:, -1:]
        assert torch.allclose(lm(prompt), full, atol=1e-5)
        kv = qwen3.Qwen3Cache(TINY, 2, 22, device="cpu", dtype=torch.float32)
        tensors = [t for layer in kv.past.layers for t in (layer.keys, layer.values)]
        assert kv.nbytes == sum(t.numel() * 4 for t in tensors) == 2 * 22 * 2 * TINY.n_layers * (
            TINY.n_heads // 2) * TINY.head_dim * 4  # allocated whole, up front (the rollout's kv_cache region)
        seq, last = greedy_decode(lm, prompt, 6, kv)
        ref_seq, ref_last = greedy_decode(lm, prompt, 6)  # no cache: the whole sequence every token
        assert torch.equal(seq, ref_seq) and torch.allclose(last, ref_last, atol=1e-4)
        for t in tensors:  # what a discarded region maps back holds: any bits, NaN included
            t.fill_(float("nan"))
        again, again_last = greedy_decode(lm, prompt, 6, kv)
    assert torch.equal(again, seq) and torch.equal(again_last, last)  # the same storage, reset by the prefill
    assert [t.data_ptr() for layer in kv.past.layers for t in (layer.keys, layer.values)] == [
        t.data_ptr() for t in tensors]
    cache = qwen3.Qwen3Cache(TINY, 2, 20, device="cpu", dtype=torch.float32)
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match="cannot continue"):
        lm(prompt[:, :4], cache, start=4)  # nothing cached yet
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match="do not fit"):
        lm(torch.zeros(2, 24, dtype=torch.long), cache)
    with pytest.raises(InvalidArgumentError, match="even n_heads"):
        qwen3.config(ModelConfig(vocab=128, d_model=384, n_layers=1, n_heads=3, d_ff=128, max_seq=128))


def test_fsdp_defaults_quick_and_refusals():
    cfg = parse_args(["--trainer", "fsdp"])
    assert cfg.model == FSDP_MODEL and cfg.decode == "eager" and cfg.variants == ("ebbtide", "verl", "tms",
                                                                                 "cpu-offload")
    assert parse_args(["--trainer", "fsdp", "--quick"]).model == FSDP_QUICK
    assert parse_args(["--quick"]).decode == "cuda-graph"  # the other trainers' default is theirs
    assert parse_args(["--trainer", "fsdp", "--moments", "bf16", "--groups", "eager"]).moments == "bf16"
    for argv, msg in ((["--decode", "cuda-graph"], "decodes with eager forwards"),
                      (["--gpus", "2"], "runs on one GPU"),
                      (["--cache-trim", "step"], "--cache-trim is an option of --trainer megatron"),
                      (["--sync-fill", "after"], "--sync-fill is an option of --trainer megatron"),
                      (["--tp", "2", "--gpus", "2", "--device", "cpu", "--variants", "ebbtide"], "--tp"),
                      (["--device", "cpu", "--variants", "ebbtide,verl"], "runs the ebbtide variant only"),
                      (["--variants", "slime"], "variants must be distinct names"),
                      (["--n-heads", "3", "--d-model", "384"], "both even")):
        with pytest.raises(InvalidArgumentError, match=msg):
            parse_args(["--trainer", "fsdp", *argv])
    with pytest.raises(InvalidArgumentError, match="--comm-teardown is an option of --trainer megatron or fsdp"):
        RunConfig(comm_teardown="joined").validate()


def test_variants_refuse_what_they_cannot_run():
    from ebbtide.bench.colocate import fvariants
    from ebbtide.bench.colocate.sync import FsdpTrainerSync

    for name in ("verl", "tms", "cpu-offload"):  # their offloads and weight update are CUDA's
        with pytest.raises(RuntimeError, match="needs a GPU"):
            fvariants.variant(name, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="unknown variant"):
        fvariants.variant("slime", torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match="sync modes are 'ebbtide' and 'verl'"):
        FsdpTrainerSync(torch.nn.Linear(2, 2), "slime", device="cpu")
    with pytest.raises(InvalidArgumentError, match="needs a GPU"):
        FsdpTrainerSync(torch.nn.Linear(2, 2), "verl", device="cpu")


def test_the_rollout_keeps_the_buffers_no_sync_refills_out_of_the_weights_region():
    # transformers' rotary inv_freq is a buffer, not a parameter: the weights' region is paused with no copy, so
    # the rollout moves it out; it refuses a scratch setting that would discard it
    from ebbtide.bench.colocate.rollout import keep_buffers

    model = qwen3.Qwen3LM.random(TINY, seed=1)
    before = {n: (b.data_ptr(), b.clone()) for n, b in model.named_buffers()}
    assert any("inv_freq" in n for n in before), list(before)
    with pytest.raises(InvalidArgumentError, match="scratch-backup none"):
        keep_buffers(model, "none")
    assert {n: b.data_ptr() for n, b in model.named_buffers()} == {n: p for n, (p, _) in before.items()}
    keep_buffers(model, "keep")
    for n, b in model.named_buffers():
        assert b.data_ptr() != before[n][0] and torch.equal(b, before[n][1]), n
