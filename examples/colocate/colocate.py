#!/usr/bin/env python3
"""Colocated RL on one GPU with ebbtide's public API: a trainer and a rollout process share the GPU and hand it
back and forth every step.

    python examples/colocate/colocate.py                   # one GPU
    python examples/colocate/colocate.py --device cpu      # the same processes and calls on the CPU

One step, in this process (the trainer) and its rollout process:

    trainer: train -> optimizer step -> weight update -> offload + release groups ........ onload + reload groups
    rollout:                                                 resume -> load -> generate -> pause

- ``ebbtide.memory``: the trainer's bf16 weights live in tag "weights" (kept in pinned host memory across a pause),
  its gradients in tag "grads" (discarded); the rollout's weights, KV cache and staging buffer in tags of its own,
  all discarded at its pause (the next update rewrites them). A pause hands the memory back to the driver; a
  resume maps it back at the same addresses, so every tensor stays valid.
- ``ebbtide.comm``: the process group's communicators are released while the rollout runs and reloaded after.
- ``ebbtide.optim.OffloadedAdam``: fp32 master weights and Adam's moments in host memory, the step on the CPU.
- ``ebbtide.sync``: the weights go to the rollout FP8-quantized through a shared pinned host buffer, versioned;
  the rollout applies an update whole or not at all.

Each step prints its phases, the memory the pause released and whether the rollout holds exactly the trainer's
weights (FP8 dequantized); the exit status is 1 if it did not. On the CPU nothing is paused (memory pause/resume
needs a GPU); everything else runs as on the GPU. The benchmark harness that races this loop against today's tools
is ``ebbtide colocate`` (ebbtide.bench.colocate).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import sys
import time
from multiprocessing.reduction import recv_handle, send_handle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ebbtide.comm as comm
import ebbtide.memory as em
from ebbtide.optim import OffloadedAdam
from ebbtide.sync import HostReceiver, HostSender, Plan, Receiver, Sender, SharedHostBuffer, expected

GiB = 1 << 30


class Policy(nn.Module):
    """A small next-token model: token embedding, a causal running mean over the sequence, residual MLP blocks and
    an output head (not a transformer: what matters here is where its memory lives and how its weights move)."""

    def __init__(self, vocab: int, d_model: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                  nn.Linear(4 * d_model, d_model)) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(self.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build(args, seed: int, device) -> Policy:
    torch.manual_seed(seed)
    return Policy(args.vocab, args.d_model, args.layers).to(torch.bfloat16).to(device)


def counting(args, step: int) -> torch.Tensor:
    """The task: each row counts up by one from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(args.vocab, (args.batch, 1), generator=g)
    return (start + torch.arange(args.seq + 1)) % args.vocab


def digest(named: dict) -> str:
    """One sha256 over every tensor's bytes, in name order (bitwise identity across processes)."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def region(cuda: bool, tag: str, backup: str = "none"):
    """A pausable region on the GPU; on the CPU, nothing to pause."""
    return em.region(tag, backup=backup) if cuda else contextlib.nullcontext()


# ---- the rollout process ---------------------------------------------------------------------------------------
def rollout(conn, args) -> None:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    with region(cuda, "rollout_weights"):  # discarded at every pause: each update rewrites them
        model = build(args, seed=1, device=device)  # other weights than the trainer's: only the update fixes them
    model.requires_grad_(False)
    with region(cuda, "kv_cache"):  # stands for an engine's KV cache pool
        kv = torch.empty(int(args.kv_gib * GiB), dtype=torch.uint8, device=device)
    plan = Plan.of(model.named_parameters())  # the same plan as the trainer's: its signature is checked
    with region(cuda, "staging"):
        staging = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    receiver = Receiver(model, plan, staging=staging)
    buf = SharedHostBuffer(recv_handle(conn), SharedHostBuffer.size_for(plan), pin=cuda)
    host = HostReceiver(buf)
    if cuda:
        em.pause()  # the trainer starts with the GPU
    conn.send(("ready", kv.numel()))
    while (msg := conn.recv())[0] == "step":
        version, t0 = msg[1], time.perf_counter()
        if cuda:
            em.resume()  # same addresses as before the pause; content undefined until rewritten
        host.receive(receiver, version)  # one copy to the GPU, dequantized, applied whole (version checked)
        held = digest(dict(model.named_parameters()))
        tokens = torch.randint(args.vocab, (args.batch, 8), generator=torch.Generator().manual_seed(version))
        tokens = tokens.to(device)
        with torch.no_grad():
            for _ in range(args.new_tokens):  # greedy decode
                tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        free = torch.cuda.mem_get_info(device)[0] if cuda else None
        if cuda:
            torch.cuda.empty_cache()  # the decode's scratch goes back too
            em.pause()
        conn.send(("done", {"digest": held, "tokens": tokens.numel(), "s": time.perf_counter() - t0,
                            "free_gib": None if free is None else free / GiB}))
    buf.close()
    conn.send(("bye",))


# ---- the trainer (this process) -----------------------------------------------------------------------------------
def tagged(kind, numel, dtype, device):
    """OffloadedAdam's flat bf16 weights in tag "weights" (pinned host backup), its flat gradient in "grads"."""
    with em.region("weights", backup="cpu") if kind == "params" else em.region("grads"):
        return torch.empty(numel, dtype=dtype, device=device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="the rollout's KV cache pool (GiB)")
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: run with --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        args.device = str(device)

    # One rank here; the same calls serve every rank of a data-parallel trainer.
    comm.install()  # before init_process_group: every group becomes reloadable, WORLD included
    store = comm.serve_store()  # the rendezvous store, listening on loopback only
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))

    model = build(args, seed=0, device=device)
    opt = OffloadedAdam(model.parameters(), lr=args.lr, weight_decay=0.1, buffer_factory=tagged if cuda else None)
    if cuda:
        torch.cuda.empty_cache()  # the model's construction-time tensors (now copied into the tags) go back

    plan = Plan.of(model.named_parameters())  # 2-D weights FP8 (128x128 blocks), embedding, head and norms bf16
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=cuda)
    sender = Sender(lambda: dict(model.named_parameters()), HostSender(buf, keep_slots=False), plan=plan)
    print(f"policy: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params; update {plan.nbytes / 1e6:.1f} MB "
          f"on the wire ({plan.source_bytes / 1e6:.1f} MB of bf16)", flush=True)

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=rollout, args=(there, args))
    proc.start()
    there.close()  # this end only: if the rollout dies, recv() raises instead of waiting
    send_handle(here, buf.fd, proc.pid)  # the shared buffer's memfd, to the rollout
    try:
        here.recv()  # the rollout is built and paused
        ok = train(args, device, model, opt, plan, sender, here)
    except EOFError:  # the rollout went away: its traceback is above
        proc.join(timeout=30)
        print(f"colocated loop FAILED: the rollout process exited (exit code {proc.exitcode})", file=sys.stderr)
        return 1
    here.send(("exit",))
    here.recv()
    proc.join()
    buf.close()
    dist.destroy_process_group()
    print("colocated loop: OK" if ok else "colocated loop FAILED: the rollout's weights differ from the trainer's")
    return 0 if ok and proc.exitcode == 0 else 1


def train(args, device, model, opt, plan, sender, rollout_conn) -> bool:
    """The RL steps; True when the rollout held the trainer's weights after every update."""
    cuda, here = device.type == "cuda", rollout_conn
    ok = True
    for step in range(1, args.steps + 1):
        t = {}
        t0 = time.perf_counter()
        opt.zero_grad()  # the grads tag was discarded at the last pause
        loss = model.loss(counting(args, step).to(device))
        loss.backward()
        dist.all_reduce(opt.flat_grad)  # data parallel: the gradients summed over the ranks
        opt.step(grad_scale=1.0 / dist.get_world_size())  # gradients down, CPU AdamW, bf16 weights up
        t["train+step"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        sender.push(step)  # FP8 into the shared buffer as version `step`
        t["update"] = time.perf_counter() - t0
        # what the rollout must hold after loading it: the trainer's weights quantized and dequantized (untimed)
        want = digest(expected(plan, {n: p.detach() for n, p in model.named_parameters()}))

        t0 = time.perf_counter()
        released = 0
        if cuda:
            torch.cuda.empty_cache()  # activations and the update's scratch: back to the driver
            released = em.pause().bytes  # weights copied to pinned host memory, gradients discarded
        comm.release(include_world=True, include_cpu=not cuda)  # the communicators' memory too
        t["offload"] = time.perf_counter() - t0

        here.send(("step", step))
        _, got = here.recv()  # the rollout: resume, load version `step`, generate, pause

        t0 = time.perf_counter()
        if cuda:
            em.resume()  # the weights back at the same addresses
        comm.reload()
        t["onload"] = time.perf_counter() - t0

        same = got["digest"] == want
        ok &= same
        memory = (f"trainer paused {released / GiB:.2f} GiB, GPU free while the rollout generated "
                  f"{got['free_gib']:.2f} GiB" if cuda else "nothing paused on the CPU")
        print(f"step {step}: loss {loss.item():.4f}; " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
              + f", rollout {got['s'] * 1e3:.1f} ms ({got['tokens']} tokens); {memory}; the rollout holds the "
              f"trainer's weights (FP8): {same}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
