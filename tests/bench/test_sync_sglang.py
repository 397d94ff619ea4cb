"""The `sync` suite's SGLang rows on the CPU: the receiver's SGLang-handler loop (``serve_sglang``) fed by the real
``Sender`` + ``SGLangTensorSender`` over a real multiprocessing Pipe (the request's payload torch-pickled, then
pickled again by the connection), bit for bit against each bucket filled apart; a refused request answered and
raised, not hung; and the rows' arithmetic. The timings and the GPU memory peak need a GPU: scripts/gpu-check
runs the suite."""
import multiprocessing as mp
import threading

import pytest
import torch

from ebbtide.bench.suites import sync
from ebbtide.errors import StateError, WaitTimeoutError
from ebbtide.sync import Plan, Sender, fill_bucket
from ebbtide.integrations.sglang import SGLangTensorSender

SPECS = [("model.embed_tokens.weight", (512, 384)), ("model.layers.0.input_layernorm.weight", (384,)),
         ("model.layers.0.self_attn.q_proj.weight", (384, 384)), ("model.layers.0.mlp.gate.weight", (8, 384)),
         ("model.layers.0.mlp.up_proj.weight", (200, 130)), ("model.layers.0.mlp.down_proj.weight", (384, 256)),
         ("model.norm.weight", (384,)), ("lm_head.weight", (512, 384))]


def _plan():
    plan = Plan.build([(n, s, torch.bfloat16) for n, s in SPECS], bucket_bytes=200_000)
    kinds = {it.kind for it in plan.items}
    assert len(plan.buckets) >= 3 and kinds == {"fp8", "raw"}, (len(plan.buckets), kinds)
    return plan


def _source(plan, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {it.source: (torch.randn(it.shape, generator=g) * 0.02).to(torch.bfloat16) for it in plan.items}


def _reference(plan, src) -> dict:
    """Every output's bytes, each bucket filled apart."""
    out = {}
    for b in plan.buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        fill_bucket(plan, b, src, buf)
        out.update({o.name: o.view(buf).clone() for o in b.outputs})
    return out


def _serving(conn, params, updates, errors):
    def run():
        try:
            sync.serve_sglang(conn, params, updates)
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            errors.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def test_receiver_answers_sglang_endpoints_and_holds_each_version_bit_for_bit():
    plan = _plan()
    params = sync._served_params(plan, "cpu")
    a, b = mp.Pipe()
    errors, posted = [], []
    th = _serving(b, params, 2, errors)
    post = sync.sglang_post(a)

    def counting(endpoint, req):
        posted.append(endpoint)
        reply = post(endpoint, req)
        assert reply == {"success": True, "message": ""}, reply
        return reply

    weights = {"now": _source(plan, 0)}
    sender = Sender(lambda: weights["now"], SGLangTensorSender(counting), plan=plan)  # read at every push
    try:
        for version in (1, 2):
            weights["now"] = _source(plan, version)  # the trainer's weights after its next step
            sender.push(version)
            want = _reference(plan, weights["now"])
            bad = [n for n, t in want.items() if not torch.equal(_bytes(params[n]), _bytes(t))]
            assert not bad, (version, bad)
    finally:
        sender.close()
    th.join(10)
    assert not th.is_alive() and not errors, errors  # the loop returned after the second end_weight_update
    per_update = ["begin_weight_update"] + ["update_weights_from_tensor"] * len(plan.buckets) + ["end_weight_update"]
    assert posted == per_update * 2
    assert not a.poll(0.1)  # one reply per request: nothing left for the next command
    a.close()
    b.close()


def test_a_refused_request_is_answered_and_raised_and_a_closed_trainer_ends_the_loop():
    plan = _plan()
    params = sync._served_params(plan, "cpu")
    a, b = mp.Pipe()
    errors = []
    th = _serving(b, params, 1, errors)
    sender = Sender(_source(plan, 0), SGLangTensorSender(sync.sglang_post(a), form="named"), plan=plan)
    with pytest.raises(StateError, match="flattened-bucket form"):
        sender.push(1)
    sender.close()
    a.close()  # the trainer gives up: the receiver's wait for the next request ends
    th.join(10)
    assert not th.is_alive() and len(errors) == 1 and isinstance(errors[0], EOFError), errors
    b.close()


def test_post_gives_up_on_a_receiver_that_does_not_answer():
    a, b = mp.Pipe()
    with pytest.raises(WaitTimeoutError, match="begin_weight_update"):
        sync.sglang_post(a, timeout=0.2)("begin_weight_update", {"selector": "all"})
    assert b.recv() == ("begin_weight_update", {"selector": "all"})  # the request went out, once
    a.close()
    b.close()


def test_rows_report_speed_and_peak_memory_beside_the_slime_style_path():
    plan = sync.make_plan("moe", False)  # metadata only: 5 buckets of at most 512 MiB
    GiB = 1 << 30
    t = {"sglang": 0.05, "slime": 0.1, "sglang_peak": int(0.9 * GiB), "slime_peak": int(1.2 * GiB)}
    speed, mem = sync.sglang_rows("MoE", plan, t, 900.0, {"buckets": len(plan.buckets)})
    assert speed.unit == "GB/s" and speed.higher_is_better and speed.limit == 900.0
    assert speed.ours == pytest.approx(plan.source_bytes / 0.05 / 1e9)
    assert speed.vs_anchor() == pytest.approx(2.0)
    assert speed.params["ms"] == pytest.approx(50) and speed.params["anchor_ms"] == pytest.approx(100)
    assert mem.unit == "GiB" and not mem.higher_is_better
    assert mem.ours == pytest.approx(0.9, abs=1e-6) and mem.anchor == pytest.approx(1.2, abs=1e-6)
    assert mem.limit == 1.0 and mem.limit_name.startswith("the plan's largest two consecutive buckets")
    assert mem.vs_anchor() == pytest.approx(1.2 / 0.9, rel=1e-6) and mem.of_limit() > 1  # within the ceiling
    assert mem.params["peak_extra_GiB"] == 0.9 and mem.params["anchor_peak_extra_GiB"] == 1.2
    assert mem.params["two_consecutive_buckets_GiB"] <= 1.0 and "reach" not in mem.note
    dense = sync.make_plan("dense", False)  # the embedding and lm_head are raw bf16 buckets over the budget
    _, mem = sync.sglang_rows("dense", dense, t, 900.0, {})
    assert mem.params["largest_bucket_GiB"] > 1.0 and "reach" in mem.note
