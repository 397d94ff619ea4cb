"""ebbtide's CPU Adam over an FSDP2 model's local shards: ``ebbtide.optim.ShardedAdam`` with one ``Shard`` per
trainable FSDPParam.

What holds:
- Shards: per trainable parameter in the model's FSDP order (after ``TrainingState``, the order they lie in its flat
  buffer, so consecutive shards are one copy each way), the DTensor's ``_local_tensor`` (bf16, the rank's rows) as
  the shard's param, and as its gradient this step's ``p.grad._local_tensor`` (FSDP's reduce-scatter output, a new
  view every backward; None when the parameter got no gradient). fp32 master and moments (or bf16 moments) live in
  host memory, 12 B (8 B) per local element.
- The step writes the new bf16 values into the shards in place; FSDP's next forward all-gathers them. Nothing else
  is collective, so ``after_step`` is not needed; ``all_reduce`` reduces over the FSDP group (``grad_norm``,
  ``has_non_finite_grad``). Clip before the step as with any torch optimizer
  (``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` works on the DTensor gradients).
- ``zero_grad()`` clears the model's parameters' gradients (``FsdpShardedAdam``): ShardedAdam's own params are
  the local tensors, and FSDP adds the next backward's gradient to one left set.
- Stale shards are refused: FSDP's ``reset_sharded_param`` (run by ``model.to()`` / ``.cpu()`` through
  ``FSDPModule._apply`` and by ``load_state_dict``) gives a parameter a new local tensor, in other memory when the
  values moved (a ``.to()`` that changes nothing makes a new tensor over the same memory, which is fine), and
  ``load_state_dict(assign=True)`` gives the module a new Parameter, whose gradients the optimizer would never
  read. ``step()`` and the mirror's upload first check, per shard, that the module's and FSDP's parameter are
  still the Parameter the optimizer was built over and that its local tensor still starts at the shard's address,
  then ShardedAdam's own storage check (``check_storage``: a ``set_`` onto another storage), and raise StateError
  naming the parameter before anything changes (a few integer and identity compares per parameter).
- ``param_groups``: torch's form, ``[{"params": [model parameters], "weight_decay": 0.0, ...}, ...]``; every
  trainable parameter in exactly one group (default: one group of all of them).
- With ``TrainingState(model, weights="discard")`` the optimizer keeps a pinned bf16 host mirror of the shards
  (``enable_param_mirror``: 2 B per local element, written by every step in place of its upload slots), so the
  offload drops the shards without a copy and the restore uploads the mirror. Writes to the parameters outside the
  optimizer (loading weights) reach the mirror only through ``opt.sync_master_from_params()``.
- Order with ``TrainingState``: ShardedAdam keeps views of the shards' memory from its construction, so build
  ``TrainingState(model)`` first (it re-backs the shards), then ``sharded_adam(model)``; a TrainingState built over a
  model that already has one is refused (InvalidArgumentError). Shards must be bf16 (build the model in bf16:
  ``param.data = param.data.to(torch.bfloat16)`` before ``fully_shard``, buffers left as they are).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ...errors import InvalidArgumentError, StateError
from ...optim import Shard, ShardedAdam
from ._model import describe

__all__ = ["sharded_adam", "FsdpShardedAdam", "has_sharded_adam", "sharded_adam_of"]

_ATTR = "_ebbtide_sharded_adam"  # on the root module: a weak reference to the ShardedAdam built over it


class FsdpShardedAdam(ShardedAdam):
    """ShardedAdam over an FSDP2 model's shards. Its own params are the local tensors, which never hold a gradient:
    ``zero_grad`` clears the model's parameters' gradients instead (FSDP accumulates into a gradient left set)."""

    def __init__(self, shards, param_groups, *, records, **kw):
        super().__init__(shards, param_groups, **kw)
        self._records = list(records)  # the ParamRecord of each shard, in shard order
        self._fsdp_params = [r.sharded_param for r in self._records]

    def check_storage(self, what: str = "step()") -> None:
        for r, s in zip(self._records, self.shards):
            fp = r.fsdp_param
            now = r.module._parameters.get(r.attr)  # the sharded parameter, or FSDP's unsharded one in between
            if fp.sharded_param is not r.sharded_param or (
                    now is not r.sharded_param and now is not getattr(fp, "_unsharded_param", None)):
                raise StateError(f"{what}: parameter {r.fqn} was replaced by a new Parameter since sharded_adam() "
                                 "(load_state_dict(assign=True) or a manual swap): its gradients would not reach the "
                                 "optimizer. Nothing was changed: build the optimizer again (sharded_adam(model))")
            if s.param.numel() and fp.sharded_param._local_tensor.data_ptr() != s.param.data_ptr():
                raise StateError(f"{what}: the shard of {r.fqn} was moved since sharded_adam() (model.to()/.cpu() "
                                 "or load_state_dict: FSDP re-created its local tensor in other memory); the "
                                 "optimizer would step the old memory. Nothing was changed: build the optimizer "
                                 "again (sharded_adam(model))")
        super().check_storage(what)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._fsdp_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def sharded_adam_of(model):
    """The ShardedAdam built over ``model`` by :func:`sharded_adam` (None if there is none, or it is gone)."""
    ref = getattr(model, _ATTR, None)
    return None if ref is None else ref()


def has_sharded_adam(model) -> bool:
    return sharded_adam_of(model) is not None


def _group_index(model_params, param_groups) -> tuple[list, dict]:
    """(hyper-parameter dicts without "params", {id(param): group index})."""
    if param_groups is None:
        return [{}], {id(p): 0 for p in model_params}
    if not isinstance(param_groups, (list, tuple)) or not all(isinstance(g, dict) for g in param_groups):
        raise InvalidArgumentError("param_groups must be a list of dicts with 'params', as for torch optimizers")
    hypers, where = [], {}
    for gi, g in enumerate(param_groups):
        params = g.get("params")
        if params is None:
            raise InvalidArgumentError(f"param_groups[{gi}] has no 'params'")
        for p in ([params] if isinstance(params, torch.Tensor) else list(params)):
            if id(p) in where:
                raise InvalidArgumentError(f"a parameter is in param_groups[{where[id(p)]}] and [{gi}]")
            where[id(p)] = gi
        hypers.append({k: v for k, v in g.items() if k != "params"})
    return hypers, where


def sharded_adam(model, param_groups=None, **adam_kwargs):
    """An ``FsdpShardedAdam`` (``ebbtide.optim.ShardedAdam``) over ``model``'s local shards (see the module doc);
    ``adam_kwargs`` are ShardedAdam's (``lr``, ``betas``, ``eps``, ``weight_decay``, ``adamw``, ``mode``,
    ``moments_dtype``, ``threads``, ``bucket_numel``, ``slots``)."""
    fsdp = describe(model)
    if has_sharded_adam(model):
        raise InvalidArgumentError("the model already has a ShardedAdam (sharded_adam() called twice)")
    trainable = [r for r in fsdp.params if r.sharded_param.requires_grad]
    hypers, where = _group_index([r.sharded_param for r in trainable], param_groups)
    shards = []
    for r in trainable:
        gi = where.get(id(r.sharded_param))
        if gi is None:
            raise InvalidArgumentError(f"{r.fqn} is trainable but in no param group")
        local = r.fsdp_param.sharded_param._local_tensor
        if local.dtype != torch.bfloat16:
            raise InvalidArgumentError(f"{r.fqn}: its shard is {local.dtype}; ShardedAdam keeps bf16 params on the "
                                       "GPU and fp32 masters on the host (cast the parameters to bf16 before "
                                       "fully_shard)")

        def grad(p=r.sharded_param):
            g = p.grad
            return None if g is None else g._local_tensor

        shards.append(Shard(local, grad, group=gi, grad_dtype=local.dtype, name=r.fqn))
    extra = set(where) - {id(r.sharded_param) for r in trainable}
    if extra:
        raise InvalidArgumentError(f"param_groups name {len(extra)} tensor(s) that are not trainable FSDP2 "
                                   "parameters of the model")
    group = fsdp.group if fsdp.world > 1 else None

    def all_reduce(t, op, _group=group):
        if _group is not None:
            dist.all_reduce(t, op=op, group=_group)
        return t

    opt = FsdpShardedAdam(shards, hypers, records=trainable, all_reduce=all_reduce, **adam_kwargs)
    state = getattr(model, "_ebbtide_training_state", None)
    state = state() if state is not None else None
    if state is not None and state.weights == "discard":
        opt.enable_param_mirror()  # every step writes it: the offload drops the shards, the restore uploads it
    setattr(model, _ATTR, weakref.ref(opt))
    return opt
