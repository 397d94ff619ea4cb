"""What ebbtide sends, decoded by SGLang's own code: its serializer, FlattenedTensorBucket, its FP8 block
helpers and its request structs (sglang 0.5.23; skipped with the reason where it is not importable)."""
import pytest
import torch

from ebbtide.integrations.sglang import forms as S
from ebbtide.sync import Plan, Sender, expected, fill_bucket
from ebbtide.testing.bits import same_bits

import sglang_code
from sync_models import RULES, checkpoint

ok, why = sglang_code.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)


def _fp8_helpers():
    from sglang.srt.utils import ceil_align, ceil_div
    return sglang_code.functions("sglang.srt.layers.quantization.fp8_utils",
                                 ("block_quant_dequant", "ceil_to_ue8m0", "per_block_cast_to_fp8"),
                                 {"torch": torch, "ceil_align": ceil_align, "ceil_div": ceil_div})


def _buckets(scale="fp32"):
    src = checkpoint(3)
    plan = Plan.of(src, rules=RULES, scale=scale, bucket_bytes=150_000)
    bufs = []
    for b in plan.buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        fill_bucket(plan, b, src, buf)
        bufs.append(buf)
    return src, plan, bufs


def _decode_served(plan, named: dict, scale: str) -> dict:
    """What SGLang serves from ebbtide's tensors: FP8 through its block_quant_dequant, INT4 through ebbtide's
    compressed-tensors unpack, raw as sent."""
    import ebbtide.quant as Q

    h = _fp8_helpers()
    out = {}
    for it in plan.items:
        if it.kind == "fp8":
            q, s = (named[o.name] for o in it.outputs)
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            if scale == "ue8m0":  # UE8M0 scales are exactly SGLang's ceil_to_ue8m0 powers of two
                assert torch.equal(h["ceil_to_ue8m0"](s), s), it.source
            out[it.source] = h["block_quant_dequant"](q, s, [128, 128], torch.bfloat16)
        elif it.kind == "int4":
            packed, sc, shape = (named[o.name] for o in it.outputs)
            out[it.source] = Q.int4_unpack(packed, sc, shape)
        else:
            out[it.source] = named[it.outputs[0].name]
    return out


def _assert_bits(plan, src, got):
    want = expected(plan, src)
    bad = [n for n in want if not same_bits(want[n], got[n])]
    assert not bad, bad


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
@pytest.mark.parametrize("as_str", [False, True])
def test_flattened_bucket_decodes_with_sglangs_serializer_and_bucket(scale, as_str):
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    src, plan, bufs = _buckets(scale)
    named = {}
    for b, buf in zip(plan.buckets, bufs):
        req = S.tensor_request(b, buf, tp_size=2, weight_version=5, as_str=as_str)
        assert req["load_format"] == "flattened_bucket" and len(req["serialized_named_tensors"]) == 2
        d = MultiprocessingSerializer.deserialize(req["serialized_named_tensors"][1])
        # what SGLang's _update_weights_from_flattened_bucket does with it
        meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in d["metadata"]]
        named.update(FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=meta)
                     .reconstruct_tensors())
    assert set(named) == {o.name for it in plan.items for o in it.outputs}
    _assert_bits(plan, src, _decode_served(plan, named, scale))


def test_named_form_decodes_with_sglangs_serializer():
    from sglang.srt.utils import MultiprocessingSerializer

    src, plan, bufs = _buckets()
    named = {}
    for b, buf in zip(plan.buckets, bufs):
        req = S.tensor_request(b, buf, form="named")
        assert req["load_format"] is None
        named.update(dict(MultiprocessingSerializer.deserialize(req["serialized_named_tensors"][0])))
    _assert_bits(plan, src, _decode_served(plan, named, "fp32"))


def test_distributed_bucket_is_what_sglang_allocates():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    src, plan, bufs = _buckets()
    named = {}
    for b, buf in zip(plan.buckets, bufs):
        req = S.distributed_request(b, group_name="g", weight_version=2)
        recv = FlattenedTensorBucket.empty(req["names"], req["dtypes"], req["shapes"], "cpu")
        assert [(m.start_idx, m.end_idx) for m in recv.get_metadata()] == \
            [(o.offset, o.offset + o.nbytes) for o in b.outputs]
        flat = recv.get_flattened_tensor()
        assert flat.numel() == b.nbytes
        flat.copy_(buf)  # the broadcast of the whole bucket lands in place
        named.update(recv.reconstruct_tensors())
    _assert_bits(plan, src, _decode_served(plan, named, "fp32"))


@pytest.mark.parametrize("cls,build", [
    ("UpdateWeightsFromTensorReqInput",
     lambda b, buf: S.tensor_request(b, buf, weight_version=1)),
    ("UpdateWeightsFromDistributedReqInput", lambda b, buf: S.distributed_request(b, weight_version=1)),
    ("InitWeightsUpdateGroupReqInput", lambda b, buf: S.init_group_request("127.0.0.1", 29500, 1, 2)),
    ("DestroyWeightsUpdateGroupReqInput", lambda b, buf: S.destroy_group_request()),
    ("BeginWeightUpdateReqInput", lambda b, buf: S.begin_request()),
    ("EndWeightUpdateReqInput", lambda b, buf: S.end_request()),
])
def test_requests_have_sglangs_fields(cls, build):
    _, plan, bufs = _buckets()
    req = build(plan.buckets[0], bufs[0])
    fields, required = sglang_code.struct_fields(cls)
    assert set(req) <= fields, set(req) - fields
    assert required <= set(req), required - set(req)
    try:
        from sglang.srt.managers import io_struct
    except ImportError:
        return  # the struct itself needs SGLang's model registry here; the fields above come from its source
    getattr(io_struct, cls)(**req)


def test_tensor_sender_end_to_end_through_sglangs_decoding():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    src = checkpoint(4)
    plan = Plan.of(src, rules=RULES, bucket_bytes=150_000)
    calls, named = [], {}

    def post(endpoint, req):  # the engine's side, by SGLang's code
        calls.append((endpoint, req.get("weight_version"), req.get("flush_cache")))
        if endpoint == "update_weights_from_tensor":
            d = MultiprocessingSerializer.deserialize(req["serialized_named_tensors"][0])
            named.update(FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"].clone(),
                                               metadata=d["metadata"]).reconstruct_tensors())
        return {"success": True, "message": "Success"}

    Sender(src, S.SGLangTensorSender(post), plan=plan).push(9)
    assert calls[0][0] == "begin_weight_update" and calls[-1][0] == "end_weight_update"
    ups = [c for c in calls if c[0] == "update_weights_from_tensor"]
    assert len(ups) == len(plan.buckets) and {c[1] for c in ups} == {"9"}
    assert [c[2] for c in ups] == [False] * (len(ups) - 1) + [True]  # flush once, after the last bucket
    _assert_bits(plan, src, _decode_served(plan, named, "fp32"))

    def refuse(endpoint, req):
        return {"success": False, "message": "no"} if endpoint == "update_weights_from_tensor" else {"success": True}

    with pytest.raises(Exception, match="SGLang refused"):
        Sender(src, S.SGLangTensorSender(refuse), plan=plan).push(10)


def test_metadata_without_sglang_in_the_trainer_decodes_too(monkeypatch):
    """A trainer without SGLang installed sends SimpleNamespace metadata; SGLang's restricted unpickler allows it
    and its loader reads the same attributes."""
    import types

    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkeypatch.setattr(S, "_metadata_class", lambda: types.SimpleNamespace)
    src, plan, bufs = _buckets()
    named = {}
    for b, buf in zip(plan.buckets, bufs):
        d = MultiprocessingSerializer.deserialize(S.tensor_request(b, buf)["serialized_named_tensors"][0])
        assert isinstance(d["metadata"][0], types.SimpleNamespace)
        named.update(FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=d["metadata"])
                     .reconstruct_tensors())
    _assert_bits(plan, src, _decode_served(plan, named, "fp32"))
