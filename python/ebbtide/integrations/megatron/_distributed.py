"""``EbbtideDistributedOptimizer``: Megatron's optimizer interface over :class:`ebbtide.optim.ShardedAdam` (the
distributed-optimizer form; how Megatron's buffers become shards is ``_sharded.py``, the step and what holds of it
ShardedAdam's).

What holds:
- Built by :func:`ebbtide.integrations.megatron.get_optimizer` when the ``OptimizerConfig`` and the model's DDP both
  say ``use_distributed_optimizer=True``. One instance covers every model chunk's buffers, dense and
  expert-parallel (each bucket's shard follows that buffer's own data-parallel group), so Megatron's param groups
  (weight decay, lr multipliers, ``is_expert_parallel``) are one list, as Megatron's ``param_groups`` expects.
- Gradients are never copied on the GPU: the step reads the reduce-scattered slices of DDP's ``grad_data``. A loss
  scaler skips the step on non-finite gradients (found on any rank of the distributed-optimizer group); the norm
  and that check are ShardedAdam's, reduced through this optimizer's ``_all_reduce`` (the Gloo twin of the
  distributed-optimizer group by default): its ``all_reduce`` hook.
- After the step the params are all-gathered as Megatron's DistributedOptimizer does (``start_param_sync`` per
  model chunk without ``overlap_param_gather``; with it, DDP's forward pre-hooks): ShardedAdam's ``after_step``
  hook, so it runs after a step that was interrupted and made whole too (before its ``StepError(completed=True)``
  is raised): every rank's params hold the new version and the ranks' collectives stay paired.
- Checkpoints: ``state_dict`` is Megatron's DistributedOptimizer form (param groups without params, the step in
  each group, the grad scaler; each loads the other's); the parameter state goes
  through ``get_parameter_state_dp_zero`` / ``load_parameter_state_from_dp_zero`` (Megatron's layout and names,
  gathered on DP rank 0 over each buffer's data-parallel group; a checkpoint whose layout does not match is
  refused on every rank before anything changes). MoE models (expert buffers in another data-parallel group) are
  refused by name for the dp_zero form.
  ``sharded_state_dict`` (Megatron's distributed checkpoint of the distributed optimizer) is refused by name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import InvalidArgumentError, UnsupportedError
from ...optim import ShardedAdam
from ._optimizer import EbbtideOptimizer
from ._sharded import MegatronShards

__all__ = ["EbbtideDistributedOptimizer"]

_KEYS = ("param", "exp_avg", "exp_avg_sq")


class EbbtideDistributedOptimizer(EbbtideOptimizer):
    """Megatron's optimizer interface over one :class:`ShardedAdam` over ``layout``'s shards (build it with
    ``get_optimizer``). It supplies the ShardedAdam's hooks: the params' all-gather after every whole step, the
    norm's and the found-inf check's reductions."""

    def __init__(self, inner: ShardedAdam, config, model_chunks, layout: MegatronShards, grad_scaler=None, *,
                 grad_stats_parallel_group=None, tp_group=None, grad_stats_cpu_group=None):
        super().__init__(inner, config, grad_scaler, grad_stats_parallel_group=grad_stats_parallel_group,
                         tp_group=tp_group, grad_stats_cpu_group=grad_stats_cpu_group,
                         model_groups=layout.model_groups)
        self.model_chunks = list(model_chunks)
        self.layout = layout
        inner.after_step, inner.all_reduce = self._start_param_sync, self._all_reduce

    # ---- gradients: read in place ----------------------------------------------------------------------------
    def _copy_model_grads_to_main_grads(self) -> None:
        for p in self._params():
            p.grad = None  # Megatron's grads live in DDP's buffer; .grad stays None as with its optimizers

    def _grads_for_norm(self) -> list:
        return self.optimizer.grads(counted_only=True)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._copy_model_grads_to_main_grads()
        self._clip_coeff = 1.0
        if not self.grad_scaler:
            return False
        found_inf = self.optimizer.has_non_finite_grad()
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return self.optimizer.grad_norm() * self._loss_unscale()

    def add_bucket_hook(self, fn):
        raise UnsupportedError("add_bucket_hook: the distributed optimizer's buckets are this rank's shards only; "
                               "stream weight updates from the gathered params (full_weights) after the step")

    def _start_param_sync(self) -> None:
        for chunk in self.model_chunks:  # Megatron's DistributedOptimizer.step_with_ready_grads
            if not chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync()

    def reload_model_params(self, state_dict=None):
        if state_dict is not None:
            raise UnsupportedError("reload_model_params(state_dict=...) is not supported; load the parameter state "
                                   "with load_parameter_state_from_dp_zero instead")
        self.optimizer.sync_master_from_params()

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self, is_loading: bool = False):
        """Megatron's DistributedOptimizer form: param groups without params, the step in each group (as Megatron
        writes it for torch's Adam), the grad scaler."""
        step = self.optimizer.step_count
        groups = [{k: v for k, v in g.items() if k != "params"} | {"step": step} for g in self.optimizer.param_groups]
        out = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def load_state_dict(self, state_dict):
        """Ours or Megatron's DistributedOptimizer.state_dict(): hyper-parameters and the step; validated first."""
        inner = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise InvalidArgumentError("not a Megatron distributed-optimizer state dict (no optimizer.param_groups)")
        saved = inner["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise InvalidArgumentError(f"the state dict has {len(saved)} param groups, the optimizer "
                                       f"{len(self.optimizer.param_groups)}")
        steps = {int(g["step"].item() if isinstance(g["step"], torch.Tensor) else g["step"])
                 for g in saved if g.get("step") is not None}
        if len(steps) > 1:
            raise InvalidArgumentError(f"the param groups' steps differ ({sorted(steps)}); one step count is kept")
        if steps:
            self.optimizer.set_step_count(steps.pop())
        for mine, theirs in zip(self.optimizer.param_groups, saved):
            for k, v in theirs.items():
                if k not in ("params", "step"):
                    mine[k] = v
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        raise UnsupportedError("sharded_state_dict of ebbtide's distributed optimizer is not supported; save the "
                               "parameter state with get_parameter_state_dp_zero() (Megatron's dp_zero layout)")

    def _single_dp_group(self, what: str) -> None:
        """The dp_zero form is one data-parallel group's: Megatron keeps expert-parallel buffers (their own DP
        group) in a second optimizer of its ChainedOptimizer, with its own dp_zero dict."""
        if len({id(b.data_parallel_group) for b in self.layout.buffers}) > 1:
            raise UnsupportedError(f"{what}: the model has expert-parallel buffers (another data-parallel group); "
                                   "the dp_zero form of MoE models (Megatron's chained [dense, expert] layout) is "
                                   "not supported")

    def _dp_group(self, bi: int):
        """The bucket shards' own data-parallel group and where its collectives take tensors."""
        buf = self.layout.buffers[bi]
        cpu = dist.get_backend(buf.data_parallel_group) == "gloo"
        return buf.data_parallel_group, ("cpu" if cpu else buf.param_data.device)

    def get_parameter_state_dp_zero(self, use_gloo_comm: bool = True, empty_data: bool = False,
                                    return_on_all_ranks: bool = False):
        """Megatron's ``DistributedOptimizer.get_parameter_state_dp_zero`` layout (see the module doc); gathered over
        each buffer's data-parallel group (``use_gloo_comm`` is accepted for Megatron's signature)."""
        self._single_dp_group("get_parameter_state_dp_zero")
        inner = self.optimizer
        state, rank0 = {"buckets_coalesced": True}, True
        for bi, buf in enumerate(self.layout.buffers):
            group, dev = self._dp_group(bi)
            dp, r = group.size(), group.rank()
            rank0 = r == 0
            world = {}
            if rank0 or return_on_all_ranks:
                world = {k: torch.zeros(buf.numel_unpadded, dtype=torch.float32) for k in _KEYS}
                world["numel_unpadded"] = buf.numel_unpadded
            off = 0
            for k, bucket in enumerate(buf.buckets):
                n_unpadded = bucket.numel_unpadded
                for key in _KEYS:
                    if empty_data:
                        continue
                    send = self.layout.bucket_state(inner, bi, k, key).to(dev)
                    recv = [torch.empty_like(send) for _ in range(dp)] if rank0 or return_on_all_ranks else None
                    if return_on_all_ranks:
                        dist.all_gather(recv, send, group=group)
                    else:
                        dist.gather(send, recv, dst=dist.get_global_rank(group, 0), group=group)
                    if rank0 or return_on_all_ranks:
                        world[key][off:off + n_unpadded].copy_(torch.cat([t.cpu() for t in recv])[:n_unpadded])
                off += n_unpadded
            state[bi] = {(buf.param_dtype, buf.grad_dtype): world}
        return state if rank0 or return_on_all_ranks else None

    @torch.no_grad()
    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format: bool = False):
        """Load Megatron's dp_zero parameter state (DP rank 0 passes it, the others None): masters and moments of
        this rank's shards, then the bf16 params from the masters. Every buffer's entry is checked on DP rank 0
        and the verdict broadcast before anything changes."""
        if update_legacy_format:
            raise UnsupportedError("update_legacy_format=True (Megatron's pre-0.9 layout) is not supported")
        self._single_dp_group("load_parameter_state_from_dp_zero")
        inner = self.optimizer
        worlds = []
        for bi, buf in enumerate(self.layout.buffers):
            group, dev = self._dp_group(bi)
            why, world = [""], None
            if group.rank() == 0:
                try:
                    world = state_dict[bi][(buf.param_dtype, buf.grad_dtype)]
                    if not state_dict.get("buckets_coalesced") or world.get("numel_unpadded") != buf.numel_unpadded:
                        raise KeyError("numel_unpadded")
                    if any(tuple(world[k].shape) != (buf.numel_unpadded,) for k in _KEYS):
                        raise KeyError("shape")
                except (KeyError, TypeError, AttributeError, IndexError):
                    why[0] = (f"buffer {bi}: not a dp_zero parameter state with buckets_coalesced=True and a "
                              f"({buf.param_dtype}, {buf.grad_dtype}) entry of {buf.numel_unpadded} elements")
            dist.broadcast_object_list(why, src=dist.get_global_rank(group, 0), group=group,
                                       device=None if dev == "cpu" else dev)
            worlds.append((why[0], world))
        bad = [w for w, _ in worlds if w]
        if bad:  # every rank of the groups raises; nothing was changed
            raise InvalidArgumentError("; ".join(bad))
        for bi, buf in enumerate(self.layout.buffers):
            group, dev = self._dp_group(bi)
            dp, r, world = group.size(), group.rank(), worlds[bi][1]
            off = 0
            for k, bucket in enumerate(buf.buckets):
                size = bucket.grad_data.numel() // dp
                for key in _KEYS:
                    recv = torch.empty(size, dtype=torch.float32, device=dev)
                    parts = None
                    if r == 0:
                        full = torch.zeros(size * dp, dtype=torch.float32)
                        full[:bucket.numel_unpadded].copy_(world[key][off:off + bucket.numel_unpadded])
                        parts = [t.to(dev) for t in full.split(size)]
                    dist.scatter(recv, parts, src=dist.get_global_rank(group, 0), group=group)
                    self.layout.set_bucket_state(inner, bi, k, key, recv.cpu())
                off += bucket.numel_unpadded
        inner.upload_params_from_master()
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)
