"""ebbtide.integrations.megatron — a Megatron-core trainer on ebbtide in a few lines.

    import ebbtide.integrations.megatron as ebt
    ebt.install_groups()                                  # before initialize_model_parallel
    parallel_state.initialize_model_parallel(...)
    model = [DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=False), m)]
    opt = ebt.get_optimizer(OptimizerConfig(bf16=True, lr=...), model)   # OffloadedAdam under Megatron's API
    state = ebt.TrainingState(model, opt)
    ...train a step...
    state.offload(); ebt.release_groups()                 # rollout runs here
    ebt.reload_groups(); state.restore()

Weights as a serving engine takes them: ``tensor_parallel_dims`` (the ``tp_dims`` of ``ebbtide.sync.Sender``) and
``full_weights`` (gathered over the tensor-parallel group, experts over the expert-parallel one under their global
names: ``expert_parallel_names``; ``expert_sources``, the ``ep_sources`` of ``ebbtide.sync.Sender``, gathers them per
bucket instead; ``gather_along``: one tensor's shards over a group, e.g. the vocabulary-split logits at TP > 1).

Groups (``install_groups``, ``release_groups``, ``reload_groups``, ``check_groups``), memory (``TrainingState``) and
the optimizer (``get_optimizer``, ``EbbtideOptimizer``; with the distributed optimizer, ``EbbtideDistributedOptimizer``
over ``ebbtide.optim.ShardedAdam``) are independent: each works with Megatron's own versions of the other two. A
trainer that keeps Megatron's HybridDeviceOptimizer (``--optimizer-cpu-offload``) and wants only ebbtide's CPU step:
``from ebbtide.integrations.megatron import hybrid_device; hybrid_device.install(mode="fast")``. What each supports
and refuses is in its module's doc and in docs/megatron.md.
"""
from __future__ import annotations

from ._groups import check_groups, install_groups, megatron_groups, release_groups, reload_groups
from ._memory import OffloadReport, TrainingState
from ._build import get_optimizer
from ._distributed import EbbtideDistributedOptimizer
from ._optimizer import EbbtideOptimizer, check_config
from ._weights import expert_parallel_names, expert_sources, full_weights, gather_along, tensor_parallel_dims

__all__ = [
    "install_groups", "release_groups", "reload_groups", "check_groups", "megatron_groups",
    "TrainingState", "OffloadReport", "get_optimizer", "EbbtideOptimizer", "EbbtideDistributedOptimizer",
    "check_config", "tensor_parallel_dims", "expert_parallel_names", "expert_sources", "full_weights", "gather_along",
]
