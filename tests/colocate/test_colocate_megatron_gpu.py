"""The colocated loop with a Megatron-core GPT on one GPU (``ebbtide colocate --trainer megatron
--quick``), one variant per test so each fits gpu-check's per-test deadline: ebbtide (the adapter, ebbtide.sync over
CUDA IPC, ebbtide.memory in the rollout; lazy and eager groups), slime (HDO + torch_memory_saver + the slime-style
update), slime-ebbtide (the same with ebbtide.compat.torch_memory_saver) and gpu-tms.
Each checks: the rollout holds the trainer's weights bit for bit after the sync and its logits match Megatron's
forward on them, no memory growth, memory handed over both ways, every phase timed, finite losses.
Megatron's DDP buffers and rotary embeddings allocate on the GPU, so these skip without CUDA."""
import importlib.util
import math

import pytest

torch = pytest.importorskip("torch")

from ebbtide.bench.colocate.config import MEGATRON_QUICK  # noqa: E402
from ebbtide.bench.colocate.measure import MEGATRON_PHASES  # noqa: E402

from colocate_cli import run_colocate  # noqa: E402  (this folder's)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="the Megatron loop needs CUDA (DDP grad buffers, rotary embeddings and CUDA IPC); no "
                              "CUDA GPU visible to torch"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


def _run(tmp_path, variant: str, *extra: str):
    name = "colocate-megatron-" + "-".join([variant, *(x.strip("-") for x in extra)])
    return run_colocate(tmp_path, name, ["--trainer", "megatron", "--quick", "--steps", "3", "--warmup", "1",
                                         "--variants", variant, "--timeout", "200", "--steady-guard", "warn", *extra])


def _used(summary: dict, phase: str, role: str):
    m = summary["memory"].get(phase, {})
    return m.get(f"{role}_nvml", m.get("device_used"))


def _check(res: dict, name: str, diag: str):
    v = res["variants"][name]
    assert v.get("summary"), f"{name}: {v.get('why')}\n{diag}"
    ck = v["checks"]
    assert ck["correct"] is True, f"{name}: {ck['verify']}\n{diag}"
    # two verified steps on every rank
    assert all(e["weights_bitwise_equal"] for e in ck["verify"]) and len(ck["verify"]) == 2 * len(v["ranks"]), \
        ck["verify"]
    assert ck["no_growth"] is True, f"{name}: {ck['growth']}\n{diag}"
    s = v["summary"]
    assert list(s["phase_s"]) == list(MEGATRON_PHASES), s["phase_s"]
    assert len(s["losses"]) == 3 and all(math.isfinite(x) for x in s["losses"]), s["losses"]
    # the memory changes hands: the trainer holds less once offloaded than after its optimizer step, the rollout
    # less after its pause than while generating
    assert _used(s, "offload", "trainer") < _used(s, "optimizer", "trainer"), (name, s["memory"])
    assert _used(s, "rollout_pause", "rollout") < _used(s, "generate", "rollout"), (name, s["memory"])
    return v


@pytest.mark.parametrize("groups,fill", [("lazy", "auto"), ("eager", "streamed"), ("used", "auto")])
def test_megatron_loop_ebbtide(tmp_path, groups, fill):
    p, res, diag = _run(tmp_path, "ebbtide", "--groups", groups, "--sync-fill", fill)
    assert p.returncode == 0, diag
    v = _check(res, "ebbtide", diag)
    setup = v["ranks"][0]["setup"]
    assert setup["optimizer"].startswith("EbbtideOptimizer") and setup["sync"] == "ebbtide", setup
    assert setup["groups"] == groups and setup["tp"] == setup["dp"] == 1, setup
    rel = [ph for ph in v["ranks"][0]["phases"] if ph["phase"] == "comm_release"]
    assert rel and "release" in rel[0]["report"]
    # the update opened beside the CPU step (the push only joined it); the offload says where its time went
    syncs = [ph for ph in v["ranks"][0]["phases"] if ph["phase"] == "sync"]
    assert syncs and all("open_s" in ph and "fill_s" in ph and ph["apply_s"] > 0 for ph in syncs), syncs
    # "auto" fills after the step; "streamed" fills each tensor while the CPU step uploads it
    assert setup["sync_fill"] == ("streamed" if fill == "streamed" else "after"), setup
    assert all((ph.get("streamed", 0) > 0) == (fill == "streamed") for ph in syncs), syncs
    offs = [ph for ph in v["ranks"][0]["phases"] if ph["phase"] == "offload"]
    assert offs and all("empty_cache_s" in ph for ph in offs), offs


@pytest.mark.parametrize("variant", ["slime", "slime-ebbtide", "gpu-tms"])
def test_megatron_loop_anchor(tmp_path, variant):
    if variant != "slime-ebbtide" and importlib.util.find_spec("torch_memory_saver") is None:
        pytest.skip("torch_memory_saver is not installed (scripts/fetch-anchor-wheels)")
    p, res, diag = _run(tmp_path, variant)
    assert p.returncode == 0, diag
    v = _check(res, variant, diag)
    setup = v["ranks"][0]["setup"]
    assert setup["sync"] == "slime" and setup["groups"] == "lazy" and setup["nccl_cumem"] == "off", setup
    assert (setup["rollout"]["hook_mode"] == "ebbtide-compat-torch") == (variant == "slime-ebbtide"), setup
    want = "HybridDeviceOptimizer" if variant.startswith("slime") else "Adam"
    assert want in setup["optimizer"], setup


# ---- 2 GPUs: tensor parallel and data parallel (the distributed optimizer) -----------------------------------
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host")
@pytest.mark.parametrize("tp", [2, 1])
@pytest.mark.parametrize("variant", ["ebbtide", "slime"])
def test_megatron_loop_two_gpus(tmp_path, tp, variant):
    """TP=2 (split tensors gathered for the rollout on each GPU) and DP=2 (ebbtide's distributed optimizer, each
    rank's host state its shard): every rank's rollout bit-equal to the weights, both ranks' weights the same."""
    if variant == "slime" and importlib.util.find_spec("torch_memory_saver") is None:
        pytest.skip("torch_memory_saver is not installed (scripts/fetch-anchor-wheels)")
    p, res, diag = _run(tmp_path, variant, "--gpus", "2", "--tp", str(tp))
    assert p.returncode == 0, diag
    v = _check(res, variant, diag)
    assert v["checks"]["ranks_in_sync"] is True, v["checks"]["verify"]
    assert len(v["ranks"]) == 2 and {r["setup"]["tp"] for r in v["ranks"]} == {tp}, [r["setup"] for r in v["ranks"]]
    setup = v["ranks"][0]["setup"]
    if variant == "ebbtide":
        sharded = tp == 1  # DP=2
        assert setup["optimizer"].startswith("EbbtideDistributedOptimizer" if sharded else "EbbtideOptimizer"), setup
        # DP=2: half the model's parameters stepped per rank; TP=2: this rank's pieces, fewer than the whole model
        half = setup["params_stepped"] * 2 == setup["params"]
        assert half if sharded else setup["params_stepped"] < setup["params"], setup


# ---- MoE: the same loop on a Megatron MoE GPT, expert parallel over two GPUs ---------------------------------
def _check_moe(v, experts: int, ep: int, d_model: int, d_ff: int, layers: int):
    setup = v["ranks"][0]["setup"]
    assert setup["moe"] == {"experts": experts, "topk": 2} and setup["ep"] == ep, setup
    # each rank steps its own experts whole (expert-DP = world / ep = 1) and half the dense params (DP = 2)
    local_experts = layers * (experts // ep) * (2 * d_model * d_ff + d_ff + d_model)  # fc1, fc2 and their biases
    dense = setup["params"] - ep * local_experts
    assert dense > 0 and setup["params_stepped"] == dense // 2 + local_experts, (setup, local_experts)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host")
@pytest.mark.parametrize("variant", ["ebbtide", "slime"])
def test_megatron_moe_loop_expert_parallel_two_gpus(tmp_path, variant):
    """EP=2: each rank trains half the experts, gathers the others for its own rollout (the whole model, bit-equal
    on both ranks' rollouts)."""
    if variant == "slime" and importlib.util.find_spec("torch_memory_saver") is None:
        pytest.skip("torch_memory_saver is not installed (scripts/fetch-anchor-wheels)")
    p, res, diag = _run(tmp_path, variant, "--gpus", "2", "--ep", "2", "--moe-experts", "4", "--d-ff", "1024")
    assert p.returncode == 0, diag
    v = _check(res, variant, diag)
    assert v["checks"]["ranks_in_sync"] is True, v["checks"]["verify"]
    q = MEGATRON_QUICK
    _check_moe(v, 4, 2, q.d_model, 1024, q.n_layers)
