"""``torch.cuda.memory_snapshot()`` read one way, the package's one parser of it: segments (address, size, pool,
expandable, device) and their blocks (each block's address: its own "address" field where the snapshot has one,
else its segment's plus the sizes of the blocks before it), plus the two summaries the diagnostics print: the
largest live blocks of torch's default pool and the largest segments they keep. Pure Python over the snapshot's
dicts (no torch import), so it is tested on a CPU with snapshots in torch's format.

Used by ``memory.release_report`` (PyTorch segments outside paused memory), ``memory.check`` (live blocks inside
paused ranges) and ``integrations.megatron.TrainingState.residual_blocks`` / ``residual_segments`` (what an offload
left in torch's default pool)."""
from __future__ import annotations

import dataclasses

__all__ = ["Block", "Segment", "segments", "largest_live_blocks", "largest_segments", "DEFAULT_POOL"]

DEFAULT_POOL = (0, 0)  # torch's default pool; ebbtide's tags and CUDA graphs live in private pools


@dataclasses.dataclass(frozen=True)
class Block:
    address: int
    size: int
    state: str  # "active_allocated", "active_pending_free", "inactive"
    frames: tuple  # the allocating frames, where memory history was recorded

    @property
    def live(self) -> bool:
        return self.state == "active_allocated"


@dataclasses.dataclass(frozen=True)
class Segment:
    address: int
    size: int  # total_size (the blocks' sum where the snapshot does not say)
    allocated: int  # allocated_size (the live blocks' sum where the snapshot does not say)
    pool: tuple  # segment_pool_id
    type: str | None  # segment_type: "large" / "small"
    expandable: bool
    device: int | None
    blocks: tuple

    @property
    def live(self) -> list:
        return [b for b in self.blocks if b.live]

    @property
    def live_bytes(self) -> int:
        return sum(b.size for b in self.live)


def segments(snapshot: list) -> list:
    """Every segment of ``snapshot`` (``torch.cuda.memory_snapshot()``'s list) as a ``Segment``."""
    out = []
    for seg in snapshot:
        addr = int(seg.get("address", 0))
        blocks = []
        for blk in seg.get("blocks", ()):
            addr = int(blk.get("address", addr))
            blocks.append(Block(address=addr, size=int(blk["size"]), state=blk.get("state", ""),
                                frames=tuple(blk.get("frames", ()))))
            addr += int(blk["size"])
        total = seg.get("total_size")
        allocated = seg.get("allocated_size")
        out.append(Segment(address=int(seg.get("address", 0)),
                           size=int(total) if total is not None else sum(b.size for b in blocks),
                           allocated=int(allocated) if allocated is not None else sum(b.size for b in blocks
                                                                                       if b.live),
                           pool=tuple(seg.get("segment_pool_id", DEFAULT_POOL)), type=seg.get("segment_type"),
                           expandable=bool(seg.get("is_expandable", False)), device=seg.get("device"),
                           blocks=tuple(blocks)))
    return out


def _frames(block: Block) -> list:
    """A block's allocating frames, ``"file:line name"``: its Python frames where memory history recorded any (the
    C++ ones are the allocator's own), else its innermost frames; six at most."""
    py = [f for f in block.frames if str(f.get("filename", "")).endswith(".py")]
    return [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" for f in (py or block.frames)[:6]]


def largest_live_blocks(snapshot: list, top: int = 8) -> list:
    """The ``top`` largest allocated blocks of the default pool, largest first, each with its segment's size and
    live bytes (``segment_bytes``, ``segment_live_bytes``): a small block alone in a large segment holds the whole
    segment reserved (the caching allocator frees whole segments only)."""
    found = []
    for seg in segments(snapshot):
        if seg.pool != DEFAULT_POOL:
            continue
        for blk in seg.live:
            found.append({"bytes": blk.size, "segment_bytes": seg.size, "segment_live_bytes": seg.live_bytes,
                          "frames": _frames(blk)})
    found.sort(key=lambda b: (-b["bytes"], -b["segment_bytes"]))
    return found[:max(0, int(top))]


def largest_segments(snapshot: list, top: int = 4) -> list:
    """The ``top`` largest segments of the default pool that hold a live block, largest first: ``{"segment_bytes",
    "live_bytes", "live_blocks", "frames"}`` (frames: its largest live block's). A segment far larger than its live
    bytes is reserved by what lives in it, not by its size."""
    found = []
    for seg in segments(snapshot):
        live = sorted(seg.live, key=lambda b: -b.size)
        if seg.pool != DEFAULT_POOL or not live:
            continue
        found.append({"segment_bytes": seg.size, "live_bytes": seg.live_bytes, "live_blocks": len(live),
                      "frames": _frames(live[0])})
    found.sort(key=lambda s: -s["segment_bytes"])
    return found[:max(0, int(top))]
