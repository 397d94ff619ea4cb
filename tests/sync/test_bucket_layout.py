"""The FP8 bucket layout (ebbtide.quant.layout): one definition, used by the list quantizer and by weight sync."""
import pytest
import torch

import ebbtide.quant as Q
from ebbtide.errors import InvalidArgumentError
from ebbtide.quant.layout import Fp8BucketLayout, block_grid, scale_shape

SHAPES = [(128, 256), (300, 200), (7, 1000), (256, 128)]


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]


def test_packed_layout_offsets():
    lay = Fp8BucketLayout.packed(SHAPES)
    qo = [e[0] for e in lay.entries]
    assert qo == [0, 32768, 32768 + 60000, 32768 + 60000 + 7008]  # 16-byte aligned, back to back
    assert [e[1] for e in lay.entries] == [0, 8, 32, 64]  # 2, 6, 8, 2 fp32 block scales, back to back
    assert lay.tile_begin == (0, 2, 8, 16) and lay.tiles == 18 and lay.scale_bytes == 72
    assert block_grid(300, 200) == (3, 2) and scale_shape((4, 300, 200)) == (4, 3, 2)
    assert Fp8BucketLayout.packed(SHAPES) is lay  # cached: the same shapes every update


def test_list_quantizer_uses_the_layout():
    ws = _weights()
    b = Q.fp8_block_quant_list(ws)
    lay = Fp8BucketLayout.packed(SHAPES)
    assert b.layout == lay
    assert b.q_buffer.numel() == lay.q_bytes and 4 * b.scale_buffer.numel() == lay.scale_bytes
    for w, (q, s) in zip(ws, b):
        rq, rs = Q.fp8_block_quant(w)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_quant_into_one_flat_buffer_at_explicit_offsets():
    ws = _weights(1)
    # scales first, then the e4m3 bytes, in one uint8 buffer (how a sync bucket places them)
    entries, so = [], 0
    for N, K in SHAPES:
        nb, kb = block_grid(N, K)
        entries.append([0, so, N, K])
        so += 4 * nb * kb
    qo = so
    for e in entries:
        e[0] = qo
        qo += e[2] * e[3]
    lay = Fp8BucketLayout.at(entries)
    buf = torch.full((lay.q_bytes + 5,), 0xA5, dtype=torch.uint8)
    b = Q.fp8_block_quant_into(ws, lay, buf, buf)
    assert int(buf[-5:].eq(0xA5).sum()) == 5  # nothing written past the layout
    for w, (q, s) in zip(ws, b):
        rq, rs = Q.fp8_block_quant(w)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_layout_errors():
    with pytest.raises(InvalidArgumentError, match="4-byte"):
        Fp8BucketLayout.at([(0, 2, 128, 128)])
    with pytest.raises(InvalidArgumentError, match="positive"):
        Fp8BucketLayout.packed([(0, 128)])
    ws = _weights()
    lay = Fp8BucketLayout.packed(SHAPES)
    with pytest.raises(InvalidArgumentError, match="needs"):
        Q.fp8_block_quant_into(ws, lay, torch.empty(16, dtype=torch.uint8), torch.empty(lay.scale_bytes // 4))
    with pytest.raises(InvalidArgumentError, match="one entry per tensor"):
        Q.fp8_block_quant_into(ws[:2], lay, torch.empty(lay.q_bytes, dtype=torch.uint8),
                               torch.empty(lay.scale_bytes // 4))
