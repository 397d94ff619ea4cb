"""A Megatron-core model's weights as a serving engine takes them: full tensors under their module names, gathered
over the tensor-parallel group where Megatron splits them.

Policies:
- ``tensor_parallel_dims(model_chunks)``: ``{name: dim}`` of every parameter Megatron splits over the tensor-parallel
  group (its ``tensor_model_parallel`` attribute; ``partition_dim`` is the dimension), names with the wrappers'
  ``module.`` prefixes removed (DDP -> Float16Module -> GPTModel). This is what ``ebbtide.sync.Sender`` takes as
  ``tp_dims`` with ``tp_group=parallel_state.get_tensor_model_parallel_group()``: one all-gather per split tensor
  per bucket, right before the bucket is quantized.
- Layouts that concatenate correctly: Megatron orders the fused QKV weight by query group and splits it between
  whole groups, so the ranks' pieces stacked along dim 0 are the TP=1 layout; vocabulary-parallel embeddings and
  output layers and column-parallel weights stack along dim 0, row-parallel ones along dim 1. A gated MLP
  (``gated_linear_unit``, SwiGLU) holds ``[gate_r; up_r]`` on rank r, so the stacked pieces interleave gate and up
  rows: refused by name at TP > 1 (UnsupportedError) rather than served wrong.
- ``full_weights(model_chunks, group=None)``: the gather done eagerly, one ``all_gather`` per split tensor as slime's
  update does (every TP rank must call it), for checks and for paths that want every tensor at once.
- Expert parallelism (MoE, ``expert_model_parallel_size`` > 1): each rank holds ``num_moe_experts / ep`` experts as
  ``mlp.experts.local_experts.{j}`` (SequentialMLP), global expert ``ep_rank * local + j`` (Megatron's
  ``local_expert_indices``). ``expert_parallel_names`` maps each local expert parameter to its global name, and
  ``full_weights`` gathers every expert over the expert-parallel group (one ``all_gather`` per local expert parameter,
  every EP rank calling it), so each rank holds the whole model under the names of EP=1, as an engine that serves all
  experts takes them; ``expert_sources`` lists, for every global expert parameter, the local name and EP rank that
  hold it, for the sender's per-bucket gather. Megatron marks expert linears ``tensor_model_parallel`` whatever the
  expert tensor-parallel size: at 1 (whole experts, what MoE with biases requires) ``tensor_parallel_dims`` leaves
  them out; expert tensor parallelism > 1 and grouped-GEMM experts (``experts.linear_fc1.weight{j}``,
  ``experts.weight1``) are refused by name.
"""
from __future__ import annotations

import re

import torch

from ...errors import InvalidArgumentError, UnsupportedError
from ..names import served_names

__all__ = ["served_names", "tensor_parallel_dims", "expert_parallel_names", "expert_sources", "full_weights",
           "gather_along"]

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12]\.weight\d+|weight[12])$")  # TE's and the legacy


def _chunks(model_chunks) -> list:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise InvalidArgumentError("no model chunks")
    return chunks


def _tp_size() -> int:
    from megatron.core import parallel_state  # noqa: PLC0415

    return parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() \
        else 1


def tensor_parallel_dims(model_chunks) -> dict:
    """``{name: partition dim}`` of every parameter split over the tensor-parallel group (see the module doc)."""
    chunks = _chunks(model_chunks)
    tp = _tp_size()
    if tp > 1:
        gated = [c for c in chunks if getattr(getattr(c, "config", None), "gated_linear_unit", False)]
        if gated:
            raise UnsupportedError("gated_linear_unit (SwiGLU) at tensor parallel > 1: each rank holds [gate; up] "
                                   "rows of its own shard, so the gathered fc1 weight interleaves them; not served")
    dims = {}
    etp = _expert_tp() if tp > 1 else 1
    for n, p in _named(chunks).items():
        if ".mlp.experts." in n and tp > 1:
            # Megatron marks expert linears tensor_model_parallel whatever the expert TP size: at 1 they are whole
            if etp > 1:
                raise UnsupportedError(f"{n}: split over the expert tensor-parallel group ({etp} ranks); not served")
            continue
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            d = int(getattr(p, "partition_dim", 0))
            if not 0 <= d < p.dim():
                raise InvalidArgumentError(f"{n}: partition_dim {d} outside its {p.dim()} dimensions")
            if int(getattr(p, "partition_stride", 1)) != 1:
                raise UnsupportedError(f"{n}: split with partition_stride {p.partition_stride}; the ranks' pieces "
                                       "do not concatenate to the whole tensor")
            dims[n] = d
    return dims


def _expert_tp() -> int:
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    return ps.get_expert_tensor_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _ep() -> tuple[int, int]:
    """(expert-parallel size, this rank's index in it); (1, 0) without Megatron's parallel state."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    if not ps.model_parallel_is_initialized():
        return 1, 0
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1 and _expert_tp() > 1:
        raise UnsupportedError("expert tensor parallelism > 1 (each expert split over ranks): not served")
    return ep, ps.get_expert_model_parallel_rank() if ep > 1 else 0


def expert_parallel_names(model_chunks) -> dict:
    """``{local name: global name}`` of every expert parameter at expert parallel size > 1 (``{}`` otherwise): see
    the module doc."""
    named = _named(_chunks(model_chunks))
    ep, rank = _ep()
    if ep == 1:
        return {}
    grouped = [n for n in named if _GROUPED_EXPERT.search(n)]
    if grouped:
        raise UnsupportedError(f"grouped-GEMM experts ({grouped[0]}): gathered only from SequentialMLP experts "
                               "(moe_grouped_gemm=False)")
    counts = _local_expert_counts(named)
    return {n: _global_expert(n, rank, counts) for n in named if _LOCAL_EXPERT.match(n)}


def expert_sources(model_chunks) -> dict:
    """``{global name: (local name, EP rank)}`` of every expert parameter of the whole model at expert parallel
    size > 1 (``{}`` otherwise): what ``ebbtide.sync.Sender`` takes as ``ep_sources`` with
    ``ep_group=parallel_state.get_expert_model_parallel_group()`` (the local names are the same on every EP rank:
    Megatron numbers each rank's experts from 0)."""
    local = expert_parallel_names(model_chunks)
    if not local:
        return {}
    ep, _ = _ep()
    counts = _local_expert_counts(local)
    return dict(sorted((_global_expert(n, r, counts), (n, r)) for r in range(ep) for n in local))  # name order


def _local_expert_counts(named) -> dict:
    """``{experts module prefix: number of local experts}``."""
    local: dict = {}
    for n in named:
        m = _LOCAL_EXPERT.match(n)
        if m:
            local.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {k: len(v) for k, v in local.items()}


def _global_expert(name: str, ep_rank: int, counts: dict) -> str:
    """The name local expert parameter ``name`` of expert-parallel rank ``ep_rank`` has in the whole model."""
    m = _LOCAL_EXPERT.match(name)
    return f"{m.group(1)}{ep_rank * counts[m.group(1)] + int(m.group(2))}{m.group(3)}"


def _named(chunks) -> dict:
    """Every chunk's parameters under served names; a name twice (virtual pipeline chunks number their layers
    from 0 each) is refused rather than overwritten."""
    out = {}
    for c in chunks:
        for n, p in served_names(c.named_parameters()).items():
            if n in out:
                raise UnsupportedError(f"two model chunks both have {n!r} (virtual pipeline stages number their "
                                       "layers locally): serve one chunk at a time or rename the layers")
            out[n] = p
    return out


def gather_along(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full tensor of ``t``'s shards over ``group``, concatenated along ``dim`` in rank order."""
    import torch.distributed as dist  # noqa: PLC0415

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def full_weights(model_chunks, group=None, expert_group=None) -> dict:
    """``{name: full tensor}``: split parameters all-gathered over the tensor-parallel group (``group``, default
    Megatron's), experts over the expert-parallel group (``expert_group``, default Megatron's) under their global
    names, the others as they are (detached)."""
    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core import parallel_state  # noqa: PLC0415

    dims = tensor_parallel_dims(model_chunks)
    experts = expert_parallel_names(model_chunks)
    if dims and group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    if experts and expert_group is None:
        expert_group = parallel_state.get_expert_model_parallel_group()
    named = _named(_chunks(model_chunks))
    counts = _local_expert_counts(named) if experts else {}
    out = {}
    for n, p in sorted(named.items()):  # the same order on every rank: the collectives pair up
        if n in experts:
            pieces = [torch.empty_like(p) for _ in range(dist.get_world_size(expert_group))]
            dist.all_gather(pieces, p.detach().contiguous(), group=expert_group)
            for r, piece in enumerate(pieces):
                out[_global_expert(n, r, counts)] = piece
        else:
            out[n] = gather_along(p, dims[n], group) if n in dims else p.detach()
    return out
