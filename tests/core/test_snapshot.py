"""The one parser of torch.cuda.memory_snapshot() (``ebbtide._snapshot``): segments and block addresses (what
release_report and the paused-block checker read) and largest_live_blocks / largest_segments (what
TrainingState.residual_blocks / residual_segments return). CPU: snapshots in torch's format; the GPU paths are the
memory tests' and the colocated loop's offload record."""
from ebbtide._snapshot import DEFAULT_POOL, largest_live_blocks, largest_segments, segments


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
    got = largest_live_blocks(snap, top=1)[0]
    assert got["segment_bytes"] == (512 + 64) << 20 and got["segment_live_bytes"] == 512 << 20


def test_segments_kept_by_small_live_blocks_largest_first():
    frame = [{"filename": "loss.py", "line": 3, "name": "f"}]
    snap = [
        _seg((0, 0), (2 << 20, "active_allocated", frame), (610 << 20, "inactive", []), (512, "active_allocated", [])),
        _seg((0, 0), (20 << 20, "active_allocated", [])),
        _seg((0, 0), (8 << 20, "inactive", [])),  # nothing live: freed by empty_cache, not the residual
        _seg((2, 1), (1 << 30, "active_allocated", [])),  # a tag's pool
    ]
    got = largest_segments(snap, top=4)
    assert [s["segment_bytes"] for s in got] == [(612 << 20) + 512, 20 << 20]
    assert got[0]["live_bytes"] == (2 << 20) + 512 and got[0]["live_blocks"] == 2
    assert got[0]["frames"] == ["loss.py:3 f"]
    assert largest_segments(snap, top=1) == got[:1] and largest_segments([], top=2) == []


def test_python_frames_first_where_recorded():
    cpp = [{"filename": "CUDACachingAllocator.cpp", "line": 0, "name": "malloc"}] * 7
    py = [{"filename": "torch/nn/functional.py", "line": 12, "name": "linear"}]
    snap = [_seg((0, 0), (32 << 20, "active_allocated", cpp + py)), _seg((0, 0), (4 << 20, "active_allocated", cpp))]
    got = largest_live_blocks(snap, top=2)
    assert got[0]["frames"] == ["torch/nn/functional.py:12 linear"]
    assert got[1]["frames"] == ["CUDACachingAllocator.cpp:0 malloc"] * 6  # no Python frame: the innermost
    assert largest_segments(snap, top=1)[0]["frames"] == ["torch/nn/functional.py:12 linear"]


def test_segments_give_each_block_its_address_and_default_what_the_snapshot_omits():
    snap = [{"address": 0x1000, "total_size": 0x300, "allocated_size": 0x100, "segment_pool_id": (1, 2),
             "segment_type": "small", "is_expandable": True, "device": 1,
             "blocks": [{"size": 0x100, "state": "active_allocated"}, {"size": 0x80, "state": "inactive"},
                        {"address": 0x1200, "size": 0x100, "state": "active_pending_free"}]},
            {"address": 0x9000, "blocks": [{"size": 64, "state": "active_allocated"},
                                           {"size": 32, "state": "active_allocated"}]}]
    a, b = segments(snap)
    assert [blk.address for blk in a.blocks] == [0x1000, 0x1100, 0x1200]  # own "address" field wins
    assert (a.size, a.allocated, a.pool, a.type, a.expandable, a.device) == (0x300, 0x100, (1, 2), "small", True, 1)
    assert [blk.size for blk in a.live] == [0x100] and a.live_bytes == 0x100
    assert [blk.address for blk in b.blocks] == [0x9000, 0x9040]
    assert (b.size, b.allocated, b.pool, b.device, b.expandable) == (96, 96, DEFAULT_POOL, None, False)
    assert segments([]) == []
