"""A Megatron-core optimizer backed by :class:`ebbtide.optim.OffloadedAdam`.

Policies:
- What it is. :class:`EbbtideOptimizer` is a ``MegatronOptimizer`` (Megatron's training loop calls ``step()`` and
  reads ``(update_successful, grad_norm, num_zeros_in_grad)``; its param scheduler writes ``lr`` and
  ``weight_decay`` into ``param_groups``; checkpoints go through ``state_dict``/``load_state_dict`` and
  ``sharded_state_dict``). The inner optimizer is one OffloadedAdam over the model's own bf16 params: they become
  views of its flat bf16 buffer on the GPU; fp32 master, exp_avg and exp_avg_sq live in host memory.
  With ``use_distributed_optimizer=True`` (config and DDP) ``get_optimizer`` (``_build.py``) builds the sharded form
  instead, :class:`EbbtideDistributedOptimizer` (``_distributed.py``) over :class:`ebbtide.optim.ShardedAdam`
  (Megatron's shards mapped by ``_sharded.py``): each data-parallel rank keeps only its shard of the host state,
  expert-parallel params included.
- Gradients. Megatron's DDP accumulates into ``param.main_grad`` (its grad buffer, fp32 or bf16) and all-reduces
  there. ``prepare_grads`` copies every ``main_grad`` into OffloadedAdam's flat bf16 gradient (one device copy per
  param; fp32 main grads are rounded to bf16, so 2 bytes per param cross PCIe, not 4) and sets ``param.grad`` to
  None as Megatron's mixed-precision optimizers do. OffloadedAdam runs with ``attach_grads=False``: it touches no
  ``.grad`` and installs no hooks, so Megatron's own gradient hooks are the only ones.
- Scaling and clipping. A loss scaler (``config.loss_scale``) is honoured: non-finite scaled gradients skip the
  step (and update the scaler) exactly as Megatron's MixedPrecisionOptimizer; the unscale factor and the clip
  coefficient (``clip_grad / (norm + 1e-6)`` when below 1, Megatron's formula) are not written into the gradient
  but passed to the CPU kernel as one ``grad_scale``. The norm is the fp32 2-norm of the gradients Megatron counts
  (not shared, not a tensor-parallel duplicate), summed over the grad-stats group (the model-parallel group).
- Checkpoints. ``state_dict`` has the layout of Megatron's ``Float16OptimizerWithFloat16Params`` (the non-distributed
  bf16 optimizer): ``{"optimizer": torch Adam state (step, exp_avg, exp_avg_sq per param), "fp32_from_fp16_params":
  fp32 masters per group[, "grad_scaler"]}``, so each loads into the other. (The sharded form speaks Megatron's
  DistributedOptimizer checkpoint instead: ``get_parameter_state_dp_zero`` and its load.)
- Precision-aware options. ``use_precision_aware_optimizer`` with ``exp_avg_dtype`` and ``exp_avg_sq_dtype`` both
  ``torch.bfloat16`` keeps the host moments in bf16 (OffloadedAdam ``moments_dtype=torch.bfloat16``: 20 instead of
  28 bytes of host memory traffic per param and step; in ``exact`` mode the master equals torch AdamW on fp32
  copies of the moments, the new moments rounded to nearest even); both fp32 is the default path. Megatron's own
  config check demands ``use_distributed_optimizer=True`` with the precision-aware optimizer; with a plain DDP
  (``use_distributed_optimizer=False`` there) the non-sharded form is built, as before. ``main_params_dtype`` stays
  fp32 (the master weights are the fp32 CPU masters).
  Checkpoints carry the moments in their dtype; Megatron's Float16 optimizer loads bf16 moments upcast (exact), and
  fp32 moments loaded here are rounded to bf16.
- Refused (UnsupportedError, before anything is built): Megatron-FSDP, fp16, fp32 params, SGD/Muon, Megatron's own
  CPU offload flags, expert-parallel params without the distributed optimizer, ``main_params_dtype`` other than
  fp32, moment dtypes other than both fp32 or both bf16, ``overlap_param_gather_with_optimizer_step``, FP8 params;
  on the model side (``_build.check_model_chunks``) pipeline interleaving (a virtual pipeline) and the
  TransformerConfig's ``fp8``/``fp8_param``/``fp4``/``fp4_param``.
"""
from __future__ import annotations

import math
import time
from itertools import chain

import torch

from ...errors import InvalidArgumentError, UnsupportedError
from ...optim import OffloadedAdam
from ...optim.sharded import sum_of_squares

try:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, MegatronOptimizer
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
except ImportError as e:  # the package is usable without Megatron; this module is not
    raise ImportError(f"ebbtide.integrations.megatron needs megatron-core (tested with 0.16.1): {e}") from e

__all__ = ["EbbtideOptimizer", "check_config", "moments_dtype"]


_MOMENTS = {(torch.float32, torch.float32): torch.float32, (torch.bfloat16, torch.bfloat16): torch.bfloat16}


def moments_dtype(config) -> torch.dtype:
    """OffloadedAdam's ``moments_dtype`` for a config that passed :func:`check_config`."""
    return _MOMENTS[(getattr(config, "exp_avg_dtype", torch.float32),
                     getattr(config, "exp_avg_sq_dtype", torch.float32))]


def check_config(config) -> None:
    """Raise UnsupportedError naming every setting of Megatron's ``OptimizerConfig`` this optimizer cannot honour
    (what is refused, and why, is in the module doc)."""
    bad = []
    if getattr(config, "optimizer", "adam") != "adam":
        bad.append(f"optimizer={config.optimizer!r} (only 'adam': Adam/AdamW)")
    if config.fp16:
        bad.append("fp16=True (params must be bf16)")
    if not config.bf16:
        bad.append("bf16=False (params must be bf16: wrap the model in Float16Module with bf16=True)")
    if config.optimizer_cpu_offload:
        bad.append("optimizer_cpu_offload=True (Megatron's HybridDeviceOptimizer; this optimizer offloads by itself)")
    main = getattr(config, "main_params_dtype", torch.float32)
    if main != torch.float32:
        bad.append(f"main_params_dtype={main} (the CPU Adam kernel keeps fp32 master weights)")
    moments = (getattr(config, "exp_avg_dtype", torch.float32), getattr(config, "exp_avg_sq_dtype", torch.float32))
    if moments not in _MOMENTS:
        bad.append(f"exp_avg_dtype={moments[0]}, exp_avg_sq_dtype={moments[1]} (the CPU Adam kernel keeps both "
                   "moments fp32 or both bf16)")
    if getattr(config, "overlap_param_gather_with_optimizer_step", False):
        bad.append("overlap_param_gather_with_optimizer_step=True (the first model chunk's all-gather inside the "
                   "optimizer step)")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        bad.append("reuse_grad_buf_for_mxfp8_param_ag=True (FP8 params)")
    if bad:
        raise UnsupportedError("ebbtide's Megatron optimizer does not support: " + "; ".join(bad))


def _float32(t) -> float:
    return float(t.item()) if isinstance(t, torch.Tensor) else float(t)


class EbbtideOptimizer(MegatronOptimizer):
    """Megatron's optimizer interface over one :class:`~ebbtide.optim.OffloadedAdam` (build it with
    :func:`get_optimizer`). ``model_groups``: Megatron's params per param group where the inner optimizer's
    groups hold other tensors (the distributed form's shards)."""

    def __init__(self, inner, config, grad_scaler=None, *, grad_stats_parallel_group=None, tp_group=None,
                 grad_stats_cpu_group=None, model_groups=None):
        super().__init__(inner, config, init_state_fn=lambda *a, **k: None)
        self.is_stub_optimizer = False
        self.grad_scaler = grad_scaler
        self.grad_stats_parallel_group = grad_stats_parallel_group
        self.grad_stats_cpu_group = grad_stats_cpu_group  # see _all_reduce
        self.tp_group = tp_group
        # Megatron's helpers (sharded_state_dict) read the model params per group under this name.
        self.float16_groups = model_groups or [list(g["params"]) for g in inner.param_groups]
        self._clip_coeff = 1.0
        self._device = inner.device
        self.last_step_times: dict = {}  # see EbbtideOptimizer.step
        # callables run by step() once the norm is done, right before the CPU update: the GPU is about to idle
        # while the host steps (TrainingState.trim_cache(background=True) goes here). One that raises aborts the
        # step before the update, after the norm's collective: every rank must then stop (a rank that steps on
        # alone waits for its peers in the next collective).
        self.update_start_hooks: list = []

    # ---- gradients -----------------------------------------------------------------------------------------
    def _params(self):
        return chain.from_iterable(self.float16_groups)

    def get_parameters(self) -> list:
        """The model's params (Megatron's ``get_parameters``)."""
        return list(self._params())

    @torch.no_grad()
    def _copy_model_grads_to_main_grads(self) -> None:
        opt = self.optimizer
        for p in self._params():
            src = getattr(p, "main_grad", None)
            if src is None:
                src = p.grad
            view = opt.grad_view(p)
            if src is None:
                view.zero_()  # a param without a gradient this step steps with zero (Megatron's behaviour)
            else:
                view.copy_(src)
            p.grad = None

    def _grads_for_norm(self) -> list:
        return [self.optimizer.grad_view(p) for p in self._params()
                if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, self.tp_group)]

    def get_main_grads_for_grad_norm(self) -> list:
        return self._grads_for_norm()

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        """``t`` reduced over the grad-stats group; not a collective where that group is this rank alone (with
        groups released between steps, a one-rank NCCL communicator would reconnect at every step's norm). With
        a CPU twin of that group (``grad_stats_cpu_group``: same ranks, Gloo) the scalar goes there instead, as a
        CPU tensor: the caller reads it on the host anyway, and a released NCCL group would be rebuilt and
        connected inside the step. Two ranks sum in the one order there is; with more, the two backends may
        add in different orders (an ulp of the norm)."""
        if self.grad_stats_cpu_group is not None:
            c = t.cpu()
            torch.distributed.all_reduce(c, op=op, group=self.grad_stats_cpu_group)
            return c
        group = self.get_grad_stats_parallel_group()
        if torch.distributed.is_initialized() and group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(t, op=op, group=group)
        return t

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy the main grads into the flat bf16 gradient; with a loss scaler, report (and book) non-finite
        scaled gradients across the grad-stats group."""
        self._copy_model_grads_to_main_grads()
        self._clip_coeff = 1.0
        if not self.grad_scaler:
            return False
        flat = self.optimizer.flat_grad
        bad = torch.zeros(1, dtype=torch.float32, device=self._device)
        if flat.numel():
            bad += (~torch.isfinite(flat)).any().float()
        found_inf = _float32(self._all_reduce(bad, torch.distributed.ReduceOp.MAX)) > 0
        self.grad_scaler.update(found_inf)
        return found_inf

    def _loss_unscale(self) -> float:
        return _float32(self.grad_scaler.inv_scale) if self.grad_scaler else 1.0

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global L2 norm: every counted gradient's fp32 norm in one multi-tensor launch (not three launches per
        slice: an MoE model's distributed optimizer owns hundreds of slices), squares summed, all-reduced."""
        total = sum_of_squares([g for g in self._grads_for_norm() if g.numel()], self._device)
        total = _float32(self._all_reduce(total, torch.distributed.ReduceOp.SUM))
        return math.sqrt(total) * self._loss_unscale()

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The norm of the (unscaled) gradients; the clip coefficient goes to the CPU kernel, not into the grads."""
        norm = self.get_grad_norm()
        coeff = clip_grad / (norm + 1.0e-6)
        self._clip_coeff = coeff if coeff < 1.0 else 1.0
        return norm

    @torch.no_grad()
    def count_zeros(self) -> float:
        n = torch.zeros(1, dtype=torch.float32, device=self._device)
        for g in self._grads_for_norm():
            n += g.numel() - torch.count_nonzero(g)
        return _float32(self._all_reduce(n, torch.distributed.ReduceOp.SUM))

    def zero_grad(self, set_to_none: bool = True):
        """Model ``.grad`` to None (Megatron's DDP zeroes its own buffer in ``zero_grad_buffer``)."""
        for p in self._params():
            p.grad = None

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler:
            return self.grad_scaler.scale
        return torch.ones(1, dtype=torch.float32, device=self._device)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        scale = self._loss_unscale() * self._clip_coeff
        self.optimizer.step(grad_scale=None if scale == 1.0 else scale)
        self._clip_coeff = 1.0
        return True

    @torch.no_grad()
    def step(self):
        """Megatron's step: prepare the grads, clip by the global norm, step. ``last_step_times`` then holds each
        part's host time (``prepare_s``; ``norm_s``: the norm, its all-reduce and the zero count, waiting for the
        GPU and for the group's slowest rank; ``hooks_s``: ``update_start_hooks``; ``update_s``: the CPU pipeline
        and the launch of the param gather)
        beside the pipeline's own (``ebbtide.optim`` ``last_step_times``)."""
        t0 = time.perf_counter()
        found_inf = self.prepare_grads()
        t1 = time.perf_counter()
        if found_inf:
            self.last_step_times = {"prepare_s": t1 - t0}
            return False, None, None
        grad_norm = 0.0
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        t2 = time.perf_counter()
        for hook in self.update_start_hooks:
            hook()
        t3 = time.perf_counter()
        ok = self.step_with_ready_grads()
        self.last_step_times = {"prepare_s": t1 - t0, "norm_s": t2 - t1, "hooks_s": t3 - t2,
                                "update_s": time.perf_counter() - t3}
        return ok, grad_norm, num_zeros

    def add_bucket_hook(self, fn):
        """``OffloadedAdam.add_bucket_hook`` of the inner optimizer: ``fn(begin, end, event)`` per bucket of new
        params queued for upload during ``step()`` (byte addresses of the model's params, which are views of its
        flat buffer), e.g. a ``Sender.streamed`` update. Returns the handle (``remove()``)."""
        return self.optimizer.add_bucket_hook(fn)

    def reload_model_params(self, state_dict=None):
        """Masters from the model's current params (after loading weights without the optimizer)."""
        if state_dict is not None:
            raise UnsupportedError("reload_model_params(state_dict=...) is not supported (nor by Megatron's "
                                   "Float16OptimizerWithFloat16Params); load the optimizer's state_dict instead")
        self.optimizer.sync_master_from_params()

    def offload_to_cpu(self):
        """No-op: the optimizer state already lives in host memory; the flat params and gradient on the GPU are
        offloaded by :class:`ebbtide.integrations.megatron.TrainingState`."""

    def restore_from_cpu(self):
        """No-op (see :meth:`offload_to_cpu`)."""

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self, is_loading: bool = False):
        inner = self.optimizer.state_dict()
        inner["state"] = {i: dict(st) for i, st in inner["state"].items()}  # torch hands out the live dicts
        masters = [[inner["state"][i].pop("master_param") for i in g["params"]] for g in inner["param_groups"]]
        out = {"optimizer": inner, "fp32_from_fp16_params": masters}
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def load_state_dict(self, state_dict):
        """Load our own state_dict or one of Megatron's ``Float16OptimizerWithFloat16Params`` (the same layout).
        Everything is validated before anything changes."""
        key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        if key not in state_dict:
            raise InvalidArgumentError(f"not a Megatron optimizer state dict (keys {sorted(state_dict)})")
        inner = dict(state_dict[key])
        inner["state"] = {k: dict(v) for k, v in inner.get("state", {}).items()}
        common = inner["state"].pop("common_step", None)
        if common is not None:
            for st in inner["state"].values():
                st["step"] = common
        inner["param_groups"] = self._filter_and_reorder_param_groups(
            self.optimizer.param_groups, [dict(g) for g in inner["param_groups"]])
        mkey = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        masters = state_dict.get(mkey)
        if masters is not None:
            if len(masters) != len(self.float16_groups):
                raise InvalidArgumentError(f"{mkey} has {len(masters)} groups, the optimizer "
                                           f"{len(self.float16_groups)}")
            for g, ms in zip(self.float16_groups, masters):
                if len(ms) != len(g) or any(tuple(m.shape) != tuple(p.shape) for p, m in zip(g, ms)):
                    raise InvalidArgumentError(f"{mkey}: a group's masters do not match its params' count or shapes")
        for st in inner["state"].values():
            st.pop("master_param", None)  # masters come from the fp32 list (Megatron's place for them)
        self.optimizer.load_state_dict(inner)  # validates, then applies (masters from the model meanwhile)
        if masters is not None:
            with torch.no_grad():
                for g, ms in zip(self.float16_groups, masters):
                    for p, m in zip(g, ms):
                        self.optimizer.state[p]["master_param"].copy_(m.detach().reshape(p.shape))
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        """Megatron's distributed-checkpoint form of :meth:`state_dict` (built by Megatron's Float16 optimizer code,
        which reads the same layout)."""
        return Float16OptimizerWithFloat16Params.sharded_state_dict(self, model_sharded_state_dict, is_loading,
                                                                    metadata)
