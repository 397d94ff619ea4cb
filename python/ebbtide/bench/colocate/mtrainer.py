"""One trainer rank of the colocated loop with a Megatron-core GPT (``--trainer megatron``; ``python -m
ebbtide.bench.colocate.mtrainer SPEC_JSON OUT_JSON``, started by the launcher, one per GPU). Ranks: tensor parallel
``spec["tp"]`` (default 1) times data parallel (the rest of the world); every rank's rollout process runs on the
rank's GPU (``rollout`` with ``arch="megatron"``, the whole model, TP=1), as slime's colocated engines do. What
differs between the variants is one object each (``mvariants``); the step is the same code for all, and for the
FSDP trainer's (``loop.LoopRank``).

Policies:
- The model: Megatron-core's ``GPTModel`` from ``get_gpt_layer_local_spec()`` (rotary positions, no dropout) under
  ``Float16Module`` (bf16) and Megatron's ``DistributedDataParallel``, trained on the example's synthetic counting
  task (``train_tokens``), fp32 loss; gradient clipping at 1.0. The rollout generates with
  ``ebbtide.testing.models.MegatronGPT``, the same architecture under the same parameter names.
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
- Variant "ebbtide": ``install_groups()`` before ``init_process_group``, ``release_groups(include_world=True,
  wait=False)`` (the communicators' teardown overlaps the offload, the rollout's generate and, where it is longer,
  the next reload: ebbtide.comm's reload goes ahead beside a teardown of destroyed groups, the next release waits for
  it; its report lands in the phase that saw it finish; ``spec["comm_teardown"]`` "joined": inside comm_release,
  so nothing of the trainer's runs beside the generate) / ``reload_groups()``; its memory, optimizer and sync:
  ``mvariants.Ebbtide``; the rollout on ebbtide.memory (preload shim). The anchors ("slime", "slime-ebbtide",
  "gpu-tms"): ``mvariants.Slime``. After each step every variant calls the optimizer's ``zero_grad()``, so the fp32
  main grads a DistributedOptimizer makes for its step are freed before the offload, not carried through it.
- Groups: every Megatron group (WORLD included) is destroyed and re-created around the rollout by ebbtide.comm's
  destroy-and-rebuild. The anchors run it with slime's own settings: what its ReloadableProcessGroup does
  (destroy each NCCL communicator, replay the group creations in order), WORLD initialised without a device (so
  each communicator is made at its group's first collective, after every reload too) and ``NCCL_CUMEM_ENABLE=0``
  (slime's actor environment). The ebbtide variant: ``spec["groups"]`` "lazy" (the same laziness), "eager"
  (WORLD bound to the device: every group connects at creation and at reload) or "used" (lazy, and the reload
  connects and warms up only the groups that had a communicator at the release: ebbtide.comm's eager reload over
  lazy groups), and ``spec["nccl_cumem"]`` "off"
  (default: slime's actor environment too) or "on" (NCCL's own default, which native suspend will need). With
  cuMem on, each communicator connecting at its first collective costs more (docs/results.md, the quick DP=2
  runs).
- Verification (untimed, the first and last steps): the trainer's Megatron forward on the weights the rollout must
  hold (the sync's dequant(quant(w))) against the rollout's logits, and every weight's digest.
"""
from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch

from ...integrations.names import served_names
from ...testing.models import ModelConfig
from .loop import LoopRank
from .measure import Recorder
from .mvariants import variant
from .rank import align_store, exit_now, prompts, rank_main, reference_entry, train_tokens
from .sync import IpcTrainerSync

__all__ = ["main", "LOGITS_RTOL", "MOE_LOGITS_RTOL"]

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

# Megatron's forward and the rollout's plain-PyTorch one on the same bf16 weights: same math, other kernels and
# operation order (fused QKV split, softmax, LayerNorm) through every layer; a wrong name or layout differs by O(1).
LOGITS_RTOL = 2.0 ** -4
# MoE: the two forwards' hidden states differ by that rounding, so a token whose top-k experts are nearly tied can
# be routed to another expert in one of them: one such flip, with the weights bitwise equal, moved the last-position
# logits past 2^-4 of the largest (docs/results.md, the EP=2 MoE runs).
# The weights' bitwise check stays exact; the logits check keeps guarding names and layouts at O(1).
MOE_LOGITS_RTOL = 2.0 ** -3


class _MegatronTrainer(LoopRank):
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
        self.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(self.dev)
        self.cfg = ModelConfig(**spec["model"])
        self.rec, self.checks = Recorder(), {"verify": []}
        self.logits_rtol = MOE_LOGITS_RTOL if self.moe else LOGITS_RTOL
        self.v = variant(self.variant)  # its memory library imported (torch_memory_saver after Megatron's GPT)
        self.setup: dict = {"variant": self.variant, "trainer": "megatron", "rank": rank, "world": world,
                            "tp": self.tp, "dp": self.dp, "ep": self.ep, "moe": self.moe,
                            "device_name": torch.cuda.get_device_name(self.dev), "torch": torch.__version__,
                            "pid": os.getpid(), "memory_history": bool(spec.get("memory_history"))}
        torch.zeros(1, device=self.dev)  # the CUDA context
        if spec.get("memory_history"):  # a diagnostic: the offload's residual blocks get their frames (slower steps)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._open_probe()
        self._init_groups()
        self._build()
        self.verify_tokens = prompts(self.cfg, spec["verify_batch"], spec["verify_len"], spec["seed"] + 11, self.dev)
        self._start_rollout()

    # ---- setup -----------------------------------------------------------------------------------------------
    def _init_groups(self):
        import torch.distributed as dist  # noqa: PLC0415
        from megatron.core import parallel_state, tensor_parallel  # noqa: PLC0415

        import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

        self.ebt = ebt
        mode, cumem, teardown = self.v.group_settings(self.spec)
        self.eager_groups = mode == "eager"  # WORLD bound to the device: every group connects at creation
        self.reload_eager = mode in ("eager", "used")  # "used": reload connects what the last step connected
        self.setup["groups"] = mode
        if cumem == "off":  # slime's actor environment (SGLang needs it off; slime sets it for every actor)
            os.environ["NCCL_CUMEM_ENABLE"] = "0"
        self.setup["nccl_cumem"] = cumem
        self.background_teardown = teardown == "background"
        self.setup["comm_teardown"] = teardown
        ebt.install_groups(**self.v.install)
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
        self.v.host_threads(local, self.setup)

    def _build(self):
        self.model, self.opt = self.v.build(self)
        self.tp_dims = self.ebt.tensor_parallel_dims([self.model])
        # {local name: global name} of this rank's experts at EP > 1: the sync sends the whole model from every rank,
        # the experts gathered over the expert-parallel group (ebbtide: the sender's coalesced gather per bucket,
        # ``expert_sources``; the slime-style update and the checks: ``full_weights``, eagerly)
        self.expert_names = self.ebt.expert_parallel_names([self.model])
        self.named = lambda: {n: p.detach() for n, p in served_names(self.model.named_parameters()).items()}
        self.full = (lambda: self.ebt.full_weights([self.model])) if self.expert_names else None
        named = served_names(self.model.named_parameters())
        self.setup["params"] = sum(p.numel() * (self.tp if n in self.tp_dims else 1)
                                   * (self.ep if n in self.expert_names else 1) for n, p in named.items())
        # this rank's share of the optimizer step: dense params over the DP group, experts over the expert-DP group
        # (world / ep with whole experts)
        local_experts = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
        dense = sum(p.numel() for p in named.values()) - local_experts
        self.setup["params_stepped"] = dense // self.dp + local_experts // (self.world // self.ep)
        self._host_floor()

    def _start_rollout(self):
        import socket  # noqa: PLC0415
        from multiprocessing.connection import Connection  # noqa: PLC0415

        mine, theirs = socket.socketpair()
        experts = {}
        if self.expert_names:
            from megatron.core import parallel_state  # noqa: PLC0415

            experts = dict(ep_group=parallel_state.get_expert_model_parallel_group(), full=self.full,
                           ep_sources=self.ebt.expert_sources([self.model]))
        self.sync = IpcTrainerSync(self.named, Connection(mine.detach()), self.v.sync_mode,
                                   tp_group=self.tp_group, tp_dims=self.tp_dims, **experts)
        self.setup.update(sync=self.sync.mode, sync_bytes=self.sync.plan.nbytes,
                          sync_bf16_bytes=self.sync.plan.source_bytes)
        extra = {}
        if self.moe:  # the whole MoE model, its router in fp32 as the trainer's (anchors.megatron.moe_fields)
            extra["moe"] = {"experts": self.moe["experts"], "topk": self.moe["topk"], "router_fp32": True}
        try:
            self._launch_rollout({"sync_fd": theirs.fileno()}, arch="megatron", sync=self.sync.mode, **extra)
        finally:
            theirs.close()

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
        with self.v.step_region():
            ok, grad_norm, _ = self.opt.step()
            # the fp32 main grads a DistributedOptimizer made for this step go now, not through the pause
            self.opt.zero_grad()
        torch.cuda.synchronize(self.dev)
        if not ok:
            raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
        out = {"grad_norm": float(grad_norm) if grad_norm is not None else None}
        out.update(self.v.step_info(self.opt, self.setup["moments"]))
        return out

    def _reference(self) -> dict:
        B, T = self.verify_tokens.shape
        pos = torch.arange(T, device=self.dev).unsqueeze(0).expand(B, -1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=self.dev), 1).view(1, 1, T, T)
        def forward():  # the logits are split over the vocabulary at TP > 1: gathered whole
            out = self.model(self.verify_tokens, pos, mask)
            return self.ebt.gather_along(out, -1, self.tp_group) if self.tp > 1 else out

        return reference_entry(served_names(self.model.named_parameters()), self.sync.reference(), forward,
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


def main(argv=None) -> int:
    return rank_main(_MegatronTrainer, argv)


if __name__ == "__main__":
    exit_now(main())  # no interpreter teardown: paused pools and communicators go with the process
