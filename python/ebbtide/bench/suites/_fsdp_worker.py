"""One variant of the ``fsdp`` suite in a process of its own (``cmd_bench(spec)`` run by ``ebbtide.testing.spawn.call``,
its result a dict): a transformers Qwen3 (random weights from a config) under ``fully_shard`` on one GPU,
trained, its weights pushed to a rollout process on the same GPU, its training state offloaded and onloaded, every
phase timed with the device drained around it.

Variants:
- ``ebbtide``: bf16 shards, ``TrainingState(model, weights="discard")`` + ``sharded_adam`` (fp32 master and moments
  on the host, the shards rebuilt from its host mirror), groups released and reloaded, ``Sender(gather=
  ShardGather)`` over CUDA IPC.
- ``ebbtide-gpu-adam``: verl's model and optimizer (fp32 shards, bf16 compute, torch AdamW on the GPU) with
  ebbtide's ``TrainingState(model, opt)`` and sync: the same bytes as verl's offload, moved by ebbtide.
- ``verl``: the same model and optimizer, offloaded and onloaded by verl's functions and its weight update
  (``ebbtide.anchors.verl``: ``model.cpu()`` / ``model.to()``, the state tensor by tensor, ``full_tensor()`` per
  tensor into one 2 GiB CUDA IPC buffer).
- ``cpu-offload``: ``CPUOffloadPolicy(pin_memory=True)`` with torch AdamW on the CPU (verl's ``offload_policy``);
  nothing to offload but the caching allocator's blocks; verl's weight update.
- ``tms``: verl's model and optimizer in a process started as AReaL starts its trainer (torch_memory_saver's
  preload hook, every allocation backed up to the CPU: ``ebbtide.anchors.areal.tms_env``), offloaded and onloaded
  by AReaL's ``pause()`` / ``resume()``; verl's weight update (AReaL's colocated mode goes through disk). The rollout
  process is started without the hook.
"""
from __future__ import annotations

import os
import statistics
import time

from ...testing.ports import free_port

SIZES = {  # Qwen3-1.7B's shape (tied embeddings: 1.72 B parameters), and a small one for --quick
    "default": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "quick": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True),
}
VARIANTS = ("ebbtide", "ebbtide-gpu-adam", "verl", "tms", "cpu-offload")
BUCKET_BYTES = 512 << 20


def _config(size: str):
    from transformers import Qwen3Config  # noqa: PLC0415

    return Qwen3Config(**SIZES[size], max_position_embeddings=4096)


def build(size: str, dtype):
    import torch  # noqa: PLC0415
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(_config(size))
    for p in model.parameters():  # the parameters only: the rotary frequencies stay fp32, as under mixed precision
        p.data = p.data.to(dtype)
    return model


def served_specs(size: str) -> list:
    """``[(name, shape, "bfloat16")]`` of the model's parameters (tied ones once), from a meta-device copy: the
    names ``fully_shard`` keeps and the rollout loads."""
    import torch  # noqa: PLC0415
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        m = Qwen3ForCausalLM(_config(size))
    return [(n, list(p.shape), "bfloat16") for n, p in m.named_parameters()]


class _Phases:
    """One step's phases, each timed with the device drained before and after: ``phases(name, fn)`` returns what
    ``fn`` returned and books its seconds under ``name``."""

    def __init__(self, torch):
        self._sync, self.seconds = torch.cuda.synchronize, {}

    def __call__(self, name: str, fn):
        self._sync()
        start = time.perf_counter()
        result = fn()
        self._sync()
        self.seconds[name] = time.perf_counter() - start
        return result


def rollout(conn, results, size: str, mode: str, specs, versions: int) -> None:
    """The rollout process: the same architecture in bf16, receiving ``versions`` updates (ebbtide's receiver, or
    verl's ``receive_weights`` loading by name); after each, "done" on ``results``."""
    import torch  # noqa: PLC0415

    from ebbtide.anchors import verl  # noqa: PLC0415
    from ebbtide.sync import IpcReceiver, Plan, Receiver  # noqa: PLC0415

    torch.cuda.set_device(0)
    model = build(size, torch.bfloat16)
    params = dict(model.named_parameters())
    if mode == "ebbtide":
        plan = Plan.build([(n, tuple(s), getattr(torch, d)) for n, s, d in specs], default="raw",
                          bucket_bytes=BUCKET_BYTES)
        receiver = Receiver({n: params[n] for n, _, _ in specs}, plan)
        rx = IpcReceiver(conn, timeout=600)
    torch.cuda.synchronize()
    results.send("ready")
    for _ in range(versions):
        if mode == "ebbtide":
            rx.receive(receiver)
        else:
            def load(weights):
                for n, t in weights:
                    if n in params:  # a tied lm_head.weight is the embedding's
                        params[n].data.copy_(t)
            verl.receive_weights(conn, load)
        torch.cuda.synchronize()
        results.send("done")


def _setup(variant: str, size: str):
    """(model, optimizer, offload(), onload(), TrainingState or None) for ``variant``; ``offload()`` returns the
    adapter's OffloadReport where there is one."""
    import torch  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    import ebbtide.integrations.fsdp as ebt  # noqa: PLC0415
    from ebbtide.anchors import areal, verl  # noqa: PLC0415

    mesh = init_device_mesh("cuda", (1,))
    bf16 = variant == "ebbtide"
    model = build(size, torch.bfloat16 if bf16 else torch.float32)
    kw = {} if bf16 else {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)}
    if variant == "cpu-offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    hyper = dict(lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    device = torch.device("cuda", 0)
    if variant == "ebbtide":
        state = ebt.TrainingState(model, weights="discard")
        opt = ebt.sharded_adam(model, mode="fast", **hyper)
    elif variant == "ebbtide-gpu-adam":
        opt = torch.optim.AdamW(model.parameters(), **hyper)
        state = ebt.TrainingState(model, opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), **hyper)
        state = None
    if state is not None:
        def offload():
            rep = state.offload()
            ebt.release_groups()
            return rep

        def onload():
            ebt.reload_groups()
            return state.restore()
    elif variant == "tms":
        offload, onload = areal.offload, areal.onload
    elif variant == "verl":
        def offload():
            verl.offload_model(model)
            verl.offload_optimizer(opt)
            torch.cuda.empty_cache()

        def onload():
            verl.load_model(model, device)
            verl.load_optimizer(opt, device)
    else:  # cpu-offload: shards, gradients and the optimizer already on the host
        def offload():
            torch.cuda.empty_cache()

        def onload():
            pass
    return model, opt, offload, onload, state


def cmd_bench(spec: dict) -> dict:
    import multiprocessing as mp  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import ebbtide.integrations.fsdp as ebt  # noqa: PLC0415
    from ebbtide.anchors import verl  # noqa: PLC0415
    from ebbtide.sync import IpcSender, Sender  # noqa: PLC0415

    variant, size, steps, warmup = spec["variant"], spec["size"], spec["steps"], spec["warmup"]
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
    ours = variant.startswith("ebbtide")
    if ours:
        ebt.install_groups()
    if variant == "tms":
        from ebbtide.anchors import areal  # noqa: PLC0415

        areal.saver()  # the preload hook, before the first allocation of the model
        for k in ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP"):
            os.environ.pop(k, None)  # the rollout process is started without it
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    specs = served_specs(size)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    versions = warmup + steps
    p = ctx.Process(target=rollout, args=(b, res_w, size, "ebbtide" if ours else "verl", specs, versions))
    p.start()
    b.close()
    if res_r.recv() != "ready":
        raise RuntimeError("the rollout process did not start")
    free, total = torch.cuda.mem_get_info()
    base_used = total - free  # this process's CUDA context and the rollout, before the trainer's model exists
    model, opt, offload, onload, state = _setup(variant, size)
    n = sum(p.numel() for p in model.parameters())
    dev = torch.device("cuda", 0)
    if ours:
        gather = ebt.ShardGather(model, dtype=torch.bfloat16)
        plan = gather.plan(default="raw", bucket_bytes=BUCKET_BYTES)
        sender = Sender(ebt.local_weights(model), IpcSender(a, timeout=600), plan=plan, gather=gather)

        def sync(version):
            sender.push(version)
    else:
        def sync(version):
            verl.send_weights(verl.per_tensor_weights(model, dev), a, torch.bfloat16, dev)
    g = torch.Generator().manual_seed(0)
    phases = {k: [] for k in ("train", "optimizer", "sync", "offload", "onload")}
    held, reserved = [], []
    for v in range(versions):
        ids = torch.randint(0, SIZES[size]["vocab_size"], (spec["batch"], spec["seq"]), generator=g).cuda()
        timed = _Phases(torch)
        timed("train", lambda: model(input_ids=ids, labels=ids).loss.backward())
        timed("optimizer", lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
        # until the rollout holds the version: ebbtide's commit returns after the rollout's apply, verl's last reply
        # comes before its load, so both wait for the rollout's own "done"
        if timed("sync", lambda: (sync(v + 1), res_r.recv())[1]) != "done":
            raise RuntimeError("the rollout did not load the update")
        rep = timed("offload", offload)
        free, total = torch.cuda.mem_get_info()
        used_off = total - free
        res_mem = torch.cuda.memory_reserved() if rep is None else rep.reserved_outside
        timed("onload", onload)
        if v >= warmup:
            for k in phases:
                phases[k].append(timed.seconds[k])
            held.append(used_off - base_used)
            reserved.append(res_mem)
    if ours:
        sender.close()
    p.join(120)
    moved = {"ebbtide": 2 * n, "ebbtide-gpu-adam": 12 * n, "verl": 12 * n, "tms": 12 * n, "cpu-offload": 0}[variant]
    wire = plan.nbytes if ours else 2 * n
    return {"variant": variant, "params": n, "device": torch.cuda.get_device_name(0),
            "phases": {k: {"median_s": statistics.median(x), "all_s": x} for k, x in phases.items()},
            "held_while_offloaded": statistics.median(held), "reserved_outside": statistics.median(reserved),
            "bytes_moved_each_way": moved, "source_bytes": 2 * n, "wire_bytes": wire}


def run(spec: dict, timeout: float = 1200.0, env: dict | None = None) -> dict:
    """``spec`` in a fresh process (``env``: its environment, default this one's); its JSON result, or
    RuntimeError with why it failed."""
    from ...testing import spawn  # noqa: PLC0415

    try:
        return spawn.call("cmd_bench", spec, module=__name__, env=env, timeout=timeout)
    except spawn.WorkerFailed as e:
        raise RuntimeError(f"fsdp worker {spec.get('variant')}: {e.brief}") from None
