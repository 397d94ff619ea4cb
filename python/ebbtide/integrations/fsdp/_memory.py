"""The GPU memory of an FSDP2 trainer, offloaded for the rollout and restored after it at the same addresses,
through ebbtide.memory.

Policies:
- Adoption (``TrainingState(model, optimizer)``, once, outside forward and backward): every FSDPParam's padded
  shard (``_sharded_param_data``) and the DTensor's ``_local_tensor`` viewing its front are re-backed in place by a
  slot of one flat buffer per dtype inside the tag ``<prefix>_weights`` (CPU backup; ``_flat.pack``). Every object
  keeps its identity -- the module's parameters, their DTensors, FSDP's shard and local tensors, whatever an
  optimizer built before or after holds -- and their addresses change once, here, and never again. FSDP's own
  ``reset_sharded_param`` (lazy init, ``load_state_dict``) then finds shard and local tensor in one storage and
  leaves them. The engine's bytes of the tag are checked against what moved: a buffer that did not land in the
  engine is an error, never a silent partial offload.
- Optimizer state: device tensors of a torch optimizer's state (AdamW's ``exp_avg``/``exp_avg_sq``, a fused
  ``step``; DTensors or plain) are re-backed the same way into ``<prefix>_optimizer`` (CPU backup) at the first
  ``offload`` that finds them (a torch optimizer makes its state at its first step); tensors that appear later (a
  loaded checkpoint) are packed at the next offload, beside the old slots.
- ``offload()``: refuses while a collective of the model is in flight (an ``unshard(async_op=True)`` not waited
  for, a backward whose reduce-scatters are not done) or when a parameter was replaced since adoption; then
  reshards every FSDP module (the unsharded parameters' all-gather outputs freed), drops FSDP's retained
  collective buffers (the last all-gather's output, the reduce-scatter inputs, the all-reduce state), discards the
  gradients (``.grad = None``: call it after the optimizer step), frees torch's cuBLAS workspaces, empties the
  caching allocator and pauses the tags. It returns once the device memory is back with the driver: the report has
  the driver's free bytes before and after, and torch's reserved bytes left outside the tags.
- ``restore()``: the same refusals (a collective in flight: an ``unshard`` issued while offloaded; a replaced
  parameter), then the tags resume at the same addresses with their content. Gradients stay None (the next backward
  makes them).
- While offloaded the model's forward raises StateError (a forward pre-hook on the root), instead of reading
  unmapped memory.
- ``weights="discard"`` (with ``sharded_adam(model)`` built after the TrainingState): the weights tag has no CPU
  backup; the optimizer keeps a pinned bf16 host mirror of the shards that every step writes, so ``offload`` drops
  the shards without a copy and ``restore`` maps fresh pages, zeroes them (FSDP's padding rows) and uploads the
  mirror. An offload without such an optimizer is refused (StateError) before anything changes.
- ``buffer_factory(tag, backup, numel, dtype, device)`` replaces how the flat buffers are allocated (default: inside
  ``ebbtide.memory.region(tag, backup=backup)``); it must allocate in that tag. No GPU and no factory:
  UnsupportedError.
"""
from __future__ import annotations

import dataclasses
import time
import weakref

import torch

from ...errors import InvalidArgumentError, StateError, UnsupportedError
from ._flat import pack
from ._model import describe

__all__ = ["TrainingState", "OffloadReport"]


@dataclasses.dataclass(frozen=True)
class OffloadReport:
    """One offload or restore: ``tags`` {tag: {"bytes", "bytes_copied", "s"}}; ``driver_free_before`` /
    ``driver_free_after`` (bytes free on the device, the driver's view, around the whole call); ``reserved_outside``
    (torch's reserved bytes outside the tags after it); ``seconds``; ``parts`` (offload: ``prepare_s`` (checks,
    reshard, state adoption, device drain), ``empty_cache_s``, ``pause_s``)."""

    kind: str
    tags: dict
    seconds: float
    driver_free_before: int
    driver_free_after: int
    reserved_outside: int
    parts: dict = dataclasses.field(default_factory=dict)

    def total(self, key: str = "bytes") -> int:
        """``key`` ("bytes" or "bytes_copied") summed over the tags."""
        return sum(t[key] for t in self.tags.values())

    @property
    def bytes(self) -> int:
        return self.total()

    @property
    def freed(self) -> int:
        """Bytes the driver gained (offload) or lost (restore, negative) during the call."""
        return self.driver_free_after - self.driver_free_before

    def summary(self) -> str:
        per = ", ".join(f"{k} {v['bytes'] / 2**20:.0f} MiB in {v['s'] * 1e3:.1f} ms" for k, v in self.tags.items())
        return (f"{self.kind} {self.seconds * 1e3:.1f} ms: {per}; driver free {self.driver_free_before / 2**30:.2f}"
                f" -> {self.driver_free_after / 2**30:.2f} GiB; torch reserved outside the tags "
                f"{self.reserved_outside / 2**20:.0f} MiB")


def _region_factory(tag: str, backup: str, numel: int, dtype, device):
    import ebbtide.memory as em  # noqa: PLC0415

    with em.region(tag, backup=backup, device=device.index):
        return torch.empty(numel, dtype=dtype, device=device)


class TrainingState:
    """Offload/restore of an FSDP2 trainer's GPU state (shards, gradients, FSDP's buffers, optimizer state)."""

    def __init__(self, model, optimizer=None, *, tag_prefix: str = "fsdp", buffer_factory=None,
                 weights: str = "copy"):
        from ._optimizer import has_sharded_adam  # noqa: PLC0415

        self.model = describe(model)
        if has_sharded_adam(model):
            raise InvalidArgumentError("a ShardedAdam was built over this model before the TrainingState: it keeps "
                                       "views of the shards' memory, which adoption re-backs. Build "
                                       "TrainingState(model) first, then sharded_adam(model)")
        dev = self.model.device
        if buffer_factory is None:
            if dev.type != "cuda":
                raise UnsupportedError(f"TrainingState pauses CUDA memory: the shards are on {dev}, not a GPU")
            buffer_factory = _region_factory
        if not callable(buffer_factory):
            raise InvalidArgumentError("buffer_factory must be callable(tag, backup, numel, dtype, device)")
        if weights not in ("copy", "discard"):
            raise InvalidArgumentError(f"weights must be 'copy' or 'discard' (got {weights!r})")
        self.weights = weights
        if not isinstance(tag_prefix, str) or not tag_prefix:
            raise InvalidArgumentError(f"tag_prefix must be a non-empty str (got {tag_prefix!r})")
        import ebbtide.memory as em  # noqa: PLC0415

        self._em = em
        self.optimizer = optimizer
        self.tags = {k: f"{tag_prefix}_{k}" for k in ("weights", "optimizer")}
        self._factory = buffer_factory
        self._offloaded = False
        self._check_idle("TrainingState()")
        self._sync()
        self.flat = pack([self._shard_group(r) for r in self.model.params], buffer_factory,
                         self.tags["weights"], "cpu" if weights == "copy" else "none")
        self._state: list = []  # the optimizer state's Flats (one per adoption that found new state tensors)
        self._sync()
        self._empty_cache()
        self._verify(self.flat)
        setattr(model, "_ebbtide_training_state", weakref.ref(self))  # sharded_adam() reads the weights mode
        # prepend: ahead of FSDP's own pre-forward hook, whose all-gather would read the unmapped shards
        self._guard = model.register_forward_pre_hook(self._refuse_forward, prepend=True)

    # ---- adoption --------------------------------------------------------------------------------------------
    @staticmethod
    def _shard_group(rec) -> list:
        """The padded shard and the DTensor's local tensor (a view of its front): re-backed together."""
        fp = rec.fsdp_param
        return [fp._sharded_param_data, fp.sharded_param._local_tensor]

    def _state_tensors(self) -> list:
        """Every state tensor of the optimizer on the model's device (a DTensor's local tensor), once each."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        opt = self.optimizer
        if opt is None or not hasattr(opt, "state"):
            return []
        out, seen = [], set()
        for st in opt.state.values():
            for v in st.values():
                local = v._local_tensor if isinstance(v, DTensor) else v
                if (isinstance(local, torch.Tensor) and local.device == self.model.device and local.numel()
                        and id(local) not in seen):
                    seen.add(id(local))
                    out.append(local)
        return out

    def _adopt_state(self) -> None:
        """Pack the optimizer's device state tensors that no earlier adoption packed into the optimizer tag. A state
        tensor replaced later (a loaded checkpoint) is packed anew; the slot of the one it replaced stays in the
        tag, paused with it, until the TrainingState goes."""
        new = [v for v in self._state_tensors() if not any(f.owns(v) for f in self._state)]
        if new:
            flat = pack([[v] for v in new], self._factory, self.tags["optimizer"], "cpu")
            self._state.append(flat)
            self._verify(flat)

    def _verify(self, flat) -> None:
        held = sum(r["bytes_active"] for r in self._em.stats()["tags"] if r["tag"] == flat.tag)
        if held < flat.nbytes:
            raise InvalidArgumentError(f"the buffers of {flat.tag} ({flat.nbytes} bytes) are not ebbtide.memory "
                                       f"allocations of that tag (the engine holds {held} bytes there): a "
                                       "buffer_factory must allocate inside ebbtide.memory.region(tag, backup)")

    # ---- checks ----------------------------------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        for g in self.model.groups:
            name = getattr(g, "_module_fqn", None) or "the root"
            if getattr(g, "_all_gather_result", None) is not None:
                raise StateError(f"{what}: an all-gather of {name} is in flight (unshard(async_op=True) not waited "
                                 "for by a forward or its handle's wait()); nothing was changed")
            if getattr(g, "_post_reduce_event", None) is not None:
                raise StateError(f"{what}: the reduce-scatter of {name}'s gradients is in flight (a backward that "
                                 "has not finished); nothing was changed")
            state = getattr(g, "_training_state", None)
            if state is not None and state.name != "IDLE":
                raise StateError(f"{what}: {name} is in {state.name} (inside forward or backward); nothing was "
                                 "changed")

    def _check_same(self, what: str) -> None:
        for r in self.model.params:
            fp = r.fsdp_param
            now = r.module._parameters.get(r.attr)  # the sharded parameter, or FSDP's unsharded one between
            unsharded = getattr(fp, "_unsharded_param", None)  # a forward and its reshard
            if fp.sharded_param is not r.sharded_param or (now is not r.sharded_param and now is not unsharded):
                raise StateError(f"{what}: parameter {r.fqn} was replaced since TrainingState was built (a new "
                                 "Parameter object: load_state_dict(assign=True), model.to()/.cpu(), or a manual "
                                 "swap); its shard is no longer the adopted one. Nothing was changed; build a new "
                                 "TrainingState for the new parameters")
            local = fp.sharded_param._local_tensor
            if not (self.flat.owns(fp._sharded_param_data) and self.flat.owns(local)) or (
                    local.numel() and local.data_ptr() != fp._sharded_param_data.data_ptr()):
                raise StateError(f"{what}: the shard of {r.fqn} was moved out of its adopted buffer (its storage "
                                 "was replaced); nothing was changed")

    def _refuse_forward(self, module, args):
        if self._offloaded:
            raise StateError("the model ran forward while its training state is offloaded: call restore() first")

    # ---- offload / restore -----------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _empty_cache(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _driver_free(self) -> int:
        if self.model.device.type != "cuda":
            return 0
        return torch.cuda.mem_get_info(self.model.device)[0]

    def _reserved_outside(self) -> int:
        if self.model.device.type != "cuda":
            return 0
        tagged = sum(r["bytes_active"] + r["bytes_paused"] for r in self._em.stats()["tags"]
                     if r.get("device", self.model.device.index) == self.model.device.index)
        return max(0, torch.cuda.memory_reserved(self.model.device) - tagged)

    def _drop_transients(self) -> None:
        """Reshard every FSDP module, drop FSDP's retained collective buffers and the gradients."""
        for m in self.model.modules:
            m.reshard()
        for ctx in self.model.comm_contexts():
            if hasattr(ctx, "all_gather_state"):
                ctx.all_gather_state = None
            if isinstance(getattr(ctx, "reduce_scatter_states", None), list):  # torch 2.13
                ctx.reduce_scatter_states.clear()
            if hasattr(ctx, "reduce_scatter_state"):  # torch 2.11
                ctx.reduce_scatter_state = None
        for g in self.model.groups:
            for attr in ("_all_reduce_state", "_partial_reduce_output"):
                if hasattr(g, attr):
                    setattr(g, attr, None)
        for r in self.model.params:
            r.sharded_param.grad = None
            fp = r.fsdp_param
            fp.unsharded_accumulated_grad = None
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    def offload(self) -> OffloadReport:
        """Release the training state's device memory (see the module doc). StateError if already offloaded."""
        if self._offloaded:
            raise StateError("offload() called twice: the training state is already offloaded (call restore())")
        t0 = time.perf_counter()
        self._check_idle("offload()")
        self._mirror()  # discard mode: refused before anything changes when nothing can rebuild the weights
        self._check_same("offload()")
        free0 = self._driver_free()
        self._drop_transients()
        self._sync()
        self._adopt_state()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # per handle and stream, kept for the process
        if clear is not None and self.model.device.type == "cuda":
            clear()
        t1 = time.perf_counter()
        self._empty_cache()
        t2 = time.perf_counter()
        tags = self._each_tag(self._em.pause)
        self._offloaded = True
        parts = {"prepare_s": t1 - t0, "empty_cache_s": t2 - t1, "pause_s": time.perf_counter() - t2}
        return OffloadReport("offload", tags, time.perf_counter() - t0, free0, self._driver_free(),
                             self._reserved_outside(), parts)

    def restore(self) -> OffloadReport:
        """Map the training state back at the same addresses with its content. StateError without offload()."""
        if not self._offloaded:
            raise StateError("restore() without offload(): the training state is resident")
        self._check_idle("restore()")
        self._check_same("restore()")
        opt = self._mirror()  # discard mode: the optimizer that rebuilds the shards, found before anything changes
        t0 = time.perf_counter()
        free0 = self._driver_free()
        tags = self._each_tag(self._em.resume)
        self._offloaded = False
        if opt is not None:  # fresh pages: zero the padding, then the shards' elements from the host mirror
            t1 = time.perf_counter()
            for b in self.flat.buffers:
                b.zero_()
            opt.upload_params_from_mirror()
            self._sync()
            tag = self.flat.tag
            tags[tag] = {**tags[tag], "bytes_copied": opt.param_mirror.nbytes,
                         "s": tags[tag]["s"] + time.perf_counter() - t1}
        return OffloadReport("restore", tags, time.perf_counter() - t0, free0, self._driver_free(),
                             self._reserved_outside())

    def _each_tag(self, op) -> dict:
        """``op`` (pause or resume) on every tag; a failure undoes the tags already done (a failed pause resumes
        them, a failed resume pauses them again), so the state is wholly offloaded or wholly resident."""
        out, done = {}, []
        undo = self._em.resume if op is self._em.pause else self._em.pause
        try:
            for tag in self._tags():
                rep = op(tag)
                done.append(tag)
                out[tag] = {"bytes": rep.bytes, "bytes_copied": rep.bytes_copied, "s": rep.total_s}
        except BaseException:
            for tag in reversed(done):
                undo(tag)
            raise
        return out

    def _mirror(self):
        """weights="discard": the model's ShardedAdam, whose host mirror rebuilds the shards (StateError when there is
        none); None in copy mode."""
        if self.weights == "copy":
            return None
        from ._optimizer import sharded_adam_of  # noqa: PLC0415

        opt = sharded_adam_of(self.model.root)
        if opt is None or opt.param_mirror is None:
            raise StateError("TrainingState(weights='discard') rebuilds the shards from ShardedAdam's host mirror: "
                             "build the optimizer with ebbtide.integrations.fsdp.sharded_adam(model) after the "
                             "TrainingState (it keeps the mirror then)")
        return opt

    def _tags(self) -> list:
        return [self.flat.tag] + ([self.tags["optimizer"]] if self._state else [])

    def close(self) -> None:
        """Remove the forward guard (the buffers stay where they are). Restores first if offloaded."""
        if self._offloaded:
            self.restore()
        self._guard.remove()
