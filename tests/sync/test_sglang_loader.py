"""ebbtide's SGLang weight loader (ebbtide.integrations.sglang.loader): the first update of a layout is placed by the
model's own ``load_weights`` and recorded, later ones replay the record; the parameters must be bitwise what the
model's loader writes for the same request, every update. CPU: a plain-torch model placing tensors as SGLang's
classes do (loader_models.py), the request path as SGLang's weight updater runs it, the refusals; SGLang's own layers
in test_sglang_loader_layers.py."""
import importlib

import pytest
import torch

from ebbtide.integrations import sglang as S
from ebbtide.integrations.sglang import loader as L
from ebbtide.sync import Plan, fill_bucket

from loader_models import Combining, TinyServed, checkpoint, combining_checkpoint


def _requests(plan, src, version, form="ebbtide"):
    """Each bucket's ``update_weights_from_tensor`` request, as the sender builds it."""
    out = []
    for b in plan.buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        fill_bucket(plan, b, src, buf)
        out.append(S.tensor_request(b, buf, form=form, weight_version=version, signature=plan.signature,
                                    buckets=len(plan.buckets)))
    return out


def _engine_apply(model, req, custom_loaders=(L.LOADER,)):
    """What SGLang 0.5.23's weight updater does with a request (weight_updater.py): deserialize this rank's
    payload, then ``dynamic_import(load_format)(model, named_tensors)`` when load_format is a registered custom
    loader, ``model.load_weights`` when it is None."""
    from multiprocessing.reduction import ForkingPickler

    named = ForkingPickler.loads(req["serialized_named_tensors"][0])
    fmt = req["load_format"]
    if fmt is None:
        model.load_weights(named)
    elif fmt in custom_loaders:
        module, fn = fmt.rsplit(".", 1)
        getattr(importlib.import_module(module), fn)(model, named)
    else:
        raise NotImplementedError(fmt)


def _reference(plan, src, tp_rank=0, tp_size=1):
    """The model's own loader over the same buckets (SGLang's named form, ``load_weights``)."""
    ref = TinyServed(tp_rank, tp_size)
    for req in _requests(plan, src, None, form="named"):
        _engine_apply(ref, req)
    return ref


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_replay_is_bitwise_what_the_models_loader_writes_over_20_updates(tp_rank, tp_size):
    model = TinyServed(tp_rank, tp_size)
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    assert len(plan.buckets) > 2
    for v in range(20):
        src = checkpoint(v)
        for req in _requests(plan, src, v):
            _engine_apply(model, req)
        want = _reference(plan, src, tp_rank, tp_size)
        for (n, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
            assert torch.equal(p, q), (v, n)
    st = L.state(model)
    assert st.held == 19 and st.recorded == len(plan.buckets) and st.replayed == 19 * len(plan.buckets)
    fallback = {n for r in st.records.values() for n in r.fallback}
    # the cast is the model's loader's, every update; so is a name it ignores (nothing observed to replay)
    assert fallback == {"layers.0.norm.weight", "layers.0.rotary.inv_freq"}


def test_stale_versions_and_mixed_plans_are_refused_untouched():
    model = TinyServed()
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    for req in _requests(plan, checkpoint(1), 5):
        _engine_apply(model, req)
    before = [p.clone() for p in model.parameters()]
    for req in _requests(plan, checkpoint(2), 5):  # not newer than the held version
        _engine_apply(model, req)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "not newer" in L.state(model).last_error
    _engine_apply(model, _requests(plan, checkpoint(3), 6)[0])
    _engine_apply(model, _requests(plan, checkpoint(3), 6)[0])  # the same bucket twice (a CPU payload reads once)
    assert "already applied" in L.state(model).last_error
    other = Plan.of({k: v for k, v in checkpoint(0).items() if "experts" not in k}, default="raw", bucket_bytes=40_000)
    mixed = _requests(other, checkpoint(3), 6)
    snapshot = [p.clone() for p in model.parameters()]
    _engine_apply(model, mixed[1])
    assert "plan signature" in L.state(model).last_error
    assert all(torch.equal(a, b) for a, b in zip(snapshot, model.parameters()))


def test_moved_parameters_are_recorded_again_and_plain_requests_pass_through():
    model = TinyServed()
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    for v in range(2):
        for req in _requests(plan, checkpoint(v), v):
            _engine_apply(model, req)
    with torch.no_grad():
        model.qkv_proj.data = model.qkv_proj.data.clone()  # the engine re-allocated a parameter
    recorded = L.state(model).recorded
    for req in _requests(plan, checkpoint(7), 2):
        _engine_apply(model, req)
    assert L.state(model).recorded > recorded
    want = _reference(plan, checkpoint(7))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want.parameters()))
    for req in _requests(plan, checkpoint(8), None, form="named"):  # SGLang's own form, load_format None
        _engine_apply(model, req)
    assert torch.equal(model.qkv_proj, _reference(plan, checkpoint(8)).qkv_proj)


def test_outputs_the_record_cannot_express_stay_with_the_models_loader():
    """A fused parameter written once two outputs of one call arrived, a buffer write and a transposed copy: the
    first update and every later one equal the model's own loader, those outputs loaded by it together."""
    model, ref = Combining(), Combining()
    plan = Plan.of(combining_checkpoint(0), default="raw", bucket_bytes=1 << 20)
    for v in range(3):
        src = combining_checkpoint(v)
        for req in _requests(plan, src, v):
            _engine_apply(model, req)
        for req in _requests(plan, src, None, form="named"):
            _engine_apply(ref, req)
        assert torch.equal(model.fused_a, ref.fused_a) and torch.any(model.fused_a != 0), v
        assert torch.equal(model.table, ref.table) and torch.equal(model.wt, ref.wt), v
    rec = next(iter(L.state(model).records.values()))
    assert sorted(rec.fallback) == ["kv_a.weight", "q_a.weight", "wt.weight"], rec.fallback  # the buffer: replayed


def test_an_older_version_cannot_interleave_with_the_one_in_progress():
    model = TinyServed()
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    _engine_apply(model, _requests(plan, checkpoint(5), 5)[0])
    before = [p.clone() for p in model.parameters()]
    _engine_apply(model, _requests(plan, checkpoint(4), 4)[1])
    assert "older than version 5" in L.state(model).last_error
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for req in _requests(plan, checkpoint(5), 5)[1:]:
        _engine_apply(model, req)
    assert L.state(model).held == 5


def test_the_ebbtide_form_needs_a_version_and_the_plan():
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    b = plan.buckets[0]
    buf = torch.empty(b.nbytes, dtype=torch.uint8)
    with pytest.raises(Exception, match="needs weight_version"):
        S.tensor_request(b, buf, form="ebbtide", weight_version=None, signature=plan.signature, buckets=3)
    with pytest.raises(Exception, match="needs weight_version"):
        S.tensor_request(b, buf, form="ebbtide", weight_version=1, signature=None, buckets=3)
    req = S.tensor_request(b, buf, form="ebbtide", weight_version=1, signature=plan.signature, buckets=3)
    assert req["load_format"] == L.LOADER == "ebbtide.integrations.sglang.load_weights"


def test_the_name_is_encode_of_the_meta_and_parses_back_any_key_order():
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    b = plan.buckets[1]
    buf = torch.empty(b.nbytes, dtype=torch.uint8)
    name = S.ebbtide_payload(b, buf, version=7, signature=plan.signature, buckets=len(plan.buckets))[0][0]
    outputs = [[o.name, o.dtype, list(o.shape), o.offset, o.offset + o.nbytes] for o in b.outputs]
    meta = {"v": 7, "sig": plan.signature, "bucket": b.index, "buckets": len(plan.buckets), "outputs": outputs}
    assert name == L.encode(meta) and L.decode(name) == meta
    layout = tuple((n, d, tuple(sh), lo, hi) for n, d, sh, lo, hi in outputs)
    assert L._parse(name) == ({k: v for k, v in meta.items() if k != "outputs"}, layout)
    other = L.encode({"outputs": outputs, "v": 7, "sig": plan.signature, "bucket": b.index, "buckets": 2})
    assert L._parse(other)[1] == layout  # "outputs" first: the general path


def test_an_unreadable_name_is_refused_untouched():
    model = TinyServed(0, 1)
    before = {n: p.clone() for n, p in model.named_parameters()}
    good = {"v": 1, "sig": "s", "bucket": 0, "buckets": 1}
    for bad in (L.PREFIX + "{not json", L.PREFIX + '{"v":1}', L.PREFIX + '{"v":1,"outputs":[[1]]}',
                L.encode({**good, "outputs": [["w", "nodtype", [2], 0, 4]]}),
                L.encode({**good, "outputs": [["w", "float32", [2], 0, 4]]}),  # 8 bytes of float32 in 4
                L.encode({**good, "outputs": [["w", "bfloat16", [2], -4, 0]]})):
        L.load_weights(model, [(bad, torch.zeros(8, dtype=torch.uint8))])
        assert "readable ebbtide layout" in L.state(model).last_error, L.state(model).last_error
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA replay (one SegmentCopy launch per bucket) needs "
                                                          "a GPU; no CUDA GPU visible to torch")
@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_cuda_replay_is_bitwise_what_the_models_loader_writes(tp_rank, tp_size):
    """The loader called as SGLang calls it (the rebuilt bucket on the engine's device), 20 updates."""
    model, ref = TinyServed(tp_rank, tp_size).cuda(), TinyServed(tp_rank, tp_size).cuda()
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=40_000)
    for v in range(20):
        src = {k: t.cuda() for k, t in checkpoint(v).items()}
        for b in plan.buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device="cuda")
            fill_bucket(plan, b, src, buf)
            L.load_weights(model, S.ebbtide_payload(b, buf, version=v, signature=plan.signature,
                                                    buckets=len(plan.buckets)))
            ref.load_weights([(o.name, o.view(buf)) for o in b.outputs])
        torch.cuda.synchronize()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p, q), (v, n)
    assert L.state(model).replayed == 19 * len(plan.buckets)


def test_a_broken_sglang_install_falls_back_to_plain_metadata(monkeypatch):
    """An SGLang whose import fails with something other than ImportError (seen: KeyError 'sglang' from importlib
    when one of its dependencies is missing) must not break the sender: the metadata become SimpleNamespaces."""
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    from ebbtide.integrations.sglang import forms as S

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "sglang" or name.startswith("sglang."):
                raise KeyError("sglang")
            return None

    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    assert S._metadata_class() is types.SimpleNamespace
