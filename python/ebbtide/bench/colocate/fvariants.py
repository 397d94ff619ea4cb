"""What differs between the FSDP2 loop's variants, one object each; ``ftrainer`` runs the same step over any of them
(``loop.LoopRank``). Each object: how the model is sharded and its optimizer built and stepped, where the trainer's
memory goes while the rollout runs (``offload`` / ``onload``, each returning once its device work is done), whether
the process groups are released (``releases_groups``), and how the weights reach the rollout (``sync_mode``;
``early_sync``: the update opened beside the CPU step). Every variant trains the same model (``ebbtide.testing.qwen3``,
one ``fully_shard`` per decoder layer and one at the root) on the same data, clips the gradients' norm at 1.0 and
steps AdamW with the same hyper-parameters.

- ``Ebbtide``: the public adapter only (``ebbtide.integrations.fsdp``): bf16 shards, ``TrainingState(model,
  weights="discard")`` (the offload drops the shards without a copy, the restore uploads the optimizer's bf16 host
  mirror), ``sharded_adam`` (ebbtide's CPU Adam over the local shards, fp32 master and moments on the host; the
  clip through its ``grad_norm`` and the step's ``grad_scale``), the groups released and reloaded
  (``install_groups`` before ``init_process_group``), weights by ``Sender(gather=ShardGather)``. On the CPU (the
  orchestration check) nothing is offloaded: no TrainingState.
- ``Verl``: verl's FSDP2 actor as verl runs it (``ebbtide.anchors.verl``, from volcengine/verl's
  ``verl/utils/fsdp_utils.py`` and ``verl/workers/fsdp_workers.py``): fp32 shards under
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torch's AdamW on the GPU, ``clip_grad_norm_``;
  offload ``model.cpu()`` + the optimizer state ``.to("cpu")`` tensor by tensor + ``empty_cache``, onload
  ``model.to(device)`` + the state back; the groups kept; verl's per-tensor weight update.
- ``Tms``: the same model and optimizer in a trainer started as AReaL starts it (``areal/utils/offload.py``:
  torch_memory_saver's preload hook, every allocation backed up to the CPU; the launcher's
  ``PRELOADED_TRAINERS``), offloaded and onloaded by AReaL's ``pause()`` / ``resume()`` (``areal/engine/
  fsdp_engine.py``; ``ebbtide.anchors.areal``); verl's weight update (AReaL's colocated update goes through disk).
- ``CpuOffload``: FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (verl's ``offload_policy``): the fp32 shards,
  gradients and torch's AdamW on the CPU, nothing to offload but torch's cached blocks; verl's weight update.
"""
from __future__ import annotations

import contextlib

import torch

from ...testing import qwen3
from .options import FSDP_VARIANTS, MOMENTS
from .rank import choice, group_settings, pipeline_times

__all__ = ["Ebbtide", "Verl", "Tms", "CpuOffload", "variant", "CLIP", "HYPER"]

CLIP = 1.0  # the gradients' norm is clipped here in every variant (verl's actor default)
HYPER = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _shard(model, mesh, **kw):
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Ebbtide:
    name = sync_mode = "ebbtide"
    releases_groups = True
    streamed_sync = False  # the update is gathered per bucket after the step (ShardGather)

    def __init__(self, dev: torch.device):
        self.dev, self.state, self.em = dev, None, None
        self.early_sync = dev.type == "cuda"  # the rollout resumes and the update opens beside the CPU step
        if dev.type == "cuda":
            import ebbtide.memory as em  # noqa: PLC0415

            self.em = em

    def group_settings(self, spec: dict) -> tuple:
        return group_settings(spec)

    def build(self, tr):
        """The bf16 model under ``fully_shard``, the training state (on a GPU) and ebbtide's optimizer on ``tr``
        (the trainer rank); returns (model, opt)."""
        import ebbtide.integrations.fsdp as ebt  # noqa: PLC0415

        s = tr.spec
        self.moments = choice(s, "moments", "fp32", MOMENTS)
        model = _shard(qwen3.build(tr.cfg, seed=s["seed"] + 1234, device=self.dev, dtype=torch.bfloat16), tr.mesh)
        if self.dev.type == "cuda":  # the shards into ebbtide.memory once; dropped at every offload
            self.state = ebt.TrainingState(model, weights="discard")
        moments = torch.float32 if self.moments == "fp32" else torch.bfloat16
        opt = ebt.sharded_adam(model, lr=s["lr"], mode="fast", moments_dtype=moments, **HYPER)
        tr.setup.update(optimizer=f"ShardedAdam(isa={opt.isa}, threads={opt.threads})", moments=self.moments)
        return model, opt

    def step(self, model, opt) -> dict:
        norm = opt.grad_norm()
        scale = CLIP / (norm + 1e-6)
        opt.step(grad_scale=scale if scale < 1 else None)
        opt.zero_grad(set_to_none=True)
        return {"grad_norm": norm, **pipeline_times(opt.last_step_times, self.moments)}

    def offload(self) -> dict:
        if self.state is None:
            return {}  # nothing is paused on the CPU
        rep = self.state.offload()
        return {"bytes": rep.total("bytes_copied"), "bytes_released": rep.bytes,
                "reserved_outside": rep.reserved_outside, **rep.parts}

    def onload(self) -> dict:
        if self.state is None:
            return {}
        return {"bytes": self.state.restore().total("bytes_copied")}

    def self_bytes(self, dev):
        """Engine bytes mapped + torch's default pool (region pools count in memory_reserved while paused)."""
        if self.em is None:
            return None
        return torch.cuda.memory_reserved(dev) - sum(r["bytes_paused"] for r in self.em.stats()["tags"])


class Verl:
    ipc_allocation = staticmethod(contextlib.nullcontext)  # where verl's update allocates its CUDA IPC buffer
    name = "verl"
    sync_mode = "verl"
    releases_groups = early_sync = streamed_sync = False
    em = state = None  # the rollout runs on torch_memory_saver
    offload_policy = None

    def __init__(self, dev: torch.device):
        self.dev = dev

    def group_settings(self, spec: dict) -> tuple:
        return "lazy", None, "joined"  # the process's groups as torch makes them, kept

    def build(self, tr):
        """verl's model (fp32 shards, bf16 compute) and torch's AdamW; returns (model, opt)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415

        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if self.offload_policy is not None:
            kw["offload_policy"] = self.offload_policy
        model = _shard(qwen3.build(tr.cfg, seed=tr.spec["seed"] + 1234, device=self.dev, dtype=torch.float32),
                       tr.mesh, **kw)
        torch.cuda.empty_cache()  # the unsharded construction's blocks (CPUOffloadPolicy: the whole model)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=tr.spec["lr"], **HYPER)
        tr.setup.update(optimizer=f"torch AdamW ({'CPU' if self.offload_policy is not None else 'GPU'}, fp32)",
                        moments="fp32")
        return model, self.opt

    def step(self, model, opt) -> dict:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm)}

    def offload(self) -> dict:
        from ...anchors import verl  # noqa: PLC0415

        verl.offload_model(self.model)  # model.cpu() + empty_cache
        verl.offload_optimizer(self.opt)
        torch.cuda.empty_cache()
        _sync(self.dev)
        return {}

    def onload(self) -> dict:
        from ...anchors import verl  # noqa: PLC0415

        verl.load_model(self.model, self.dev)
        verl.load_optimizer(self.opt, self.dev)
        _sync(self.dev)
        return {}

    def self_bytes(self, dev):
        return None


class Tms(Verl):
    name = "tms"

    def __init__(self, dev: torch.device):
        from ...anchors import areal  # noqa: PLC0415

        super().__init__(dev)
        self.areal = areal
        areal.saver()  # the preload hook set on the package, as AReaL's engine sets it before the model exists

    def ipc_allocation(self):
        return self.areal.outside_hook()  # the hook's memory cannot be exported by CUDA IPC

    def offload(self) -> dict:
        self.areal.offload()
        return {}

    def onload(self) -> dict:
        self.areal.onload()
        return {}


class CpuOffload(Verl):
    name = "cpu-offload"

    def __init__(self, dev: torch.device):
        from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: PLC0415

        super().__init__(dev)
        self.offload_policy = CPUOffloadPolicy(pin_memory=True)

    def offload(self) -> dict:
        torch.cuda.empty_cache()  # the shards, gradients and optimizer state live on the host already
        _sync(self.dev)
        return {}

    def onload(self) -> dict:
        return {}


VARIANTS = {"ebbtide": Ebbtide, "verl": Verl, "tms": Tms, "cpu-offload": CpuOffload}
assert tuple(VARIANTS) == FSDP_VARIANTS


def variant(name: str, dev: torch.device):
    """The object of variant ``name`` (one of ``options.FSDP_VARIANTS``) on ``dev``."""
    if name not in VARIANTS:
        raise RuntimeError(f"unknown variant {name!r} (known: {FSDP_VARIANTS})")
    if name != "ebbtide" and dev.type != "cuda":
        raise RuntimeError(f"variant {name!r} needs a GPU (the CPU run checks the ebbtide variant's orchestration)")
    return VARIANTS[name](dev)
