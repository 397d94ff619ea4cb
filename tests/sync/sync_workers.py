"""Child processes of the GPU sync tests (spawned; importable by name)."""
from __future__ import annotations

import os

import torch

from ebbtide.testing.bits import digests


class _DyingConn:
    """A connection that kills its process when a ``kind`` message arrives (a receiver dying mid-update: the
    sender has written the staging and asks for the commit)."""

    def __init__(self, conn, kind: str):
        self.conn, self.kind = conn, kind

    def recv(self):
        msg = self.conn.recv()
        if msg[0] == self.kind:
            os._exit(3)
        return msg

    def __getattr__(self, name):
        return getattr(self.conn, name)


def ipc_receiver(conn, results, plan_kw: dict, expect: list, die_on: str | None = None) -> None:
    """Receive ``len(expect)`` updates over CUDA IPC (``expect[i]``: the version required, or None); after each,
    send ("ok", version, digests) or ("error", type name, message, digests of what is held)."""
    from ebbtide.sync import IpcReceiver, Plan, Receiver
    from sync_models import checkpoint

    torch.cuda.set_device(0)
    src = checkpoint(0, "cuda")
    params = {n: torch.zeros_like(t) for n, t in src.items()}
    receiver = Receiver(params, Plan.of(src, **plan_kw))
    c = conn if die_on is None else _DyingConn(conn, die_on)
    rx = IpcReceiver(c, timeout=120)
    for want in expect:
        try:
            v = rx.receive(receiver, want)
            results.send(("ok", v, digests(params)))
        except Exception as e:  # noqa: BLE001 (reported to the test)
            results.send(("error", type(e).__name__, str(e), digests(params)))
            return
    try:  # the sender closes its buffers at the end
        rx.receive(receiver)
    except Exception:  # noqa: BLE001
        pass


def nccl_rank(rank: int, port: int, plan_kw: dict, versions: int, results) -> None:
    """Rank 0 sends ``versions`` updates by NCCL broadcast, rank 1 receives them; rank 1 reports digests."""
    import torch.distributed as dist

    from ebbtide.sync import NcclReceiver, NcclSender, Plan, Receiver, Sender
    from sync_models import checkpoint

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev)
    try:
        src = checkpoint(0, dev)
        plan = Plan.of(src, **plan_kw)
        if rank == 0:
            sender = Sender(src, NcclSender(dist.group.WORLD, src=0), plan=plan)
            for v in range(1, versions + 1):
                with torch.no_grad():
                    for t in src.values():
                        t.mul_(1.25)
                sender.push(v)
        else:
            params = {n: torch.zeros_like(t) for n, t in src.items()}
            receiver = Receiver(params, plan)
            for v in range(1, versions + 1):
                NcclReceiver(dist.group.WORLD, src=0).receive(receiver, v)
                results.send((v, digests(params)))
    finally:
        dist.destroy_process_group()


def rank1_dies_rank0_pushes(rank: int, sender, q) -> None:
    """After a barrier: rank 1 exits without a word (no destroy, no goodbye, once the barrier's last bytes reached
    rank 0); rank 0 pushes version 2 and reports ("push", error type or None, message, seconds). Neither returns."""
    import time

    if rank == 1:
        q.close()
        q.join_thread()  # the queue's feeder thread has written the report (os._exit skips it)
        time.sleep(0.5)
        os._exit(0)
    time.sleep(2.0)
    t0 = time.monotonic()
    try:
        sender.push(2)
        q.put(("push", None, "", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        q.put(("push", type(e).__name__, str(e), time.monotonic() - t0))
    q.close()
    q.join_thread()
    os._exit(0)  # the group is broken: skip its teardown


def tp_rank(rank: int, port: int, buf_path: str, nbytes: int, q, die: bool = False) -> None:
    """One of two TP ranks on the CPU (Gloo): shards two weights, pushes version 1 into the host buffer. ``die``:
    then rank 1 exits without a word and rank 0 pushes version 2, reporting the error and how long it took."""
    import torch.distributed as dist

    from ebbtide.sync import HostSender, Sender, SharedHostBuffer
    from sync_models import checkpoint

    from datetime import timedelta

    # the bound on a peer's death: Gloo usually sees the closed connection at once, and its op timeout otherwise
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20 if die else 300))
    try:
        full = checkpoint(0)
        dims = {"model.layers.0.self_attn.qkv_proj.weight": 0, "model.layers.0.self_attn.o_proj.weight": 1}
        local = {n: (t.chunk(2, dims[n])[rank].contiguous() if n in dims else t) for n, t in full.items()}
        buf = SharedHostBuffer(os.open(buf_path, os.O_RDWR), nbytes, pin=False)
        s = Sender(local, HostSender(buf), tp_group=dist.group.WORLD, tp_dims=dims, bucket_bytes=150_000)
        s.push(1)
        q.put((rank, s.is_source, s.plan.signature))
        if die:
            dist.barrier()
            rank1_dies_rank0_pushes(rank, s, q)
    finally:
        dist.destroy_process_group()


def ipc_receiver_region(conn, results, plan_kw: dict, versions: int, shareable: bool) -> None:
    """Receive ``versions`` updates over CUDA IPC into a staging buffer in an ebbtide.memory region (VMM memory,
    which torch's CUDA IPC handle cannot share), pausing the staging (discard) between updates as a rollout does;
    after each, send ("ok", version, digests) or ("error", type name, message, digests)."""
    import ebbtide.memory as em
    from ebbtide.sync import IpcReceiver, Plan, Receiver
    from sync_models import checkpoint

    torch.cuda.set_device(0)
    src = checkpoint(0, "cuda")
    params = {n: torch.zeros_like(t) for n, t in src.items()}
    plan = Plan.of(src, **plan_kw)
    with em.region("sync_staging", shareable=shareable):
        staging = torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
    receiver = Receiver(params, plan, staging=staging)
    rx = IpcReceiver(conn, timeout=120)
    for _ in range(versions):
        try:
            v = rx.receive(receiver)
            results.send(("ok", v, digests(params)))
        except Exception as e:  # noqa: BLE001 (reported to the test)
            results.send(("error", type(e).__name__, str(e), digests(params)))
            return
        em.pause("sync_staging")  # the rollout's pause: the staging leaves the GPU until the next update
        em.resume("sync_staging")
    try:
        rx.receive(receiver)  # the sender's close
    except Exception:  # noqa: BLE001
        pass


def sglang_consumer(conn, release_first: bool, sleep_cycles: int) -> None:
    """An SGLang-like engine for ``SGLangTensorSender``: rebuilds each bucket from the request (torch's unpickler,
    as SGLang's serializer), queues a long kernel and then the copies out of it on its stream, and answers before
    the copies ran. ``release_first``: drops the rebuilt tensors before answering (SGLang's handler: they are
    locals); otherwise after (the worst case for the sender). At "end_weight_update" replies with the digests of
    everything it copied."""
    import io
    import pickle

    torch.cuda.set_device(0)
    held = {}
    while True:
        endpoint, req = conn.recv()
        if endpoint == "exit":
            return
        if endpoint == "end_weight_update":
            torch.cuda.synchronize()
            conn.send({"success": True, "message": "", "digests": digests(held)})
            continue
        if endpoint != "update_weights_from_tensor":
            conn.send({"success": True, "message": ""})
            continue
        payload = pickle.load(io.BytesIO(req["serialized_named_tensors"][0]))
        torch.cuda._sleep(sleep_cycles)  # the engine is busy: its copies start late
        for m in payload["metadata"]:
            src = payload["flattened_tensor"][m.start_idx:m.end_idx]
            dst = held.get(m.name)
            if dst is None:
                dst = held[m.name] = torch.empty_like(src)
            dst.copy_(src)
        if release_first:
            del payload, src  # torch's deleter waits for this stream, then releases the sender's block
            conn.send({"success": True, "message": ""})
        else:
            conn.send({"success": True, "message": ""})
            del payload, src


def moe_checkpoint(experts: int = 4, layers: int = 2, seed: int = 0) -> dict:
    """A small MoE model under the global (EP=1) names: per layer a norm, ``experts`` experts (bf16 fc1/fc2
    weights, fp32 fc1 biases) and a router."""
    g = torch.Generator().manual_seed(seed)
    out = {"embedding.word_embeddings.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16)}
    for layer in range(layers):
        pre = f"decoder.layers.{layer}.mlp."
        out[f"{pre}router.weight"] = torch.randn(experts, 128, generator=g).to(torch.bfloat16)
        for e in range(experts):
            x = f"{pre}experts.local_experts.{e}."
            out[x + "linear_fc1.weight"] = torch.randn(256, 128, generator=g).to(torch.bfloat16)
            out[x + "linear_fc1.bias"] = torch.randn(256, generator=g)
            out[x + "linear_fc2.weight"] = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    return out


def ep_split(full: dict, ep: int, rank: int) -> tuple[dict, dict]:
    """(rank's local tensors under local names, {global name: (local name, EP rank)}) of ``moe_checkpoint``."""
    import re

    pat = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")
    per = 1 + max(int(pat.match(n).group(2)) for n in full if pat.match(n))
    local_n = per // ep
    local, sources = {}, {}
    for n, t in full.items():
        m = pat.match(n)
        if not m:
            local[n] = t
            continue
        e = int(m.group(2))
        owner, j = divmod(e, local_n)
        name = f"{m.group(1)}{j}{m.group(3)}"
        sources[n] = (name, owner)
        if owner == rank:
            local[name] = t.clone()
    return local, sources


def ep_rank(rank: int, port: int, buf_path: str, nbytes: int, q, die: bool = False) -> None:
    """One of two EP ranks on the CPU (Gloo), each holding half the experts: pushes version 1 of the whole model
    into its own host buffer (``buf_path`` % rank); reports (rank, plan signature, implicit plan signature,
    the refusals of bad expert arguments). ``die``: then rank 1 exits without a word and rank 0 pushes version 2,
    reporting the error and how long it took."""
    from datetime import timedelta

    import torch.distributed as dist

    from ebbtide.errors import InvalidArgumentError
    from ebbtide.sync import HostSender, Plan, Sender, SharedHostBuffer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20 if die else 300))
    try:
        full = moe_checkpoint()
        local, sources = ep_split(full, 2, rank)
        plan = Plan.of(dict(sorted(full.items())), rules=[(r"linear_fc1\.weight$", "fp8")], bucket_bytes=100_000)
        buf = SharedHostBuffer(os.open(buf_path % rank, os.O_RDWR), nbytes, pin=False)
        s = Sender(local, HostSender(buf), plan=plan, ep_group=dist.group.WORLD, ep_sources=sources,
                   each_rank_sends=True)
        s.push(1)
        implicit = Sender(local, HostSender(buf), ep_group=dist.group.WORLD, ep_sources=sources,
                          rules=[(r"linear_fc1\.weight$", "fp8")], bucket_bytes=100_000).plan.signature
        refused = []
        one = next(iter(sources))
        for bad in ({one: (sources[one][0], 2)}, {one: ("no.such.tensor", 0)},
                    {g: s for g, s in sources.items() if s[1] == 0}):
            try:
                Sender(local, HostSender(buf), ep_group=dist.group.WORLD, ep_sources=bad)
                refused.append(None)
            except InvalidArgumentError as e:
                refused.append(str(e))
        q.put((rank, plan.signature, implicit, refused))
        dist.barrier()
        if die:
            rank1_dies_rank0_pushes(rank, s, q)
    finally:
        dist.destroy_process_group()
