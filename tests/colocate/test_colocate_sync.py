"""Weight sync on the CPU: layout, pack/unpack bit for bit with both codecs, the shared buffer, errors."""
import pytest
import torch

import ebbtide.quant as Q
from ebbtide.colocate import SharedHostBuffer, SyncLayout, TinyLM, pack, reference_weights, unpack
from ebbtide.colocate.rollout import weight_digests
from ebbtide.errors import InvalidArgumentError

from test_colocate_model import TINY


@pytest.mark.parametrize("codec", ["ebbtide", "torch"])
def test_rollout_holds_the_trainers_weights_dequantized_bit_for_bit(codec):
    trainer, rollout = TinyLM.random(TINY, seed=0), TinyLM.random(TINY, seed=1)
    layout = SyncLayout.of_model(trainer)
    buf = SharedHostBuffer.create(layout.nbytes, pin=False)
    try:
        buf.tensor.fill_(0xA5)  # stale bytes must be overwritten everywhere the load reads
        assert pack(trainer, layout, buf.tensor, codec) == layout.nbytes
        assert unpack(rollout, layout, buf.tensor, codec) == layout.nbytes
        want = weight_digests(reference_weights(trainer, layout, codec))
        assert want == weight_digests(dict(rollout.named_parameters()))
        with torch.no_grad():  # and the dequantized weights are close to the originals (FP8: 2^-4 relative)
            for n, p in trainer.named_parameters():
                q = dict(rollout.named_parameters())[n]
                assert (q.float() - p.float()).abs().max() <= 0.07 * p.float().abs().max(), n
    finally:
        buf.close()


def test_layout_is_the_quant_list_bucket_layout():
    m = TinyLM.random(TINY, seed=0)
    layout = SyncLayout.of_model(m)
    bucket = Q.fp8_block_quant_list([p for p in m.parameters() if p.dim() == 2])
    assert bucket.q_buffer.numel() == layout.q_bytes and bucket.scale_buffer.numel() == layout.scale_count
    assert layout.scale_start % 256 == 0 and layout.raw_start % 256 == 0 and layout.nbytes % 256 == 0
    assert layout.nbytes < 0.55 * layout.bf16_bytes()  # FP8 + scales is about half of bf16


def test_shared_buffer_is_shared_through_its_fd():
    import subprocess
    import sys
    import textwrap

    buf = SharedHostBuffer.create(4096, pin=False)
    try:
        buf.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        code = f"""
            import os, torch
            from ebbtide.colocate import SharedHostBuffer
            b = SharedHostBuffer({buf.fd}, 4096, pin=False)
            assert b.tensor[:4].tolist() == [1, 2, 3, 4], b.tensor[:4]
            b.tensor[4:8] = 9
            """
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], pass_fds=(buf.fd,), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert buf.tensor[4:8].tolist() == [9, 9, 9, 9]
    finally:
        buf.close()


def test_sync_argument_errors():
    m = TinyLM.random(TINY, seed=0)
    layout = SyncLayout.of_model(m)
    with pytest.raises(InvalidArgumentError, match="multiple of 128"):
        SyncLayout.of([("w", (128, 100))])
    with pytest.raises(InvalidArgumentError, match="1-D and 2-D"):
        SyncLayout.of([("w", (2, 128, 128))])
    with pytest.raises(InvalidArgumentError, match="no 2-D weights"):
        SyncLayout.of([("g", (128,))])
    with pytest.raises(InvalidArgumentError, match="needs"):
        pack(m, layout, torch.zeros(16, dtype=torch.uint8), "ebbtide")
    with pytest.raises(InvalidArgumentError, match="codec"):
        pack(m, layout, torch.zeros(layout.nbytes, dtype=torch.uint8), "int4")
    with pytest.raises(InvalidArgumentError, match="lacks params"):
        pack(torch.nn.Linear(128, 128), layout, torch.zeros(layout.nbytes, dtype=torch.uint8), "torch")
    with pytest.raises(InvalidArgumentError, match="positive"):
        SharedHostBuffer.create(0, pin=False)
