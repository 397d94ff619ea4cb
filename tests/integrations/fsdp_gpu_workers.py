"""GPU rank bodies for the FSDP2 adapter tests (one GPU, NCCL, world 1): a transformers Qwen3 under fully_shard as
verl builds it (fp32 shards, bf16 compute under MixedPrecisionPolicy, torch AdamW on the GPU), and the rollout's
receiving process for the CUDA IPC weight sync."""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ebbtide.testing._worker import progress
from ebbtide.testing.bits import digests
from ebbtide.testing.spawn import join_store

SIZE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=32, max_position_embeddings=256)


def init(rank, world, addr, install=True):
    if install:
        import ebbtide.integrations.fsdp as ebt

        ebt.install_groups()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=join_store(addr), rank=rank, world_size=world,
                            device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=120))


def qwen3(seed=0, dtype=torch.float32, device="cuda", tie=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    # eager attention: matmuls and a softmax, deterministic under torch.use_deterministic_algorithms (the fused
    # attention kernels' backward may accumulate with atomics)
    cfg = Qwen3Config(**SIZE, tie_word_embeddings=tie, attn_implementation="eager")
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype)


def shard(model, world, bf16_compute=True, reduce_dtype=torch.float32, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if bf16_compute else \
        MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kw)
    return model


def batch(step, n=4, seq=128):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, SIZE["vocab_size"], (n, seq), generator=g).cuda()


def step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().float().cpu()


def offload_cycles(rank, world, addr, steps=10):
    """A twin trained without offload first (its memory gone before the other is built), then the same model
    offloaded and restored after every step, its groups released and reloaded: the losses are bit-identical, every
    shard keeps its identity and address, and each offload gives the tags' bytes back to the driver."""
    import ebbtide.integrations.fsdp as ebt

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    init(rank, world, addr)
    twin = shard(qwen3(), world)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.1)
    want = [step(twin, topt, batch(s)) for s in range(steps)]
    del twin, topt
    torch.cuda.empty_cache()
    model = shard(qwen3(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    state = ebt.TrainingState(model, opt)
    ebt.check_groups(model)
    ptrs = [(id(r.sharded_param), r.fsdp_param._sharded_param_data.data_ptr()) for r in ebt.describe(model).params]
    got, reports = [], []
    for s in range(steps):
        got.append(step(model, opt, batch(s)))
        off = state.offload()
        ebt.release_groups()
        free_released = torch.cuda.mem_get_info()[0]
        ebt.reload_groups()
        on = state.restore()
        now = [(id(r.sharded_param), r.fsdp_param._sharded_param_data.data_ptr()) for r in ebt.describe(model).params]
        assert now == ptrs, f"step {s}: a shard moved"
        assert off.freed >= 0.9 * off.bytes, off.summary()
        reports.append({"offload_s": off.seconds, "restore_s": on.seconds, "bytes": off.bytes,
                        "freed": off.freed, "reserved_outside": off.reserved_outside, "free_released": free_released,
                        "tags": list(off.tags)})
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want, got)), (want, got)
    assert reports[-1]["tags"] == ["fsdp_weights", "fsdp_optimizer"], reports[-1]
    dist.destroy_process_group()
    return {"losses": [x.item() for x in got], "reports": reports}


_ROLLOUT_MAIN = ("import json, sys; a = json.loads(sys.argv[1]); sys.path[:0] = a['path']; "
                 "import fsdp_gpu_workers; fsdp_gpu_workers.rollout_main(a)")


def start_rollout(args: dict):
    """The rollout in a program of its own (a subprocess, not a multiprocessing child: a rank process may be
    daemonic, and a daemonic process may not have children), in the rank's process group (stopping the rank stops
    it), its two connections inherited as sockets: (process, the sync's connection, the results' connection). ``args``: ``rollout``'s keyword
    arguments (JSON)."""
    sync, sync_child = socket.socketpair()
    res, res_child = socket.socketpair()
    fds = [sync_child.fileno(), res_child.fileno()]
    arg = json.dumps({**args, "fds": fds, "path": [os.path.dirname(os.path.abspath(__file__)), *sys.path]})
    try:
        p = subprocess.Popen([sys.executable, "-c", _ROLLOUT_MAIN, arg], pass_fds=fds)
    finally:
        sync_child.close()
        res_child.close()
    return p, Connection(sync.detach()), Connection(res.detach())


def rollout_said(res_r, wait: float = 20.0):
    """What the rollout reported last (its error, where it failed), or why nothing came."""
    try:
        return res_r.recv() if res_r.poll(wait) else f"nothing within {wait:.0f} s"
    except (EOFError, OSError) as e:
        return f"nothing: it went away ({type(e).__name__})"


def rollout_main(a: dict) -> None:
    conn, results = (Connection(socket.socket(fileno=fd).detach()) for fd in a.pop("fds"))
    a.pop("path")
    rollout(conn, results, **a)


def rollout(conn, results, specs, plan_kw, versions):
    """The rollout process on the same GPU: an HF Qwen3 (bf16, not sharded) receiving ``versions`` updates over
    CUDA IPC, the digests of its weights sent after each."""
    import traceback

    from ebbtide.sync import IpcReceiver, Plan, Receiver

    try:
        torch.cuda.set_device(0)
        model = qwen3(seed=1, dtype=torch.bfloat16)
        params = dict(model.named_parameters())
        plan = Plan.build([(n, tuple(shape), getattr(torch, dt)) for n, shape, dt in specs], **plan_kw)
        rx = IpcReceiver(conn, timeout=120)
        held = {n: params[n] for n, _, _ in specs}
        receiver = Receiver(held, plan)
        for _ in range(versions):
            v = rx.receive(receiver)
            results.send(("ok", v, digests(held)))
    except Exception as e:  # noqa: BLE001 (reported to the test, with where it happened)
        results.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        return
    try:
        rx.receive(receiver)  # the sender's close
    except Exception:  # noqa: BLE001
        pass


def ipc_sync(rank, world, addr, versions=5, fp8=False):
    """Trainer side: after every step push the model through Sender(gather=ShardGather) over CUDA IPC to the
    rollout process; its weights must equal ``ebbtide.sync.expected`` of the trainer's gathered weights bit for
    bit (bf16 raw, or FP8 block-quantized and dequantized)."""
    import ebbtide.integrations.fsdp as ebt
    from ebbtide.sync import IpcSender, Sender, expected

    init(rank, world, addr, install=False)
    model = shard(qwen3(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gather = ebt.ShardGather(model)  # bf16: the compute dtype, never the fp32 masters
    plan_kw = {"default": "fp8" if fp8 else "raw", "bucket_bytes": 4 << 20}
    plan = gather.plan(**plan_kw)
    specs = [(n, list(shape), str(dt).replace("torch.", "")) for n, shape, dt in gather.specs()]
    p, a, res_r = start_rollout({"specs": specs, "plan_kw": plan_kw, "versions": versions})
    sender = Sender(ebt.local_weights(model), IpcSender(a, timeout=120), plan=plan, gather=gather)
    progress(f"{len(plan.buckets)} buckets of {plan.nbytes} bytes; rollout pid {p.pid} started")
    seconds = []
    try:
        for v in range(1, versions + 1):
            step(model, opt, batch(v))
            try:
                rep = sender.push(v)
            except Exception as e:
                raise AssertionError(f"push {v} failed; the rollout said: {rollout_said(res_r)}") from e
            seconds.append(rep["seconds"])
            got = res_r.recv()
            progress(f"version {v}: pushed in {rep['seconds']:.3f} s, rollout {got[0]}")
            assert got[0] == "ok", f"version {v}: the rollout failed: {got}"
            assert got[1] == v, got
            full = {n: t.cpu() for n, t in ebt.full_weights(model).items()}
            own = {n: p.full_tensor().to(torch.bfloat16).cpu() for n, p in ebt.local_weights(model).items()}
            assert all(torch.equal(full[n], own[n]) for n in own)  # the gather equals FSDP's own, cast to bf16
            want = expected(plan, full)
            assert got[2] == digests({n: want[n] for n in got[2]}), f"version {v}: the rollout's weights differ"
        sender.close()
    except BaseException:
        p.kill()  # it may be waiting for the next update: do not wait for its timeout
        raise
    finally:
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    dist.destroy_process_group()
    return {"push_s": seconds, "buckets": len(plan.buckets), "exit": p.returncode}


def exact_sharded_adam(rank, world, addr, steps=20):
    """ebbtide's ShardedAdam (exact) over a bf16 FSDP2 model, offloaded with its groups released after every step,
    against FSDP2's own CPU path (CPUOffloadPolicy, fp32 shards starting from the same bf16 values, bf16 compute and
    reduction, torch's for-loop AdamW on the CPU): losses and weights bit-identical over ``steps`` steps."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    import ebbtide.integrations.fsdp as ebt

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    init(rank, world, addr)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = qwen3(device="cpu")
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    ref = shard(ref, world, reduce_dtype=torch.bfloat16, offload_policy=CPUOffloadPolicy(pin_memory=True))
    topt = torch.optim.AdamW(ref.parameters(), foreach=False, **hyper)
    want = [step(ref, topt, batch(s)) for s in range(steps)]
    ref_weights = {n: p._local_tensor.to(torch.bfloat16) for n, p in ref.named_parameters()}
    del ref, topt
    model = qwen3()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model = shard(model, world, bf16_compute=False)
    state = ebt.TrainingState(model)
    opt = ebt.sharded_adam(model, mode="exact", **hyper)
    got = []
    for s in range(steps):
        got.append(step(model, opt, batch(s)))
        state.offload()
        ebt.release_groups()
        ebt.reload_groups()
        state.restore()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want, got)), (want, got)
    for n, p in model.named_parameters():
        assert torch.equal(p._local_tensor.cpu().view(torch.int16), ref_weights[n].view(torch.int16)), n
    dist.destroy_process_group()
    return {"losses": [x.item() for x in got], "step_s": opt.last_step_times}


if __name__ == "__main__":  # pragma: no cover - run by the test through the spawn helper
    raise SystemExit(os.EX_USAGE)
