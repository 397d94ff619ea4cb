"""A Megatron-core GPT's weights as the rollout takes them, at TP=2 on CPU (Gloo) against the same GPT at TP=1
(scenarios in megatron_weights_workers.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("megatron.core")

import megatron_spawn as _spawn  # noqa: E402


def test_tp2_full_weights_and_each_rank_sends_equal_tp1():
    (one,) = _spawn.run("weights", 1, module="megatron_weights_workers", timeout=240, tp=1)
    assert one["dims"] == {}
    two = _spawn.run("weights", 2, module="megatron_weights_workers", timeout=240, tp=2)
    for r in two:
        # fused QKV and fc1 (column), proj and fc2 (row), the embedding and output layer (vocabulary) are split
        assert {d for d in r["dims"].values()} == {0, 1}, r["dims"]
        assert any("linear_qkv.weight" in n for n in r["dims"]) and any("linear_proj.weight" in n for n in r["dims"])
        assert r["digests"] == one["digests"]  # gathered at TP=2 == the TP=1 model, bit for bit
        assert r["sent_equal"] and r["sent"] == len(one["digests"]) and r["fp8_items"] > 0, r


def test_distributed_optimizer_host_mirror_rebuilds_the_weights_bitwise():
    res = _spawn.run("shard_mirror", 2, module="megatron_weights_workers", timeout=240)
    assert all(len(r["losses"]) == 4 and r["owned_written"] for r in res), res
