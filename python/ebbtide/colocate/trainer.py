"""One trainer rank of the colocated loop (``python -m ebbtide.colocate.trainer SPEC_JSON``; started by the
launcher). It owns one GPU, starts its rollout process on the same GPU and drives the RL step.

Policies:
- The step: train (forward, backward, gradient all-reduce with 2+ GPUs) -> optimizer (the step) -> sync_pack
  (FP8 block quant + D2H into the shared pinned buffer, while the trainer still holds its weights) ->
  trainer_pause (weights backed up, grads and activations discarded) -> comm_release -> rollout_resume ->
  sync_load (H2D + dequant in the rollout) -> generate -> rollout_pause -> trainer_resume -> comm_reload.
- Variant "ebbtide": ebbtide.memory in torch hook mode (tags "weights" backup=cpu, "grads" discard; activations
  and other scratch live in torch's default pool and go back with ``empty_cache``), ``OffloadedAdam``,
  ``ebbtide.comm`` release/reload (WORLD included), ``ebbtide.quant``. Nothing of ebbtide.comm is imported with
  one GPU.
- Variant "anchor" (the same loop on today's tools, best settings): torch_memory_saver (torch hook mode,
  ``retain_cpu_backup=True``), ``destroy_process_group`` + ``init_process_group`` on a kept TCPStore, torch fused
  AdamW on CPU fp32 masters with plain copies, the torch quant formula.
- Verification runs between phases (untimed) on the steps in ``verify_steps``: the trainer computes
  ``dequant(quant(w))`` with its codec and the logits of its model holding those weights; the rollout returns
  its logits and per-weight digests after the load. With ``decode="cuda-graph"`` the rollout's verified
  generation is also compared with the eager decode (``check_decode``, reported, not gating).
- Results (phases, memory samples, checks, setup) go to the output JSON; any failure writes the traceback there
  too and exits non-zero, after asking the rollout to exit.
- ``device="cpu"`` (variant "ebbtide" only) runs the same processes, sync, decode and checks on the CPU with Gloo
  and without memory pause/resume or NVML: how the orchestration is tested on machines without a GPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

from .measure import NvmlProbe, Recorder
from .model import ModelConfig, TinyLM
from .rollout import SCRATCH_TAG, die_with_parent, prompts, weight_digests
from .sync import TrainerSync

__all__ = ["main", "train_tokens", "region_buffers", "without_expandable_segments", "verify_entry", "reference_entry",
           "rollout_env", "align_ranks", "align_store"]

# The weights must match bit for bit. The logits come from the same code on the same weights, but two processes may
# pick different GEMM kernels (alignment, workspace): allowed difference, relative to the largest |logit|, is about
# two bf16 ulps there. Whether they matched bitwise is reported too.
LOGITS_RTOL = 2.0 ** -6


def train_tokens(cfg: ModelConfig, batch: int, seq: int, step: int, rank: int) -> torch.Tensor:
    """A learnable synthetic task: each row counts up by one from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(cfg.vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq + 1)) % cfg.vocab


def region_buffers(em):
    """An OffloadedAdam ``buffer_factory`` placing the flat bf16 params in ebbtide.memory's "weights" tag (CPU
    backup) and the flat gradient in its "grads" tag (discarded at pause)."""

    def factory(kind, numel, dtype, device):
        ctx = em.region("weights", backup="cpu") if kind == "params" else em.region("grads")
        with ctx:
            return torch.empty(numel, dtype=dtype, device=device)

    return factory


def rollout_env(em, scratch_backup: str) -> dict:
    """The rollout process's environment: this one without the launcher's rank variables; with ``em`` (the
    ebbtide.memory module) also under the LD_PRELOAD shim, its untagged allocations in ``SCRATCH_TAG`` (``keep``:
    never paused, so no backup)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if em is None:
        return env
    backup = "none" if scratch_backup == "keep" else scratch_backup
    return em.preload_env(without_expandable_segments(env), default_tag=SCRATCH_TAG, default_backup=backup)


def without_expandable_segments(env: dict) -> dict:
    """``env`` without ``expandable_segments:True`` in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF. Expandable
    segments map memory with cuMemCreate, around cudaMalloc, so the preload shim could pause none of the rollout's
    allocations (ebbtide.memory refuses regions under it); the rollout uses the plain caching allocator instead."""
    out = dict(env)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if key not in out:
            continue
        keep = [e for e in out[key].split(",")
                if e.strip() and not e.replace(" ", "").lower().startswith("expandable_segments:")]
        if keep:
            out[key] = ",".join(keep)
        else:
            del out[key]
    return out


class _RolloutClient:
    """The rollout process and its socket; ``call`` raises with the rollout's traceback on failure. ``fds``: file
    descriptors the rollout inherits, named in its spec (``buf_fd``: the shared host buffer; ``sync_fd``: the
    socket of the IPC weight sync). ``send`` + ``reply`` split a call around work the trainer does meanwhile."""

    def __init__(self, spec: dict, env: dict, fds: dict):
        parent, child = socket.socketpair()
        spec = dict(spec, sock_fd=child.fileno(), **fds)
        self.proc = subprocess.Popen([sys.executable, "-m", "ebbtide.colocate.rollout", json.dumps(spec)], env=env,
                                     pass_fds=(child.fileno(), *fds.values()))
        child.close()
        self.conn = Connection(parent.detach())
        self.info = self._recv(timeout=spec.get("timeout_s", 600))

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the rollout did not answer within {timeout} s (exit code {self.proc.poll()})")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = None
            raise RuntimeError(f"the rollout process went away ({type(e).__name__}; exit code {rc}); its output "
                               f"is in this log above") from None
        if not msg.get("ok"):
            raise RuntimeError(f"rollout failed:\n{msg.get('error', msg)}")
        return msg

    def call(self, cmd: str, timeout: float = 600, **args) -> dict:
        self.send(cmd, **args)
        return self._recv(timeout)

    def send(self, cmd: str, **args) -> None:
        self.conn.send({"cmd": cmd, "args": args})

    def reply(self, timeout: float = 600) -> dict:
        return self._recv(timeout)

    def close(self):
        try:
            if self.proc.poll() is None:
                self.conn.send({"cmd": "exit"})
                self.conn.poll(30) and self.conn.recv()
        except (OSError, EOFError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Comm:
    """Data-parallel gradient all-reduce and release/reload (ebbtide.comm) or destroy/re-create (anchor)."""

    def __init__(self, variant: str, rank: int, world: int, dev: torch.device):
        import torch.distributed as dist  # noqa: PLC0415

        self.dist, self.variant, self.rank, self.world, self.dev = dist, variant, rank, world, dev
        self.generation = 0
        if variant == "ebbtide":
            import ebbtide.comm as comm  # noqa: PLC0415

            self.comm = comm
            comm.install()
        # The launcher serves the store (loopback unless it was told otherwise); ranks only connect.
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = dist.TCPStore(host, port, None, False, timeout=timedelta(minutes=10))
        if variant == "ebbtide":
            if dev.type == "cuda":
                dist.init_process_group("nccl", store=self.store, rank=rank, world_size=world, device_id=dev,
                                        timeout=timedelta(minutes=10))
            else:
                dist.init_process_group("gloo", store=self.store, rank=rank, world_size=world,
                                        timeout=timedelta(minutes=10))
        else:
            self._init()
        self.all_reduce(torch.zeros(1, device=dev))  # communicator up before the first timed step

    def _init(self):
        self.dist.init_process_group("nccl", store=self.dist.PrefixStore(f"gen{self.generation}", self.store),
                                     rank=self.rank, world_size=self.world, device_id=self.dev,
                                     timeout=timedelta(minutes=10))

    def all_reduce(self, t):
        self.dist.all_reduce(t)

    def release(self) -> dict:
        if self.variant == "ebbtide":
            rep = self.comm.release(include_world=True, include_cpu=self.dev.type == "cpu")
            return {"report": rep.summary()}
        self.dist.destroy_process_group()
        return {}

    def reload(self) -> dict:
        if self.variant == "ebbtide":
            rep = self.comm.reload()
            return {"report": rep.summary()}
        self.generation += 1
        self._init()
        self.dist.barrier(device_ids=[self.dev.index])
        return {}

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _Trainer:
    def __init__(self, spec: dict, rank: int, world: int):
        self.spec, self.rank, self.world, self.variant = spec, rank, world, spec["variant"]
        self.cuda = spec.get("device", "cuda") == "cuda"
        if self.cuda:
            self.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", str(rank))))
            torch.cuda.set_device(self.dev)
        else:
            self.dev = torch.device("cpu")
        self.cfg = ModelConfig(**spec["model"])
        self.codec = "ebbtide" if self.variant == "ebbtide" else "torch"
        self.rec = Recorder()
        self.checks: dict = {"verify": []}
        self.em = None
        if self.variant == "ebbtide" and self.cuda:
            import ebbtide.memory as em  # noqa: PLC0415

            self.em = em
        self.setup: dict = {"variant": self.variant, "rank": rank, "world": world,
                            "device_name": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
                            "torch": torch.__version__, "pid": os.getpid()}
        torch.zeros(1, device=self.dev)  # the CUDA context
        if self.cuda:
            props = torch.cuda.get_device_properties(self.dev)
            self.nvml = NvmlProbe(uuid=str(getattr(props, "uuid", "") or ""), index=self.dev.index)
        else:
            self.nvml = NvmlProbe.unavailable("device is cpu")
        self.setup["nvml"] = self.nvml.why or "ok"
        self.nvml.assign(spec.get("baseline_pids", []), "other")
        self.nvml.claim("trainer", pid=os.getpid())
        self.setup["context_bytes"] = self._sample(-1, "context")["nvml"].get("trainer")
        self.comm = _Comm(self.variant, rank, world, self.dev) if world > 1 else None
        self.align = align_store(world)  # after the comm's store: the launcher's server is up
        self.nvml.claim("peer_trainers")  # other ranks' NCCL mappings on this GPU, if NVML lists them
        self._build_model()
        self.sync = TrainerSync(self.model, self.codec, pin=self.cuda)
        self.verify_tokens = prompts(self.cfg, spec["verify_batch"], spec["verify_len"], spec["seed"] + 11, self.dev)
        self.rollout = self._start_rollout()
        self.nvml.claim("rollout", pid=self.rollout.info.get("pid"))
        self.setup["nvml_roles"] = {str(k): v for k, v in self.nvml.roles.items()}
        self.setup["rollout"] = {k: v for k, v in self.rollout.info.items() if k not in ("ok", "mem")}
        self.setup.update(params=self.cfg.n_params(), sync_bytes=self.sync.plan.nbytes,
                          sync_bf16_bytes=self.sync.plan.source_bytes)

    # ---- setup -----------------------------------------------------------------------------------------------
    def _build_model(self):
        s = self.spec
        if self.variant == "ebbtide":
            from ebbtide.optim import OffloadedAdam  # noqa: PLC0415

            em = self.em
            self.model = TinyLM.random(self.cfg, seed=s["seed"], device=self.dev)
            # DP: grads are all-reduced before the step, so downloads may not start during backward
            self.opt = OffloadedAdam(self.model.parameters(), lr=s["lr"], weight_decay=0.1, mode="fast",
                                     overlap_with_backward=self.world == 1,
                                     buffer_factory=region_buffers(em) if self.cuda else None)
            if self.cuda:
                torch.cuda.empty_cache()  # the model's construction-time tensors in the default pool go back
            self.setup["optimizer"] = f"OffloadedAdam(isa={self.opt.isa}, threads={self.opt.threads})"
        else:
            from torch_memory_saver import torch_memory_saver as tms  # noqa: PLC0415

            self.tms = tms
            tms.hook_mode = "torch"
            tms.retain_cpu_backup = True  # keep the pinned backup across cycles (its best setting)
            with tms.region(tag="weights", enable_cpu_backup=True):
                self.model = TinyLM.random(self.cfg, seed=s["seed"], device=self.dev)
            self.params = list(self.model.parameters())
            self.masters = [p.detach().float().cpu().requires_grad_(True) for p in self.params]
            self.opt = torch.optim.AdamW(self.masters, lr=s["lr"], weight_decay=0.1, fused=True)
            self.setup["optimizer"] = "torch.optim.AdamW(fused=True) on CPU fp32 masters, plain copies"

    def _start_rollout(self) -> _RolloutClient:
        s = self.spec
        spec = {k: s[k] for k in ("model", "variant", "seed", "gen_batch", "prompt_len", "new_tokens",
                                  "kv_reserve_bytes", "verify_batch", "verify_len", "timeout_s", "scratch_backup")}
        spec["decode"] = s.get("decode", "eager")
        spec.update(device=self.dev.index if self.cuda else "cpu", buf_bytes=self.sync.nbytes,
                    trainer_pid=os.getpid())
        env = rollout_env(self.em if self.variant == "ebbtide" and self.cuda else None, s["scratch_backup"])
        return _RolloutClient(spec, env, {"buf_fd": self.sync.fd})

    # ---- measurement -----------------------------------------------------------------------------------------
    def _sample(self, step: int, phase: str, rollout_mem: dict | None = None) -> dict:
        m = self.nvml.sample()
        if m.get("device_used") is None and self.cuda:
            free, total = torch.cuda.mem_get_info(self.dev)
            m["device_used"] = total - free
        selfm = dict(rollout_mem or {})
        if self.em is not None:
            selfm["trainer"] = (sum(r["bytes_active"] for r in self.em.stats()["tags"])
                                + torch.cuda.memory_reserved(self.dev) - self._region_reserved())
        m["self"] = selfm
        self.rec.sample(step, phase, m)
        return m

    def _region_reserved(self) -> int:
        # torch counts region pools in memory_reserved even while paused; the default pool is the rest
        return sum(r["bytes_active"] + r["bytes_paused"] for r in self.em.stats()["tags"])

    # ---- the step --------------------------------------------------------------------------------------------
    def _train(self, step: int) -> dict:
        """Forward and backward (and, with 2+ GPUs, the gradient all-reduce): the steady phase, done when the compute
        stream is. With ``OffloadedAdam(overlap_with_backward=True)`` the backward also launches gradient downloads
        on a stream of their own; what of them is still running belongs to the optimizer step, which waits for it."""
        s = self.spec
        tokens = train_tokens(self.cfg, s["batch"], s["seq"], step, self.rank).to(self.dev)
        if self.variant == "ebbtide":
            self.opt.zero_grad()  # the grads tag was discarded at the last pause: zero it before accumulating
        loss = self.model.loss(tokens)
        loss.backward()
        if self.comm:
            if self.variant == "ebbtide":
                self.comm.all_reduce(self.opt.flat_grad)
            else:
                grads = [p.grad for p in self.params]
                flat = torch._utils._flatten_dense_tensors(grads)
                self.comm.all_reduce(flat)
                flat.div_(self.world)
                for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(f)
        if self.cuda:
            torch.cuda.current_stream(self.dev).synchronize()
        return {"loss": float(loss.item())}

    def _step_optimizer(self) -> dict:
        """The optimizer step: gradients down, CPU Adam, bf16 params up."""
        if self.variant == "ebbtide":
            self.opt.step(grad_scale=1.0 / self.world)
            moved = 2 * 2 * self.opt.numel  # grads down, params up (bf16)
        else:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float().cpu()
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m.detach().to(torch.bfloat16))
                    p.grad = None
            moved = 2 * 2 * sum(p.numel() for p in self.params)
        self._sync()
        return {"bytes": moved}

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def _reference(self) -> dict:
        return reference_entry(dict(self.model.named_parameters()), self.sync.reference(),
                               lambda: self.model(self.verify_tokens))

    def _verify(self, step: int, ref: dict, got: dict, gen: dict):
        self.checks["verify"].append(verify_entry(step, self.rank, ref, got, gen, LOGITS_RTOL))

    def step(self, step: int, verify: bool):
        R, rec = self.rollout, self.rec
        with rec.phase(step, "train") as info:
            info.update(self._train(step))
        self._sample(step, "train")
        with rec.phase(step, "optimizer") as info:
            info.update(self._step_optimizer())
        self._sample(step, "optimizer")
        ref = self._reference() if verify else None  # untimed
        if verify:  # the ranks' untimed work differs: the next timed phases start together
            align_ranks(self.align, self.world, f"{self.variant}/{step}/reference")
        with rec.phase(step, "sync_pack") as info:
            info["bytes"] = self.sync.pack(step + 1)  # version = step + 1
        self._sample(step, "sync_pack")
        with rec.phase(step, "trainer_pause") as info:
            self._sync()
            if not self.cuda:
                pass  # nothing to release on the CPU
            elif self.variant == "ebbtide":
                torch.cuda.empty_cache()  # activations and other scratch of the default pool
                rep = self.em.pause()
                info.update(bytes=rep.bytes_copied, bytes_released=rep.bytes)
            else:
                torch.cuda.empty_cache()
                self.tms.pause()
                torch.cuda.empty_cache()
        self._sample(step, "trainer_pause")
        if self.comm:
            with rec.phase(step, "comm_release") as info:
                info.update(self.comm.release())
            self._sample(step, "comm_release")
        tmo = self.spec["timeout_s"]
        for name, cmd in (("rollout_resume", "resume"), ("sync_load", "load"), ("generate", "generate"),
                          ("rollout_pause", "pause")):
            with rec.phase(step, name) as info:
                out = R.call(cmd, timeout=tmo, **({"version": step + 1} if cmd == "load" else {}))
                info.update({k: v for k, v in out.items() if k in ("bytes", "inside_s", "tokens", "bytes_released",
                                                                   "bytes_mapped", "prefill_gpu_s", "decode_gpu_s",
                                                                   "host_enqueue_s", "prefill_host_s",
                                                                   "device_mallocs")})
            self._sample(step, name, out.get("mem"))
            # Verification is untimed: the rollout checks between phases, before it pauses.
            if cmd == "load":
                loaded = out
                if verify:
                    loaded.update(_only(R.call("verify_load", timeout=tmo), "logits", "digests"))
            if cmd == "generate":
                gen = out
                self._note_decode(out)
                if verify:
                    gen.update(_only(R.call("verify_generate", timeout=tmo), "decode_vs_full_max_abs",
                                     "decode_vs_full_rel", "decode_vs_full_argmax_equal"))
                if verify and out.get("decode") != "eager":  # the graph decode against the eager one
                    gen.update(R.call("check_decode", timeout=tmo))
        if verify:
            self._verify(step, ref, loaded, gen)
            align_ranks(self.align, self.world, f"{self.variant}/{step}/verify")
        with rec.phase(step, "trainer_resume") as info:
            if not self.cuda:
                pass
            elif self.variant == "ebbtide":
                rep = self.em.resume()
                info["bytes"] = rep.bytes_copied
            else:
                self.tms.resume()
            self._sync()
        self._sample(step, "trainer_resume")
        if self.comm:
            with rec.phase(step, "comm_reload") as info:
                info.update(self.comm.reload())
            self._sample(step, "comm_reload")

    def _note_decode(self, gen: dict):
        """What the rollout's decode really was, and the memory its graph took (the anchor holds it while
        paused), into setup["rollout"] once."""
        ro = self.setup.setdefault("rollout", {})
        if "decode_used" not in ro:
            ro["decode_used"] = gen.get("decode")
        if "graph_bytes" in gen and "graph_bytes" not in ro:
            ro["graph_bytes"] = gen["graph_bytes"]
            ro["graph_pausable"] = self.variant == "ebbtide"
            if "graph_engine_bytes" in gen:
                ro["graph_engine_bytes"] = gen["graph_engine_bytes"]

    def run(self) -> None:
        steps = self.spec["steps"]
        verify_steps = {0, steps - 1}
        for s in range(steps):
            self.step(s, s in verify_steps)
            last = [p for p in self.rec.phases if p["step"] == s]
            print(f"[{self.variant} rank {self.rank}] step {s}: {sum(p['s'] for p in last) * 1e3:.1f} ms, "
                  f"loss {last[0].get('loss', float('nan')):.4f}", flush=True)

    def close(self):
        self.rollout.close()
        self.sync.close()


@torch.no_grad()
def reference_entry(named: dict, ref: dict, forward, local=None) -> dict:
    """What the rollout must show after the sync: the last-position logits of ``forward()`` run with ``ref`` (the
    weights the rollout must hold) copied into the parameters ``named`` (put back afterwards), and ``ref``'s
    digests. ``local(name, ref)``: what this rank's parameter ``name`` holds of the whole ``ref`` (tensor
    parallel: its piece; expert parallel: the global expert it is)."""
    saved = {n: p.detach().clone() for n, p in named.items()}
    try:
        for n, p in named.items():
            p.copy_(local(n, ref) if local is not None else ref[n])
        logits = forward()[:, -1].float().cpu()
    finally:
        for n, p in named.items():
            p.copy_(saved[n])
    return {"logits": logits, "digests": weight_digests(ref)}


def verify_entry(step: int, rank: int, ref: dict, got: dict, gen: dict, rtol: float) -> dict:
    """One verified step: ``ref`` (the trainer's {"digests", "logits"}) against what the rollout returned after
    the load (``got``) and its generation checks (``gen``). ``ok``: every weight bitwise equal and the logits within
    ``rtol`` of the largest |logit|."""
    mismatch = [n for n, d in ref["digests"].items() if got["digests"].get(n) != d]
    logits = torch.tensor(got["logits"])
    diff = float((logits - ref["logits"]).abs().max().item())
    tol = rtol * float(ref["logits"].abs().max().item())
    whole = hashlib.sha256("".join(ref["digests"][n] for n in sorted(ref["digests"])).encode()).hexdigest()
    return {"step": step, "rank": rank, "ok": not mismatch and diff <= tol, "trainer_weights_digest": whole,
            "weights_bitwise_equal": not mismatch, "mismatching_weights": mismatch[:8],
            "logits_bitwise_equal": bool(torch.equal(logits, ref["logits"])),
            "logits_max_abs_diff": diff, "logits_atol": tol, "decode": gen.get("decode"),
            **{k: gen.get(k) for k in ("decode_vs_full_max_abs", "decode_vs_full_rel", "decode_vs_full_argmax_equal",
                                       "decode_vs_eager_tokens_equal", "decode_vs_eager_first_diff",
                                       "decode_vs_eager_max_abs") if k in gen}}


def align_store(world: int):
    """A connection of this rank's own to the launcher's store for ``align_ranks`` (None with one rank). Its own: a
    blocking wait on a store client blocks every other call on that client, and the ebbtide variant's background
    group release runs its own store barrier on the trainer's client while the main thread aligns."""
    if world <= 1:
        return None
    import torch.distributed as dist  # noqa: PLC0415

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timeout=timedelta(minutes=10))


def align_ranks(store, world: int, key: str) -> None:
    """Return once all ``world`` ranks have called this with ``key``: a barrier on the launcher's store (a connection
    from ``align_store``), which needs no process group (the loop's groups may be released when it runs). The loops
    call it after their untimed verification, whose length differs between ranks: without it the next timed phase
    holding a barrier of its own (group release or reload) measures that difference."""
    if world <= 1:
        return
    if store.add(f"align/{key}", 1) == world:
        store.set(f"align/{key}/go", b"1")
    store.wait([f"align/{key}/go"])


def _only(d: dict, *keys: str) -> dict:
    """The entries of ``d`` named in ``keys`` (a reply's payload without its timing and memory fields)."""
    return {k: d[k] for k in keys if k in d}


def main(argv=None, trainer_cls=None) -> int:
    """Run one rank (``trainer_cls``: this module's trainer unless another loop's is given) and write its result
    file; 0 on success."""
    args = argv or sys.argv[1:]
    spec, out_path = json.loads(args[0]), args[1]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    result: dict = {"ok": False, "rank": rank}
    tr = None
    t0 = time.perf_counter()
    try:
        die_with_parent(spec.get("launcher_pid"))
        tr = (trainer_cls or _Trainer)(spec, rank, world)
        result["setup"] = tr.setup
        tr.run()
        result["ok"] = True
    except Exception:  # noqa: BLE001 (written to the result file and printed; the launcher reports it)
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    finally:
        if tr is not None:
            result.update(phases=tr.rec.phases, memory=tr.rec.memory, checks=tr.checks, setup=tr.setup)
            try:
                tr.close()
            except Exception:  # noqa: BLE001
                result.setdefault("close_error", traceback.format_exc())
        result["wall_s"] = time.perf_counter() - t0
        with open(out_path, "w") as f:
            json.dump(result, f)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: paused pools, pinned registrations and communicators go with the process (a
    # teardown that frees them one by one can block on a peer that already left)
    os._exit(code)
