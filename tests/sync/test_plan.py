"""The sync plan: kinds, serving names, buckets by byte budget, the gapless layout, errors."""
import pytest
import torch

from ebbtide.errors import InvalidArgumentError
from ebbtide.sync import Plan

from sync_models import RULES, checkpoint


def _plan(**kw):
    return Plan.of(checkpoint(), rules=RULES, **kw)


def test_kinds_and_serving_names():
    p = _plan()
    kinds = {it.source: it.kind for it in p.items}
    assert kinds["model.layers.0.self_attn.qkv_proj.weight"] == "fp8"
    assert kinds["model.layers.0.mlp.experts.w13_weight"] == "fp8"  # by rule: a stacked [E, N, K] weight
    assert kinds["model.layers.1.qat.down_proj.weight"] == "int4"
    for raw in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight",
                "model.layers.0.mlp.gate.weight"):
        assert kinds[raw] == "raw", raw
    outs = {o.name: o for it in p.items for o in it.outputs}
    w, s = outs["model.layers.1.mlp.down_proj.weight"], outs["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert (w.dtype, w.shape, s.dtype, s.shape) == ("float8_e4m3fn", (200, 300), "float32", (2, 3))
    assert outs["model.layers.0.mlp.experts.w13_weight_scale_inv"].shape == (4, 2, 2)
    m = "model.layers.1.qat.down_proj."
    assert (outs[m + "weight_packed"].dtype, outs[m + "weight_packed"].shape) == ("int32", (128, 32))
    assert (outs[m + "weight_scale"].dtype, outs[m + "weight_scale"].shape) == ("bfloat16", (128, 2))
    assert (outs[m + "weight_shape"].dtype, outs[m + "weight_shape"].shape) == ("int32", (2,))
    assert outs["lm_head.weight"].dtype == "bfloat16"


def test_gapless_aligned_layout():
    for budget in (1, 100_000, 1 << 30):
        p = _plan(bucket_bytes=budget)
        for b in p.buckets:
            off = 0
            for o in b.outputs:
                assert o.offset == off, (o.name, o.offset, off)  # no gaps: FlattenedTensorBucket.empty's layout
                assert o.offset % torch.empty(0, dtype=getattr(torch, o.dtype)).element_size() == 0
                if o.dtype == "float8_e4m3fn":
                    assert o.offset % 16 == 0  # weight rows start on full vectors
                off += o.nbytes
            assert off == b.nbytes


def test_buckets_follow_the_byte_budget():
    one = _plan(bucket_bytes=1 << 30)
    assert len(one.buckets) == 1
    tiny = _plan(bucket_bytes=1)
    assert len(tiny.buckets) == len(tiny.items)  # a tensor larger than the budget gets a bucket of its own
    mid = _plan(bucket_bytes=150_000)
    assert 1 < len(mid.buckets) < len(mid.items)
    for b in mid.buckets:
        assert b.nbytes <= 150_000 or len(b.items) == 1
    assert [it.source for b in mid.buckets for it in b.items] == list(checkpoint())  # order kept
    assert one.nbytes == mid.nbytes == tiny.nbytes


def test_signature_is_a_function_of_the_specs():
    a, b = _plan(), Plan.build([(n, t.shape, t.dtype) for n, t in checkpoint(5).items()], rules=RULES)
    assert a.signature == b.signature
    assert _plan(scale="ue8m0").signature != a.signature
    assert _plan(bucket_bytes=1).signature != a.signature


def test_plan_errors():
    ck = checkpoint()
    with pytest.raises(InvalidArgumentError, match="FP8"):
        Plan.of({"w.weight": torch.zeros(128, 128)}, rules=[("w", "fp8")])  # fp32 source
    with pytest.raises(InvalidArgumentError, match="INT4"):
        Plan.of({"w.weight": torch.zeros(128, 100, dtype=torch.bfloat16)}, default="int4")
    with pytest.raises(InvalidArgumentError, match="kind"):
        Plan.of(ck, rules=[("x", "fp4")])
    with pytest.raises(InvalidArgumentError, match="same name"):
        Plan.of({"a.weight": torch.zeros(128, 128, dtype=torch.bfloat16),
                 "a.weight_scale_inv": torch.zeros(1, 1)})
    with pytest.raises(InvalidArgumentError, match="scale"):
        Plan.of(ck, scale="ue8m0_packed")
    with pytest.raises(InvalidArgumentError, match="bucket_bytes"):
        Plan.of(ck, bucket_bytes=0)
    with pytest.raises(InvalidArgumentError, match="'w.weight': not a tensor \\(int\\)"):
        Plan.of({"w.weight": 3})
    with pytest.raises(InvalidArgumentError, match="not a tensor \\(ndarray\\)"):
        Plan.of([("w.weight", torch.zeros(2).numpy())])
    with pytest.raises(InvalidArgumentError, match="\\(name, tensor\\) pairs"):
        Plan.of(["w.weight"])
