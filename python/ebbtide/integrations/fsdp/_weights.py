"""An FSDP2 model's weights as a serving engine takes them: full tensors under the names of an HF checkpoint,
gathered per bucket with one collective per bucket and dtype.

What holds:
- Names: the model's parameter FQNs with wrapper segments removed (``served_name``): for a transformers model under
  ``fully_shard`` they are the checkpoint's names (``model.layers.0.self_attn.q_proj.weight``), what SGLang's
  loaders take, in ``named_parameters()`` order. Tied parameters appear once, under their first name
  (``named_parameters``' rule; a tied ``lm_head.weight`` is not sent, as HF checkpoints of tied models omit it).
  Two FQNs that map to one served name are refused.
- ``ShardGather(model)`` is the ``gather`` of ``ebbtide.sync.Sender``: for one bucket's sources it packs this rank's
  padded shards (``_sharded_param_data``, cast to the gather dtype on the way) into one buffer per dtype, joins one
  ``all_gather_into_tensor`` over the FSDP group, and unpacks every tensor with one ``split_with_sizes_copy`` (FSDP's
  own copy-out); a full tensor is the first ``numel`` elements of its gathered rows (``torch.chunk``'s chunks are
  all full but the last ones, so padding only trails). At one rank nothing is gathered: the full tensor is a view
  of the shard itself (a cast copy where the dtypes differ).
- The gather dtype: ``dtype`` if given, else the mixed-precision ``param_dtype`` the model computes in, else the
  shard's dtype; so fp32 shards under ``MixedPrecisionPolicy(param_dtype=bf16)`` cross the wire as bf16, never fp32.
- Every rank must call the gather with the same names in the same order (the Sender does: plan order); a rank that
  died makes the others' collective raise (Gloo at once; NCCL at the group's timeout), which the Sender reports as
  PartialUpdateError with nothing committed.
- Shards not along dim 0 (``shard_placement_fn``) are refused by name.
"""
from __future__ import annotations

import torch

from ...errors import InvalidArgumentError, UnsupportedError
from ._model import describe, served_name

__all__ = ["ShardGather", "local_weights", "full_weights"]


def _records(model) -> dict:
    """``{served name: ParamRecord}`` in ``model.named_parameters()`` order (the checkpoint's order, which a rollout
    building the plan from its own copy of the architecture also sees)."""
    by_id = {id(r.sharded_param): r for r in describe(model).params}
    out = {}
    for _, p in model.named_parameters():
        r = by_id.get(id(p))
        if r is None:
            continue
        name = served_name(r.fqn)
        if name in out:
            raise InvalidArgumentError(f"{out[name].fqn!r} and {r.fqn!r} are both served as {name!r}")
        out[name] = r
    return out


def local_weights(model) -> dict:
    """``{served name: the rank's sharded parameter (a DTensor)}``: the ``tensors`` of ``ebbtide.sync.Sender``
    with ``gather=ShardGather(model)``."""
    return {n: r.sharded_param for n, r in _records(model).items()}


class ShardGather:
    """The per-bucket gather of an FSDP2 model's shards (see the module doc)."""

    def __init__(self, model, *, dtype: torch.dtype | None = None):
        fsdp = describe(model)
        self._by_name = _records(model)
        self.group, self.world, self.rank = fsdp.group, fsdp.world, fsdp.rank
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise InvalidArgumentError(f"dtype must be a floating-point torch.dtype, not {dtype!r}")
        self._dtype = dtype
        for name, r in self._by_name.items():
            if r.fsdp_param.fsdp_placement.dim != 0:
                raise UnsupportedError(f"{name}: sharded along dim {r.fsdp_param.fsdp_placement.dim} "
                                       "(shard_placement_fn); only dim-0 shards are gathered")

    def dtype_of(self, name: str) -> torch.dtype:
        fp = self._by_name[name].fsdp_param
        return self._dtype or fp.mp_policy.param_dtype or fp._sharded_param_data.dtype

    def spec(self, name: str, local=None) -> tuple:
        """(full shape, gather dtype) of ``name``."""
        if name not in self._by_name:
            raise InvalidArgumentError(f"{name!r} is not a parameter of the model")
        return tuple(self._by_name[name].fsdp_param._orig_size), self.dtype_of(name)

    def plan(self, **plan_options):
        """The ``ebbtide.sync.Plan`` of the whole model (full shapes, gather dtypes, served names, model order):
        the same on every rank and in the rollout, which builds it from the same specs."""
        from ...sync import Plan  # noqa: PLC0415

        return Plan.build(self.specs(), **plan_options)

    def specs(self) -> list:
        """``[(served name, full shape, dtype)]`` in model order (what a rollout builds the plan from)."""
        return [(n, *self.spec(n)) for n in self._by_name]

    @torch.no_grad()
    def __call__(self, names: list, tensors=None) -> tuple[dict, list]:
        """``({name: full tensor}, [tensors allocated here])`` for ``names`` (collective over the FSDP group)."""
        out, new, by_dtype = {}, [], {}
        for n in names:
            fp = self._by_name[n].fsdp_param
            dt = self.dtype_of(n)
            if self.world == 1:
                shard = fp._sharded_param_data.narrow(0, 0, fp._orig_size.numel()).view(fp._orig_size)
                out[n] = shard if shard.dtype == dt else shard.to(dt)
                if out[n] is not shard:
                    new.append(out[n])
            else:
                by_dtype.setdefault(dt, []).append(n)
        for dt, group_names in by_dtype.items():
            shards = [self._by_name[n].fsdp_param._sharded_param_data for n in group_names]
            sizes = [s.numel() for s in shards]
            packed = torch.empty(sum(sizes), dtype=dt, device=shards[0].device)
            torch._foreach_copy_(list(torch.split(packed, sizes)), shards)
            whole = torch.empty(self.world * packed.numel(), dtype=dt, device=packed.device)
            import torch.distributed as dist  # noqa: PLC0415

            dist.all_gather_into_tensor(whole, packed, group=self.group)  # rank r's shards at r * packed.numel()
            rows = [torch.empty(self.world * k, dtype=dt, device=packed.device) for k in sizes]
            torch.split_with_sizes_copy(whole.view(self.world, -1), sizes, dim=1,
                                        out=[t.view(self.world, -1) for t in rows])
            for n, t in zip(group_names, rows):
                size = self._by_name[n].fsdp_param._orig_size
                out[n] = t.narrow(0, 0, size.numel()).view(size)
            new += rows
        return out, new


def full_weights(model, *, dtype: torch.dtype | None = None) -> dict:
    """``{served name: full tensor}`` of every parameter, gathered at once (one collective per dtype; every rank of
    the FSDP group calls it): for checks and paths that want every tensor together."""
    g = ShardGather(model, dtype=dtype)
    full, _ = g(list(g._by_name))
    return full
