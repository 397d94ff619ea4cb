"""The sync suite's "into SGLang's loaders" measurement, in a process of its own (SGLang's imports publish server
arguments and may stand in for torchvision): ``main(model, quick, reps, device)`` run by
``ebbtide.testing.spawn.call``; returns the result dict.

The same buckets (the sync suite's plan: FP8 128x128 linears, raw norms/embeddings/router, 512 MiB) go into two
copies of the served model (``ebbtide.testing.scenarios.sglang_served``: SGLang's layers, FP8 served form), as
SGLang's weight updater hands them over after rebuilding the request's tensors:
- SGLang's path for slime's request (``load_format="flattened_bucket"``): ``FlattenedTensorBucket`` rebuilds the
  views of each bucket, then the model's ``load_weights`` (SGLang's Qwen3 / Qwen3-MoE code) places them;
- ebbtide's loader (``load_format=ebbtide.integrations.sglang.LOADER``): its ``load_weights`` per bucket
  (the first update records, later ones replay one segment-copy launch per bucket).
Each timed update ends with ``torch.cuda.synchronize()``; the IPC transport before it is the same in both (one
handle per bucket) and not timed. The two paths alternate, one update each, after warm-up updates; the result has
the medians, the first (recording) update of ebbtide's loader, and whether both models hold the same bits.
"""
from __future__ import annotations

import statistics
import time


def main(model: str, quick: bool, reps: int, device: str) -> dict:
    import torch  # noqa: PLC0415

    from ...testing.bits import same_bits  # noqa: PLC0415
    from ...testing.scenarios import sglang_served as served  # noqa: PLC0415

    stood_in = served.prepare()
    from ...sync import fill_bucket  # noqa: PLC0415
    from ...integrations.sglang import ebbtide_payload, flattened_payload  # noqa: PLC0415
    from ...integrations.sglang import loader as L  # noqa: PLC0415
    from .sync import make_plan, specs  # noqa: PLC0415

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    spec = specs(model, quick)
    plan = make_plan(model, quick)
    g = torch.Generator(device=device).manual_seed(0)
    bufs = []
    for b in plan.buckets:  # the sender's buckets, filled once (what is in them does not change the placement)
        src = {it.source: (torch.randn(it.shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
               for it in plan.items if any(o.name in {x.name for x in b.outputs} for o in it.outputs)}
        buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        fill_bucket(plan, b, src, buf)
        bufs.append(buf)
        del src
    theirs, ours = served.build(spec, fp8=True, device=device), served.build(spec, fp8=True, device=device)
    sync()
    version = [0]

    # What the sender builds (the request's payload) is made before the clock starts; what SGLang's process does
    # with it (rebuild the flattened bucket's views; decode the ebbtide name) is timed.
    flat = [flattened_payload(b, buf) for b, buf in zip(plan.buckets, bufs)]
    updates = 1 + 1 + 2 + reps
    ebb = [[ebbtide_payload(b, buf, version=v, signature=plan.signature, buckets=len(plan.buckets))
            for b, buf in zip(plan.buckets, bufs)] for v in range(updates)]

    def sglang_update():
        for p in flat:
            theirs.load_weights(served.rebuild_flattened(p))
        sync()

    def ebbtide_update():
        for named in ebb[version[0]]:
            L.load_weights(ours, named)
        sync()
        version[0] += 1

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    first = timed(ebbtide_update)  # records
    first_sglang = timed(sglang_update)
    for _ in range(2):
        sglang_update()
        ebbtide_update()
    t_theirs, t_ours = [], []
    for _ in range(reps):
        t_theirs.append(timed(sglang_update))
        t_ours.append(timed(ebbtide_update))
    same = all(same_bits(p, q) for (_, p), (_, q) in zip(theirs.named_parameters(), ours.named_parameters()))
    # and both hold the sent bytes: every output SGLang keeps under its own name (o_proj, down_proj, norms, ...)
    params = dict(theirs.named_parameters())
    direct = [(o, buf) for b, buf in zip(plan.buckets, bufs) for o in b.outputs if o.name in params]
    holds = bool(direct) and all(torch.equal(params[o.name].detach().reshape(-1).view(torch.uint8),
                                             buf[o.offset:o.offset + o.nbytes]) for o, buf in direct)
    st = L.state(ours)
    return {"ok": True, "sglang_s": statistics.median(t_theirs), "ebbtide_s": statistics.median(t_ours),
            "sglang_first_s": first_sglang, "ebbtide_record_s": first, "bitwise_equal": same and holds,
            "direct_outputs_checked": len(direct),
            "sglang_range_s": [min(t_theirs), max(t_theirs)], "ebbtide_range_s": [min(t_ours), max(t_ours)],
            "wire_bytes": plan.nbytes, "source_bytes": plan.source_bytes, "buckets": len(plan.buckets),
            "tensors": len(plan.items), "segments": sum(len(r.dst) for r in st.records.values()),
            "fallback": sorted({n for r in st.records.values() for n in r.fallback})[:8],
            "replayed": st.replayed, "stood_in": stood_in}

