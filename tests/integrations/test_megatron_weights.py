"""A Megatron-core GPT's weights as the rollout takes them, at TP=2 on CPU (Gloo) against the same GPT at TP=1
(scenarios in megatron_weights_workers.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("megatron.core")

from ebbtide.testing import spawn  # noqa: E402


def test_tp2_full_weights_and_each_rank_sends_equal_tp1():
    (one,) = spawn.ranks("weights", 1, module="megatron_weights_workers", timeout=240, tp=1)
    assert one["dims"] == {}
    two = spawn.ranks("weights", 2, module="megatron_weights_workers", timeout=240, tp=2)
    for r in two:
        # fused QKV and fc1 (column), proj and fc2 (row), the embedding and output layer (vocabulary) are split
        assert {d for d in r["dims"].values()} == {0, 1}, r["dims"]
        assert any("linear_qkv.weight" in n for n in r["dims"]) and any("linear_proj.weight" in n for n in r["dims"])
        assert r["digests"] == one["digests"]  # gathered at TP=2 == the TP=1 model, bit for bit
        assert r["sent_equal"] and r["sent"] == len(one["digests"]) and r["fp8_items"] > 0, r


def test_distributed_optimizer_host_mirror_rebuilds_the_weights_bitwise():
    res = spawn.ranks("shard_mirror", 2, module="megatron_weights_workers", timeout=240)
    assert all(len(r["losses"]) == 4 and r["owned_written"] for r in res), res


def test_ep2_full_weights_hold_every_expert_and_serve_megatrons_forward():
    res = spawn.ranks("ep_weights", 2, module="megatron_weights_workers", timeout=240)
    experts, layers, per_expert = 4, 2, 4  # fc1 and fc2, weight and bias
    for r in res:
        assert r["local_experts"] == layers * (experts // 2) * per_expert, r["local_experts"]
        assert r["names_equal"], r  # the EP=1 names of the rollout's MoE model
        assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["max_abs_logit"]), r  # rollout == Megatron's EP=2 forward
        assert r["sent_equal"], r  # and through ebbtide.sync to each rank's own engine
        assert r["sources_match_names"] and r["buckets"] > 4 and r["sent_per_bucket_equal"], r  # gathered per bucket
    assert res[0]["digests"] == res[1]["digests"]  # both ranks hold the whole model
    owned = {**res[0]["local_digests"], **res[1]["local_digests"]}
    assert len(owned) == layers * experts * per_expert  # each global expert from exactly one rank
    assert all(res[0]["digests"][n] == d for n, d in owned.items())  # ... and gathered bit for bit


def test_tp2_with_whole_experts_gathers_the_rest_and_leaves_the_experts():
    res = spawn.ranks("tp_moe_weights", 2, module="megatron_weights_workers", timeout=240)
    for r in res:
        assert r["experts_in_dims"] == [] and r["split"] > 0, r
        assert r["fc1_shape"] == r["want_fc1"] and r["qkv_rows"] == r["want_qkv_rows"], r
    assert res[0]["experts"] == res[1]["experts"]  # whole experts, the same on both TP ranks
