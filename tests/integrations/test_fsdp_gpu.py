"""The FSDP2 adapter on one GPU (NCCL, world 1), a transformers Qwen3 as verl builds it (fp32 shards, bf16 compute,
torch's fused AdamW): offload/restore with the groups released and reloaded every step, bit-identical losses,
addresses kept, the memory back with the driver; the weight sync over CUDA IPC into a rollout process, bit for bit
(bf16 and FP8). CPU runs of the logic: test_fsdp_cpu.py."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ebbtide.testing import spawn  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FSDP2 over NCCL)")]


def _record(name, res):
    out = os.environ.get("EBBTIDE_TEST_ARTIFACTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"fsdp-{name}.json"), "w") as f:
            json.dump(res, f, indent=1)


def test_offload_restore_with_groups_released_every_step_is_bit_identical_and_frees_the_memory():
    res = spawn.ranks("offload_cycles", 1, module="fsdp_gpu_workers", timeout=400, steps=10)
    _record("offload-cycles", res)
    reps = res[0]["reports"]
    assert len(reps) == 10 and all(r["freed"] >= 0.9 * r["bytes"] for r in reps), reps


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_weights_over_cuda_ipc_equal_the_gathered_weights_bit_for_bit(fp8):
    res = spawn.ranks("ipc_sync", 1, module="fsdp_gpu_workers", timeout=400, versions=5, fp8=fp8)
    _record(f"ipc-{'fp8' if fp8 else 'bf16'}", res)
    assert res[0]["exit"] == 0 and res[0]["buckets"] >= 2, res


def test_sharded_adam_exact_equals_fsdp2s_cpu_adamw_over_20_steps_with_offload_and_groups_released():
    pytest.importorskip("ebbtide.optim.sharded")
    res = spawn.ranks("exact_sharded_adam", 1, module="fsdp_gpu_workers", timeout=400, steps=20)
    _record("exact", res)
    assert len(res[0]["losses"]) == 20, res
