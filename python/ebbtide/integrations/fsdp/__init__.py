"""ebbtide.integrations.fsdp — an FSDP2 (``torch.distributed.fsdp.fully_shard``) trainer on ebbtide.

    import ebbtide.integrations.fsdp as ebt
    ebt.install_groups()                                  # before init_process_group / init_device_mesh
    dist.init_process_group("nccl", device_id=dev)
    mesh = init_device_mesh("cuda", (world,))
    for layer in model.model.layers: fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = ebt.TrainingState(model)                      # once: shards moved into ebbtide.memory, addresses kept
    opt = ebt.sharded_adam(model, lr=...)                 # ebbtide's CPU Adam over the local shards (bf16)
    # (or opt = torch.optim.AdamW(...) and TrainingState(model, opt): its GPU state is offloaded too)
    sender = Sender(ebt.local_weights(model), IpcSender(conn), gather=ebt.ShardGather(model), default="raw")
    ...train a step; sender.push(step)...                 # full tensors, HF names, one all-gather per bucket
    state.offload(); ebt.release_groups()                 # rollout runs here
    ebt.reload_groups(); state.restore()

Memory (``TrainingState``), the optimizer (``sharded_adam``), groups (``install_groups``, ``release_groups``,
``reload_groups``, ``check_groups``) and weights (``ShardGather``, ``local_weights``, ``full_weights``,
``served_name``) are independent; each works with torch's own versions of the others. What each supports and
refuses is in its module's doc and docs/fsdp.md.
"""
from __future__ import annotations

from ._groups import check_groups, fsdp_groups, install_groups, release_groups, reload_groups
from ._memory import OffloadReport, TrainingState
from ._model import describe, served_name
from ._optimizer import sharded_adam
from ._weights import ShardGather, full_weights, local_weights

__all__ = [
    "install_groups", "release_groups", "reload_groups", "check_groups", "fsdp_groups", "TrainingState",
    "OffloadReport", "sharded_adam", "describe", "served_name", "ShardGather", "local_weights", "full_weights",
]
