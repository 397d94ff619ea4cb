"""ebbtide.quant.prepared on the GPU: the copy kernel moves exactly the segments' bytes (every size class and
alignment), and a replayed Fp8BucketQuant gives fp8_block_quant_into's bits, follows new values in place, rebuilds
on a new address and runs on another stream."""
from __future__ import annotations

import pytest
import torch

import ebbtide.quant as Q
from ebbtide.quant import Fp8BucketLayout, Fp8BucketQuant, SegmentCopy

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_segment_copy_every_size_and_alignment():
    chunk = Q._cuda._q().COPY_SEGMENT_CHUNK
    g = torch.Generator(device=DEV).manual_seed(0)
    n = 16 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV, generator=g)
    dst = torch.full((n,), 0x7B, dtype=torch.uint8, device=DEV)
    sizes = [1, 3, 15, 16, 17, 255, 4096, chunk - 1, chunk, chunk + 1, 3 * chunk + 5, 1_572_864, 2_000_003]
    spans, a = [], 0
    for i, size in enumerate(sizes * 3):
        shift = (0, 1, 8)[i // len(sizes)]  # 16-byte aligned, odd, 8-byte aligned starts
        a = (a + 15) // 16 * 16 + shift
        spans.append((a, a + 7 if shift == 1 else a, size))  # dst offset, src offset (misaligned pair too)
        a += size + 9
    assert a + 16 < n
    copy = SegmentCopy([dst[d:d + s] for d, _, s in spans], [src[o:o + s] for _, o, s in spans])
    copy()
    torch.cuda.synchronize()
    want = torch.full_like(dst, 0x7B)
    for d, o, s in spans:
        want[d:d + s] = src[o:o + s]
    bad = (dst != want).sum().item()
    assert bad == 0, f"{bad} wrong bytes"


def test_segment_copy_keeps_no_device_table_between_calls():
    """The device table is uploaded at every call and released after it (nothing of it stays on the device, where
    a pause could discard it): a copy made after the caching allocator handed the previous upload's block to
    someone who scribbled on it still copies right."""
    a = torch.randn(3000, 1000, device=DEV)
    b = torch.empty_like(a)
    copy = SegmentCopy(list(b.unbind(0)), list(a.unbind(0)))  # 3000 segments: a 96 KB table
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    copy()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # the upload went back to the pool
    junk = torch.full((3000 * 4,), -1, dtype=torch.int64, device=DEV)  # the table's size: its freed block
    b.zero_()
    copy()
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    del junk


def test_segment_copy_on_another_stream_and_repeated():
    a = torch.randn(1 << 20, device=DEV)
    b = torch.empty_like(a)
    copy = SegmentCopy([b[:1000], b[1000:]], [a[:1000], a[1000:]])
    s = torch.cuda.Stream()
    for k in range(3):
        a.mul_(2.0)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            copy()
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(a, b), k


@pytest.mark.parametrize("count", [50, 300])  # the table inside the launch / on the device
def test_fp8_bucket_quant_replays_bitwise(count):
    g = torch.Generator(device=DEV).manual_seed(count)
    shapes = [((768, 2048), (2048, 768), (129, 300), (256, 256))[i % 4] for i in range(count)]
    ts = [(torch.randn(s, device=DEV, generator=g) * 0.02).to(torch.bfloat16) for s in shapes]
    layout = Fp8BucketLayout.packed(shapes)
    buf_q = torch.empty(layout.q_bytes, dtype=torch.uint8, device=DEV)
    buf_s = torch.empty(layout.scale_bytes, dtype=torch.uint8, device=DEV)

    def want():
        q, s = torch.full_like(buf_q, 0x7B), torch.full_like(buf_s, 0x7B)  # padding bytes stay as they were
        Q.fp8_block_quant_into(ts, layout, q, s)
        return q, s

    run = Fp8BucketQuant(layout)
    stream = torch.cuda.Stream()
    tables = []
    for step in range(4):
        if step == 1:
            for t in ts:
                t.mul_(1.25)  # new values, same addresses: the kept table
        if step == 2:
            ts[count // 2] = ts[count // 2].clone()  # a new address: rebuilt
        buf_q.fill_(0x7B)
        buf_s.fill_(0x7B)
        if step == 3:  # another stream than the one the table was copied on
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run(ts, buf_q, buf_s)
            torch.cuda.current_stream().wait_stream(stream)
        else:
            run(ts, buf_q, buf_s)
        tables.append(run._table)
        q, s = want()
        assert torch.equal(buf_q, q) and torch.equal(buf_s, s), step
    # kept for new values and on another stream, rebuilt for the new address
    assert tables[1] is tables[0] and tables[2] is not tables[1] and tables[3] is tables[2]
    assert run._key[0][count // 2] == ts[count // 2].data_ptr()
