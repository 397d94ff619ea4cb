"""What differs between the Megatron loop's variants, one object each; ``mtrainer`` runs the same step over any
of them. Each object: where the trainer's memory lives and how it goes (``offload`` / ``onload``), how its
optimizer is built and stepped, the group settings it runs, and how the weights reach the rollout (``sync_mode``;
``early_sync``: the update opened beside the CPU step).

- ``Ebbtide``: the public adapter only (``ebbtide.integrations.megatron``): ``get_optimizer`` (the distributed
  form with data or expert parallelism), ``TrainingState`` offload and restore with ``weights="discard"`` (the
  weights dropped and rebuilt from the optimizer's host mirror, as slime drops its DDP buffers and restores them
  from its TensorBackuper; the upload overlapping the next first forward), groups as ``spec`` says, weights by
  ``ebbtide.sync`` over CUDA IPC.
- ``Slime`` (variants "slime", "slime-ebbtide", "gpu-tms"): today's tools from ``ebbtide.anchors``: "slime" is
  slime's colocated configuration (DistributedOptimizer + HybridDeviceOptimizer, precision-aware unless
  ``spec["anchor_precision_aware"]`` is False; torch_memory_saver with the optimizer in a region with CPU backup,
  the DDP param and grad buffers in a region without backup and the weights in slime's TensorBackuper), "gpu-tms"
  Megatron's GPU-resident DistributedOptimizer with the DDP buffers and the optimizer state in one region with CPU
  backup, "slime-ebbtide" "slime" on ``ebbtide.compat.torch_memory_saver``. They run slime's group settings (lazy
  communicators, NCCL_CUMEM_ENABLE=0, destroy-and-rebuild joined) and the slime-style weight update. The model is
  built outside torch_memory_saver and only the DDP construction inside it, so the model's construction-time
  storages (freed once DDP copied them into its buffers) are not cached in a region pool that every pause would
  copy; the optimizer step runs inside the region, so state the step creates lazily (Adam's moments) is paused
  with the rest.
"""
from __future__ import annotations

import contextlib
import os

import torch

from ...anchors import tms as anchor_tms
from .options import CACHE_TRIMS, MEGATRON_VARIANTS, MOMENTS, SYNC_FILLS
from .rank import choice as _choice
from .rank import group_settings, pipeline_times

__all__ = ["Ebbtide", "Slime", "variant"]


def _dims(tr) -> tuple:
    c = tr.cfg
    return (c.n_layers, c.d_model, c.n_heads, c.d_ff, c.vocab, c.max_seq)


class Ebbtide:
    name = sync_mode = "ebbtide"
    early_sync = True  # the rollout resumes and the update opens beside the CPU step (the GPU is idle meanwhile)
    releases_groups = True
    install = {}  # ebbtide.integrations.megatron.install_groups arguments: its default strategy

    def __init__(self, name: str):
        import ebbtide.memory as em  # noqa: PLC0415

        self.em = em
        self.state = None
        self.streamed_sync = False

    def group_settings(self, spec: dict) -> tuple:
        """(communicator mode, NCCL_CUMEM_ENABLE, teardown) as ``spec`` asks."""
        return group_settings(spec)

    def host_threads(self, local: int, setup: dict) -> None:
        pass  # ebbtide's pool takes this rank's share of the host's cores by its own default (LOCAL_WORLD_SIZE)

    def build(self, tr):
        """The model, ebbtide's optimizer and the training state on ``tr`` (the trainer rank); returns (model, opt)."""
        from ...anchors.megatron import build_gpt, opt_config  # noqa: PLC0415

        s, ebt = tr.spec, tr.ebt
        moe = (tr.moe["experts"], tr.moe["topk"]) if tr.moe else None
        moments = _choice(s, "moments", "fp32", MOMENTS)
        # the distributed optimizer: each DP rank's host state is its shard (the adapter steps expert-parallel
        # params only in that form; a MoE model runs at EP >= 2, so DP >= 2 here anyway)
        sharded = tr.dp > 1 or moe is not None
        model = build_gpt(*_dims(tr), dist_opt=sharded, seed=s["seed"] + 1234, moe=moe)
        cfg = opt_config(lr=s["lr"], clip_grad=1.0, use_distributed_optimizer=sharded)
        if moments == "bf16":
            # Megatron's precision-aware fields, set after construction as a config made on a Transformer Engine
            # machine carries them: megatron-core 0.16.1 validates use_precision_aware_optimizer through TE's
            # version and fails without TE (is_te_min_version), even with CPU offload.
            cfg.use_precision_aware_optimizer = cfg.use_distributed_optimizer = True
            cfg.exp_avg_dtype = cfg.exp_avg_sq_dtype = torch.bfloat16
        opt = ebt.get_optimizer(cfg, [model])
        # weights dropped at the offload and rebuilt from the optimizer's host mirror (sharded: each rank's
        # slices, all-gathered at the first forward, after the groups' reload)
        self.state = ebt.TrainingState([model], opt, weights="discard")
        trim = _choice(s, "cache_trim", "auto", CACHE_TRIMS)
        if trim == "auto":  # measured: the trim beside the sharded step delays its param gather's launch
            trim = "offload" if sharded else "step"
        if trim == "step":  # the activations' cached blocks go back while the host steps, not in the offload
            opt.update_start_hooks.append(lambda: self.state.trim_cache(background=True))
        fill = _choice(s, "sync_fill", "auto", SYNC_FILLS)
        # streamed: needs the non-sharded optimizer's bucket hook and a sender without TP/EP gathers
        can_stream = not sharded and tr.tp == 1
        if fill == "streamed" and not can_stream:
            raise RuntimeError("sync_fill 'streamed' needs one rank per model replica without the distributed "
                               "optimizer (TP = EP = DP = 1): the gathers pair up in plan order")
        self.streamed_sync = fill == "streamed"  # "auto" = after: streamed measured slower (docs/results.md)
        inner = getattr(opt, "optimizer", None)
        tr.setup.update(cache_trim=trim, sync_fill="streamed" if self.streamed_sync else "after",
                        optimizer=f"{type(opt).__name__}({type(inner).__name__}, isa={getattr(inner, 'isa', '?')})",
                        moments=moments, onload_overlaps_train=True)  # restore(overlap_forward=True) in onload
        return model, opt

    def step_region(self):
        return contextlib.nullcontext()

    def step_info(self, opt, moments: str) -> dict:
        """Where the optimizer phase went (Megatron's ChainedOptimizer asserts on .optimizer)."""
        return {**opt.last_step_times, **pipeline_times(opt.optimizer.last_step_times, moments)}

    def offload(self) -> dict:
        rep = self.state.offload()
        return {"bytes": rep.bytes_copied, "bytes_released": rep.bytes, "residual_reserved": rep.residual_reserved,
                **rep.parts}

    def onload(self) -> dict:
        # the upload (and the sharded form's all-gather) overlaps the next first forward
        return {"bytes": self.state.restore(overlap_forward=True).bytes_copied}

    def self_bytes(self, dev) -> int:
        """Engine bytes mapped + torch's default pool (region pools count in memory_reserved while paused)."""
        return torch.cuda.memory_reserved(dev) - sum(r["bytes_paused"] for r in self.em.stats()["tags"])


class Slime:
    sync_mode = "slime"
    early_sync = False
    releases_groups = True  # slime's sleep() destroys them (ebbtide.comm's destroy strategy, as slime does)
    install = {"strategy": "destroy"}  # what slime's ReloadableProcessGroup does: destroy, replay the creations
    em = state = None
    streamed_sync = False

    def __init__(self, name: str):
        from ...anchors.megatron import torch_memory_saver  # noqa: PLC0415

        self.name = name
        self.slime = name.startswith("slime")
        self.tms = torch_memory_saver(dropin=name == "slime-ebbtide")
        self.backuper = None

    def group_settings(self, spec: dict) -> tuple:
        return "lazy", "off", "joined"  # slime's own settings, whatever spec says

    def host_threads(self, local: int, setup: dict) -> None:
        if local > 1:  # the anchors' torch CPU AdamW: this rank's share of the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
            setup["torch_threads"] = torch.get_num_threads()

    def _region(self, tag: str, backup: bool):
        return self.tms.region(tag=tag, enable_cpu_backup=backup)

    def build(self, tr):
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

        from ...anchors.megatron import TensorBackuper, build_gpt, opt_config, slime_offload_config  # noqa: PLC0415

        s = tr.spec
        moe = (tr.moe["experts"], tr.moe["topk"]) if tr.moe else None
        # the DDP param and grad buffers: without backup for slime (--offload-train), else with the rest
        buffers = ("ddp_buffers", False) if self.slime else ("train", True)
        model = build_gpt(*_dims(tr), dist_opt=True, seed=s["seed"] + 1234, ddp_region=lambda: self._region(*buffers),
                          moe=moe)
        # slime's model scripts: distributed optimizer + HDO (offload 1.0, overlap) + precision-aware
        pa = bool(s.get("anchor_precision_aware", True))
        cfg = (slime_offload_config(precision_aware=pa, lr=s["lr"], clip_grad=1.0) if self.slime
               else opt_config(lr=s["lr"], clip_grad=1.0, use_distributed_optimizer=True))
        with self._region("train", True):
            opt = get_megatron_optimizer(cfg, [model])
        tr.setup["precision_aware"] = bool(cfg.use_precision_aware_optimizer)
        if self.slime:  # slime's TensorBackuper: the weights survive the pause in a pinned per-parameter copy
            self.backuper = TensorBackuper(model.parameters())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.model = model
        subs = getattr(opt, "chained_optimizers", [opt])  # Megatron returns a ChainedOptimizer
        tr.setup.update(moments="fp32",  # HybridDeviceOptimizer's CPU torch AdamW: no moment dtype
                        optimizer=", ".join(f"{type(o).__name__}({type(getattr(o, 'optimizer', o)).__name__})"
                                            for o in subs))
        return model, opt

    def step_region(self):
        return self._region("train", True)

    def step_info(self, opt, moments: str) -> dict:
        return {}

    def offload(self) -> dict:
        if self.backuper is not None:  # slime's TensorBackuper: the weights to their pinned copy
            self.backuper.backup()
        anchor_tms.pause(self.tms)
        return {}

    def onload(self) -> dict:
        self.tms.resume()
        if self.backuper is not None:
            self.backuper.restore()
            self.model.zero_grad_buffer()  # the grad buffers come back undefined (no backup)
        torch.cuda.synchronize()
        return {}

    def self_bytes(self, dev):
        return None


def variant(name: str):
    """The object of variant ``name`` (one of ``options.MEGATRON_VARIANTS``)."""
    if name not in MEGATRON_VARIANTS:
        raise RuntimeError(f"unknown variant {name!r} (known: {MEGATRON_VARIANTS})")
    return Ebbtide(name) if name == "ebbtide" else Slime(name)
