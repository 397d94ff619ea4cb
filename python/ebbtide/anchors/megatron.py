"""Megatron-core setups shared by the benchmarks and the colocated loop: a GPT built as Megatron trains it, the
``OptimizerConfig`` they use, the CPU-offloaded optimizer slime runs (DistributedOptimizer + HybridDeviceOptimizer),
torch_memory_saver configured in a Megatron process, and slime's pinned copy of the weights across a pause
(``TensorBackuper``). Import it only where megatron-core is installed."""
from __future__ import annotations

import torch

__all__ = ["build_gpt", "opt_config", "hdo", "moe_fields", "slime_offload_config", "torch_memory_saver",
           "TensorBackuper"]


def moe_fields(experts: int, topk: int) -> dict:
    """TransformerConfig fields of the MoE GPT both the example and the benchmarks build: ``experts`` whole experts
    of ``ffn_hidden_size`` (SequentialMLP: the local spec without grouped GEMM) over Megatron's expert-parallel
    group, ``topk`` per token, the alltoall token dispatcher, an fp32 router (``moe_router_dtype``: near-tie
    routing decisions then agree more often between the trainer and a rollout that recomputes them) and Megatron's
    other router defaults (softmax after top-k, no scaling, no capacity, no aux loss)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    _moe_without_te()
    return dict(num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
                moe_router_dtype="fp32", moe_grouped_gemm=False,
                expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), expert_tensor_parallel_size=1)


def _moe_without_te() -> None:
    """megatron-core 0.16.1 leaves ``moe_utils.te_general_gemm`` undefined without Transformer Engine (a NameError
    in every MoE forward); None selects its torch path."""
    import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: PLC0415

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt(layers: int, hidden: int, heads: int, ffn: int, vocab: int, seq: int, *, dist_opt: bool,
              seed: int = 1234, ddp_region=None, moe: tuple | None = None):
    """GPTModel (local layer spec, rotary positions, no dropout) -> Float16Module (bf16) -> Megatron's DDP.
    ``ddp_region``: a context manager factory entered around the DDP construction only, so its param and grad
    buffers are allocated inside it (e.g. a torch_memory_saver region) while the model's construction-time
    tensors, freed once DDP has copied them into its buffers, stay outside it. ``moe``: (experts, topk) for a MoE
    MLP in every layer (``moe_fields``; Megatron's parallel state initialised with the expert-parallel size)."""
    from megatron.core import tensor_parallel  # noqa: PLC0415
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    extra = moe_fields(*moe) if moe else {}
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            ffn_hidden_size=ffn, bf16=True, pipeline_dtype=torch.bfloat16,
                            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, **extra)
    spec = get_gpt_layer_local_spec(num_experts=moe[0], moe_grouped_gemm=False) if moe else get_gpt_layer_local_spec()
    gpt = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope")
    # Megatron's get_model moves each chunk to the GPU before wrapping it: some modules of the local spec (norms)
    # are built on the CPU, and plain DDP (no distributed optimizer) leaves params where they are.
    gpt.cuda(torch.cuda.current_device())
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                            use_distributed_optimizer=dist_opt)
    chunk = Float16Module(cfg, gpt)
    if ddp_region is None:
        return DistributedDataParallel(cfg, ddp_cfg, chunk)
    with ddp_region():
        return DistributedDataParallel(cfg, ddp_cfg, chunk)


def opt_config(**kw):
    from megatron.core.optimizer import OptimizerConfig  # noqa: PLC0415

    base = dict(optimizer="adam", lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                bf16=True, clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def slime_offload_config(*, precision_aware: bool = True, **kw):
    """The ``OptimizerConfig`` of slime's model scripts: ``--use-distributed-optimizer --optimizer-cpu-offload
    --overlap-cpu-optimizer-d2h-h2d`` (offload fraction 1.0) and ``--use-precision-aware-optimizer``. With CPU
    offload the precision-aware flag changes what the DistributedOptimizer keeps on the GPU: no fp32 main-param
    shard (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``), the HybridDeviceOptimizer's fp32 CPU copy is the
    master, its CPU AdamW keeps fp32 moments. megatron-core 0.16.1's ``__post_init__`` compares Transformer
    Engine's version before it returns for CPU offload and fails without TE, so where TE is absent the fields are
    set after construction to what ``__post_init__`` derives with TE (``store_param_remainders`` off, as for TE
    below 2.1: it only concerns TE's FusedAdam, which this path never builds)."""
    base = dict(use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                overlap_cpu_optimizer_d2h_h2d=True)
    base.update(kw)
    if not precision_aware:
        return opt_config(**base)
    try:
        return opt_config(use_precision_aware_optimizer=True, **base)
    except TypeError:  # is_te_min_version(...) without Transformer Engine: None >= Version
        cfg = opt_config(**base)
    cfg.use_precision_aware_optimizer = True
    cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True  # the __post_init__ formula with CPU offload
    cfg.store_param_remainders = False
    return cfg


def hdo(model, clip: float = 0.0, fused: bool = True):
    """Megatron's CPU path as slime runs it: DistributedOptimizer + HybridDeviceOptimizer, all of it on the CPU,
    D2H/H2D overlapped. ``fused=False`` switches its CPU torch AdamW to the for-loop implementation."""
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    opt = get_megatron_optimizer(opt_config(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                                            optimizer_offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=True,
                                            clip_grad=clip), [model])
    if not fused:
        for g in opt.optimizer.param_groups:
            g["fused"] = False
    return opt


def torch_memory_saver(*, dropin: bool = False):
    """``anchors.tms.torch_memory_saver(retain_cpu_backup=True)`` in a Megatron-core process: configured after
    ``import megatron.core.models.gpt``, which sets the package's hook mode on import (it refuses a change once
    initialised). ``dropin``: ebbtide.compat.torch_memory_saver, imported in the same order."""
    import megatron.core.models.gpt  # noqa: F401

    from .tms import torch_memory_saver as configured

    return configured(dropin=dropin, retain_cpu_backup=True)


class TensorBackuper:
    """slime's ``TensorBackuper`` (its ``--offload-train`` patch): the weights survive a pause of their (backup-less)
    region in a pinned per-parameter host copy, refreshed before the pause and copied back after the resume."""

    def __init__(self, params):
        self.params = list(params)
        self.copies = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in self.params]

    def backup(self) -> None:
        for b, p in zip(self.copies, self.params):
            b.copy_(p.detach(), non_blocking=True)
        torch.cuda.synchronize()

    @torch.no_grad()
    def restore(self) -> None:
        """Queued on the current stream (the caller synchronizes)."""
        for b, p in zip(self.copies, self.params):
            p.copy_(b, non_blocking=True)
