"""The example's weight sync on the CPU (ebbtide.sync's host transport, and the anchor codec over the same
buffer layout): the rollout holds the trainer's weights dequantized bit for bit, versions are checked."""
import pytest
import torch

from ebbtide.bench.colocate.sync import RolloutSync, TrainerSync, sync_plan
from ebbtide.errors import InvalidArgumentError
from ebbtide.sync import WeightVersionError
from ebbtide.testing.bits import digests
from ebbtide.testing.models import TinyLM

from test_colocate_model import TINY


@pytest.mark.parametrize("codec", ["ebbtide", "torch"])
def test_rollout_holds_the_trainers_weights_dequantized_bit_for_bit(codec):
    trainer, rollout = TinyLM.random(TINY, seed=0), TinyLM.random(TINY, seed=1)
    ts = TrainerSync(trainer, codec, pin=False)
    try:
        ts.buffer.tensor.fill_(0xA5)  # stale bytes must be overwritten everywhere the load reads
        rs = RolloutSync(rollout, codec, ts.fd, ts.nbytes, pin=False)
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.5)
            assert ts.pack(version) == ts.plan.nbytes
            assert rs.load(version) == ts.plan.nbytes
            assert digests(ts.reference()) == digests(dict(rollout.named_parameters()))
        with torch.no_grad():  # and the dequantized weights are close to the originals (FP8: 2^-4 relative)
            for n, p in trainer.named_parameters():
                q = dict(rollout.named_parameters())[n]
                assert (q.float() - p.float()).abs().max() <= 0.07 * p.float().abs().max(), n
        rs.close()
    finally:
        ts.close()


def test_plan_quantizes_every_weight_and_halves_the_bytes():
    m = TinyLM.random(TINY, seed=0)
    plan = sync_plan(m)
    assert {it.kind for it in plan.items if len(it.shape) == 2} == {"fp8"}
    assert {it.kind for it in plan.items if len(it.shape) == 1} == {"raw"}
    assert plan.nbytes < 0.55 * plan.source_bytes  # FP8 + scales is about half of bf16


def test_ebbtide_load_checks_the_version():
    trainer, rollout = TinyLM.random(TINY, seed=0), TinyLM.random(TINY, seed=1)
    ts = TrainerSync(trainer, "ebbtide", pin=False)
    try:
        rs = RolloutSync(rollout, "ebbtide", ts.fd, ts.nbytes, pin=False)
        ts.pack(1)
        with pytest.raises(WeightVersionError, match="expected 2"):
            rs.load(2)
        rs.load(1)
        with pytest.raises(WeightVersionError, match="not newer"):
            rs.load(1)
        rs.close()
    finally:
        ts.close()


def test_sync_argument_errors():
    m = TinyLM.random(TINY, seed=0)
    with pytest.raises(InvalidArgumentError, match="codec"):
        TrainerSync(m, "int4", pin=False)
