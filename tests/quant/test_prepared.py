"""ebbtide.quant.prepared on CPU: Fp8BucketQuant gives fp8_block_quant_into's bits, SegmentCopy copies every byte
and nothing else, the native copy launcher validates its table before any CUDA call, and bad input is a typed
error. The CUDA launches are tests/quant/test_prepared_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ebbtide.quant as Q
from ebbtide.errors import InvalidArgumentError
from ebbtide.quant import Fp8BucketLayout, Fp8BucketQuant, SegmentCopy
from quant_oracle import heavy_tailed


def test_fp8_bucket_quant_gives_each_tensors_block_quant():
    shapes = [(128, 256), (130, 200), (64, 128)]
    ts = [heavy_tailed(s, seed=i) for i, s in enumerate(shapes)]
    layout = Fp8BucketLayout.packed(shapes)
    run = Fp8BucketQuant(layout)
    for _ in range(2):
        q_buf = torch.zeros(layout.q_bytes, dtype=torch.uint8)
        s_buf = torch.zeros(layout.scale_bytes, dtype=torch.uint8)
        run(ts, q_buf, s_buf)
        qs, ss = layout.views(q_buf, s_buf)
        for t, q, s in zip(ts, qs, ss):  # the oracle, one tensor at a time
            qr, sr = Q.reference.fp8_block_quant(t)
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_fp8_bucket_quant_refuses_what_is_not_a_list_of_tensors():
    layout = Fp8BucketLayout.packed([(128, 128)])
    run = Fp8BucketQuant(layout)
    q, s = torch.zeros(layout.q_bytes, dtype=torch.uint8), torch.zeros(layout.scale_bytes, dtype=torch.uint8)
    for bad in (torch.zeros(128, 128, dtype=torch.bfloat16), None, ["x"]):
        with pytest.raises(InvalidArgumentError, match="tensors"):
            run(bad, q, s)
    w = [torch.zeros(128, 128, dtype=torch.bfloat16)]
    for qb, sb, what in ((None, s, "q_buffer"), (q, q.numpy(), "scale_buffer"), (q.view(2, -1), s, "q_buffer")):
        with pytest.raises(InvalidArgumentError, match=what):
            run(w, qb, sb)


@pytest.mark.parametrize("make, match", [
    (lambda: Fp8BucketQuant("not a layout"), "Fp8BucketLayout"),
    (lambda: Fp8BucketQuant(Fp8BucketLayout.packed([(128, 128)]), scale="ue8m0_packed"), "scale"),
    (lambda: Fp8BucketQuant(Fp8BucketLayout.packed([(128, 128)]), eps=-1.0), "eps"),
])
def test_fp8_bucket_quant_bad_arguments(make, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def test_fp8_bucket_quant_checks_its_tensors():
    layout = Fp8BucketLayout.packed([(128, 128)])
    run = Fp8BucketQuant(layout)
    q, s = torch.zeros(layout.q_bytes, dtype=torch.uint8), torch.zeros(layout.scale_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="shape"):
        run([torch.zeros(128, 256, dtype=torch.bfloat16)], q, s)
    assert not q.any() and not s.any()  # refused before anything was written


def test_fp8_bucket_quant_keeps_its_table_only_for_the_same_tensors():
    """The replay check (what a CUDA call compares before reusing its table) on CPU tensors."""
    base = torch.zeros(256 * 256, dtype=torch.bfloat16)
    a, b = base[:128 * 256].view(128, 256), torch.zeros(256, 128, dtype=torch.bfloat16)
    run = Fp8BucketQuant(Fp8BucketLayout.packed([(128, 256), (256, 128)]))
    run._remember([a, b], (1, 64, 2, 8))
    assert run._matches([a, b], (1, 64, 2, 8))
    assert run._matches([a.view(128, 256), b], (1, 64, 2, 8))  # another view object, same everything
    assert not run._matches([a, b], (1, 64, 3, 8))  # another buffer
    assert not run._matches([a, b], (1, 32, 2, 8))  # a smaller buffer at the same address
    assert not run._matches([a.clone(), b], (1, 64, 2, 8))  # another address
    assert not run._matches([a, b.t().contiguous().t()], (1, 64, 2, 8))  # same shape, other strides
    assert not run._matches([base[:128 * 256].view(256, 128), b], (1, 64, 2, 8))  # same address, other shape
    assert not run._matches([a.view(torch.float16), b], (1, 64, 2, 8))  # same bytes, other dtype
    assert not run._matches([a, "b"], (1, 64, 2, 8)) and not run._matches([a], (1, 64, 2, 8))
    # same address, row pitch and element count, fewer columns: x[:128] vs x[:, :128]
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    run1 = Fp8BucketQuant(Fp8BucketLayout.packed([(128, 256)]))
    run1._remember([x[:128]], (1, 64, 2, 8))
    assert run1._matches([x[:128]], (1, 64, 2, 8))
    assert not run1._matches([x[:, :128]], (1, 64, 2, 8))
    wide = torch.zeros(128, 300, dtype=torch.bfloat16)
    run2 = Fp8BucketQuant(Fp8BucketLayout.packed([(128, 256)]))
    run2._remember([wide[:, :256]], (1, 64, 2, 8))  # rows not contiguous
    assert run2._matches([wide[:, :256]], (1, 64, 2, 8))
    assert not run2._matches([wide.view(-1)[:128 * 300].as_strided((64, 512), (300, 1))], (1, 64, 2, 8))


def test_segment_copy_copies_exactly_the_segments():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    dst = torch.full((5000,), 0x7B, dtype=torch.uint8)
    spans = [(0, 1), (3, 17), (100, 1000), (1111, 3333), (4999, 1)]
    copy = SegmentCopy([dst[a:a + n] for a, n in spans], [src[a:a + n] for a, n in spans])
    assert copy.count == len(spans) and copy.nbytes == sum(n for _, n in spans)
    copy()
    mask = torch.zeros(5000, dtype=torch.bool)
    for a, n in spans:
        mask[a:a + n] = True
    assert torch.equal(dst[mask], src[mask]) and bool((dst[~mask] == 0x7B).all())


def test_segment_copy_moves_bytes_between_dtypes():
    a = torch.randn(6, dtype=torch.float32)
    b = torch.zeros(12, dtype=torch.bfloat16)  # same 24 bytes, other dtype
    SegmentCopy([b], [a])()
    assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))


def test_segment_copy_refuses_overlaps():
    buf = torch.zeros(1000, dtype=torch.uint8)
    src = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="destinations overlap"):
        SegmentCopy([buf[0:100], buf[50:150]], [src[0:100], src[200:300]])
    with pytest.raises(InvalidArgumentError, match="overlaps segment 1's source"):
        SegmentCopy([buf[0:100], buf[500:600]], [src[0:100], buf[50:150]])
    with pytest.raises(InvalidArgumentError, match="overlaps segment 0's source"):
        SegmentCopy([buf[0:100]], [buf[99:199]])
    SegmentCopy([buf[0:100], buf[100:200]], [buf[200:300], buf[300:400]])()  # touching ranges are fine


@pytest.mark.parametrize("dsts, srcs, match", [
    ([], [], "at least one"),
    ([torch.zeros(4)], [], "equally many"),
    ([torch.zeros(4)], [torch.zeros(5)], "bytes"),
    ([torch.zeros(0)], [torch.zeros(0)], "bytes"),
    ([torch.zeros(4, 4).t()], [torch.zeros(4, 4)], "contiguous"),
    (["x"], [torch.zeros(4)], "tensors"),
])
def test_segment_copy_bad_arguments(dsts, srcs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SegmentCopy(dsts, srcs)


def test_native_copy_launcher_validates_before_launching(native):
    C = native
    if not C.quant.WITH_CUDA:
        pytest.skip("built without CUDA: every quant launcher raises UnsupportedError")
    chunk = C.quant.COPY_SEGMENT_CHUNK
    # no device table (0): the entries are checked first, and a launcher that skipped them would still stop there
    # instead of launching on a made-up address
    call = lambda t: C.quant.copy_segments(host_segments=t.ctypes.data, device_segments=0, count=len(t), stream=0)  # noqa: E731
    table = np.array([[16, 32, chunk + 1, 0], [64, 128, 8, 1]], dtype=np.int64)  # 2 chunks, then 1: prefix 2
    with pytest.raises(InvalidArgumentError, match="prefix"):
        call(table)
    table[1, 3], table[1, 2] = 2, 0
    with pytest.raises(InvalidArgumentError, match="at least 1"):
        call(table)
    table[1, 2], table[1, 0] = 8, 0
    with pytest.raises(InvalidArgumentError, match="null pointer"):
        call(table)
    table[1, 0] = 64
    with pytest.raises(InvalidArgumentError, match="too many chunks"):
        call(np.array([[16, 32, 1 << 62, 0], [64, 128, 1 << 62, 1 << 47]], dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="null device segment table"):
        call(table)  # a valid table: only the missing device copy is left to refuse
    top = (1 << 31) - 1  # the most chunks one launch takes
    edge = np.array([[16, 32, (top - 1) * chunk, 0], [64, 128, chunk, top - 1]], dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match="null device segment table"):
        call(edge)  # exactly 2^31 - 1 chunks: accepted
    edge[1, 2] = chunk + 1
    with pytest.raises(InvalidArgumentError, match="too many chunks at segment 1"):
        call(edge)


def test_segment_table_prefix_sums():
    from ebbtide.quant import _cuda
    try:
        chunk = _cuda._q().COPY_SEGMENT_CHUNK
    except Exception as e:  # noqa: BLE001  (no CUDA build: nothing to check)
        pytest.skip(f"quant kernels not built: {e}")
    d = [torch.zeros(n, dtype=torch.uint8) for n in (1, chunk, chunk + 1, 7)]
    s = [torch.zeros_like(t) for t in d]
    table = _cuda.segment_table(d, s).view(-1, 4)
    assert table[:, 2].tolist() == [1, chunk, chunk + 1, 7]
    assert table[:, 3].tolist() == [0, 1, 2, 4]
    assert table[:, 0].tolist() == [t.data_ptr() for t in d] and table[:, 1].tolist() == [t.data_ptr() for t in s]
