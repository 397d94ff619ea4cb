"""One trainer rank of the colocated loop with a Megatron-core GPT (``--trainer megatron``; ``python -m
ebbtide.colocate.mtrainer SPEC_JSON OUT_JSON``, started by the launcher, one per GPU). Ranks: tensor parallel
``spec["tp"]`` (default 1) times data parallel (the rest of the world); every rank's rollout process runs on the
rank's GPU (``rollout`` with ``arch="megatron"``, the whole model, TP=1), as slime's colocated engines do.

Policies:
- The model: Megatron-core's ``GPTModel`` from ``get_gpt_layer_local_spec()`` (rotary positions, no dropout) under
  ``Float16Module`` (bf16) and Megatron's ``DistributedDataParallel``, trained on the example's synthetic counting
  task (``train_tokens``), fp32 loss; gradient clipping at 1.0. The rollout generates with ``gpt.MegatronGPT``, the
  same architecture under the same parameter names.
- Parallelism: ``initialize_model_parallel(tp, 1)``; each data-parallel rank trains its own batch (TP ranks share
  theirs). MoE (``spec["moe"]``: experts, top-k; ``anchors.megatron.moe_fields``: SequentialMLP experts, alltoall
  dispatcher, fp32 router) over ``spec["ep"]`` expert-parallel ranks with whole experts (expert TP 1); every variant
  runs the same model, the ebbtide one always on its distributed optimizer (the adapter steps expert params only in
  that form). At EP > 1 each rank sends the whole model to its rollout, the experts all-gathered over the
  expert-parallel group: in the ebbtide variant by its sender, per bucket (one coalesced gather per bucket,
  ``expert_sources``); in the anchors eagerly before the update (``full_weights``, one gather per local expert tensor;
  slime broadcasts each expert tensor from its owner per bucket, the same bytes). With data parallelism the ebbtide
  variant runs ebbtide's distributed optimizer (each rank's host state is its shard; the weights are discarded at the
  offload and rebuilt from each rank's mirrored slices, all-gathered at the first forward after the groups' reload),
  without it the non-sharded one (weights discarded and rebuilt from the whole mirror under the first forward). The
  weight sync sends the full tensors from every rank to its own rollout, split tensors all-gathered over the TP group
  (``tensor_parallel_dims``). Host threads: with several ranks on one host each rank's CPU work gets its share of the
  cores (``LOCAL_WORLD_SIZE``): ebbtide's pool by its own default, the anchors' torch CPU AdamW by
  ``torch.set_num_threads`` (what a careful user does with ``OMP_NUM_THREADS``).
- The step: train (zero the grad buffer, forward, backward, ``finish_grad_sync``) -> optimizer -> rollout_resume
  -> sync (the rollout holds the new weights) -> comm_release -> offload -> generate -> rollout_pause -> onload ->
  comm_reload (slime's sleep() destroys the groups, then pauses its memory; wake_up() resumes, then reloads). Each
  phase ends when its device work is complete, except the ebbtide variant's onload: ``restore(overlap_forward=
  True)`` queues the weights' upload and each layer's first forward waits for its own, so the upload's tail is
  inside the next train phase. The ebbtide variant also sends the rollout its resume and load and opens the update
  right after the backward, beside the CPU step: ``open(wait=False)``, or with ``sync_fill`` "streamed" (one rank
  per replica) ``Sender.streamed``, each tensor filled as the step uploads it (the optimizer's bucket hook):
  rollout_resume only collects the reply, sync fills and commits (streamed: commits and fills the last part).
- Variant "ebbtide", through the public adapter only: ``install_groups()`` before ``init_process_group``,
  ``get_optimizer`` (``EbbtideOptimizer``, DDP without the distributed optimizer), ``TrainingState`` offload and
  restore (``weights="discard"``: the weights are dropped and rebuilt from the optimizer's host mirror, as slime
  drops its DDP buffers and restores them from its TensorBackuper), ``release_groups(include_world=True,
  wait=False)`` (the communicators' teardown overlaps the offload, the rollout's generate and, where it is longer,
  the next reload: ebbtide.comm's reload goes ahead beside a teardown of destroyed groups, the next release waits for
  it; its report lands in the phase that saw it finish; ``spec["comm_teardown"]`` "joined": inside comm_release,
  so nothing of the trainer's runs beside the generate) / ``reload_groups()``;
  weights by ``ebbtide.sync`` (``Sender`` + ``IpcSender``); the rollout on ebbtide.memory (preload shim).
- Variant "slime", the configuration slime runs colocated: Megatron's DistributedOptimizer + HybridDeviceOptimizer
  (offload fraction 1.0, D2H/H2D overlap, precision-aware as slime's scripts pass it unless
  ``spec["anchor_precision_aware"]`` is False: ``anchors.megatron.slime_offload_config``); torch_memory_saver
  (torch hook mode, ``retain_cpu_backup``) with the optimizer in a region with CPU backup, the DDP param and grad
  buffers allocated in a region without backup and the weights kept in a pinned per-parameter CPU copy, refreshed
  before the pause and copied back after the resume (slime's ``--offload-train`` patch and ``TensorBackuper``);
  the slime-style weight update; the rollout on torch_memory_saver (discard).
- Variant "slime-ebbtide": "slime" with one import swapped, ``ebbtide.compat.torch_memory_saver`` for the
  ``torch_memory_saver`` package in the trainer and the rollout (ebbtide as a plain drop-in; nothing else changes).
- Variant "gpu-tms": Megatron's GPU-resident DistributedOptimizer, the DDP buffers and the optimizer state in one
  torch_memory_saver region with CPU backup; weight update and rollout as "slime".
- Anchors build the model outside torch_memory_saver and only the DDP construction inside it, so the model's
  construction-time storages (freed once DDP copied them into its buffers) are not cached in a region pool that
  every pause would copy. After each step every variant calls the optimizer's ``zero_grad()``, so the fp32 main
  grads a DistributedOptimizer makes for its step are freed before the offload, not carried through it.
- Groups: every Megatron group (WORLD included) is destroyed and re-created around the rollout by ebbtide.comm's
  destroy-and-rebuild. The anchors run it with slime's own settings: what its ReloadableProcessGroup does
  (destroy each NCCL communicator, replay the group creations in order), WORLD initialised without a device (so
  each communicator is made at its group's first collective, after every reload too) and ``NCCL_CUMEM_ENABLE=0``
  (slime's actor environment). The ebbtide variant: ``spec["groups"]`` "lazy" (the same laziness), "eager"
  (WORLD bound to the device: every group connects at creation and at reload) or "used" (lazy, and the reload
  connects and warms up only the groups that had a communicator at the release: ebbtide.comm's eager reload over
  lazy groups), and ``spec["nccl_cumem"]`` "off"
  (default: slime's actor environment too) or "on" (NCCL's own default, which native suspend will need). With
  cuMem on, each communicator connecting at its first collective between two GPUs cost ~0.1 s more (2 H200,
  NCCL 2.28.9: forward+backward 246 vs 128 ms, optimizer step 215 vs 89 ms at DP=2, quick size).
- torch_memory_saver is configured after ``import megatron.core.models.gpt`` (that import sets its hook mode, which
  it refuses once initialised). Anchors run the optimizer step inside their region, so state the step creates
  lazily (Adam's moments) is paused with the rest.
- Verification (untimed, the first and last steps): the trainer's Megatron forward on the weights the rollout must
  hold (the sync's dequant(quant(w))) against the rollout's logits, and every weight's digest.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from concurrent import futures
from datetime import timedelta

import torch

from ._records import note_release, note_residual
from .gpt import megatron_names
from .measure import NvmlProbe, Recorder
from .model import ModelConfig
from .rollout import prompts
from .sync import IpcTrainerSync
from .trainer import (_only, _RolloutClient, align_ranks, align_store, main as _rank_main, reference_entry,
                      rollout_env, train_tokens, verify_entry)

__all__ = ["main", "VARIANTS", "LOGITS_RTOL", "MOE_LOGITS_RTOL"]

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

VARIANTS = ("ebbtide", "slime", "slime-ebbtide", "gpu-tms")
GROUP_MODES = ("lazy", "eager", "used")
CUMEM_MODES = ("off", "on")
MOMENTS = ("fp32", "bf16")
TEARDOWNS = ("background", "joined")
CACHE_TRIMS = ("auto", "step", "offload")
SYNC_FILLS = ("auto", "streamed", "after")
# One CPU Adam step's bytes through host memory per parameter: fp32 master read + write (8), both moments read +
# write (16 in fp32, 8 in bf16), the bf16 gradient read (2) and the bf16 parameter written back (2); the DMA
# traffic of the gradient download and the parameter upload (another ~4) is not counted, so the floor is a lower
# bound.
STEP_BYTES = {"fp32": 28, "bf16": 20}
# Megatron's forward and the rollout's plain-PyTorch one on the same bf16 weights: same math, other kernels and
# operation order (fused QKV split, softmax, LayerNorm) through every layer; a wrong name or layout differs by O(1).
LOGITS_RTOL = 2.0 ** -4
# MoE: the two forwards' hidden states differ by that rounding, so a token whose top-k experts are nearly tied can
# be routed to another expert in one of them: one such flip moved the last-position logits by 6.8% of the largest
# (0.305 of 4.47; 2 H200, 2.15 B MoE at EP=2, weights bitwise equal) where the same step of another run read 1.2%.
# The weights' bitwise check stays exact; the logits check keeps guarding names and layouts at O(1).
MOE_LOGITS_RTOL = 2.0 ** -3


class _MegatronTrainer:
    def __init__(self, spec: dict, rank: int, world: int):
        self.tp = int(spec.get("tp", 1))
        if self.tp < 1 or world % self.tp:
            raise RuntimeError(f"tensor parallel {self.tp} does not divide the world of {world} ranks")
        self.dp = world // self.tp
        self.ep = int(spec.get("ep", 1))
        self.moe = spec.get("moe")  # {"experts", "topk"} or None (dense)
        if self.ep < 1 or world % self.ep or (self.ep > 1 and not self.moe):
            raise RuntimeError(f"expert parallel {self.ep} needs a MoE model and must divide the world of {world}")
        self.spec, self.rank, self.world, self.variant = spec, rank, world, spec["variant"]
        if self.variant not in VARIANTS:
            raise RuntimeError(f"unknown variant {self.variant!r} (known: {VARIANTS})")
        self.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(self.dev)
        self.cfg = ModelConfig(**spec["model"])
        self.rec, self.checks = Recorder(), {"verify": []}
        self.em = self.tms = self.backup = self.state = self.releasing = None
        self.streamed_sync = False
        if self.variant == "ebbtide":
            import ebbtide.memory as em  # noqa: PLC0415

            self.em = em
        elif self.variant == "slime-ebbtide":
            import megatron.core.models.gpt  # noqa: F401, PLC0415  (as below, for the same import order)

            from ebbtide.compat.torch_memory_saver import torch_memory_saver as tms  # noqa: PLC0415

            tms.hook_mode = "torch"
            tms.retain_cpu_backup = True
            self.tms = tms
        else:
            import megatron.core.models.gpt  # noqa: F401, PLC0415  (sets TMS's hook mode on import: before TMS)
            from torch_memory_saver import torch_memory_saver as tms  # noqa: PLC0415

            tms.hook_mode = "torch"
            tms.retain_cpu_backup = True  # keep the pinned backup across cycles (its best setting)
            self.tms = tms
        self.setup: dict = {"variant": self.variant, "trainer": "megatron", "rank": rank, "world": world,
                            "tp": self.tp, "dp": self.dp, "ep": self.ep, "moe": self.moe,
                            "device_name": torch.cuda.get_device_name(self.dev), "torch": torch.__version__,
                            "pid": os.getpid(), "memory_history": bool(spec.get("memory_history"))}
        torch.zeros(1, device=self.dev)  # the CUDA context
        if spec.get("memory_history"):  # a diagnostic: the offload's residual blocks get their frames (slower steps)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        props = torch.cuda.get_device_properties(self.dev)
        self.nvml = NvmlProbe(uuid=str(getattr(props, "uuid", "") or ""), index=self.dev.index)
        self.setup["nvml"] = self.nvml.why or "ok"
        self.nvml.assign(spec.get("baseline_pids", []), "other")
        self.nvml.claim("trainer", pid=os.getpid())
        self.setup["context_bytes"] = self._sample(-1, "context")["nvml"].get("trainer")
        self._init_groups()
        self._build()
        self.verify_tokens = prompts(self.cfg, spec["verify_batch"], spec["verify_len"], spec["seed"] + 11, self.dev)
        self._start_rollout()
        self.nvml.claim("rollout", pid=self.rollout.info.get("pid"))
        self.setup["nvml_roles"] = {str(k): v for k, v in self.nvml.roles.items()}
        self.setup["rollout"] = {k: v for k, v in self.rollout.info.items() if k not in ("ok", "mem")}

    # ---- setup -----------------------------------------------------------------------------------------------
    def _init_groups(self):
        import torch.distributed as dist  # noqa: PLC0415
        from megatron.core import parallel_state, tensor_parallel  # noqa: PLC0415

        import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

        self.ebt = ebt
        ours = self.variant == "ebbtide"
        mode = self.spec.get("groups", "lazy") if ours else "lazy"
        if mode not in GROUP_MODES:
            raise RuntimeError(f"groups must be one of {GROUP_MODES}, not {mode!r}")
        self.eager_groups = mode == "eager"  # WORLD bound to the device: every group connects at creation
        self.reload_eager = mode in ("eager", "used")  # "used": reload connects what the last step connected
        self.setup["groups"] = mode
        cumem = self.spec.get("nccl_cumem", "off") if ours else "off"
        if cumem not in CUMEM_MODES:
            raise RuntimeError(f"nccl_cumem must be one of {CUMEM_MODES}, not {cumem!r}")
        if cumem == "off":  # slime's actor environment (SGLang needs it off; slime sets it for every actor)
            os.environ["NCCL_CUMEM_ENABLE"] = "0"
        self.setup["nccl_cumem"] = cumem
        teardown = self.spec.get("comm_teardown", "background") if ours else "joined"
        if teardown not in TEARDOWNS:
            raise RuntimeError(f"comm_teardown must be one of {TEARDOWNS}, not {teardown!r}")
        self.background_teardown = teardown == "background"
        self.setup["comm_teardown"] = teardown
        ebt.install_groups(**({} if ours else {"strategy": "destroy"}))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = dist.TCPStore(host, port, None, False, timeout=timedelta(minutes=10))
        self.align = align_store(self.world)  # its own connection: the background release uses self.store
        bound = {"device_id": self.dev} if self.eager_groups else {}
        dist.init_process_group("nccl", store=self.store, rank=self.rank, world_size=self.world,
                                timeout=timedelta(minutes=10), **bound)
        # whole experts (expert TP 1) over ep ranks; Megatron's default expert TP is the TP size
        experts = dict(expert_model_parallel_size=self.ep, expert_tensor_parallel_size=1) if self.moe else {}
        parallel_state.initialize_model_parallel(self.tp, 1, **experts)
        tensor_parallel.model_parallel_cuda_manual_seed(self.spec["seed"] + 1234)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.setup["local_world"] = local
        if not ours and local > 1:  # the anchors' torch CPU AdamW: this rank's share of the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
            self.setup["torch_threads"] = torch.get_num_threads()

    def _region(self, tag: str, backup: bool):
        return self.tms.region(tag=tag, enable_cpu_backup=backup)

    def _build(self):
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

        from ..anchors.megatron import build_gpt, opt_config, slime_offload_config  # noqa: PLC0415

        c, s = self.cfg, self.spec
        dims = (c.n_layers, c.d_model, c.n_heads, c.d_ff, c.vocab, c.max_seq)
        seed = s["seed"] + 1234
        moe = (self.moe["experts"], self.moe["topk"]) if self.moe else None
        if self.variant == "ebbtide":
            moments = s.get("moments", "fp32")
            if moments not in MOMENTS:
                raise RuntimeError(f"moments must be one of {MOMENTS}, not {moments!r}")
            # the distributed optimizer: each DP rank's host state is its shard (the adapter steps expert-parallel
            # params only in that form; a MoE model runs at EP >= 2, so DP >= 2 here anyway)
            sharded = self.dp > 1 or moe is not None
            self.model = build_gpt(*dims, dist_opt=sharded, seed=seed, moe=moe)
            cfg = opt_config(lr=s["lr"], clip_grad=1.0, use_distributed_optimizer=sharded)
            if moments == "bf16":
                # Megatron's precision-aware fields, set after construction as a config made on a Transformer Engine
                # machine carries them: megatron-core 0.16.1 validates use_precision_aware_optimizer through TE's
                # version and fails without TE (is_te_min_version), even with CPU offload.
                cfg.use_precision_aware_optimizer = cfg.use_distributed_optimizer = True
                cfg.exp_avg_dtype = cfg.exp_avg_sq_dtype = torch.bfloat16
            self.opt = self.ebt.get_optimizer(cfg, [self.model])
            # weights dropped at the offload and rebuilt from the optimizer's host mirror (sharded: each rank's
            # slices, all-gathered at the first forward, after the groups' reload)
            self.state = self.ebt.TrainingState([self.model], self.opt, weights="discard")
            trim = s.get("cache_trim", "auto")
            if trim not in CACHE_TRIMS:
                raise RuntimeError(f"cache_trim must be one of {CACHE_TRIMS}, not {trim!r}")
            if trim == "auto":  # measured: the trim beside the sharded step delays its param gather's launch
                trim = "offload" if sharded else "step"
            if trim == "step":  # the activations' cached blocks go back while the host steps, not in the offload
                self.opt.update_start_hooks.append(lambda: self.state.trim_cache(background=True))
            self.setup["cache_trim"] = trim
            fill = s.get("sync_fill", "auto")
            if fill not in SYNC_FILLS:
                raise RuntimeError(f"sync_fill must be one of {SYNC_FILLS}, not {fill!r}")
            # streamed: needs the non-sharded optimizer's bucket hook and a sender without TP/EP gathers
            can_stream = not sharded and self.tp == 1
            if fill == "streamed" and not can_stream:
                raise RuntimeError("sync_fill 'streamed' needs one rank per model replica without the distributed "
                                   "optimizer (TP = EP = DP = 1): the gathers pair up in plan order")
            self.streamed_sync = fill == "streamed"  # "auto" = after: streamed measured slower (docs/colocate.md)
            self.setup["sync_fill"] = "streamed" if self.streamed_sync else "after"
            inner = getattr(self.opt, "optimizer", None)
            self.setup["optimizer"] = (f"{type(self.opt).__name__}({type(inner).__name__}, "
                                       f"isa={getattr(inner, 'isa', '?')})")
            self.setup["moments"] = moments
            self.setup["onload_overlaps_train"] = True  # restore(overlap_forward=True) in _onload
        else:
            slime = self.variant.startswith("slime")
            # the DDP param and grad buffers: without backup for slime (--offload-train), else with the rest
            buffers = ("ddp_buffers", False) if slime else ("train", True)
            self.model = build_gpt(*dims, dist_opt=True, seed=seed, ddp_region=lambda: self._region(*buffers),
                                   moe=moe)
            # slime's model scripts: distributed optimizer + HDO (offload 1.0, overlap) + precision-aware
            pa = bool(s.get("anchor_precision_aware", True))
            cfg = (slime_offload_config(precision_aware=pa, lr=s["lr"], clip_grad=1.0) if slime
                   else opt_config(lr=s["lr"], clip_grad=1.0, use_distributed_optimizer=True))
            with self._region("train", True):
                self.opt = get_megatron_optimizer(cfg, [self.model])
            self.setup["precision_aware"] = bool(cfg.use_precision_aware_optimizer)
            if slime:  # slime's TensorBackuper: the weights survive the pause in a pinned per-parameter copy
                self.params = list(self.model.parameters())
                self.backup = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in self.params]
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.setup["moments"] = "fp32"  # HybridDeviceOptimizer's CPU torch AdamW: no moment dtype
            subs = getattr(self.opt, "chained_optimizers", [self.opt])  # Megatron returns a ChainedOptimizer
            self.setup["optimizer"] = ", ".join(f"{type(o).__name__}({type(getattr(o, 'optimizer', o)).__name__})"
                                                for o in subs)
        self.tp_dims = self.ebt.tensor_parallel_dims([self.model])
        # {local name: global name} of this rank's experts at EP > 1: the sync sends the whole model from every rank,
        # the experts gathered over the expert-parallel group (ebbtide: the sender's coalesced gather per bucket,
        # ``expert_sources``; the slime-style update and the checks: ``full_weights``, eagerly)
        self.expert_names = self.ebt.expert_parallel_names([self.model])
        self.named = lambda: {n: p.detach() for n, p in megatron_names(self.model.named_parameters()).items()}
        self.full = (lambda: self.ebt.full_weights([self.model])) if self.expert_names else None
        named = megatron_names(self.model.named_parameters())
        self.setup["params"] = sum(p.numel() * (self.tp if n in self.tp_dims else 1)
                                   * (self.ep if n in self.expert_names else 1) for n, p in named.items())
        # this rank's share of the optimizer step: dense params over the DP group, experts over the expert-DP group
        # (world / ep with whole experts)
        local_experts = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
        dense = sum(p.numel() for p in named.values()) - local_experts
        self.setup["params_stepped"] = dense // self.dp + local_experts // (self.world // self.ep)
        self._host_floor()

    def _host_floor(self):
        """The CPU optimizer step's host-memory floor on this machine, measured before the rollout starts: the
        step's bytes per parameter over the in-place triad bandwidth of every thread."""
        from .. import _native  # noqa: PLC0415

        C = _native.load()
        gbps = C.host_triad_bandwidth(512 << 20, C.cpu_affinity_count(), 8) / 1e9
        self.setup["host_triad_gbps"] = round(gbps, 2)
        # every rank of the host steps its share at the same time, over the same memory bandwidth
        local = self.setup["local_world"]
        self.setup["optimizer_floor_s"] = (STEP_BYTES[self.setup["moments"]] * self.setup["params_stepped"] * local
                                           / (gbps * 1e9))

    def _start_rollout(self):
        import socket  # noqa: PLC0415
        from multiprocessing.connection import Connection  # noqa: PLC0415

        s = self.spec
        mine, theirs = socket.socketpair()
        experts = {}
        if self.expert_names:
            from megatron.core import parallel_state  # noqa: PLC0415

            experts = dict(ep_group=parallel_state.get_expert_model_parallel_group(), full=self.full,
                           ep_sources=self.ebt.expert_sources([self.model]))
        self.sync = IpcTrainerSync(self.named, Connection(mine.detach()),
                                   "ebbtide" if self.variant == "ebbtide" else "slime",
                                   tp_group=self.tp_group, tp_dims=self.tp_dims, **experts)
        self.setup.update(sync=self.sync.mode, sync_bytes=self.sync.plan.nbytes,
                          sync_bf16_bytes=self.sync.plan.source_bytes)
        spec = {k: s[k] for k in ("model", "variant", "seed", "gen_batch", "prompt_len", "new_tokens",
                                  "kv_reserve_bytes", "verify_batch", "verify_len", "timeout_s", "scratch_backup")}
        spec.update(decode=s.get("decode", "eager"), device=self.dev.index, trainer_pid=os.getpid(), arch="megatron",
                    sync=self.sync.mode)
        if self.moe:  # the whole MoE model, its router in fp32 as the trainer's (anchors.megatron.moe_fields)
            spec["moe"] = {"experts": self.moe["experts"], "topk": self.moe["topk"], "router_fp32": True}
        env = rollout_env(self.em, s["scratch_backup"])
        try:
            self.rollout = _RolloutClient(spec, env, {"sync_fd": theirs.fileno()})
        finally:
            theirs.close()

    # ---- measurement -----------------------------------------------------------------------------------------
    def _sample(self, step: int, phase: str, rollout_mem: dict | None = None) -> dict:
        m = self.nvml.sample()
        if m.get("device_used") is None:
            free, total = torch.cuda.mem_get_info(self.dev)
            m["device_used"] = total - free
        selfm = dict(rollout_mem or {})
        if self.em is not None:  # engine bytes mapped + torch's default pool (region pools count while paused)
            tags = self.em.stats()["tags"]
            selfm["trainer"] = (torch.cuda.memory_reserved(self.dev)
                                - sum(r["bytes_paused"] for r in tags))
        m["self"] = selfm
        self.rec.sample(step, phase, m)
        return m

    # ---- the step --------------------------------------------------------------------------------------------
    def _batch(self, step: int):
        s = self.spec
        t = train_tokens(self.cfg, s["batch"], s["seq"], step, self.dp_rank).to(self.dev)
        T = s["seq"]
        pos = torch.arange(T, device=self.dev).unsqueeze(0).expand(t.shape[0], -1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=self.dev), 1).view(1, 1, T, T)
        return t[:, :-1].contiguous(), pos, mask, t[:, 1:].contiguous()

    def _train(self, step: int) -> float:
        self.model.zero_grad_buffer()
        self.opt.zero_grad()
        tokens, pos, mask, labels = self._batch(step)
        loss = self.model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        self.model.finish_grad_sync()
        torch.cuda.synchronize(self.dev)
        return float(loss.item())

    def _step_optimizer(self) -> dict:
        with self._region("train", True) if self.tms is not None else contextlib.nullcontext():
            ok, grad_norm, _ = self.opt.step()
            # the fp32 main grads a DistributedOptimizer made for this step go now, not through the pause
            self.opt.zero_grad()
        torch.cuda.synchronize(self.dev)
        if not ok:
            raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
        out = {"grad_norm": float(grad_norm) if grad_norm is not None else None}
        if self.variant == "ebbtide":  # where the phase went (Megatron's ChainedOptimizer asserts on .optimizer)
            out.update(self.opt.last_step_times)
            times = self.opt.optimizer.last_step_times
            if times and times["kernel_s"] > 0:
                out.update(pipeline_s=times["seconds"], kernel_s=times["kernel_s"], copy_wait_s=times["wait_s"],
                           kernel_gbps=STEP_BYTES[self.setup["moments"]] * times["elements"] / times["kernel_s"] / 1e9)
        return out

    def _offload(self) -> dict:
        if self.em is not None:
            rep = self.state.offload()
            return {"bytes": rep.bytes_copied, "bytes_released": rep.bytes, "residual_reserved": rep.residual_reserved,
                    **rep.parts}
        if self.backup is not None:  # slime's TensorBackuper: the weights to their pinned copy
            for b, p in zip(self.backup, self.params):
                b.copy_(p.detach(), non_blocking=True)
            torch.cuda.synchronize(self.dev)
        torch.cuda.empty_cache()
        self.tms.pause()
        torch.cuda.empty_cache()
        return {}

    def _onload(self) -> dict:
        if self.em is not None:  # the upload (and the sharded form's all-gather) overlaps the next first forward
            rep = self.state.restore(overlap_forward=True)
            return {"bytes": rep.bytes_copied}
        self.tms.resume()
        if self.backup is not None:
            with torch.no_grad():
                for b, p in zip(self.backup, self.params):
                    p.copy_(b, non_blocking=True)
            self.model.zero_grad_buffer()  # the grad buffers come back undefined (no backup)
        torch.cuda.synchronize(self.dev)
        return {}

    def _reference(self) -> dict:
        B, T = self.verify_tokens.shape
        pos = torch.arange(T, device=self.dev).unsqueeze(0).expand(B, -1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=self.dev), 1).view(1, 1, T, T)
        def forward():  # the logits are split over the vocabulary at TP > 1: gathered whole
            from ..integrations.megatron._weights import gather_along  # noqa: PLC0415

            out = self.model(self.verify_tokens, pos, mask)
            return gather_along(out, -1, self.tp_group) if self.tp > 1 else out

        return reference_entry(megatron_names(self.model.named_parameters()), self.sync.reference(), forward,
                               local=self._shard)

    def _shard(self, name: str, full: dict) -> torch.Tensor:
        """What this rank's parameter ``name`` holds of the whole model ``full``: its TP piece, or for a local
        expert the global expert it is."""
        t = full[self.expert_names.get(name, name)]
        d = self.tp_dims.get(name)
        if d is None:
            return t
        r = torch.distributed.get_rank(self.tp_group)
        return t.chunk(self.tp, d)[r]

    def step(self, step: int, verify: bool):
        R, rec, tmo, version = self.rollout, self.rec, self.spec["timeout_s"], step + 1
        with rec.phase(step, "train") as info:
            info["loss"] = self._train(step)
        self._sample(step, "train")
        early = self.em is not None and self.sync.mode == "ebbtide"
        hook = None
        if early:  # the rollout resumes and the update opens beside the CPU step (the GPU is idle meanwhile)
            R.send("resume")
            R.send("load", version=version)
            opened = self.sync.open(version, streamed=self.streamed_sync)  # joined (its failure raised) by the push
            if self.streamed_sync:  # each tensor filled into the rollout's staging as the CPU step uploads it
                hook = self.opt.add_bucket_hook(opened)
        try:
            with rec.phase(step, "optimizer") as info:
                try:
                    info.update(self._step_optimizer())
                finally:
                    if hook is not None:
                        hook.remove()
            self._sample(step, "optimizer")
            ref = self._reference() if verify else None  # untimed
            if verify:  # the ranks' untimed work differs: the next timed phases start together
                align_ranks(self.align, self.world, f"{self.variant}/{step}/reference")
        except BaseException:
            if early:  # the push will not come: the rollout's load ends now, its weights as they were
                self.sync.abort()
            raise
        with rec.phase(step, "rollout_resume") as info:
            info.update(_only(R.reply(timeout=tmo) if early else R.call("resume", timeout=tmo), "inside_s",
                              "bytes_mapped"))
        self._sample(step, "rollout_resume")
        with rec.phase(step, "sync") as info:
            if not early:
                R.send("load", version=version)
            info["bytes"] = self.sync.push(version)
            info.update(self.sync.last_push)
            load = R.reply(timeout=tmo)
            info.update(_only(load, "apply_s"))  # the rollout's apply of the committed version
            if not early:  # after an early open the rollout's load began beside the optimizer step
                info.update(_only(load, "inside_s"))
        self._sample(step, "sync")
        loaded = R.call("verify_load", timeout=tmo) if verify else None
        if verify:
            align_ranks(self.align, self.world, f"{self.variant}/{step}/load")
        with rec.phase(step, "comm_release") as info:
            if self.em is not None and self.background_teardown:  # agreed, detached; teardown beside offload, generate
                previous = self.releasing
                # release() joins the previous teardown itself: a failure there raises on every rank (its agreement)
                self.releasing = self.ebt.release_groups(include_world=True, wait=False)
                note_release(info, previous)
                info["report"] = "teardown in the background (its report: comm_reload's release_report)"
            else:
                info["report"] = self.ebt.release_groups(include_world=True).summary()
        self._sample(step, "comm_release")
        with rec.phase(step, "offload") as info:
            info.update(self._offload())
        if self.em is not None:
            note_residual(self.rec.phases[-1])
        self._sample(step, "offload")
        clock = self.nvml.sm_clock_mhz()  # the clock the prefill starts at (read outside the timed phase)
        with rec.phase(step, "generate") as info:
            if clock is not None:
                info["sm_clock_mhz"] = clock
            gen = R.call("generate", timeout=tmo)
            info.update(_only(gen, "tokens", "inside_s", "prefill_gpu_s", "decode_gpu_s",
                              "host_enqueue_s", "prefill_host_s", "device_mallocs"))
        self._sample(step, "generate", gen.get("mem"))
        self._note_decode(gen)
        if verify:
            gen.update(_only(R.call("verify_generate", timeout=tmo), "decode_vs_full_max_abs", "decode_vs_full_rel",
                             "decode_vs_full_argmax_equal"))
            if gen.get("decode") != "eager":
                gen.update(R.call("check_decode", timeout=tmo))
            rtol = MOE_LOGITS_RTOL if self.moe else LOGITS_RTOL
            self.checks["verify"].append(verify_entry(step, self.rank, ref, loaded, gen, rtol))
            align_ranks(self.align, self.world, f"{self.variant}/{step}/generate")
        with rec.phase(step, "rollout_pause") as info:
            info.update(_only(R.call("pause", timeout=tmo), "inside_s", "bytes_released"))
        self._sample(step, "rollout_pause")
        with rec.phase(step, "onload") as info:
            info.update(self._onload())
        self._sample(step, "onload")
        with rec.phase(step, "comm_reload") as info:
            # a teardown still running (a short generate) goes on beside the reload: not waited for here
            info["release_teardown_running"] = self.releasing is not None and not self.releasing.done()
            info["report"] = self.ebt.reload_groups(eager=self.reload_eager).summary()
            if self.releasing is not None and self.releasing.done():
                note_release(info, self.releasing)
                self.releasing = None
        if self.releasing is not None:
            # (a generate shorter than the teardown) the step's memory must not count the old communicators beside
            # the new ones: wait outside the timed phases, say how long, note the release's report here.
            t0 = time.perf_counter()
            done, _ = futures.wait([self.releasing], timeout=tmo)
            ph = self.rec.phases[-1]
            ph.update(teardown_wait_s=time.perf_counter() - t0, teardown_wait_timed_out=not done)
            if done:
                note_release(ph, self.releasing)
                self.releasing = None
        self._sample(step, "comm_reload")

    def _note_decode(self, gen: dict):
        ro = self.setup.setdefault("rollout", {})
        ro.setdefault("decode_used", gen.get("decode"))
        if "graph_bytes" in gen and "graph_bytes" not in ro:
            ro.update(graph_bytes=gen["graph_bytes"], graph_pausable=self.variant == "ebbtide")

    def run(self) -> None:
        steps = self.spec["steps"]
        for s in range(steps):
            self.step(s, s in (0, steps - 1))
            last = [p for p in self.rec.phases if p["step"] == s]
            print(f"[megatron {self.variant}] step {s}: {sum(p['s'] for p in last) * 1e3:.1f} ms, "
                  f"loss {last[0].get('loss', float('nan')):.4f}", flush=True)
        if self.releasing is not None:  # the last step's teardown: joined before the process ends, its report kept
            self.releasing.exception()
            last_release: dict = {}
            note_release(last_release, self.releasing)
            self.setup["last_release"], self.releasing = last_release, None

    def close(self):
        try:
            sync = getattr(self, "sync", None)
            if sync is not None and sync.mode == "ebbtide":
                sync.sender.close()  # its open thread; the IPC end was closed after the last push
        finally:
            self.rollout.close()


def main(argv=None) -> int:
    return _rank_main(argv, _MegatronTrainer)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: paused pools and communicators go with the process
