"""Rank bodies for the FSDP2 adapter tests on the CPU (Gloo): a tiny transformers Qwen3 under fully_shard over a
1-D CPU mesh. Each returns a JSON-able dict; a failed check raises inside the rank.

On the CPU the memory tags live in the host-memory fake of the CUDA driver (EBBTIDE_LIBCUDA set by the test): the
flat buffers come from the engine's own pluggable-allocator entry inside a region and are seen by torch as CPU
tensors at the engine's addresses, so pause really unmaps them and resume maps them back at the same addresses."""
from __future__ import annotations

import ctypes
import datetime
import os
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*torch.distributed.*")

from ebbtide.testing.spawn import join_store  # noqa: E402
from ebbtide.errors import EbbtideError  # noqa: E402


def init(rank, world, addr, timeout=60, install=False):
    """Gloo over the launcher's store (``addr``: "tcp://host:port") or, for an int, a rendezvous on that port."""
    if install:
        import ebbtide.integrations.fsdp as ebt

        ebt.install_groups()
    where = ({"init_method": f"tcp://127.0.0.1:{addr}"} if isinstance(addr, int) else {"store": join_store(addr)})
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout),
                            **where)


def qwen3(seed=0, layers=2, tie=False, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(dtype)


def shard(model, world, mesh_shape=None, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


_RT = None


def fake_factory(tag, backup, numel, dtype, device):
    """Flat buffers in the engine (fake driver): ebt_torch_malloc inside a region, seen by torch as a CPU tensor."""
    global _RT
    import ebbtide.memory as em
    from ebbtide import _native

    if _RT is None:
        _RT = ctypes.CDLL(_native.runtime_library_path())
        _RT.ebt_torch_malloc.restype = ctypes.c_void_p
        _RT.ebt_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    size = torch.empty(0, dtype=dtype).element_size()
    with em.region(tag, backup=backup):
        p = _RT.ebt_torch_malloc(numel * size, 0, None)
    assert p, _native.load().last_error()
    raw = (ctypes.c_uint8 * (numel * size)).from_address(p)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def batch(step, rank, n=2, seq=12, vocab=96):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (n, seq), generator=g)


def train_step(model, opt, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.detach().clone()


def snapshot(model):
    """(ids, addresses, values) of every shard as the adapter must keep them."""
    from ebbtide.integrations.fsdp import describe

    out = []
    for r in describe(model).params:
        fp = r.fsdp_param
        out.append((id(r.sharded_param), id(fp.sharded_param), id(fp._sharded_param_data),
                    id(fp.sharded_param._local_tensor), fp._sharded_param_data.data_ptr(),
                    fp.sharded_param._local_tensor.data_ptr(), fp._sharded_param_data.clone()))
    return out


def same(a, b, addresses=True) -> bool:
    k = 6 if addresses else 4
    return all(x[:k] == y[:k] and torch.equal(x[6].view(torch.uint8), y[6].view(torch.uint8)) for x, y in zip(a, b))


def tag_rows():
    import ebbtide.memory as em

    return {r["tag"]: r for r in em.stats()["tags"]}


def memory_round_trip(rank, world, addr, steps=8):
    """A model offloaded and restored after every step trains bit for bit as its twin that never is; identities,
    addresses and values survive every cycle; the tags are really paused in between."""
    from ebbtide.integrations.fsdp import TrainingState

    init(rank, world, addr)
    a, b = shard(qwen3(), world), shard(qwen3(), world)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    before = snapshot(a)
    state = TrainingState(a, opt_a, buffer_factory=fake_factory)
    # adoption moved the content and kept every object (the parameter, its DTensor, the shard and local tensors)
    assert same(before, snapshot(a), addresses=False)
    assert all(x[4] != y[4] for x, y in zip(before, snapshot(a)))  # ... into the tag's buffer
    losses_a, losses_b, paused = [], [], []
    for step in range(steps):
        ids = batch(step, rank)
        losses_a.append(train_step(a, opt_a, ids))
        losses_b.append(train_step(b, opt_b, ids))
        snap = snapshot(a)
        rep = state.offload()
        rows = tag_rows()
        paused.append({t: rows[t]["state"] for t in rep.tags})
        assert all(rows[t]["bytes_paused"] >= rep.tags[t]["bytes"] > 0 for t in rep.tags), rows
        try:
            a(input_ids=ids)
            raise AssertionError("forward while offloaded was not refused")
        except EbbtideError as e:
            assert "offloaded" in str(e)
        state.restore()
        assert same(snap, snapshot(a)), f"step {step}: a shard moved or changed across offload/restore"
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(losses_a, losses_b))
    assert set(paused[-1]) == {"fsdp_weights", "fsdp_optimizer"}, paused[-1]
    dist.destroy_process_group()
    return {"losses": [x.item() for x in losses_a], "paused": paused[-1]}


def refusals(rank, world, addr):
    """Every refusal is a typed error raised before anything changed."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    import ebbtide.integrations.fsdp as ebt
    from ebbtide.errors import InvalidArgumentError, StateError, UnsupportedError

    init(rank, world, addr)
    seen = {}

    def expect(kind, fn, match):
        try:
            fn()
        except kind as e:
            assert match in str(e), (match, str(e))
            seen[match] = type(e).__name__
            return
        raise AssertionError(f"not refused: {match}")

    expect(InvalidArgumentError, lambda: ebt.TrainingState(qwen3(), buffer_factory=fake_factory), "not wrapped")
    ddp = torch.nn.parallel.DistributedDataParallel(qwen3())
    expect(UnsupportedError, lambda: ebt.TrainingState(ddp, buffer_factory=fake_factory), "plain Distributed")
    hsdp = shard(qwen3(), world, mesh_shape=(1, world))
    expect(UnsupportedError, lambda: ebt.TrainingState(hsdp, buffer_factory=fake_factory), "HSDP")
    off = shard(qwen3(), world, offload_policy=CPUOffloadPolicy(pin_memory=False))
    expect(UnsupportedError, lambda: ebt.TrainingState(off, buffer_factory=fake_factory), "CPUOffloadPolicy")
    expect(UnsupportedError, lambda: ebt.TrainingState(shard(qwen3(), world)), "not a GPU")
    expect(StateError, lambda: ebt.check_groups(shard(qwen3(), world)), "install_groups")  # the mesh came first

    m = shard(qwen3(), world)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
    train_step(m, opt, batch(0, rank))
    handle = m.model.layers[0].unshard(async_op=True)  # a collective in flight: nothing may change
    snap = snapshot(m)
    expect(StateError, lambda: ebt.TrainingState(m, opt, buffer_factory=fake_factory), "in flight")
    assert same(snap, snapshot(m))
    handle.wait()
    m.model.layers[0].reshard()
    state = ebt.TrainingState(m, opt, buffer_factory=fake_factory)
    expect(StateError, state.restore, "without offload")
    handle = m.model.layers[1].unshard(async_op=True)
    expect(StateError, state.offload, "in flight")
    assert not state.offloaded
    handle.wait()
    m.model.layers[1].reshard()
    state.offload()
    expect(StateError, state.offload, "called twice")
    attn = m.model.layers[0].self_attn.q_proj
    kept = attn._parameters["weight"]
    attn._parameters["weight"] = torch.nn.Parameter(torch.zeros_like(kept))  # replaced while offloaded (no read)
    expect(StateError, state.restore, "was replaced")
    assert state.offloaded and tag_rows()["fsdp_weights"]["state"] == "paused"
    attn._parameters["weight"] = kept
    state.restore()
    loss = train_step(m, opt, batch(1, rank))  # trains on after the refusals
    dist.destroy_process_group()
    return {"seen": seen, "loss": loss.item()}


def weights_sync(rank, world, addr, steps=3, bucket_bytes=6_000):
    """Each rank pushes its model to a receiver over the host transport after every step: the receiver's weights
    equal FSDP's own full tensors bit for bit, under the HF names, with one all-gather per bucket."""
    import ebbtide.integrations.fsdp as ebt
    from ebbtide.sync import HostReceiver, HostSender, Receiver, Sender, SharedHostBuffer

    init(rank, world, addr)
    model = shard(qwen3(tie=True, dtype=torch.bfloat16), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gather = ebt.ShardGather(model)
    # the plan's order is the architecture's own (a rollout builds it from its unsharded copy)
    assert [n for n, *_ in gather.specs()] == [n for n, _ in qwen3(tie=True).named_parameters()]
    sender = None
    rollout = qwen3(tie=True, dtype=torch.bfloat16)
    calls = []
    real = dist.all_gather_into_tensor

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_gather_into_tensor = counting
    for step in range(steps):
        train_step(model, opt, batch(step, rank))
        if sender is None:
            plan = gather.plan(default="raw", bucket_bytes=bucket_bytes)
            buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
            sender = Sender(ebt.local_weights(model), HostSender(buf), plan=plan, gather=gather)
            dst = dict(rollout.named_parameters())
            receiver = Receiver(dst, sender.plan)
        calls.clear()
        sender.push(step + 1)
        pushed_gathers = len(calls)
        HostReceiver(buf).receive(receiver, step + 1)
        want = {n: p.full_tensor() for n, p in ebt.local_weights(model).items()}  # FSDP's own gather
        assert set(want) == set(dst) - {"lm_head.weight"}, sorted(set(dst) ^ set(want))
        for n, t in want.items():
            assert torch.equal(t.view(torch.int16), dst[n].detach().view(torch.int16)), n
        assert pushed_gathers == len(sender.plan.buckets), (pushed_gathers, len(sender.plan.buckets))
    dist.all_gather_into_tensor = real
    full = ebt.full_weights(model)
    assert all(torch.equal(full[n], want[n]) for n in want)
    dist.destroy_process_group()
    return {"buckets": len(sender.plan.buckets), "names": sorted(want)[:3]}


def dying_rank(rank, world, port, where, q):
    """Rank 1 exits without a word, mid-offload (``where="offload"``) or before a weight push (``"gather"``); rank 0
    must get a typed error within a bound: its own offload is local, and the release after it times out naming
    rank 1; its push's gather fails as PartialUpdateError."""
    import ebbtide.integrations.fsdp as ebt
    from ebbtide.sync import HostSender, Sender, SharedHostBuffer

    init(rank, world, port, timeout=15, install=True)
    model = shard(qwen3(dtype=torch.bfloat16), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    train_step(model, opt, batch(0, rank))
    state = ebt.TrainingState(model, opt, buffer_factory=fake_factory)
    gather = ebt.ShardGather(model)
    plan = gather.plan(default="raw", bucket_bytes=20_000)
    sender = Sender(ebt.local_weights(model), HostSender(SharedHostBuffer.create(SharedHostBuffer.size_for(plan),
                                                                                 pin=False)), plan=plan, gather=gather)
    dist.barrier()
    if rank == 1:
        if where == "offload":
            state.offload()  # its pauses ran; it dies before the release that every rank must join
        time.sleep(0.5)
        os._exit(0)
    time.sleep(1.0)
    t0 = time.monotonic()
    try:
        if where == "offload":
            state.offload()
            ebt.release_groups(include_cpu=True, timeout=10)
        else:
            sender.push(1)
        err, msg = None, ""
    except Exception as e:  # noqa: BLE001 (reported to the test)
        err, msg = type(e).__name__, str(e)
    q.put((err, msg[:400], time.monotonic() - t0))
    q.close()
    q.join_thread()
    os._exit(0)  # the group is broken: skip its teardown


def bf16_params(model):
    """The model's parameters cast to bf16, its buffers (rotary frequencies) left fp32: what the fp32 model
    under MixedPrecisionPolicy(param_dtype=bf16) computes with."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def exact_sharded_adam(rank, world, addr, steps=20, offload=True, weights="copy"):
    """ShardedAdam (exact mode) over a bf16 FSDP2 model trains bit for bit as torch's AdamW (for-loop) over the same
    model kept in fp32 (starting from the same bf16 values) under MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16): the same forward, the same reduced gradients, the same master update. With ``offload``, the
    ShardedAdam model is offloaded and restored after every step (the fake driver's tags); with ``weights="discard"``
    the offload copies nothing (the optimizer's host mirror rebuilds the shards at restore)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import ebbtide.integrations.fsdp as ebt
    from ebbtide.errors import InvalidArgumentError

    init(rank, world, addr)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ref = qwen3()
    for p in ref.parameters():  # fp32 masters that start where ShardedAdam's start: the bf16 weights, exactly
        p.data = p.data.to(torch.bfloat16).float()
    ref = shard(ref, world, mp_policy=mp)
    ours = shard(bf16_params(qwen3()), world)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    decay = [p for n, p in ref.named_parameters() if n.endswith("proj.weight")]
    rest = [p for n, p in ref.named_parameters() if not n.endswith("proj.weight")]
    topt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], foreach=False, **hyper)
    state = ebt.TrainingState(ours, buffer_factory=fake_factory, weights=weights) if offload else None
    if weights == "discard":
        try:
            state.offload()
            raise AssertionError("a discard offload without the optimizer's mirror was not refused")
        except EbbtideError as e:
            assert "mirror" in str(e) and not state.offloaded
    named = dict(ours.named_parameters())
    groups = [{"params": [named[n] for n in named if n.endswith("proj.weight")]},
              {"params": [named[n] for n in named if not n.endswith("proj.weight")], "weight_decay": 0.0}]
    opt = ebt.sharded_adam(ours, groups, mode="exact", threads=1, **hyper)
    try:
        ebt.TrainingState(ours, buffer_factory=fake_factory)
        raise AssertionError("a TrainingState after the ShardedAdam was not refused")
    except InvalidArgumentError as e:
        assert "first" in str(e)
    want, got = [], []
    for step in range(steps):
        ids = batch(step, rank)
        want.append(train_step(ref, topt, ids))
        got.append(train_step(ours, opt, ids))
        if state is not None:
            rep = state.offload()
            assert list(rep.tags) == ["fsdp_weights"], rep.tags  # ShardedAdam's state lives on the host
            assert (rep.total("bytes_copied") == 0) == (weights == "discard"), rep.tags
            back = state.restore()
            if weights == "discard":
                assert back.total("bytes_copied") == opt.param_mirror.nbytes, back.tags
    for a, b in zip(want, got):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (want, got)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p._local_tensor.to(torch.bfloat16).view(torch.int16), q._local_tensor.view(torch.int16)), n
    dist.destroy_process_group()
    return {"losses": [x.item() for x in got]}


def stale_shards(rank, world, addr):
    """sharded_adam's step refuses, naming the parameter, every way FSDP can leave it holding a stale shard, and
    changes nothing; a ``.to()`` that moves nothing (new local tensors over the same memory) trains on."""
    import ebbtide.integrations.fsdp as ebt
    from ebbtide.errors import StateError

    init(rank, world, addr)
    seen = []

    def trained():
        model = shard(bf16_params(qwen3()), world)
        opt = ebt.sharded_adam(model, lr=1e-2)
        train_step(model, opt, batch(0, rank))
        return model, opt

    def refused(model, opt, match):
        out = model(input_ids=batch(1, rank), labels=batch(1, rank))
        out.loss.backward()
        before = [p._local_tensor.clone() for p in model.parameters()]
        try:
            opt.step()
            raise AssertionError(f"a stale shard was stepped ({match})")
        except StateError as e:
            assert match in str(e) and "model.embed_tokens.weight" in str(e), str(e)
            seen.append(match)
        assert opt.step_count == 1, opt.step_count
        assert all(torch.equal(a, p._local_tensor) for a, p in zip(before, model.parameters()))

    model, opt = trained()
    model.to(torch.bfloat16)  # nothing to convert: FSDP's new local tensors lie where the old ones did
    train_step(model, opt, batch(1, rank))
    assert opt.step_count == 2
    model, opt = trained()
    model.to(torch.float32).to(torch.bfloat16)  # the values moved: new local tensors in new memory
    refused(model, opt, "was moved since sharded_adam()")
    model, opt = trained()
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    refused(model, opt, "new Parameter")
    model, opt = trained()
    local = next(iter(model.parameters()))._local_tensor
    local.set_(local.clone())  # the local tensor itself re-pointed
    refused(model, opt, "moved to another storage")
    dist.destroy_process_group()
    return {"seen": seen}


def groups_cycle(rank, world, addr):
    """The mesh's groups through ebbtide.comm, install_groups() first: reloadable; a collective of the model on a
    released group raises StateError; after reload it trains on."""
    import ebbtide.integrations.fsdp as ebt
    from ebbtide.errors import StateError

    init(rank, world, addr, install=True)
    model = shard(qwen3(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    report = ebt.check_groups(model)
    assert report["shard"]["reloadable"] and report["shard"]["size"] == world, report
    before = train_step(model, opt, batch(0, rank))
    ebt.release_groups(include_cpu=True)  # Gloo is this mesh's backend
    try:
        model(input_ids=batch(1, rank))
        raise AssertionError("a forward over the released group ran")
    except StateError as e:
        assert "released" in str(e)
    for m in describe_modules(model):
        m.reshard()
    ebt.reload_groups()
    after = train_step(model, opt, batch(1, rank))
    dist.destroy_process_group()
    return {"losses": [before.item(), after.item()]}


def describe_modules(model):
    from ebbtide.integrations.fsdp import describe

    return describe(model).modules
