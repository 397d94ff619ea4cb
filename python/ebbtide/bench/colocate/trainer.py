"""One trainer rank of the colocated loop's toy trainer (``python -m ebbtide.bench.colocate.trainer SPEC_JSON
OUT_JSON``; started by the launcher). It owns one GPU, starts its rollout process on the same GPU and drives the RL
step; what differs between the variants is one object (``VARIANTS``), the loop is the same code.

Policies:
- The step: train (forward, backward, gradient all-reduce with 2+ GPUs) -> optimizer (the step) -> sync_pack
  (FP8 block quant + D2H into the shared pinned buffer, while the trainer still holds its weights) ->
  trainer_pause (weights backed up, grads and activations discarded) -> comm_release -> rollout_resume ->
  sync_load (H2D + dequant in the rollout) -> generate -> rollout_pause -> trainer_resume -> comm_reload.
- Variant "ebbtide" (``_Ebbtide``): ebbtide.memory in torch hook mode (tags "weights" backup=cpu, "grads" discard;
  activations and other scratch live in torch's default pool and go back with ``empty_cache``), ``OffloadedAdam``,
  ``ebbtide.comm`` release/reload (WORLD included), ``ebbtide.quant``. Nothing of ebbtide.comm is imported with
  one GPU.
- Variant "anchor" (``_Anchor``: the same loop on today's tools, best settings, from ``ebbtide.anchors``):
  torch_memory_saver (torch hook mode, ``retain_cpu_backup=True``), ``destroy_process_group`` +
  ``init_process_group`` on a kept TCPStore, torch fused AdamW on CPU fp32 masters with plain copies, the torch
  quant formula.
- Verification runs between phases (untimed) on the steps in ``verify_steps``: the trainer computes
  ``dequant(quant(w))`` with its codec and the logits of its model holding those weights; the rollout returns
  its logits and per-weight digests after the load. With ``decode="cuda-graph"`` the rollout's verified
  generation is also compared with the eager decode (``check_decode``, reported, not gating).
- Results (phases, memory samples, checks, setup) go to the output JSON; any failure writes the traceback there
  too and exits non-zero, after asking the rollout to exit (``rank.rank_main``).
- ``device="cpu"`` (variant "ebbtide" only) runs the same processes, sync, decode and checks on the CPU with Gloo
  and without memory pause/resume or NVML: how the orchestration is tested on machines without a GPU.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch

from ...anchors import tms as anchor_tms
from ...anchors.groups import DestroyRecreate
from ...anchors.optim import TorchCpuAdamW
from ...testing.models import ModelConfig, TinyLM
from .measure import GENERATE_KEYS, NvmlProbe, Recorder
from .options import TOY_VARIANTS
from .rank import (align_ranks, align_store, exit_now, only, prompts, rank_main, reference_entry, train_tokens,
                   verify_entry)
from .rollout import RolloutClient, rollout_env
from .sync import TrainerSync

__all__ = ["main", "region_buffers", "VARIANTS", "LOGITS_RTOL"]

# The weights must match bit for bit. The logits come from the same code on the same weights, but two processes may
# pick different GEMM kernels (alignment, workspace): allowed difference, relative to the largest |logit|, is about
# two bf16 ulps there. Whether they matched bitwise is reported too.
LOGITS_RTOL = 2.0 ** -6


def region_buffers(em):
    """An OffloadedAdam ``buffer_factory`` placing the flat bf16 params in ebbtide.memory's "weights" tag (CPU
    backup) and the flat gradient in its "grads" tag (discarded at pause)."""

    def factory(kind, numel, dtype, device):
        ctx = em.region("weights", backup="cpu") if kind == "params" else em.region("grads")
        with ctx:
            return torch.empty(numel, dtype=dtype, device=device)

    return factory


def _store():
    """This rank's client of the launcher's store (loopback unless it was told otherwise; ranks only connect)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timeout=timedelta(minutes=10))


class _EbbtideGroups:
    """WORLD through ebbtide.comm (installed before it is made): released with WORLD included, reloaded eagerly."""

    def __init__(self, rank: int, world: int, dev: torch.device):
        import torch.distributed as dist  # noqa: PLC0415

        import ebbtide.comm as comm  # noqa: PLC0415

        self.dist, self.comm, self.dev = dist, comm, dev
        comm.install()
        self.store = _store()
        if dev.type == "cuda":
            dist.init_process_group("nccl", store=self.store, rank=rank, world_size=world, device_id=dev,
                                    timeout=timedelta(minutes=10))
        else:
            dist.init_process_group("gloo", store=self.store, rank=rank, world_size=world,
                                    timeout=timedelta(minutes=10))

    def all_reduce(self, t) -> None:
        self.dist.all_reduce(t)

    def release(self) -> dict:
        return {"report": self.comm.release(include_world=True, include_cpu=self.dev.type == "cpu").summary()}

    def reload(self) -> dict:
        return {"report": self.comm.reload().summary()}

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _Ebbtide:
    """The ebbtide variant's trainer state: the model's weights and gradients in memory tags, OffloadedAdam, groups
    through ebbtide.comm (see the module policies). On the CPU nothing is paused."""
    name, codec = "ebbtide", "ebbtide"

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.em = None
        if dev.type == "cuda":
            import ebbtide.memory as em  # noqa: PLC0415

            self.em = em

    def groups(self, rank: int, world: int):
        return _EbbtideGroups(rank, world, self.dev)

    def build(self, cfg: ModelConfig, *, seed: int, lr: float, world: int):
        from ebbtide.optim import OffloadedAdam  # noqa: PLC0415

        model = TinyLM.random(cfg, seed=seed, device=self.dev)
        # DP: grads are all-reduced before the step, so downloads may not start during backward
        self.opt = OffloadedAdam(model.parameters(), lr=lr, weight_decay=0.1, mode="fast",
                                 overlap_with_backward=world == 1,
                                 buffer_factory=region_buffers(self.em) if self.em is not None else None)
        if self.em is not None:
            torch.cuda.empty_cache()  # the model's construction-time tensors in the default pool go back
        self.label = f"OffloadedAdam(isa={self.opt.isa}, threads={self.opt.threads})"
        return model

    def zero_grad(self) -> None:
        self.opt.zero_grad()  # the grads tag was discarded at the last pause: zero it before accumulating

    def all_reduce_grads(self, groups, world: int) -> None:
        groups.all_reduce(self.opt.flat_grad)

    def step(self, world: int) -> int:
        self.opt.step(grad_scale=1.0 / world)
        return 2 * 2 * self.opt.numel  # grads down, params up (bf16)

    def pause(self, info: dict) -> None:
        if self.em is None:
            return  # nothing to release on the CPU
        torch.cuda.empty_cache()  # activations and other scratch of the default pool
        rep = self.em.pause()
        info.update(bytes=rep.bytes_copied, bytes_released=rep.bytes)

    def resume(self, info: dict) -> None:
        if self.em is not None:
            info["bytes"] = self.em.resume().bytes_copied

    def self_bytes(self):
        """The trainer's own view of what it holds: bytes active in the engine + torch's default pool (torch counts
        region pools in memory_reserved even while paused; the default pool is the rest). None on the CPU."""
        if self.em is None:
            return None
        tags = self.em.stats()["tags"]
        return (sum(r["bytes_active"] for r in tags) + torch.cuda.memory_reserved(self.dev)
                - sum(r["bytes_active"] + r["bytes_paused"] for r in tags))


class _Anchor:
    """The same loop on today's tools (``ebbtide.anchors``): torch_memory_saver, destroy + re-create, torch's fused
    CPU AdamW with plain copies, the torch quant formula (the sync's "torch" codec)."""
    name, codec = "anchor", "torch"
    em = None

    def __init__(self, dev: torch.device):
        self.dev = dev

    def groups(self, rank: int, world: int):
        return DestroyRecreate(_store(), rank, world, self.dev)

    def build(self, cfg: ModelConfig, *, seed: int, lr: float, world: int):
        self.tms = anchor_tms.torch_memory_saver(retain_cpu_backup=True)  # the backup kept across cycles (its best)
        with self.tms.region(tag="weights", enable_cpu_backup=True):
            model = TinyLM.random(cfg, seed=seed, device=self.dev)
        self.opt = TorchCpuAdamW(model.parameters(), lr=lr, weight_decay=0.1)
        self.label = TorchCpuAdamW.LABEL
        return model

    def zero_grad(self) -> None:
        pass  # the step dropped the gradients

    def all_reduce_grads(self, groups, world: int) -> None:
        self.opt.all_reduce_grads(groups.all_reduce, world)

    def step(self, world: int) -> int:
        self.opt.step()
        return 2 * 2 * self.opt.numel

    def pause(self, info: dict) -> None:
        anchor_tms.pause(self.tms)

    def resume(self, info: dict) -> None:
        self.tms.resume()

    def self_bytes(self):
        return None


VARIANTS = {"ebbtide": _Ebbtide, "anchor": _Anchor}
assert tuple(VARIANTS) == TOY_VARIANTS


class _Trainer:
    def __init__(self, spec: dict, rank: int, world: int):
        self.spec, self.rank, self.world, self.variant = spec, rank, world, spec["variant"]
        if self.variant not in VARIANTS:
            raise RuntimeError(f"unknown variant {self.variant!r} (known: {TOY_VARIANTS})")
        self.cuda = spec.get("device", "cuda") == "cuda"
        if self.cuda:
            self.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", str(rank))))
            torch.cuda.set_device(self.dev)
        else:
            self.dev = torch.device("cpu")
        self.cfg = ModelConfig(**spec["model"])
        self.rec = Recorder()
        self.checks: dict = {"verify": []}
        self.v = VARIANTS[self.variant](self.dev)
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
        self.comm = self.v.groups(rank, world) if world > 1 else None
        if self.comm is not None:
            self.comm.all_reduce(torch.zeros(1, device=self.dev))  # communicator up before the first timed step
        self.align = align_store(world)  # after the comm's store: the launcher's server is up
        self.nvml.claim("peer_trainers")  # other ranks' NCCL mappings on this GPU, if NVML lists them
        self.model = self.v.build(self.cfg, seed=spec["seed"], lr=spec["lr"], world=world)
        self.setup["optimizer"] = self.v.label
        self.sync = TrainerSync(self.model, self.v.codec, pin=self.cuda)
        self.verify_tokens = prompts(self.cfg, spec["verify_batch"], spec["verify_len"], spec["seed"] + 11, self.dev)
        self.rollout = self._start_rollout()
        self.nvml.claim("rollout", pid=self.rollout.info.get("pid"))
        self.setup["nvml_roles"] = {str(k): v for k, v in self.nvml.roles.items()}
        self.setup["rollout"] = {k: v for k, v in self.rollout.info.items() if k not in ("ok", "mem")}
        self.setup.update(params=self.cfg.n_params(), sync_bytes=self.sync.plan.nbytes,
                          sync_bf16_bytes=self.sync.plan.source_bytes)

    def _start_rollout(self) -> RolloutClient:
        s = self.spec
        spec = {k: s[k] for k in ("model", "variant", "seed", "gen_batch", "prompt_len", "new_tokens",
                                  "kv_reserve_bytes", "verify_batch", "verify_len", "timeout_s", "scratch_backup")}
        spec["decode"] = s.get("decode", "eager")
        spec.update(device=self.dev.index if self.cuda else "cpu", buf_bytes=self.sync.nbytes,
                    trainer_pid=os.getpid())
        return RolloutClient(spec, rollout_env(self.v.em, s["scratch_backup"]), {"buf_fd": self.sync.fd})

    # ---- measurement -----------------------------------------------------------------------------------------
    def _sample(self, step: int, phase: str, rollout_mem: dict | None = None) -> dict:
        m = self.nvml.sample()
        if m.get("device_used") is None and self.cuda:
            free, total = torch.cuda.mem_get_info(self.dev)
            m["device_used"] = total - free
        selfm = dict(rollout_mem or {})
        mine = self.v.self_bytes()
        if mine is not None:
            selfm["trainer"] = mine
        m["self"] = selfm
        self.rec.sample(step, phase, m)
        return m

    # ---- the step --------------------------------------------------------------------------------------------
    def _train(self, step: int) -> dict:
        """Forward and backward (and, with 2+ GPUs, the gradient all-reduce): the steady phase, done when the compute
        stream is. With ``OffloadedAdam(overlap_with_backward=True)`` the backward also launches gradient downloads
        on a stream of their own; what of them is still running belongs to the optimizer step, which waits for it."""
        s = self.spec
        tokens = train_tokens(self.cfg, s["batch"], s["seq"], step, self.rank).to(self.dev)
        self.v.zero_grad()
        loss = self.model.loss(tokens)
        loss.backward()
        if self.comm:
            self.v.all_reduce_grads(self.comm, self.world)
        if self.cuda:
            torch.cuda.current_stream(self.dev).synchronize()
        return {"loss": float(loss.item())}

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def step(self, step: int, verify: bool):
        R, rec = self.rollout, self.rec
        with rec.phase(step, "train") as info:
            info.update(self._train(step))
        self._sample(step, "train")
        with rec.phase(step, "optimizer") as info:  # gradients down, CPU Adam, bf16 params up
            info["bytes"] = self.v.step(self.world)
            self._sync()
        self._sample(step, "optimizer")
        ref = None
        if verify:  # untimed; the ranks' untimed work differs: the next timed phases start together
            ref = reference_entry(dict(self.model.named_parameters()), self.sync.reference(),
                                  lambda: self.model(self.verify_tokens))
            align_ranks(self.align, self.world, f"{self.variant}/{step}/reference")
        with rec.phase(step, "sync_pack") as info:
            info["bytes"] = self.sync.pack(step + 1)  # version = step + 1
        self._sample(step, "sync_pack")
        with rec.phase(step, "trainer_pause") as info:
            self._sync()
            self.v.pause(info)
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
                info.update({k: v for k, v in out.items()
                             if k in ("bytes", "bytes_released", "bytes_mapped", *GENERATE_KEYS)})
            self._sample(step, name, out.get("mem"))
            # Verification is untimed: the rollout checks between phases, before it pauses.
            if cmd == "load":
                loaded = out
                if verify:
                    loaded.update(only(R.call("verify_load", timeout=tmo), "logits", "digests"))
            if cmd == "generate":
                gen = out
                self._note_decode(out)
                if verify:
                    gen.update(only(R.call("verify_generate", timeout=tmo), "decode_vs_full_max_abs",
                                    "decode_vs_full_rel", "decode_vs_full_argmax_equal"))
                if verify and out.get("decode") != "eager":  # the graph decode against the eager one
                    gen.update(R.call("check_decode", timeout=tmo))
        if verify:
            self.checks["verify"].append(verify_entry(step, self.rank, ref, loaded, gen, LOGITS_RTOL))
            align_ranks(self.align, self.world, f"{self.variant}/{step}/verify")
        with rec.phase(step, "trainer_resume") as info:
            self.v.resume(info)
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
            ro["graph_pausable"] = self.v.name == "ebbtide"
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


def main(argv=None) -> int:
    return rank_main(_Trainer, argv)


if __name__ == "__main__":
    exit_now(main())
