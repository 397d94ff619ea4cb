"""Transports on one host: a shared pinned host buffer, and CUDA IPC between two processes on one GPU.

Every transport has a sending end (``begin(version, plan, device)``, ``buffer(bucket, stream)``, ``send(bucket,
buf, stream)``, ``commit(version)``, ``close()``; driven by ``Sender``) and a receiving end (``receive(receiver,
version=None)``, which stages every bucket into the ``Receiver`` and applies the version, or raises).

Policies:
- Host (``HostSender`` / ``HostReceiver``): the whole update goes into a shared memfd mapping (``SharedHostBuffer``;
  not /dev/shm, which containers often cap at 64 MiB) registered with CUDA by both processes, so both copies are
  DMA at PCIe speed. The sender quantizes bucket k+1 into the other of two device buffers while bucket k is copied
  down on a copy stream. A 4 KiB header (magic, version, state, size, plan signature) makes the buffer
  self-describing: the receiver refuses another plan, an incomplete update, an unexpected or stale version, and an
  update that was overwritten while it was read. On the CPU the sender quantizes straight into the buffer.
- CUDA IPC (``IpcSender`` / ``IpcReceiver``, two processes, one GPU, a ``multiprocessing`` connection for control):
  the receiver shares its staging buffer (plain device memory: torch's CUDA IPC handle, in its reply to the first
  "begin", and again only when its staging changes, a new generation; memory that ebbtide.memory owns, which that
  handle cannot share: the shareable region's fd, passed over the connection's Unix socket with every "begin" and
  unmapped by the sender after the commit, so the receiver may pause it between updates; a non-shareable region is
  refused with the way out) and the sender quantizes every bucket straight into it, at
  the bucket's offset: the bytes cross HBM once on the way in (no producer buffer, no device-to-device copy), then
  the receiver's apply moves them into the parameters. One round trip per update, none per bucket: "begin" (plan
  signature and version checked before any byte is written; the receiver then checks its destinations while the
  sender fills), then "commit" after the sender recorded its "ready" event (interprocess, sent with every "begin")
  behind the last bucket; the receiver's stream waits for it, applies, and answers once the apply completed on the
  device. The sender writes the staging again only in the next update, after that
  answer, so it never overwrites bytes the receiver is still reading. A sender that goes away mid-update leaves
  only the staging half written: the parameters keep the last complete version.
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch

from ..errors import EbbtideError, InvalidArgumentError, StateError
from .errors import PartialUpdateError, PlanMismatchError, WeightVersionError

__all__ = ["SharedHostBuffer", "HostSender", "HostReceiver", "IpcSender", "IpcReceiver", "HEADER_BYTES"]

HEADER_BYTES = 4096
_MAGIC = 0x45425453594E4331  # "EBTSYNC1"
_EMPTY, _WRITING, _COMPLETE = 0, 1, 2


class SharedHostBuffer:
    """``nbytes`` of shared host memory behind a memfd, optionally registered (pinned) with CUDA.
    ``SharedHostBuffer.create(n)`` in one process; ``SharedHostBuffer(fd, n)`` in a child that inherited ``fd``."""

    def __init__(self, fd: int, nbytes: int, *, pin: bool):
        if nbytes <= 0:
            raise InvalidArgumentError(f"shared buffer size must be positive, got {nbytes}")
        self.fd, self.nbytes = fd, nbytes
        self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            self.pinned = True

    @classmethod
    def create(cls, nbytes: int, *, pin: bool) -> "SharedHostBuffer":
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgumentError(f"shared buffer size must be a positive int, got {nbytes!r}")
        fd = os.memfd_create("ebbtide-sync", 0)  # no MFD_CLOEXEC: a child started with pass_fds inherits it
        os.ftruncate(fd, nbytes)
        return cls(fd, nbytes, pin=pin)

    @staticmethod
    def size_for(plan) -> int:
        """Bytes a host transport needs for ``plan`` (header + the whole update)."""
        return HEADER_BYTES + plan.nbytes

    def payload(self, nbytes: int | None = None) -> torch.Tensor:
        """The buffer after its header (uint8, shared): where the host transports lay out the whole update, bucket
        after bucket at the plan's ``bucket_offsets()``; its first ``nbytes`` (default: all of it). For a codec of
        the caller's own over the same layout (the transports' header, version and checks are theirs alone)."""
        room = self.nbytes - HEADER_BYTES
        if nbytes is None:
            nbytes = room
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= room:
            raise InvalidArgumentError(f"payload size must be an int in [0, {room}] (the buffer after its "
                                       f"{HEADER_BYTES}-byte header), got {nbytes!r}")
        return self.tensor[HEADER_BYTES:HEADER_BYTES + nbytes]

    def close(self):
        if self.pinned:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            self.pinned = False
        self.tensor = None
        try:
            self._mm.close()
        except BufferError:  # a view still references it; the mapping goes with the process
            pass


def _sig_words(signature: str) -> list:
    return np.frombuffer(bytes.fromhex(signature)[:32], dtype=np.int64).tolist()


class _Header:
    def __init__(self, buf: SharedHostBuffer):
        self.words = buf.tensor[:64].numpy().view(np.int64)  # magic, version, state, nbytes, signature[4]

    def write(self, version: int, state: int, nbytes: int, signature: str) -> None:
        self.words[2] = _WRITING
        self.words[0], self.words[1], self.words[3] = _MAGIC, version, nbytes
        self.words[4:8] = _sig_words(signature)
        self.words[2] = state

    def read(self) -> tuple:
        w = self.words.copy()
        return int(w[0]), int(w[1]), int(w[2]), int(w[3]), w[4:8].tolist()


def _check_buffer(buf, plan) -> None:
    if not isinstance(buf, SharedHostBuffer):
        raise InvalidArgumentError(f"expected a SharedHostBuffer, got {type(buf).__name__}")
    if buf.nbytes < SharedHostBuffer.size_for(plan):
        raise InvalidArgumentError(f"the host buffer has {buf.nbytes} bytes, the plan needs "
                                   f"{SharedHostBuffer.size_for(plan)} (SharedHostBuffer.size_for(plan))")


class HostSender:
    """Sending end of the host transport (see the module policies). ``keep_slots=False`` frees the two device
    buffers after every update (a trainer that hands the GPU to its rollout between updates)."""

    def __init__(self, buffer: SharedHostBuffer, *, keep_slots: bool = True):
        self.buf, self.header, self.keep_slots = buffer, _Header(buffer), keep_slots
        self._slots, self._copied, self._copy_stream = [], [], None

    @staticmethod
    def streams(device) -> bool:
        """Whether buckets may come out of plan order (``Sender.streamed``): on the CPU (written straight into the
        shared buffer); not from a GPU (two device slots recycled in plan order)."""
        return torch.device(device).type != "cuda"

    def begin(self, version, plan, device) -> None:
        _check_buffer(self.buf, plan)
        self.plan, self.device, self.version = plan, torch.device(device), version
        self.offsets = plan.bucket_offsets()
        self.header.write(version, _WRITING, plan.nbytes, plan.signature)
        if self.device.type == "cuda" and (not self._slots or self._slots[0].numel() < plan.max_bucket_bytes
                                           or self._slots[0].device != self.device):
            self._slots = [torch.empty(plan.max_bucket_bytes, dtype=torch.uint8, device=self.device)
                           for _ in range(2)]
            self._copied = [torch.cuda.Event() for _ in range(2)]
            self._copy_stream = torch.cuda.Stream(self.device)

    def _host(self, bucket) -> torch.Tensor:
        o = HEADER_BYTES + self.offsets[bucket.index]
        return self.buf.tensor[o:o + bucket.nbytes]

    def buffer(self, bucket, stream):
        if self.device.type != "cuda":
            return self._host(bucket)
        slot = bucket.index % 2
        stream.wait_event(self._copied[slot])  # its previous bucket is down in host memory
        return self._slots[slot]

    def send(self, bucket, buf, stream) -> None:
        if self.device.type != "cuda":
            return
        cs = self._copy_stream
        cs.wait_stream(stream)
        with torch.cuda.stream(cs):
            self._host(bucket).copy_(buf[:bucket.nbytes], non_blocking=True)
        self._copied[bucket.index % 2].record(cs)

    def commit(self, version) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self.header.write(version, _COMPLETE, self.plan.nbytes, self.plan.signature)
        if not self.keep_slots:
            self._slots, self._copied = [], []

    def close(self) -> None:
        self._slots, self._copied = [], []


class HostReceiver:
    """Receiving end of the host transport: one host-to-device copy of the update into the receiver's staging,
    then the receiver applies it."""

    def __init__(self, buffer: SharedHostBuffer):
        self.buf, self.header = buffer, _Header(buffer)

    def _checked(self, receiver, expected):
        magic, version, state, nbytes, sig = self.header.read()
        plan = receiver.plan
        if magic != _MAGIC:
            raise PartialUpdateError("the host buffer holds no update (no sender has written it)")
        if sig != _sig_words(plan.signature) or nbytes != plan.nbytes:
            raise PlanMismatchError("the update in the host buffer was made for another plan (names, shapes, "
                                    "dtypes, kinds or bucketing differ from the receiver's)")
        if state != _COMPLETE:
            raise PartialUpdateError(f"update {version} in the host buffer is incomplete (the sender did not "
                                     f"finish it); the rollout keeps version {receiver.version}")
        receiver.check_next(version, expected)
        return version

    def receive(self, receiver, version: int | None = None) -> int:
        v = self._checked(receiver, version)
        _check_buffer(self.buf, receiver.plan)
        src = self.buf.payload(receiver.plan.nbytes)
        dst = receiver.staging[:receiver.plan.nbytes]
        if receiver.cuda:
            with torch.cuda.stream(receiver.stream):
                dst.copy_(src, non_blocking=True)
            receiver.prepare(v)  # while the bytes travel
            receiver.stream.synchronize()
        else:
            dst.copy_(src)
        if self.header.read()[1:3] != (v, _COMPLETE):
            raise PartialUpdateError(f"the host buffer was rewritten while update {v} was read; nothing applied")
        receiver.apply(v)
        return v


# ---- CUDA IPC -----------------------------------------------------------------------------------------------
def _recv(conn, timeout: float, who: str):
    if not conn.poll(timeout):
        raise PartialUpdateError(f"the {who} did not answer within {timeout} s")
    try:
        msg = conn.recv()
    except (EOFError, OSError) as e:
        raise PartialUpdateError(f"the {who} went away ({type(e).__name__})") from None
    return msg


def _engine_owned(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is an ebbtide.memory allocation (a region's VMM memory)."""
    from ..errors import NotFoundError  # noqa: PLC0415
    from ..memory._common import mem  # noqa: PLC0415

    try:
        mem().lookup(t.data_ptr())
    except NotFoundError:
        return False
    return True


class IpcSender:
    """Sending end of the CUDA IPC transport (see the module policies). ``conn`` is a
    ``multiprocessing.connection.Connection`` to the process that runs ``IpcReceiver.receive``."""

    def __init__(self, conn, *, timeout: float = 600.0):
        import torch.multiprocessing  # noqa: F401,PLC0415  (registers torch's CUDA IPC reductions)

        self.conn, self.timeout = conn, timeout
        self.gen, self._staging, self._ready, self._offsets = None, None, None, None
        self._import = None  # the receiver's staging mapped through ebbtide.memory's fd export (one update long)
        self._peer = False  # a conversation is open (close() tells the receiver)

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise PartialUpdateError(f"the receiver went away ({type(e).__name__})") from None

    def _call(self, msg, want: str):
        self._send(msg)
        reply = _recv(self.conn, self.timeout, "receiver")
        if reply[0] == "error":
            raise StateError(f"the receiver refused the update: {reply[1]}")
        if reply[0] != want:
            raise StateError(f"protocol error: expected {want!r} from the receiver, got {reply[0]!r}")
        return reply

    @staticmethod
    def streams(device) -> bool:
        """Buckets may come in any order (``Sender.streamed``): each is written in place in the receiver's staging."""
        return True

    def begin(self, version, plan, device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgumentError("the CUDA IPC transport needs tensors on a CUDA device")
        self.plan, self.version, self._filled = plan, version, 0
        if self._ready is None:
            self._ready = torch.cuda.Event(interprocess=True)
        # the event travels with every "begin" (a receiver that restarted needs it too); one per update, not bucket
        _, gen, share = self._call(("begin", version, plan.signature, len(plan.buckets), self._ready, self.gen),
                                   "begun")
        self._peer = True
        if share is not None:  # first update, or the receiver's staging changed: the old mapping is dropped
            self._drop_import()
            kind, payload = share
            if kind == "torch":
                self._staging = payload
            else:  # "vmm": the fd follows on the connection's socket
                from multiprocessing.reduction import recv_handle  # noqa: PLC0415

                from ..memory import import_tensor  # noqa: PLC0415

                try:
                    fd = recv_handle(self.conn)
                except OSError as e:
                    raise PartialUpdateError(f"the receiver's staging fd did not arrive ({e})") from None
                self._import = import_tensor(payload, fd)
                self._staging = self._import.tensor
            self.gen = gen
        if self._staging is None or self._staging.device != device or self._staging.numel() < plan.nbytes:
            have = "none" if self._staging is None else f"{self._staging.numel()} bytes on {self._staging.device}"
            raise StateError(f"the receiver's staging buffer ({have}) cannot hold the update ({plan.nbytes} bytes on "
                             f"{device})")
        self._offsets = plan.bucket_offsets()

    def buffer(self, bucket, stream):
        o = self._offsets[bucket.index]
        return self._staging[o:o + bucket.nbytes]  # the receiver's own staging: quantized in place, no copy

    def send(self, bucket, buf, stream) -> None:
        self._filled += 1
        self._stream = stream

    def _drop_import(self) -> None:
        if self._import is not None:
            self._import.close()  # drains the device, then unmaps: the receiver may pause its staging again
            self._import = None
            self._staging = None

    def commit(self, version) -> None:
        self._ready.record(self._stream)  # every bucket is written once this completes on the device
        try:
            self._call(("commit", version, self._filled), "committed")
        finally:
            self._drop_import()  # an imported staging is mapped for one update only

    def close(self) -> None:
        self._drop_import()
        if self._peer:
            self._peer = False
            try:
                self._call(("close", self.gen), "closed")
            except StateError:  # PartialUpdateError included: the receiver is gone already
                pass
        self._staging = None


class IpcReceiver:
    """Receiving end of the CUDA IPC transport; ``receive`` serves one update (or a close) and returns the version
    applied (None after a close)."""

    def __init__(self, conn, *, timeout: float = 600.0):
        import torch.multiprocessing  # noqa: F401,PLC0415

        self.conn, self.timeout = conn, timeout
        self.gen, self._shared, self._ready = 0, None, None
        self.last_apply_s = None  # the last commit's seconds from its arrival to the apply done on the device

    def _begun(self, staging, sender_gen) -> None:
        """Answer "begin", sharing ``staging`` where the sender does not hold it: by torch's CUDA IPC handle (plain
        device memory; once), or, for memory that ``ebbtide.memory`` owns (VMM, which that handle cannot share), by
        the shareable region's fd (every update: the sender unmaps after each one, so the staging may pause)."""
        vmm = _engine_owned(staging)
        if not vmm and self._shared is staging and sender_gen == self.gen:
            self.conn.send(("begun", self.gen, None))
            return
        self.gen += 1  # a staging the sender has not mapped yet (first update, a new receiver, or an fd export)
        if not vmm:
            try:  # pickling makes the handle; a failure raises before anything is written to the connection
                self.conn.send(("begun", self.gen, ("torch", staging)))
            except RuntimeError as e:
                self._fail(StateError(f"the receiver's staging cannot be shared by CUDA IPC ({e})"))
            self._shared = staging
            return
        from multiprocessing.reduction import send_handle  # noqa: PLC0415

        from ..memory import export_tensor  # noqa: PLC0415

        try:
            fd, handle = export_tensor(staging)
        except InvalidArgumentError as e:
            self._fail(StateError(f"the receiver's staging is ebbtide.memory region memory that cannot be shared "
                                  f"({e}); allocate it in a region entered with shareable=True, or inside "
                                  f"ebbtide.memory.disable()"))
        except EbbtideError as e:  # e.g. the staging's tag is paused: resume it before receiving
            self._fail(StateError(f"the receiver's staging cannot be exported now ({type(e).__name__}: {e})"))
        try:
            self._shared = None
            self.conn.send(("begun", self.gen, ("vmm", handle)))
            send_handle(self.conn, fd, None)  # SCM_RIGHTS on the connection's Unix socket
        finally:
            os.close(fd)

    def _fail(self, err: Exception):
        try:
            self.conn.send(("error", f"{type(err).__name__}: {err}"))
        except OSError:
            pass
        raise err

    def receive(self, receiver, version: int | None = None) -> int | None:
        pending = None
        while True:
            msg = _recv(self.conn, self.timeout, "sender")
            kind = msg[0]
            if kind == "close":
                self._shared, self._ready = None, None
                self.conn.send(("closed",))
                return None
            if kind == "begin":
                _, v, sig, n, ready, sender_gen = msg
                if sig != receiver.plan.signature or n != len(receiver.plan.buckets):
                    self._fail(PlanMismatchError("the sender's plan differs from the receiver's (names, shapes, "
                                                 "dtypes, kinds or bucketing)"))
                try:
                    receiver.check_next(v, version)
                except WeightVersionError as e:
                    self._fail(e)
                self._ready = ready
                pending = v
                self._begun(receiver.staging, sender_gen)
                receiver.prepare(v)  # while the sender fills the buckets
            elif kind == "commit":
                _, v, filled = msg
                if v != pending or filled != len(receiver.plan.buckets):
                    self._fail(PartialUpdateError(f"commit of version {v} with {filled} of "
                                                  f"{len(receiver.plan.buckets)} buckets written (update {pending})"))
                t0 = time.perf_counter()
                if receiver.stream is not None:
                    receiver.stream.wait_event(self._ready)  # the sender's writes into staging are complete
                receiver.apply(v)
                self.last_apply_s = time.perf_counter() - t0
                self.conn.send(("committed", v))
                return v
            else:
                self._fail(StateError(f"protocol error: unknown message {kind!r}"))
