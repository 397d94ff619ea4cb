"""Rank bodies for a Megatron-core GPT's weights as the rollout takes them, on CPU (Gloo): the tensor-parallel
gather (``tensor_parallel_dims``, ``full_weights``) and ``ebbtide.sync.Sender`` with ``each_rank_sends`` over the
host transport. With ``use_cpu_initialization`` Megatron draws every split weight whole and keeps the rank's
piece, so the same seed gives the TP=1 model's tensors bit for bit: the oracle."""
from __future__ import annotations

import hashlib

import torch

from megatron_dist_workers import _gpt, _setup


def _digests(named: dict) -> dict:
    return {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in sorted(named.items())}


def weights(rank, world, init, tp=1):
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.integrations.names import served_names  # noqa: PLC0415
    from ebbtide.sync import (HostReceiver, HostSender, Plan, Receiver, Sender, SharedHostBuffer,  # noqa: PLC0415
                              expected)

    _setup(rank, world, init, tp=tp)
    model = _gpt(seed=11, hidden=128, heads=4, vocab=256)
    dims = ebt.tensor_parallel_dims([model])
    full = ebt.full_weights([model])
    out = {"dims": dims, "digests": _digests(full)}
    if tp > 1:
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        local = {n: p.detach() for n, p in served_names(model.named_parameters()).items()}
        plan = Plan.of({n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in full.items()})
        buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
        try:
            sender = Sender(local, HostSender(buf, keep_slots=False), plan=plan, each_rank_sends=True,
                            tp_group=ps.get_tensor_model_parallel_group(), tp_dims=dims)
            dst = {it.source: torch.zeros(it.shape, dtype=full[it.source].dtype) for it in plan.items}
            sender.push(3)
            HostReceiver(buf).receive(Receiver(dst, plan), 3)
            want = expected(plan, full)
            out["sent_equal"] = all(torch.equal(dst[n], want[n]) for n in want)
            out["sent"] = len(want)
            out["fp8_items"] = sum(it.kind == "fp8" for it in plan.items)
        finally:
            buf.close()
    return out


def shard_mirror(rank, world, init, steps=4):
    """ebbtide's distributed optimizer with its host mirror (what TrainingState(weights="discard") rebuilds the
    weights from): losses bitwise those without it, the mirror equal to the owned params after every step, and
    params scribbled over come back bitwise from the mirror and DDP's all-gather."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.integrations.megatron._sharded import shard_ranges  # noqa: PLC0415
    from megatron_dist_workers import _step, opt_config  # noqa: PLC0415

    _setup(rank, world, init)
    plain_model = _gpt()
    plain = ebt.get_optimizer(opt_config(), [plain_model], mode="exact", bucket_numel=1000)
    model = _gpt()
    opt = ebt.get_optimizer(opt_config(), [model], mode="exact", bucket_numel=1000)
    inner = opt.optimizer
    mirror = inner.enable_param_mirror()
    assert mirror.numel() == inner.numel and inner.enable_param_mirror() is mirror
    losses, plain_losses = [], []
    for s in range(steps):
        plain_losses.append(_step(plain_model, plain, s, rank))
        losses.append(_step(model, opt, s, rank))
        for r in inner._runs:
            got = model.buffers[r.buffer].param_data[r.lo:r.hi]
            assert torch.equal(mirror[r.host:r.host + r.hi - r.lo], got), (s, r)
    assert losses == plain_losses, (losses, plain_losses)
    before = [p.detach().clone() for p in model.parameters()]
    for b in model.buffers:
        b.param_data.normal_()  # the weights lost (on a GPU: discarded pages)
    inner.upload_params_from_mirror()
    owned_written = all(b.param_data[lo:hi].ne(0).any() for b in model.buffers for lo, hi in shard_ranges(b))
    model.start_param_sync(force_sync=True)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    more = [_step(model, opt, s, rank) for s in range(steps, steps + 2)]
    more_plain = [_step(plain_model, plain, s, rank) for s in range(steps, steps + 2)]
    assert more == more_plain, (more, more_plain)
    return {"losses": losses, "owned_written": bool(owned_written)}
