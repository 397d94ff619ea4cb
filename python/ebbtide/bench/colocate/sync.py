"""Weight sync of the colocated loop: the trainer packs its weights into one shared pinned host buffer, the
rollout loads them (``ebbtide.sync``'s host transport), with the same plan on both sides.

Policies:
- The plan is ``ebbtide.sync.Plan`` of the model's parameters with nothing ignored: every 2-D weight is sent as
  FP8 128x128 block (``weight`` + ``weight_scale_inv``), every 1-D parameter as raw bf16. Both processes build it
  from their own model, and the buffer's header carries its signature, so nothing but bytes crosses the buffer.
- Two codecs over the same buffer layout: "ebbtide" (``ebbtide.sync``: one FP8 launch per bucket, bucket k copied
  down while k+1 is quantized; the rollout stages the update with one host-to-device copy and applies it whole,
  checking the version) and "torch" (the anchor: the DeepGEMM / slime torch formula per tensor, plain per-tensor
  copies, no version check: ``ebbtide.anchors.sync.torch_pack`` / ``torch_load`` over the buffer's ``payload``).
  Each side's reference for the correctness check is ``dequant(quant(w))`` of its codec.
- The buffer is a memfd shared mapping that both processes register with ``cudaHostRegister`` (created by the
  trainer, inherited by the rollout), so both copies are DMA at PCIe speed.
- The Megatron loop (``IpcTrainerSync`` / ``IpcRolloutSync``) moves its weights by CUDA IPC on the one GPU both
  processes share, over a socket of their own, with ``megatron_plan`` (``Plan.of`` with its default ignore list
  and the output layer kept raw: the linear weights FP8 block, embeddings, output layer, norms and biases raw
  bf16; 512 MiB buckets). Mode
  "ebbtide": ``Sender`` + ``IpcSender`` -> ``IpcReceiver`` into a ``Receiver`` (staged, applied whole, version
  checked); the producer buffers are given back after every update (``IpcSender.close`` + ``ipc_collect``) so the
  trainer holds nothing for the sync while the rollout runs. Mode "slime": the slime-style update the sync benchmark
  runs too (``ebbtide.anchors.sync.slime_update``: per-tensor FP8 launches, a ``torch.cat`` and one IPC request per
  bucket, ``ipc_collect`` + ``empty_cache`` per bucket; split tensors gathered one at a time, ``GatheredEach``);
  the rollout rebuilds the views, dequantizes each weight with one launch and copies it into its parameter, as a
  serving engine's ``load_weights`` does, and answers once those copies completed (``slime_load``).
- The FSDP loop (``FsdpTrainerSync``; the rollout's ``IpcRolloutSync`` / ``RolloutSync`` with ``hf_plan``) sends
  every parameter raw in bf16 under its HF name (``hf_plan``: the model's order, 512 MiB buckets), as verl's and
  AReaL's rollouts serve the trainer's dtype. Mode "ebbtide": ``Sender`` with ``ebbtide.integrations.fsdp``'s
  ``ShardGather`` (one all-gather per bucket, bf16) over ``IpcSender`` on the GPU or the shared host buffer on the
  CPU (the orchestration check; the rollout reads the buffer after the push). Mode "verl": verl's update
  (``ebbtide.anchors.verl``: ``full_tensor()`` per tensor, cast, copied into one 2 GiB CUDA IPC buffer, a round trip
  per bucket; the rollout clones each bucket out and copies every tensor into its parameter by name).
"""
from __future__ import annotations

import contextlib

import time

import torch

from ...anchors import verl
from ...anchors.sync import GatheredEach, slime_load, slime_update, torch_load, torch_pack, torch_reference
from ...errors import InvalidArgumentError, StateError
from ...sync import (HostReceiver, HostSender, IpcReceiver, IpcSender, Plan, Receiver, Sender, SharedHostBuffer,
                     expected)
from .options import CODECS, IPC_MODES

__all__ = ["sync_plan", "TrainerSync", "RolloutSync", "megatron_plan", "IpcTrainerSync", "IpcRolloutSync",
           "hf_plan", "FsdpTrainerSync", "PLANS"]

MEGATRON_RULES = ((r"^output_layer\.", "raw"),)  # the LM head stays bf16, as slime serves it (HF "lm_head")
HF_BUCKET_BYTES = 512 << 20


def sync_plan(model) -> Plan:
    """The toy loop's plan: all 2-D weights FP8 block, 1-D parameters raw, one bucket per 256 MiB of output."""
    return Plan.of(model.named_parameters(), ignore=(), bucket_bytes=256 << 20)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise InvalidArgumentError(f"codec must be one of {CODECS}, got {codec!r}")


# ---- trainer side --------------------------------------------------------------------------------------------
class TrainerSync:
    """The trainer's end: owns the shared buffer (``fd``, ``nbytes`` go to the rollout)."""

    def __init__(self, model, codec: str, *, pin: bool):
        _check_codec(codec)
        self.model, self.codec = model, codec
        self.plan = sync_plan(model)
        self.buffer = SharedHostBuffer.create(SharedHostBuffer.size_for(self.plan), pin=pin)
        self.fd, self.nbytes = self.buffer.fd, self.buffer.nbytes
        self.sender = Sender(lambda: dict(model.named_parameters()), HostSender(self.buffer, keep_slots=False),
                             plan=self.plan) \
            if codec == "ebbtide" else None

    @torch.no_grad()
    def pack(self, version: int) -> int:
        """Quantize the weights into the buffer as ``version``; complete when it returns. Returns bytes written."""
        if self.sender is not None:
            self.sender.push(version)
            return self.plan.nbytes
        torch_pack(self.plan, dict(self.model.named_parameters()), self.buffer.payload(self.plan.nbytes))
        return self.plan.nbytes

    @torch.no_grad()
    def reference(self) -> dict:
        """{name: dequant(quant(w))} for 2-D weights and the bf16 value for 1-D params, on the model's device: what
        the rollout must hold after a load."""
        named = {n: p.detach() for n, p in self.model.named_parameters()}
        return expected(self.plan, named) if self.codec == "ebbtide" else torch_reference(self.plan, named)

    def close(self) -> None:
        self.buffer.close()


# ---- rollout side --------------------------------------------------------------------------------------------
class RolloutSync:
    """The rollout's end over the buffer the trainer created (``fd``, ``nbytes`` inherited). ``staging`` is the
    device buffer the update is copied into before it is applied (``plan.nbytes``; allocated here if None);
    ``plan_of``: how both ends build the plan from a model (default the toy loop's)."""

    def __init__(self, model, codec: str, fd: int, nbytes: int, *, pin: bool, staging: torch.Tensor | None = None,
                 plan_of=sync_plan):
        _check_codec(codec)
        self.model, self.codec = model, codec
        self.plan = plan_of(model)
        self.buffer = SharedHostBuffer(fd, nbytes, pin=pin)
        self.receiver = Receiver(model, self.plan, staging=staging)
        self.host = HostReceiver(self.buffer)

    @staticmethod
    def staging_bytes(model, plan_of=sync_plan) -> int:
        return plan_of(model).nbytes

    @torch.no_grad()
    def load(self, version: int) -> int:
        """Load ``version`` from the buffer into the model's parameters. Returns bytes moved host -> device."""
        if self.codec == "ebbtide":
            self.host.receive(self.receiver, version)
            return self.plan.nbytes
        torch_load(self.plan, dict(self.model.named_parameters()), self.receiver.staging[:self.plan.nbytes],
                   self.buffer.payload(self.plan.nbytes))
        return self.plan.nbytes

    def close(self) -> None:
        self.buffer.close()


# ---- the Megatron loop: CUDA IPC on one GPU -----------------------------------------------------------------
def megatron_plan(named) -> Plan:
    """The Megatron loop's plan (both sides build it from their own ``{name: tensor}``; see the module policies).
    Tensors in name order: Megatron's module lists its parameters in another order than the rollout's copy of
    the architecture, and the plan (its buckets and signature) follows the order it is given."""
    return Plan.of(dict(sorted(dict(named).items())), rules=MEGATRON_RULES)


def hf_plan(named) -> Plan:
    """The FSDP loop's plan (see the module policies), from ``{name: tensor}`` or ``model.named_parameters()`` in
    the model's order: the trainer's full shapes under served names, the rollout's own parameters."""
    if isinstance(named, torch.nn.Module):
        named = named.named_parameters()
    return Plan.build([(n, tuple(t.shape), torch.bfloat16) for n, t in dict(named).items()], default="raw",
                      bucket_bytes=HF_BUCKET_BYTES)


# the rollout's arch -> how its end builds the plan (the trainer's end builds the same from its names and shapes)
PLANS = {"tiny": sync_plan, "megatron": lambda m: megatron_plan(m.named_parameters()), "qwen3": hf_plan}


def _check_mode(mode: str) -> None:
    if mode not in IPC_MODES:
        raise InvalidArgumentError(f"IPC sync mode must be one of {IPC_MODES}, got {mode!r}")


class IpcTrainerSync:
    """The trainer's end: ``weights`` is a callable returning ``{name: tensor}`` (read at every push); ``conn`` a
    ``multiprocessing`` connection to the rollout's ``IpcRolloutSync``. With tensor parallelism, ``tp_dims``
    (``{name: split dim}``) and ``tp_group``: ``weights`` gives this rank's shards, the plan has the full shapes,
    and every TP rank sends the full tensors to the rollout on its own GPU (ebbtide: the sender's one gather per
    split tensor per bucket; slime: one gather per tensor as it is packed). With expert parallelism,
    ``ep_sources`` (``{global name: (local name, EP rank)}``), ``ep_group`` and ``full`` (a callable returning the
    whole model, experts gathered eagerly): ``weights`` gives this rank's local experts, the plan has every expert
    under its global name; ebbtide's sender gathers them per bucket, the slime-style update and the reference
    read ``full()``."""
    receiver_first = True  # the rollout's load runs while the push does (it maps each bucket as it comes)

    def __init__(self, weights, conn, mode: str, *, tp_group=None, tp_dims=None, ep_group=None, ep_sources=None,
                 full=None):
        _check_mode(mode)
        self.weights, self.conn, self.mode = weights, conn, mode
        self.tp_dims = dict(tp_dims or {})
        self.tp_group = tp_group
        self.ep_sources = dict(ep_sources or {})
        if self.ep_sources and full is None:
            raise InvalidArgumentError("ep_sources needs full (the whole model, experts gathered)")
        self.full = full
        self.last_push: dict = {}  # the ebbtide sender's time split of the latest push (see push)
        self._streamed = None  # the StreamedPush that open(streamed=True) began
        local = weights()
        tp = 1
        if self.tp_dims:
            import torch.distributed as dist  # noqa: PLC0415

            tp = dist.get_world_size(tp_group)
        experts = {src[0] for src in self.ep_sources.values()}
        shapes = {n: t for n, t in local.items() if n not in experts}
        shapes.update((g, local[src[0]]) for g, src in self.ep_sources.items())
        meta = {}
        for n, t in shapes.items():
            shape = list(t.shape)
            if n in self.tp_dims:
                shape[self.tp_dims[n]] *= tp
            meta[n] = torch.empty(shape, dtype=t.dtype, device="meta")
        self.plan = megatron_plan(meta)
        if mode == "ebbtide":
            self.ipc = IpcSender(conn)
            args = dict(tp_group=tp_group, tp_dims=self.tp_dims) if self.tp_dims else {}
            if self.ep_sources:
                args.update(ep_group=ep_group, ep_sources=self.ep_sources)
            self.sender = Sender(weights, self.ipc, plan=self.plan, each_rank_sends=bool(args), **args)

    def _full(self):
        if self.full is not None:
            return self.full()
        local = self.weights()
        return GatheredEach(local, self.tp_dims, self.tp_group) if self.tp_dims else local

    def open(self, version: int, *, streamed: bool = False):
        """Mode "ebbtide": begin update ``version`` on the sender's thread (the rollout must be in its ``load``):
        ``Sender.open(wait=False)``, returning its Future, or with ``streamed`` ``Sender.streamed``, returning the
        ``StreamedPush`` (the optimizer's bucket hook: each tensor filled as the step uploads it; refused with TP or
        EP gathers). None in the slime-style mode (nothing to begin)."""
        if self.mode != "ebbtide":
            return None
        if streamed:
            self._streamed = self.sender.streamed(version)
            return self._streamed
        return self.sender.open(version, wait=False)

    def abort(self) -> None:
        """Give up an opened update: the rollout's ``load`` raises and it keeps its weights."""
        if self.mode == "ebbtide":
            st, self._streamed = self._streamed, None
            if st is not None:
                st.abort()
            else:
                self.sender.abort()

    @torch.no_grad()
    def push(self, version: int) -> int:
        """Send the current weights as ``version``; returns when the rollout holds them. Returns wire bytes;
        ``last_push`` then holds the ebbtide sender's time split (its ``PushReport`` parts and ``close_s``, the
        unmapping of the rollout's staging)."""
        if self.mode == "ebbtide":
            st, self._streamed = self._streamed, None
            if st is not None and st.version != version:
                st.abort()
                raise InvalidArgumentError(f"push({version}) while streamed update {st.version} is open")
            rep = st.finish() if st is not None else self.sender.push(version)
            t0 = time.perf_counter()
            self.ipc.close()  # the imported staging is unmapped (re-shared at the next push)
            self.last_push = {k: rep[k] for k in ("begin_s", "open_s", "fill_s", "commit_s", "streamed",
                                                  "stream_fill_s") if k in rep}
            self.last_push["close_s"] = time.perf_counter() - t0
        else:
            slime_update(self.plan, self._full(), self.conn)
        torch.cuda.ipc_collect()
        return self.plan.nbytes

    @torch.no_grad()
    def reference(self) -> dict:
        """{name: what the rollout must hold after a push} (full tensors) on the weights' device."""
        src = self._full()
        named = {it.source: src[it.source].detach() for it in self.plan.items}
        if self.mode == "ebbtide":
            return expected(self.plan, named)
        from ...quant import fp8_block_dequant, fp8_block_quant  # noqa: PLC0415  (slime's update runs ebbtide's)

        return {it.source: fp8_block_dequant(*fp8_block_quant(named[it.source])) if it.kind == "fp8"
                else named[it.source].clone() for it in self.plan.items}

    def close(self) -> None:
        if self.mode == "ebbtide":
            self.sender.close()  # its open thread; the IPC end was closed after the last push


class IpcRolloutSync:
    """The rollout's end over ``conn``; ``staging`` (mode "ebbtide": ``plan.nbytes`` on the device) is where the
    update is staged before it is applied; ``plan_of``: how both ends build the plan from a model (default the
    Megatron loop's)."""

    def __init__(self, model, conn, mode: str, *, staging: torch.Tensor | None = None, plan_of=PLANS["megatron"]):
        _check_mode(mode)
        self.model, self.conn, self.mode = model, conn, mode
        self.params = dict(model.named_parameters())
        self.plan = plan_of(model)
        if mode == "ebbtide":
            self.receiver = Receiver(self.params, self.plan, staging=staging)
            self.ipc = IpcReceiver(conn)

    @staticmethod
    def staging_bytes(model, plan_of=PLANS["megatron"]) -> int:
        return plan_of(model).nbytes

    @torch.no_grad()
    def load(self, version: int) -> int:
        """Serve one push of ``version``; returns the wire bytes received."""
        if self.mode == "ebbtide":
            got = self.ipc.receive(self.receiver, version)
            if got is None:  # the sender gave the update up (Sender.abort or close) before committing it
                raise StateError(f"the sender closed update {version} before committing it; the rollout keeps "
                                 f"version {self.receiver.version}")
            if self.ipc.receive(self.receiver) is not None:  # the sender gives its buffers back after each update
                raise StateError("protocol error: expected the sender's close after the update")
            if got != version:
                raise StateError(f"the rollout applied version {got}, expected {version}")
            return self.plan.nbytes
        if self.mode == "verl":
            verl.receive_weights(self.conn, self._load_by_name)
            return self.plan.nbytes
        return slime_load(self.plan, self.params, self.conn)

    @torch.no_grad()
    def _load_by_name(self, weights) -> None:
        """verl's update's load: each ``(name, tensor)`` copied into the parameter of that name (a tied
        ``lm_head.weight`` a trainer's state_dict lists is the embedding: not a parameter of its own here)."""
        for name, t in weights:
            p = self.params.get(name)
            if p is not None:
                p.copy_(t)


# ---- the FSDP loop --------------------------------------------------------------------------------------------
class FsdpTrainerSync:
    """The FSDP loop's trainer end (see the module policies): ``model`` an FSDP2 model of transformers' names,
    ``mode`` "ebbtide" or "verl", ``conn`` the socket's connection to the rollout's ``IpcRolloutSync`` (on the GPU);
    on the CPU (mode "ebbtide" only) the end owns a shared host buffer (``fd``, ``nbytes`` go to the rollout).
    ``receiver_first``: whether the rollout's load must run while the push does (IPC) or after it (host buffer)."""

    def __init__(self, model, mode: str, *, device, conn=None, ipc_allocation=None):
        import ebbtide.integrations.fsdp as ebt  # noqa: PLC0415

        _check_mode(mode)
        if mode == "slime":
            raise InvalidArgumentError("the FSDP loop's sync modes are 'ebbtide' and 'verl'")
        self.model, self.mode, self.conn, self.device = model, mode, conn, torch.device(device)
        self.ipc_allocation = ipc_allocation or contextlib.nullcontext  # mode "verl": where its IPC buffer lives
        self.cuda = self.device.type == "cuda"
        if mode == "verl" and not self.cuda:
            raise InvalidArgumentError("verl's update moves the weights by CUDA IPC: it needs a GPU")
        self.receiver_first = self.cuda
        self.last_push: dict = {}
        # full shapes under served names, in the model's order (a DTensor's shape is the full one)
        self.plan = hf_plan({ebt.served_name(n): torch.empty(p.shape, device="meta")
                             for n, p in model.named_parameters()})
        self.fd = self.nbytes = self.buffer = None
        if mode == "ebbtide":
            if self.cuda:
                self.transport = IpcSender(conn)
            else:
                self.buffer = SharedHostBuffer.create(SharedHostBuffer.size_for(self.plan), pin=False)
                self.fd, self.nbytes = self.buffer.fd, self.buffer.nbytes
                self.transport = HostSender(self.buffer, keep_slots=False)
            gather = ebt.ShardGather(model, dtype=torch.bfloat16)
            self.sender = Sender(ebt.local_weights(model), self.transport, plan=self.plan, gather=gather)

    def open(self, version: int, *, streamed: bool = False):
        """Mode "ebbtide" on the GPU: begin update ``version`` on the sender's thread (``Sender.open(wait=False)``;
        the rollout must be in its load). None otherwise."""
        if streamed:
            raise InvalidArgumentError("the FSDP loop's update is gathered per bucket: it cannot be streamed")
        if self.mode != "ebbtide" or not self.cuda:
            return None
        return self.sender.open(version, wait=False)

    def abort(self) -> None:
        if self.mode == "ebbtide":
            self.sender.abort()

    @torch.no_grad()
    def push(self, version: int) -> int:
        """Send the current weights as ``version``; returns the plan's wire bytes. IPC: returns when the rollout
        holds them; the host buffer: when they are in it (the rollout's load comes next)."""
        if self.mode == "ebbtide":
            rep = self.sender.push(version)
            t0 = time.perf_counter()
            if self.cuda:
                self.transport.close()  # the imported staging is unmapped (re-shared at the next push)
            self.last_push = {k: rep[k] for k in ("begin_s", "open_s", "fill_s", "commit_s") if k in rep}
            self.last_push["close_s"] = time.perf_counter() - t0
        else:
            verl.send_weights(verl.per_tensor_weights(self.model, self.device), self.conn, torch.bfloat16,
                              self.device, allocation=self.ipc_allocation)
        if self.cuda:
            torch.cuda.ipc_collect()
        return self.plan.nbytes

    @torch.no_grad()
    def reference(self) -> dict:
        """{name: the bf16 full tensor the rollout must hold after a push}, gathered tensor by tensor (collective
        over the model's group), whatever the variant's shards and dtypes."""
        names = {it.source for it in self.plan.items}
        return {n: t.to(torch.bfloat16) for n, t in verl.per_tensor_weights(self.model, self.device) if n in names}

    def close(self) -> None:
        if self.mode == "ebbtide":
            self.sender.close()
        if self.buffer is not None:
            self.buffer.close()
