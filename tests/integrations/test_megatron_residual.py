"""largest_live_blocks: what TrainingState.residual_blocks reads out of torch.cuda.memory_snapshot() (CPU: a
snapshot in torch's format; the GPU path is the colocated loop's offload record)."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ebbtide.integrations.megatron._memory import largest_live_blocks  # noqa: E402


def _seg(pool, *blocks):
    return {"device": 0, "segment_pool_id": pool, "total_size": sum(b[0] for b in blocks),
            "blocks": [{"size": n, "state": st, "frames": fr} for n, st, fr in blocks]}


def test_only_live_blocks_of_the_default_pool_largest_first():
    frame = [{"filename": "mtrainer.py", "line": 7, "name": "_step"}] * 9
    snap = [
        _seg((0, 0), (512 << 20, "active_allocated", frame), (64 << 20, "inactive", [])),
        _seg((1, 3), (2 << 30, "active_allocated", [])),  # a tag's private pool: never the residual
        _seg((0, 0), (2 << 20, "active_allocated", []), (96 << 20, "active_pending_free", []),
             (128 << 20, "active_allocated", [])),
    ]
    got = largest_live_blocks(snap, top=2)
    assert [b["bytes"] for b in got] == [512 << 20, 128 << 20]
    assert got[0]["frames"] == ["mtrainer.py:7 _step"] * 6 and got[1]["frames"] == []
    assert [b["bytes"] for b in largest_live_blocks(snap, top=8)] == [512 << 20, 128 << 20, 2 << 20]
    assert largest_live_blocks([], top=3) == [] and largest_live_blocks(snap, top=0) == []
