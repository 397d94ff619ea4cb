"""The Megatron optimizer adapter on CPU tensors (Gloo, 2 data-parallel ranks): exact equality with torch AdamW on
fp32 masters under Megatron's param groups and clipping, state_dict round trips with Megatron's own Float16
optimizer code, and the refusals. The model-level path (DDP buffers, a GPT) needs CUDA: test_megatron_gpu.py."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("megatron.core.optimizer")

from ebbtide.testing import spawn  # noqa: E402

M = "megatron_opt_workers"


def test_exact_steps_with_and_without_clipping():
    res = spawn.ranks("exact_steps", 2, module=M, timeout=150)
    assert res[0]["clip0.05"] == res[1]["clip0.05"]  # the norm is summed over ranks' identical grads
    assert len(res[0]["clip0.05"]) == 4 and all(n > 0.05 for n in res[0]["clip0.05"])  # clipping was active


def test_state_dict_round_trips_with_megatron():
    res = spawn.ranks("state_dicts", 2, module=M, timeout=150)
    assert all("masters" in r["refused"] for r in res)


def test_precision_aware_bf16_moments():
    res = spawn.ranks("bf16_moments", 2, module=M, timeout=150)
    assert all(r["steps"] == 3 for r in res)


def test_refused_configs():
    res = spawn.ranks("bad_configs", 1, module=M, timeout=150)
    r = res[0]
    assert "build both the same way" in r["use_distributed_optimizer"]
    assert "both moments fp32 or both bf16" in r["exp_avg_dtype"]
    assert "fp32 master weights" in r["main_params_dtype"]
    assert "bf16" in r["fp32 params"]
    assert "2 model chunk(s)" in r["pipeline interleaving"]
    assert "fp8_param=True" in r["fp8='hybrid'"]  # every refused field named at once
    assert "GPU" in r["training_state"] or "DistributedDataParallel" in r["training_state"]
