"""``get_optimizer``: Megatron's ``get_megatron_optimizer`` for ebbtide. It picks the form from the model's DDP config
(non-sharded ``EbbtideOptimizer`` over OffloadedAdam, or the sharded ``EbbtideDistributedOptimizer``); what each
form supports and refuses is in its module (``_optimizer.py``, ``_distributed.py``)."""
from __future__ import annotations

import torch

from ...errors import InvalidArgumentError, UnsupportedError
from ...optim import OffloadedAdam
from ._distributed import EbbtideDistributedOptimizer
from ._groups import gloo_twin
from ._optimizer import EbbtideOptimizer, check_config, moments_dtype
from ._sharded import MegatronShards

try:
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_param_groups
except ImportError as e:  # the package is usable without Megatron; this module is not
    raise ImportError(f"ebbtide.integrations.megatron needs megatron-core (tested with 0.16.1): {e}") from e

__all__ = ["check_model_chunks", "get_optimizer"]

_FP8_FIELDS = ("fp8", "fp8_param", "fp4", "fp4_param")  # TransformerConfig: FP8/FP4 training or low-precision params


def check_model_chunks(model_chunks) -> None:
    """Raise UnsupportedError naming every model-side setting this optimizer cannot honour, before anything is
    built: Megatron-FSDP, pipeline interleaving (a virtual pipeline: several model chunks per rank, whose buffers
    and param-gather order the optimizer does not follow), and FP8/FP4 training or params (their quantized param
    buffers and scaling state are not the bf16 params the CPU step writes)."""
    bad = []
    configs = [getattr(chunk, "config", None) for chunk in model_chunks]  # a MegatronModule's TransformerConfig
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    vpp = vpp or max((getattr(c, "virtual_pipeline_model_parallel_size", None) or 1 for c in configs), default=1)
    if len(model_chunks) > 1 or vpp > 1:
        bad.append(f"pipeline interleaving ({len(model_chunks)} model chunk(s) per rank, "
                   f"virtual_pipeline_model_parallel_size={vpp})")
    for name in _FP8_FIELDS:
        values = {repr(getattr(c, name, None)) for c in configs if getattr(c, name, None)}
        if values:
            bad.append(f"{name}={', '.join(sorted(values))} in the TransformerConfig (FP8/FP4 training or params: the "
                       "CPU step writes bf16 params)")
    if any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in model_chunks):
        bad.append("use_megatron_fsdp=True in the model's DDP config (Megatron-FSDP)")
    if bad:
        raise UnsupportedError("ebbtide's Megatron optimizer does not support: " + "; ".join(bad))


def get_optimizer(config, model_chunks, config_overrides=None, *, mode: str = "fast", threads: int | None = None,
                  bucket_numel: int = 16 * 2**20, slots: int = 3, buffer_factory=None,
                  stats_on_cpu: bool = True) -> EbbtideOptimizer:
    """Megatron's ``get_megatron_optimizer`` for ebbtide: the same ``OptimizerConfig`` and model chunks (Megatron
    DDP, bf16 params), param groups formed by Megatron (weight-decay and lr multipliers, ``config_overrides``).
    With ``use_distributed_optimizer=False`` (config and DDP): an :class:`EbbtideOptimizer` (whole host state on
    every rank). With ``use_distributed_optimizer=True`` in both: an ``EbbtideDistributedOptimizer`` (each
    data-parallel rank holds its shard; expert-parallel params too). ``mode``: "fast" or "exact" (fp32 master
    bit-identical to torch's CPU AdamW). ``threads``/``bucket_numel``/``slots`` go to the CPU pipeline
    (``bucket_numel``: its transfer granularity); ``buffer_factory`` to OffloadedAdam (non-sharded form only).
    ``stats_on_cpu``: the step's scalar all-reduces (grad norm, found-inf, zero count) run over a Gloo twin of the
    grad-stats group (``gloo_twin``), never waiting on a released NCCL group's reconnect; False keeps them on the
    NCCL group (no Gloo, or Gloo unable to reach the peers); the same on every rank. Collective over WORLD (Megatron
    aligns param groups across ranks)."""
    check_config(config)
    if not isinstance(stats_on_cpu, bool):
        raise InvalidArgumentError(f"stats_on_cpu must be True or False (got {stats_on_cpu!r})")
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    if not model_chunks:
        raise InvalidArgumentError("model_chunks is empty")
    check_model_chunks(model_chunks)
    ddp_configs = [getattr(chunk, "ddp_config", None) for chunk in model_chunks]  # None: a plain module
    forms = {bool(getattr(d, "use_distributed_optimizer", False)) for d in ddp_configs}
    if len(forms) > 1:
        raise InvalidArgumentError("the model chunks' DDP configs differ in use_distributed_optimizer")
    sharded = forms.pop()
    precision_aware = bool(getattr(config, "use_precision_aware_optimizer", False))
    # Megatron demands use_distributed_optimizer=True in the OptimizerConfig with the precision-aware options: with
    # a plain DDP that combination keeps meaning the non-sharded form.
    if sharded != bool(config.use_distributed_optimizer) and not (precision_aware and not sharded):
        raise InvalidArgumentError(
            f"the OptimizerConfig says use_distributed_optimizer={config.use_distributed_optimizer} and the model's "
            f"DDP config {sharded}: build both the same way")
    groups = _get_param_groups(list(model_chunks), config, config_overrides)
    if not sharded and any(g["is_expert_parallel"] and g["params"] for g in groups):
        raise UnsupportedError("expert-parallel (MoE) params need the distributed optimizer with ebbtide's Megatron "
                               "optimizer (use_distributed_optimizer=True in the DDP and OptimizerConfig)")
    groups = [g for g in groups if g["params"] and (sharded or not g["is_expert_parallel"])]
    for g in groups:
        for p in g["params"]:
            if p.dtype != torch.bfloat16:
                raise UnsupportedError(f"param of dtype {p.dtype}: ebbtide's Megatron optimizer needs bf16 params "
                                       "(Float16Module with bf16=True)")
    grad_scaler = None
    if config.loss_scale:
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler  # noqa: PLC0415

        grad_scaler = ConstantGradScaler(config.loss_scale)
    hyper = dict(lr=config.lr if config.lr is not None else 1e-3, betas=(config.adam_beta1, config.adam_beta2),
                 eps=config.adam_eps, weight_decay=config.weight_decay, adamw=config.decoupled_weight_decay,
                 mode=mode, threads=threads, slots=slots, moments_dtype=moments_dtype(config))
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if sharded:
        if buffer_factory is not None:
            raise InvalidArgumentError("buffer_factory applies to the non-sharded form only (the distributed form "
                                       "keeps the params in Megatron's DDP buffers)")
        buffers = [b for c in model_chunks for b in list(c.buffers) + list(c.expert_parallel_buffers)]
        layout = MegatronShards(groups, buffers, tp_group)
        inner = layout.optimizer(bucket_numel=bucket_numel, **hyper)
        stats = parallel_state.get_intra_distributed_optimizer_instance_group()
        return EbbtideDistributedOptimizer(
            inner, config, model_chunks, layout, grad_scaler, grad_stats_parallel_group=stats, tp_group=tp_group,
            grad_stats_cpu_group=gloo_twin(stats) if stats_on_cpu else None)
    inner = OffloadedAdam(groups, bucket_numel=bucket_numel, buffer_factory=buffer_factory, attach_grads=False,
                          **hyper)
    stats = parallel_state.get_model_parallel_group()
    return EbbtideOptimizer(inner, config, grad_scaler, grad_stats_parallel_group=stats, tp_group=tp_group,
                            grad_stats_cpu_group=gloo_twin(stats) if stats_on_cpu else None)
