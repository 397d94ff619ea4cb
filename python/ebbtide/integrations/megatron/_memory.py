"""The trainer's GPU memory of a Megatron-core model, offloaded for the rollout and restored after it, through
ebbtide.memory.

Policies:
- Adoption (``TrainingState(model_chunks, optimizer)``, once, on the GPU): every tensor of the training state is
  moved into an ebbtide.memory tag by re-allocating its *storage* inside a region (``storage.resize_(0)``, then
  ``resize_(nbytes)`` in the region, content copied back), so every view -- ``param.main_grad``, bucket slices,
  the params themselves -- stays valid at its new address, as Megatron's own ``offload_grad_buffers`` relies on.
  Tags: ``<prefix>_weights`` (CPU backup): the params (OffloadedAdam's flat param buffer, a DDP ``param_data``
  buffer, or each standalone param); ``<prefix>_grads`` (discarded): the DDP grad buffers and OffloadedAdam's flat
  gradient; ``<prefix>_optimizer`` (CPU backup): CUDA tensors of a Megatron optimizer's state and fp32 main params
  (GPU-resident optimizers; new state tensors made by later steps are adopted at the next ``offload``).
  After adoption each tag's engine bytes are checked against what was moved: a storage that did not land in the
  engine is an error, never a silent partial offload.
- ``weights="discard"``: OffloadedAdam's flat params go to ``<prefix>_weights_mirrored`` (no backup) and the
  optimizer keeps a pinned host mirror of them that every step writes (``OffloadedAdam.enable_param_mirror``):
  offload drops the weights without a D2H copy, restore maps fresh pages and uploads the mirror. Params outside
  OffloadedAdam stay in ``<prefix>_weights`` (copied). Writes to the params after the optimizer's last step that
  do not go through it are lost at the next offload unless ``optimizer.sync_master_from_params()`` runs after them
  (loading weights in place needs that call for the masters anyway). With ebbtide's distributed optimizer
  (``ShardedAdam``) the DDP ``param_data`` buffers go to ``<prefix>_weights_mirrored`` and the mirror holds each
  rank's shards only: restore zeroes those buffers (fresh pages), uploads the shards and the params are
  all-gathered over the data-parallel group
  (DDP's ``start_param_sync``), at restore or, with ``overlap_forward=True``, at each chunk's first forward (after
  a group reload that comes after restore, as in slime's wake-up). Other optimizers: InvalidArgumentError.
- ``offload()``: empty the caching allocator (activations and other scratch of the default pool), then pause grads
  (discard), optimizer and weights (copy to pinned host memory); the report has seconds and bytes per tag, and the
  memory left: torch's reserved bytes outside the tags and the device's used bytes (driver view: CUDA context, NCCL,
  other processes included). ``restore()``: resume weights, optimizer, grads (same addresses), zero the DDP grad
  buffers (``zero_grad_buffer``: the state Megatron expects at the start of a step). ``restore(overlap_forward=
  True)`` (discard mode) queues the mirror's upload and returns: each module's first forward waits for its own
  parameters' buckets (a one-shot forward pre-hook), so the upload overlaps the first layers' compute.
- ``residual_blocks()``: the largest live blocks of torch's default pool (outside every tag) with their sizes and,
  where torch records memory history, the frames that allocated them: what keeps ``residual_reserved`` up.
- Errors: offload twice or restore without offload -> StateError; a model chunk that is not Megatron's DDP, or a
  trainable param without ``main_grad`` (held outside the DDP buffers) -> InvalidArgumentError naming it; no GPU
  -> UnsupportedError. Checks happen before anything is paused.
"""
from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from itertools import chain

import torch

from ..._snapshot import largest_live_blocks, largest_segments
from ...errors import InvalidArgumentError, StateError, UnsupportedError

__all__ = ["TrainingState", "OffloadReport"]


# Note [cuBLAS workspaces]
# torch keeps one cuBLAS workspace per (handle, stream) for the life of the process (32 MiB each on Hopper; every thread
# that runs a matmul, autograd's backward thread included, has its own handle), allocated from the caching allocator's
# default pool at the first matmul. One that is carved out of a large free block, such as the segment the logits used,
# keeps that whole segment live through every empty_cache, reserved outside the tags after every offload
# (docs/results.md, "Megatron-core adapter", has what it held). The offload frees them (torch's own clear, which its
# CUDA-graph trees and leak checks use); the first matmul after the restore allocates a new one.
def _clear_blas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # a private torch hook: where a build lacks it, the workspaces stay (memory, not bits)
        clear()


@dataclasses.dataclass(frozen=True)
class OffloadReport:
    """One offload or restore. ``tags``: per tag {"bytes": released/mapped, "bytes_copied": ..., "s": ...};
    ``residual_reserved``: torch-reserved bytes outside the tags after the call; ``device_used``: the driver's used
    bytes on the device (everything on it); ``seconds``: wall time of the call; ``parts`` (offload): its split,
    ``drain_s`` (waiting for the device, adopting a GPU optimizer's new state and for a background trim_cache),
    ``empty_cache_s`` (the caching allocator's free blocks back), ``pause_s`` (the tags' pauses and the residual's
    reading) and, after a ``trim_cache`` since the last offload, ``trim_s`` (the trims' own seconds, off the
    offload's path)."""

    kind: str
    seconds: float
    tags: dict
    residual_reserved: int
    device_used: int
    parts: dict = dataclasses.field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(t["bytes"] for t in self.tags.values())

    @property
    def bytes_copied(self) -> int:
        return sum(t["bytes_copied"] for t in self.tags.values())

    def summary(self) -> str:
        per = ", ".join(f"{k} {v['bytes'] / 2**20:.0f} MiB ({v['s'] * 1e3:.1f} ms)" for k, v in self.tags.items())
        return (f"{self.kind}: {self.seconds * 1e3:.1f} ms; {per}; torch reserved outside the tags "
                f"{self.residual_reserved / 2**20:.0f} MiB; device used {self.device_used / 2**20:.0f} MiB")


def _ddp_buffers(chunks) -> list:
    """Every DDP param-and-grad buffer of the model chunks, dense and expert-parallel."""
    return [b for c in chunks for b in list(c.buffers) + list(getattr(c, "expert_parallel_buffers", []))]


def _inner_optimizers(optimizer):
    """The torch optimizers inside a Megatron optimizer (ChainedOptimizer included)."""
    if optimizer is None:
        return []
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is not None:
        return list(chain.from_iterable(_inner_optimizers(o) for o in subs))
    inner = getattr(optimizer, "optimizer", None)
    return [optimizer if inner is None else inner]


class TrainingState:
    """Offload/restore of a Megatron-core trainer's GPU state (params, DDP grad buffers, optimizer state)."""

    def __init__(self, model_chunks, optimizer=None, *, tag_prefix: str = "megatron", weights: str = "copy"):
        from ...optim import OffloadedAdam, ShardedAdam  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise UnsupportedError("TrainingState pauses CUDA memory: it needs a GPU (Megatron's DDP buffers are "
                                   "CUDA tensors)")
        import ebbtide.memory as em  # noqa: PLC0415

        self._em = em
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if not chunks:
            raise InvalidArgumentError("model_chunks is empty")
        for i, c in enumerate(chunks):
            if not hasattr(c, "buffers") or not hasattr(c, "zero_grad_buffer"):
                raise InvalidArgumentError(f"model chunk {i} ({type(c).__name__}) is not Megatron's "
                                           "DistributedDataParallel (it has no grad buffers)")
            for name, p in c.named_parameters():
                if p.requires_grad and getattr(p, "main_grad", None) is None:
                    raise InvalidArgumentError(f"param {name!r} of chunk {i} is trainable but outside Megatron's "
                                               "DDP grad buffers (no main_grad): it would not be offloaded")
        if weights not in ("copy", "discard"):
            raise InvalidArgumentError(f"weights must be 'copy' or 'discard' (got {weights!r})")
        self.chunks = chunks
        self.optimizer = optimizer
        self.weights = weights
        self.tags = {k: f"{tag_prefix}_{k}" for k in ("weights", "grads", "optimizer", "weights_mirrored")}
        self._moved: set = set()  # storage data_ptrs already in a tag
        self._expected = {t: 0 for t in self.tags.values()}
        self._offloaded = False
        self._armed, self._uploads = [], []  # an overlapped restore's forward pre-hooks and last upload events
        self._offadams = [o for o in _inner_optimizers(optimizer) if isinstance(o, OffloadedAdam)]
        self._shards = [o for o in _inner_optimizers(optimizer) if isinstance(o, ShardedAdam)]
        if weights == "discard" and not (self._offadams or self._shards):
            raise InvalidArgumentError("weights='discard' rebuilds the weights from the optimizer's host mirror: the "
                                       "optimizer must be ebbtide's (get_optimizer)")
        for opt in (self._offadams + self._shards) if weights == "discard" else []:
            opt.enable_param_mirror()
        # the DDP buffers whose param_data a ShardedAdam mirror rebuilds: those its shards are ranges of
        storages = {s.param.untyped_storage().data_ptr() for o in self._shards for s in o.shards}
        self._mirrored_buffers = [b for b in _ddp_buffers(chunks) if weights == "discard" and b.param_data is not None
                                  and b.param_data.untyped_storage().data_ptr() in storages]
        self._gathers = {}  # an overlapped restore's pending all-gathers: id(chunk) -> its forward pre-hook
        self._trim = None  # the last background trim_cache(): [thread, seconds or None, exception or None]
        self._trim_s = 0.0  # background trims' own seconds since the last offload (its parts' trim_s)
        self._trimmed = False  # a trim_cache() since the last offload
        torch.cuda.synchronize()
        self._adopt_model()
        self._adopt_optimizer_state()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the storages' previous homes go back
        self._verify()

    # ---- adoption --------------------------------------------------------------------------------------------
    def _move_storage(self, t: torch.Tensor, kind: str, *, keep: bool = True) -> None:
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0 or ptr in self._moved:
            return
        backup = "none" if kind in ("grads", "weights_mirrored") else "cpu"
        saved = None
        if keep:
            saved = torch.empty(n, dtype=torch.uint8, device=t.device)
            saved.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st))
        st.resize_(0)
        with self._em.region(self.tags[kind], backup=backup, device=t.device.index):
            st.resize_(n)
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        if saved is not None:
            whole.copy_(saved)
        else:
            whole.zero_()
        self._moved.add(st.data_ptr())
        self._expected[self.tags[kind]] += n

    def _adopt_model(self) -> None:
        em = self._em
        for opt in self._offadams:
            mirrored = self.weights == "discard"

            def factory(kind, numel, dtype, device, _em=em, _mirrored=mirrored):
                if kind == "params":
                    tag, backup = ((self.tags["weights_mirrored"], "none") if _mirrored
                                   else (self.tags["weights"], "cpu"))
                else:
                    tag, backup = self.tags["grads"], "none"
                with _em.region(tag, backup=backup):
                    return torch.empty(numel, dtype=dtype, device=device)

            opt.rebind_buffers(factory)
            self._moved.update((opt.flat_params.untyped_storage().data_ptr(),
                                opt.flat_grad.untyped_storage().data_ptr()))
            self._expected[self.tags["weights_mirrored" if mirrored else "weights"]] += \
                opt.flat_params.untyped_storage().nbytes()
            self._expected[self.tags["grads"]] += opt.flat_grad.untyped_storage().nbytes()
        for buf in _ddp_buffers(self.chunks):
            self._move_storage(buf.grad_data, "grads", keep=False)
            if buf.param_data is not None:
                mirrored = any(buf is b for b in self._mirrored_buffers)
                self._move_storage(buf.param_data, "weights_mirrored" if mirrored else "weights")
        for c in self.chunks:
            for p in c.parameters():
                self._move_storage(p, "weights")  # standalone params (no-op for the buffers moved above)

    def _adopt_optimizer_state(self) -> None:
        for inner in _inner_optimizers(self.optimizer):
            if inner in self._offadams:
                continue  # its state is in host memory; its device buffers were adopted with the model
            tensors = [p for g in inner.param_groups for p in g["params"]]
            for st in inner.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
            for t in tensors:
                if t.is_cuda:
                    self._move_storage(t, "optimizer")

    def _tag_bytes(self) -> dict:
        out = {}
        for row in self._em.stats()["tags"]:
            out[row["tag"]] = out.get(row["tag"], 0) + row["bytes_active"] + row["bytes_paused"]
        return out

    def _verify(self) -> None:
        have = self._tag_bytes()
        short = {t: (n, have.get(t, 0)) for t, n in self._expected.items() if n and have.get(t, 0) < n}
        if short:
            raise StateError("training state did not land in ebbtide.memory: " + ", ".join(
                f"{t} expected >= {n} bytes, engine holds {h}" for t, (n, h) in short.items()))

    # ---- offload / restore -----------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def _residual(self) -> tuple[int, int]:
        tagged = sum(row["bytes_active"] + row["bytes_paused"] for row in self._em.stats()["tags"])
        free, total = torch.cuda.mem_get_info()
        return max(0, torch.cuda.memory_reserved() - tagged), total - free

    def residual_blocks(self, top: int = 8) -> list[dict]:
        """The ``top`` largest live blocks of torch's default pool (the memory ``residual_reserved`` counts, never
        a tag's), largest first: ``{"bytes", "segment_bytes", "segment_live_bytes", "frames"}``; frames
        (``"file:line name"``, innermost first) only when ``torch.cuda.memory._record_memory_history`` has been on
        since the block was allocated. A diagnostic: call it outside timed code (it walks every segment)."""
        return largest_live_blocks(torch.cuda.memory_snapshot(), top)

    def residual_segments(self, top: int = 4) -> list[dict]:
        """The ``top`` largest segments of torch's default pool that something keeps (``largest_segments``): where
        a few live bytes hold a large segment, freeing or moving them returns the whole segment."""
        return largest_segments(torch.cuda.memory_snapshot(), top)

    def _tags_present(self) -> list[str]:
        return [t for t in (self.tags["grads"], self.tags["optimizer"], self.tags["weights"],
                            self.tags["weights_mirrored"]) if self._expected[t]]

    def offload(self) -> OffloadReport:
        """Release the training state's GPU memory (grads discarded, weights and optimizer state kept in pinned
        host memory) and the caching allocator's free blocks. StateError if already offloaded."""
        if self._offloaded:
            raise StateError("offload() called twice: the training state is already offloaded (call restore())")
        t0 = time.perf_counter()
        self._join_trim()  # first: a failed trim raises here, before anything changed
        trim_s, self._trim_s, trimmed = self._trim_s, 0.0, self._trimmed
        self._trimmed = False
        # an overlapped restore whose forward never ran: its upload ends before the pause; a pending all-gather is
        # dropped (the weights are discarded again and the next restore rebuilds them from the mirror)
        self._drop_pending()
        for h in self._gathers.values():
            h.remove()
        self._gathers = {}
        torch.cuda.synchronize()
        self._adopt_optimizer_state()  # state tensors a GPU optimizer created since the last call
        _clear_blas_workspaces()  # Note [cuBLAS workspaces]
        t1 = time.perf_counter()
        torch.cuda.empty_cache()  # after a background trim: only what was cached since it ran
        t2 = time.perf_counter()
        tags = {}
        for tag in self._tags_present():
            rep = self._em.pause(tag)
            tags[tag] = {"bytes": rep.bytes, "bytes_copied": rep.bytes_copied, "s": rep.total_s}
        self._offloaded = True
        residual, used = self._residual()
        parts = {"drain_s": t1 - t0, "empty_cache_s": t2 - t1, "pause_s": time.perf_counter() - t2}
        if trimmed:
            parts["trim_s"] = trim_s
        return OffloadReport("offload", time.perf_counter() - t0, tags, residual, used, parts)

    def trim_cache(self, *, background: bool = False) -> None:
        """Give the caching allocator's free blocks (the forward's and backward's activations, once the backward
        is done) back to the device ahead of :meth:`offload`, which then frees only what was cached since.
        ``background=True`` runs it on a thread and returns at once; while an earlier background trim still runs
        the call does nothing (it is already trimming), and one that ended is collected first (what it raised is
        raised here as StateError). ``offload`` joins the last one, raises what it raised before changing anything,
        and reports the trims' own seconds as ``parts["trim_s"]``. ``torch.cuda.empty_cache`` holds the
        allocator's lock and synchronizes the device for every segment it frees, so while a trim runs every
        allocation and free of this process waits, and each ``cudaFree`` holds the driver: start it where the host
        is busy and the GPU mostly idle (the CPU optimizer step's kernel: ``EbbtideOptimizer.update_start_hooks``),
        never during a CUDA graph capture, and only where torch releases the GIL inside ``empty_cache`` (torch 2.11
        did: the CPU step beside it kept its speed), or the trim stalls this process's Python. StateError while
        offloaded."""
        if self._offloaded:
            raise StateError("trim_cache() while offloaded: the cache was emptied by offload()")
        box = self._trim
        if box is not None and background and box[0].is_alive():
            return
        self._join_trim()
        self._trimmed = True
        if not background:
            t = time.perf_counter()
            torch.cuda.empty_cache()
            self._trim_s += time.perf_counter() - t
            return
        device = torch.cuda.current_device()
        box = [None, None, None]

        def run():
            try:
                torch.cuda.set_device(device)
                t = time.perf_counter()
                torch.cuda.empty_cache()
                box[1] = time.perf_counter() - t
            except BaseException as e:  # noqa: BLE001 -- raised again by the join
                box[2] = e

        box[0] = threading.Thread(target=run, name="ebbtide-trim-cache", daemon=True)
        self._trim = box
        box[0].start()

    def _join_trim(self) -> None:
        """Wait for the last background trim_cache(), add its seconds to the offload's trim_s; its exception
        raised here as StateError."""
        box, self._trim = self._trim, None
        if box is None:
            return
        box[0].join()
        if box[2] is not None:
            raise StateError(f"the background trim_cache() failed: {box[2]}") from box[2]
        self._trim_s += box[1]

    def restore(self, *, overlap_forward: bool = False) -> OffloadReport:
        """Map the training state back at the same addresses, restore weights and optimizer state, zero the DDP
        grad buffers. StateError without a previous offload().

        ``overlap_forward=True`` (``weights="discard"`` only): return once the weights' upload from the host mirror
        is queued; each module's first forward afterwards waits, on its own stream, for the buckets holding its
        parameters (a forward pre-hook, removed once it ran), so the first layers compute while the later ones
        arrive. Anything else that reads or writes the weights before that forward calls :meth:`wait_weights` first
        (``offload`` and the optimizer's step wait by themselves)."""
        if not self._offloaded:
            raise StateError("restore() without offload(): the training state is resident")
        if overlap_forward and self.weights != "discard":
            raise InvalidArgumentError("restore(overlap_forward=True) overlaps the upload of the host mirror: it "
                                       "needs TrainingState(weights='discard')")
        t0 = time.perf_counter()
        tags = {}
        for tag in reversed(self._tags_present()):
            rep = self._em.resume(tag)
            tags[tag] = {"bytes": rep.bytes, "bytes_copied": rep.bytes_copied, "s": rep.total_s}
        self._offloaded = False
        if self.weights == "discard":
            t1 = time.perf_counter()
            # fresh pages mapped above: the weights come from the host mirror
            uploads = [(o, o.upload_params_from_mirror(wait=not overlap_forward)) for o in self._offadams]
            for b in self._mirrored_buffers:
                b.param_data.zero_()  # padding and the other ranks' slices (the all-gather fills those)
            for o in self._shards:
                o.upload_params_from_mirror()
            if overlap_forward:
                self._arm_forward_waits(uploads)
                self._arm_gathers()
            elif self._shards:
                self._gather_now(self.chunks)
            tag = self.tags["weights_mirrored"]
            copied = sum(o.flat_params.nbytes for o in self._offadams) + sum(o.param_mirror.nbytes
                                                                             for o in self._shards)
            tags[tag] = {**tags[tag], "bytes_copied": copied, "s": tags[tag]["s"] + time.perf_counter() - t1}
        for c in self.chunks:
            c.zero_grad_buffer()
        for opt in self._offadams:
            opt.flat_grad.zero_()
        if not overlap_forward:
            torch.cuda.synchronize()
        residual, used = self._residual()
        return OffloadReport("restore", time.perf_counter() - t0, tags, residual, used)

    def _arm_forward_waits(self, uploads) -> None:
        """A forward pre-hook on every module with parameters in an OffloadedAdam flat buffer: its stream waits for
        the upload event of the last bucket holding any of them (one stream per optimizer uploads in order, so that
        event covers the earlier buckets), then the hook removes itself."""
        flats = []
        for opt, buckets in uploads:
            f = opt.flat_params
            flats.append((f.data_ptr(), f.element_size(), f.numel(), buckets, [end for _, end, _ in buckets]))
        for c in self.chunks:
            for module in c.modules():
                need = {}
                for p in module.parameters(recurse=False):
                    for i, (base, es, n, _buckets, ends) in enumerate(flats):
                        last = (p.data_ptr() - base) // es + p.numel() - 1
                        if 0 <= last < n:
                            need[i] = max(need.get(i, -1), bisect.bisect_right(ends, last))  # its last bucket
                events = [flats[i][3][k][2] for i, k in need.items() if flats[i][3][k][2] is not None]
                if events:
                    box: list = []

                    def hook(module, args, _events=tuple(events), _box=box):
                        stream = torch.cuda.current_stream()
                        for ev in _events:
                            stream.wait_event(ev)
                        _box[0].remove()

                    box.append(module.register_forward_pre_hook(hook))
                    self._armed.append(box[0])
        self._uploads = [b[-1][2] for _, b in uploads if b and b[-1][2] is not None]

    def _arm_gathers(self) -> None:
        """Distributed optimizer: each chunk's first forward all-gathers its params (one-shot pre-hook, removed once
        the gather succeeded: a gather that raises, e.g. with the groups still released, is tried again by the next
        forward rather than leaving the other ranks' slices zero)."""
        if not self._shards:
            return
        for c in self.chunks:
            def hook(module, args):
                self._gather_now([module])
                self._gathers.pop(id(module)).remove()

            self._gathers[id(c)] = c.register_forward_pre_hook(hook)

    @staticmethod
    def _gather_now(chunks) -> None:
        for c in chunks:  # collective over the data-parallel group, as Megatron's DistributedOptimizer step ends
            c.start_param_sync(force_sync=True)

    def wait_weights(self) -> None:
        """Make the current stream wait for an overlapped restore's whole upload and drop its remaining hooks (a
        no-op when nothing is pending); with the distributed optimizer, all-gather the params of every chunk whose
        forward has not run yet (collective: every data-parallel rank calls it, with the groups loaded)."""
        self._drop_pending()
        for c in self.chunks:
            if id(c) in self._gathers:
                self._gather_now([c])
                self._gathers.pop(id(c)).remove()

    def _drop_pending(self) -> None:
        stream = torch.cuda.current_stream()
        for ev in self._uploads:
            stream.wait_event(ev)
        for h in self._armed:
            h.remove()
        self._uploads, self._armed = [], []
