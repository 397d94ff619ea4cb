"""What a module wrapped with ``torch.distributed.fsdp.fully_shard`` (FSDP2) holds, read once, and what the adapter
refuses.

What holds (torch 2.11 and 2.13, read from ``torch/distributed/fsdp/_fully_shard/``):
- Every ``FSDPModule`` has an ``FSDPState`` (``_get_fsdp_state()``) whose param groups (``_fsdp_param_groups`` in
  2.13, the single ``_fsdp_param_group`` in 2.11) hold one ``FSDPParam`` per parameter. An ``FSDPParam`` owns a
  padded 1-D ``_sharded_param_data`` (this rank's dim-0 chunk, padded to ``ceil(dim0 / world)`` rows) and the
  module's parameter ``sharded_param``, a DTensor whose ``_local_tensor`` is the unpadded front of it.
- The unsharded parameters (``all_gather_outputs``) are freed by ``reshard()`` (storage resized to 0) and allocated
  again by the next all-gather; gradients are views of the reduce-scatter's output, set as ``sharded_param.grad``.
- Refused by name, before anything changes: FSDP1 (``FullyShardedDataParallel``), plain ``DistributedDataParallel``,
  a model with no ``fully_shard`` module or with a trainable parameter outside every FSDP2 group, HSDP (a 2-D
  mesh with a replicate dimension), DDP-style replication (``replicate``), ``CPUOffloadPolicy`` (the shards already
  live in host memory: nothing to offload), ``reshard_after_forward`` as an int (a second, smaller shard kept after
  forward), parameters that were DTensors before ``fully_shard`` (tensor parallel on a 2-D mesh), and a parameter
  whose shards are not on the module's device.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ...errors import InvalidArgumentError, UnsupportedError

__all__ = ["FsdpModel", "describe", "served_name"]

# Wrappers that put a segment into parameter names without changing the checkpoint's: activation checkpointing
# (``checkpoint_wrapper``), ``torch.compile`` and DDP/FSDP1-style ``module.``. HF checkpoints name none of them.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def served_name(fqn: str) -> str:
    """``fqn`` as an HF checkpoint names it (what SGLang's loaders take): wrapper segments removed."""
    for seg in _WRAPPER_SEGMENTS:
        fqn = fqn.replace(seg, "")
    while fqn.startswith("module."):
        fqn = fqn[len("module."):]
    return fqn


@dataclasses.dataclass
class ParamRecord:
    """One FSDPParam as adopted: the objects and addresses that must not change behind the adapter's back."""
    fqn: str
    fsdp_param: object
    sharded_param: nn.Parameter
    module: nn.Module
    attr: str


@dataclasses.dataclass
class FsdpModel:
    """The FSDP2 structure of one model: its FSDP modules, param groups and params (in module order)."""
    root: nn.Module
    modules: list      # every FSDPModule in model.modules() order
    groups: list       # every FSDPParamGroup
    params: list       # ParamRecord per FSDPParam, in group order
    device: torch.device
    group: object      # the shard process group (one for the whole model)
    world: int
    rank: int

    def comm_contexts(self) -> list:
        """The distinct FSDPCommContext objects (one per root, shared by its states)."""
        seen, out = set(), []
        for g in self.groups:
            ctx = getattr(g, "comm_ctx", None)
            if ctx is not None and id(ctx) not in seen:
                seen.add(id(ctx))
                out.append(ctx)
        return out


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13
    if groups is None:
        g = getattr(state, "_fsdp_param_group", None)  # torch 2.11
        groups = [g] if g is not None else []
    return list(groups)


def _refuse_other_wrappers(model) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415

    for name, m in model.named_modules():
        where = f" (at {name!r})" if name else ""
        if isinstance(m, FullyShardedDataParallel):
            raise UnsupportedError(f"the model is wrapped with FSDP1 (FullyShardedDataParallel){where}: "
                                   "ebbtide.integrations.fsdp supports FSDP2 only (torch.distributed.fsdp.fully_shard)")
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            raise UnsupportedError(f"the model is wrapped with plain DistributedDataParallel{where}: "
                                   "ebbtide.integrations.fsdp supports FSDP2 only (torch.distributed.fsdp."
                                   "fully_shard); for a replicated model, fully_shard it over a 1-D mesh")


def _check_param(fp, fqn: str) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: PLC0415
    from torch.distributed.fsdp._fully_shard import _fsdp_common as common  # noqa: PLC0415

    info = fp.mesh_info
    hsdp = getattr(common, "HSDPMeshInfo", None)
    if hsdp is not None and isinstance(info, hsdp):
        raise UnsupportedError(f"{fqn}: HSDP (a 2-D mesh with a replicate dimension) is not supported: shard "
                               "over a 1-D mesh")
    if not isinstance(info, common.FSDPMeshInfo):
        raise UnsupportedError(f"{fqn}: replicated, not sharded ({type(info).__name__}: torch's replicate()); "
                               "ebbtide.integrations.fsdp supports fully_shard over a 1-D mesh")
    if getattr(fp, "offload_to_cpu", False) or isinstance(getattr(fp, "offload_policy", None), CPUOffloadPolicy):
        raise UnsupportedError(f"{fqn}: fully_shard(offload_policy=CPUOffloadPolicy()) keeps the shards in host "
                               "memory already; there is nothing on the GPU to offload")
    post = getattr(fp, "post_forward_mesh_info", None)  # True: the mesh itself; an int: a smaller one
    if post is not None and post is not info and getattr(post, "shard_mesh_size", None) != info.shard_mesh_size:
        raise UnsupportedError(f"{fqn}: reshard_after_forward as an int (a smaller shard kept after forward) is not "
                               "supported: use True or False")
    if getattr(fp, "is_dtensor", False):
        raise UnsupportedError(f"{fqn}: the parameter was a DTensor before fully_shard (tensor parallel on a 2-D "
                               "mesh): not supported")
    if type(fp._sharded_param_data) is not torch.Tensor:
        raise UnsupportedError(f"{fqn}: its shard is a {type(fp._sharded_param_data).__name__} (a tensor subclass, "
                               "e.g. FP8 all-gather): not supported")


def describe(model) -> FsdpModel:
    """The FSDP2 structure of ``model`` (see the module doc), or the typed error that says why it is refused."""
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"expected an nn.Module wrapped with fully_shard, got {type(model).__name__}")
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    _refuse_other_wrappers(model)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise InvalidArgumentError(f"{type(model).__name__} is not wrapped with torch.distributed.fsdp.fully_shard "
                                   "(no FSDPModule in it): call fully_shard on its layers and on the model first")
    groups, params, seen = [], [], set()
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied parameter goes by its first name, as named_parameters() gives it
    for m in modules:
        for g in _param_groups(m._get_fsdp_state()):
            if id(g) in seen:
                continue
            seen.add(id(g))
            groups.append(g)
            for fp in g.fsdp_params:
                fqn = names.get(id(fp.sharded_param)) or getattr(fp, "_param_fqn", None) or "?"
                _check_param(fp, fqn)
                info = fp._module_info
                params.append(ParamRecord(fqn, fp, fp.sharded_param, info.module, info.param_name))
    managed = {id(r.sharded_param) for r in params}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
    if outside:
        raise InvalidArgumentError(f"{len(outside)} trainable parameter(s) are outside every fully_shard group "
                                   f"({', '.join(outside[:4])}): they would not be offloaded")
    if not params:
        raise InvalidArgumentError("the model's fully_shard groups hold no parameters")
    devices = {r.fsdp_param.device for r in params}
    if len(devices) != 1:
        raise UnsupportedError(f"the shards are on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    for r in params:
        if r.fsdp_param._sharded_param_data.device != device:
            raise UnsupportedError(f"{r.fqn}: its shard is on {r.fsdp_param._sharded_param_data.device}, the module "
                                   f"on {device}")
    pgs = {id(r.fsdp_param.mesh_info.shard_process_group): r.fsdp_param.mesh_info for r in params}
    if len(pgs) != 1:
        raise UnsupportedError(f"the model's params are sharded over {len(pgs)} different meshes: one mesh only")
    info = next(iter(pgs.values()))
    return FsdpModel(model, modules, groups, params, device, info.shard_process_group, info.shard_mesh_size,
                     info.shard_mesh_rank)
