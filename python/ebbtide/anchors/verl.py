"""verl's FSDP2 trainer paths, reproduced from its source so the races run what verl users run (volcengine/verl at
b178a3cd; verl's wheel is not on the GPU machine, and its functions are small enough to restate):

- offload / onload of the model (``verl/utils/fsdp_utils.py``: ``offload_fsdp2_model_to_cpu`` is ``model.cpu()``
  then ``empty_cache()``; ``load_fsdp2_model_to_gpu`` is ``model.to(device)``: FSDP's ``_apply`` reshards, moves each
  shard into new pageable host memory (or new device memory) and resets the sharded parameters: new addresses every
  cycle);
- the optimizer state (``offload_fsdp_optimizer`` / ``load_fsdp_optimizer``: every state tensor
  ``.to("cpu"/device, non_blocking=True)``, one tensor at a time);
- the weight update into a colocated vLLM (``verl/workers/fsdp_workers.py`` ``update_weights``: ``state_dict()``,
  then per tensor ``param.to(device, non_blocking=True).full_tensor()`` -- the fp32 masters gathered, one collective
  per tensor -- and ``verl/workers/rollout/vllm_rollout/vllm_rollout.py`` ``update_weights``: each tensor cast to the
  rollout's dtype and copied into one uint8 CUDA IPC buffer of ``update_weights_bucket_megabytes`` (2048 by
  default), and per full bucket a device synchronize and a request/reply round trip, the receiver cloning every
  tensor out of the buffer (``vllm_rollout/utils.py`` ``update_weights_from_ipc``) before it replies). ZMQ's
  REQ/REP pair is a ``multiprocessing`` connection here: the same one round trip per bucket.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["offload_model", "load_model", "offload_optimizer", "load_optimizer", "per_tensor_weights",
           "send_weights", "receive_weights"]

BUCKET_BYTES = 2048 << 20  # verl's rollout.checkpoint_engine.update_weights_bucket_megabytes default


@torch.no_grad()
def offload_model(model, empty_cache: bool = True) -> None:
    model.cpu()
    if empty_cache:
        torch.cuda.empty_cache()


@torch.no_grad()
def load_model(model, device) -> None:
    model.to(device)


def _each_state_tensor(optimizer, to) -> None:
    if not optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.to(to, non_blocking=True)


@torch.no_grad()
def offload_optimizer(optimizer) -> None:
    _each_state_tensor(optimizer, "cpu")


@torch.no_grad()
def load_optimizer(optimizer, device) -> None:
    _each_state_tensor(optimizer, device)


def per_tensor_weights(model, device):
    """verl's generator: ``(name, full tensor)`` per entry of ``state_dict()``, each gathered on its own."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    for name, p in model.state_dict().items():
        yield name, (p.to(device, non_blocking=True).full_tensor() if isinstance(p, DTensor) else p)


@torch.no_grad()
def send_weights(weights, conn, dtype: torch.dtype, device, bucket_bytes: int = BUCKET_BYTES, *,
                 allocation=contextlib.nullcontext) -> int:
    """Push ``weights`` (``(name, tensor)`` pairs) through one CUDA IPC buffer, a round trip per bucket; returns
    the number of buckets. ``allocation()``: the context the buffer is allocated in (a process under
    torch_memory_saver's preload hook allocates it outside the hook, whose memory the driver does not export by
    ``cudaIpcGetMemHandle``)."""
    with allocation():
        buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    conn.send(("buffer", buffer))  # torch pickles a CUDA tensor as its IPC handle
    conn.recv()
    offset, meta, buckets = 0, {}, 0
    for name, w in weights:
        w = w.to(dtype, non_blocking=True)
        if offset + w.nbytes > bucket_bytes:
            torch.cuda.synchronize()
            conn.send(("bucket", meta, False))
            conn.recv()
            meta, offset, buckets = {}, 0, buckets + 1
        if w.nbytes > bucket_bytes:
            raise ValueError(f"{name} ({w.nbytes} bytes) does not fit the {bucket_bytes}-byte bucket")
        meta[name] = (tuple(w.shape), w.dtype, offset)
        buffer[offset:offset + w.nbytes].copy_(w.reshape(-1).view(torch.uint8), non_blocking=True)
        offset += w.nbytes
    torch.cuda.synchronize()
    conn.send(("bucket", meta, True))
    conn.recv()
    del buffer
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return buckets + 1


@torch.no_grad()
def receive_weights(conn, load) -> int:
    """The rollout's side: open the buffer, then per bucket clone every tensor out of it, reply, and ``load`` the
    list of ``(name, tensor)`` (the engine's ``load_weights``). Returns the tensors loaded."""
    _, buffer = conn.recv()
    conn.send(b"")
    loaded = 0
    while True:
        _, meta, last = conn.recv()
        weights = []
        for name, (shape, dtype, offset) in meta.items():
            size = dtype.itemsize * torch.Size(shape).numel()
            weights.append((name, buffer[offset:offset + size].view(dtype).view(shape).clone()))
        torch.cuda.synchronize()
        conn.send(b"")
        load(weights)
        loaded += len(weights)
        del weights
        if last:
            break
    del buffer
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return loaded
