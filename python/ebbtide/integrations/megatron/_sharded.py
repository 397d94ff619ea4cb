"""Megatron's distributed-optimizer shards as :class:`ebbtide.optim.ShardedAdam`'s: each data-parallel rank keeps and
steps only its part of every DDP bucket, fp32 master and Adam moments in host memory.

What holds:
- Layout. Megatron's DDP built with ``use_distributed_optimizer=True`` keeps every param in a flat ``param_data``
  buffer and its gradient in ``grad_data`` (one buffer per dtype, dense and expert-parallel apart), cut into
  buckets whose sizes divide by the bucket's data-parallel group size. Rank r owns, in each bucket, the contiguous
  slice ``[offset + r*S, offset + (r+1)*S)`` with ``S = bucket numel / dp`` (``DistributedOptimizer.
  _build_model_gbuf_range``). Each param's part of that slice is one ``Shard``: ``param_data[lo:hi]`` with its
  gradient ``grad_data[lo:hi]`` (reduce-scattered there by DDP's ``finish_grad_sync`` before ``optimizer.step()``;
  bf16, or fp32 with ``grad_reduce_in_fp32``), in the param's Megatron param group, counting for the norm unless
  shared or a tensor-parallel duplicate (Megatron's rule for its distributed form). The shards go in forward order
  (the last bucket holds the first layers: DDP fills buckets in backward order) and, within a bucket, in buffer
  order, so params next to each other are one copy each way. Alignment gaps between params are no shard: never
  stepped, never written. Host memory is 12 B per owned element (8 with bf16 moments): 1/dp of the non-sharded
  optimizer's.
- Numerics: ``mode="exact"`` gives torch's CPU AdamW (for-loop) on fp32 masters, the master initialised as
  ``param.float()`` -- what Megatron's DistributedOptimizer with HybridDeviceOptimizer (offload fraction 1.0)
  computes, so losses match it bit for bit. Unscale and clip go into the kernel's ``grad_scale``.
- Checkpoints in Megatron's dp_zero layout go through :meth:`MegatronShards.bucket_state` (this rank's slice of a
  bucket, fp32, zeros where no param is) and :meth:`MegatronShards.set_bucket_state`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import InvalidArgumentError
from ...optim import Shard, ShardedAdam

try:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
except ImportError as e:  # pragma: no cover - the package is imported through integrations.megatron
    raise ImportError(f"ebbtide.integrations.megatron needs megatron-core (tested with 0.16.1): {e}") from e

__all__ = ["MegatronShards", "shard_ranges", "dp_zero_key"]

_KEYS = {"param": "master_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Megatron's -> ShardedAdam's


def dp_zero_key(key: str) -> str:
    """ShardedAdam's state key for a key of Megatron's dp_zero checkpoint ("param", "exp_avg", "exp_avg_sq")."""
    return _KEYS[key]


@dataclass(frozen=True)
class _Place:
    buffer: int  # index into MegatronShards.buffers
    bucket: int
    lo: int  # [lo, hi): the shard's element range in the buffer
    hi: int


def shard_ranges(buffer) -> list[tuple[int, int]]:
    """This rank's ``[start, end)`` slice of every bucket of a Megatron ``_ParamAndGradBuffer`` (buffer coords)."""
    dp = buffer.data_parallel_group.size()
    r = buffer.data_parallel_group.rank()
    out = []
    for b in buffer.buckets:
        n = b.grad_data.numel()
        if n % dp:
            raise InvalidArgumentError(f"a bucket of {n} elements does not divide by the data-parallel size {dp}")
        s = n // dp
        out.append((b.offset + r * s, b.offset + min(n, (r + 1) * s)))
    return out


class MegatronShards:
    """Megatron's param groups and DDP buffers mapped onto ShardedAdam's shards and param groups (see the module
    doc): ``shards``, ``param_groups`` (Megatron's keys, without ``params``), ``model_groups`` (Megatron's params per
    group), ``buffers``, and where each shard lies (``places``)."""

    def __init__(self, groups: list[dict], buffers: list, tp_group=None):
        self.buffers = list(buffers)
        self.model_groups = [list(g["params"]) for g in groups]
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        group_of = {id(p): gi for gi, ps in enumerate(self.model_groups) for p in ps}
        devices = {b.param_data.device for b in self.buffers if b.param_data is not None}
        if len(devices) > 1:
            raise InvalidArgumentError(f"the DDP buffers are on several devices: {sorted(map(str, devices))}")
        found = []
        for bi, buf in enumerate(self.buffers):
            if buf.param_data is None or buf.param_dtype != torch.bfloat16:
                raise InvalidArgumentError(f"DDP buffer {bi}: ebbtide's distributed optimizer needs bf16 params in "
                                           f"the buffer (param dtype {buf.param_dtype})")
            slices = shard_ranges(buf)
            for p, (start, end, k) in buf.param_index_map.items():
                lo, hi = max(start, slices[k][0]), min(end, slices[k][1])
                if lo >= hi:
                    continue
                gi = group_of.get(id(p))
                if gi is None:
                    raise InvalidArgumentError("a param of the DDP buffers is in no param group of the optimizer")
                counts = param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group)
                found.append((_Place(bi, k, lo, hi), gi, counts))
        found.sort(key=lambda f: (f[0].buffer, -f[0].bucket, f[0].lo))  # forward order, then buffer order
        if not found and self.buffers:  # a rank whose slices hold only padding: an empty shard keeps the device
            s0 = shard_ranges(self.buffers[0])[0][0]
            found.append((_Place(0, 0, s0, s0), 0, False))
        self.places = [place for place, _, _ in found]
        self.shards = [Shard(self.buffers[pl.buffer].param_data[pl.lo:pl.hi],
                             self.buffers[pl.buffer].grad_data[pl.lo:pl.hi], group=gi, counts_for_norm=counts)
                       for pl, gi, counts in found]

    def optimizer(self, **kw) -> ShardedAdam:
        """The ShardedAdam over these shards (``kw``: its hyper-parameters and pipeline settings)."""
        return ShardedAdam(self.shards, self.param_groups, **kw)

    def _in_bucket(self, bi: int, k: int):
        return [(i, pl) for i, pl in enumerate(self.places) if pl.buffer == bi and pl.bucket == k]

    def bucket_state(self, opt: ShardedAdam, bi: int, k: int, key: str) -> torch.Tensor:
        """This rank's slice of bucket ``k`` of buffer ``bi`` for ``key`` ("param", "exp_avg", "exp_avg_sq") as
        Megatron's checkpoint code lays it out: fp32, zeros where no param is."""
        buf = self.buffers[bi]
        s0, _ = shard_ranges(buf)[k]
        out = torch.zeros(buf.buckets[k].grad_data.numel() // buf.data_parallel_group.size(), dtype=torch.float32)
        for i, pl in self._in_bucket(bi, k):
            out[pl.lo - s0:pl.hi - s0].copy_(opt.local_shard(i, dp_zero_key(key)))
        return out

    def set_bucket_state(self, opt: ShardedAdam, bi: int, k: int, key: str, shard: torch.Tensor) -> None:
        """The inverse of :meth:`bucket_state` (then ``opt.upload_params_from_master()`` once the masters are in)."""
        s0, _ = shard_ranges(self.buffers[bi])[k]
        for i, pl in self._in_bucket(bi, k):
            opt.set_local_shard(i, dp_zero_key(key), shard[pl.lo - s0:pl.hi - s0])
