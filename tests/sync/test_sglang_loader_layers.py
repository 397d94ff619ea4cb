"""ebbtide's loader behind SGLang 0.5.23's own layers (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear, ReplicatedLinear, FusedMoE and their weight_loaders, under SGLang's own Qwen3-MoE load_weights),
each run in a fresh process (sglang_layers_worker.main): after every one of 20 updates the parameters equal, bit for
bit, what SGLang's own path writes for slime's flattened-bucket request of the same buckets; bf16, FP8 with fp32
scales and FP8 with UE8M0 scales (weight_scale_inv); TP=1 and the rank-1 shard of TP=2. Skipped with the reason
where SGLang's layers do not import (.ci/run installs them)."""
import importlib.util
import os

import pytest

from ebbtide.testing import spawn

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tp_size, tp_rank, updates, form):
    try:
        return spawn.call("main", tp_size, tp_rank, updates, form, module="sglang_layers_worker", path=[HERE],
                          timeout=600)
    except spawn.WorkerFailed as e:
        tail = str(e)[-3000:]
        if "ModuleNotFoundError" in tail or "ImportError" in tail:
            pytest.skip(f"SGLang's layers do not import here (.ci/run installs their dependencies): {e.brief}")
        raise


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="sglang 0.5.23 is not installed here; .ci/run installs it")
@pytest.mark.parametrize("tp_size,tp_rank,form", [(1, 0, "bf16"), (2, 1, "bf16"), (1, 0, "fp8"), (2, 1, "fp8"),
                                                  (2, 1, "fp8-ue8m0")])
def test_replay_equals_sglangs_own_placement_20_updates(tp_size, tp_rank, form):
    r = _run(tp_size, tp_rank, 20, form)
    assert r["ok"], r["why"]
    assert r["recorded"] == r["buckets"] and r["replayed"] == 19 * r["buckets"], r
    assert r["fallback"] == [], r  # every SGLang loader here only places bytes, FP8 scales included
    assert r["kinds"] == (["fp8", "raw"] if form != "bf16" else ["raw"]), r
    qkv = "model.layers.0.self_attn.qkv_proj."
    if form != "bf16":
        assert r["params"][qkv + "weight"][1] == "torch.float8_e4m3fn", r["params"][qkv + "weight"]
        assert r["params"][qkv + "weight_scale_inv"][1] == "torch.float32"
    if tp_size == 2:  # the rank's shard along the input dimension
        assert r["params"]["model.layers.0.mlp.down_proj.weight"][0] == [256, 1024]
