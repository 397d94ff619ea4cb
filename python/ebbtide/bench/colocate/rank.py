"""What every trainer rank of the colocated loop shares, whichever trainer it runs: the synthetic data, the
untimed verification (the rollout's weights and logits against the trainer's), the ranks' alignment on the
launcher's store, and the rank's process: its result file, and no interpreter teardown at exit.

Policies:
- A rank's result file gets everything it recorded (phases, memory samples, checks, setup) whatever happened; a
  failure adds the traceback and the exit status is 1.
- Ranks and rollouts die with their parent (``die_with_parent``: PR_SET_PDEATHSIG).
- ``exit_now`` ends the process without interpreter teardown: paused pools, pinned registrations and communicators
  go with the process (a teardown that frees them one by one can block on a peer that already left).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch

from ...testing.bits import digests
from ...testing.models import ModelConfig
from .options import CUMEM_MODES, GROUP_MODES, STEP_BYTES, TEARDOWNS

__all__ = ["train_tokens", "prompts", "die_with_parent", "reference_entry", "verify_entry",
           "align_store", "align_ranks", "only", "rank_main", "exit_now", "choice", "group_settings", "pipeline_times"]


def train_tokens(cfg: ModelConfig, batch: int, seq: int, step: int, rank: int) -> torch.Tensor:
    """A learnable synthetic task: each row counts up by one from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(cfg.vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq + 1)) % cfg.vocab


def prompts(cfg: ModelConfig, batch: int, length: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab, (batch, length), generator=g).to(device)


def die_with_parent(parent_pid) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``), so a launcher
    killed by a test deadline, or a trainer killed by the launcher, takes its children and their GPU memory with
    it. ``parent_pid``: who started us; if it is already gone (it died before the prctl), raise."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes  # noqa: PLC0415

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ul = ctypes.c_ulong  # prctl is variadic: pass full-width arguments
        libc.prctl(1, ul(int(signal.SIGKILL)), ul(0), ul(0), ul(0))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent_pid):
        raise RuntimeError(f"parent process {parent_pid} exited before this process started")


@torch.no_grad()
def reference_entry(named: dict, ref: dict, forward, local=None) -> dict:
    """What the rollout must show after the sync: the last-position logits of ``forward()`` run with ``ref`` (the
    weights the rollout must hold) copied into the parameters ``named`` (put back afterwards), and ``ref``'s
    digests. ``local(name, ref)``: what this rank's parameter ``name`` holds of the whole ``ref`` (tensor
    parallel: its piece; expert parallel: the global expert it is)."""
    saved = {n: p.detach().clone() for n, p in named.items()}
    try:
        for n, p in named.items():
            p.copy_(local(n, ref) if local is not None else ref[n])
        logits = forward()[:, -1].float().cpu()
    finally:
        for n, p in named.items():
            p.copy_(saved[n])
    return {"logits": logits, "digests": digests(ref)}


def verify_entry(step: int, rank: int, ref: dict, got: dict, gen: dict, rtol: float) -> dict:
    """One verified step: ``ref`` (the trainer's {"digests", "logits"}) against what the rollout returned after
    the load (``got``) and its generation checks (``gen``). ``ok``: every weight bitwise equal and the logits within
    ``rtol`` of the largest |logit|."""
    mismatch = [n for n, d in ref["digests"].items() if got["digests"].get(n) != d]
    logits = torch.tensor(got["logits"])
    diff = float((logits - ref["logits"]).abs().max().item())
    tol = rtol * float(ref["logits"].abs().max().item())
    whole = hashlib.sha256("".join(ref["digests"][n] for n in sorted(ref["digests"])).encode()).hexdigest()
    return {"step": step, "rank": rank, "ok": not mismatch and diff <= tol, "trainer_weights_digest": whole,
            "weights_bitwise_equal": not mismatch, "mismatching_weights": mismatch[:8],
            "logits_bitwise_equal": bool(torch.equal(logits, ref["logits"])),
            "logits_max_abs_diff": diff, "logits_atol": tol, "decode": gen.get("decode"),
            **{k: gen.get(k) for k in ("decode_vs_full_max_abs", "decode_vs_full_rel", "decode_vs_full_argmax_equal",
                                       "decode_vs_eager_tokens_equal", "decode_vs_eager_first_diff",
                                       "decode_vs_eager_max_abs") if k in gen}}


def align_store(world: int):
    """A connection of this rank's own to the launcher's store for ``align_ranks`` (None with one rank). Its own: a
    blocking wait on a store client blocks every other call on that client, and the ebbtide variant's background
    group release runs its own store barrier on the trainer's client while the main thread aligns."""
    if world <= 1:
        return None
    import torch.distributed as dist  # noqa: PLC0415

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timeout=timedelta(minutes=10))


def align_ranks(store, world: int, key: str) -> None:
    """Return once all ``world`` ranks have called this with ``key``: a barrier on the launcher's store (a connection
    from ``align_store``), which needs no process group (the loop's groups may be released when it runs). The loops
    call it after their untimed verification, whose length differs between ranks: without it the next timed phase
    holding a barrier of its own (group release or reload) measures that difference."""
    if world <= 1:
        return
    if store.add(f"align/{key}", 1) == world:
        store.set(f"align/{key}/go", b"1")
    store.wait([f"align/{key}/go"])


def choice(spec: dict, key: str, default: str, words: tuple) -> str:
    """``spec[key]`` (``default`` when absent), one of ``words`` (RuntimeError otherwise: the launcher validated)."""
    v = spec.get(key, default)
    if v not in words:
        raise RuntimeError(f"{key} must be one of {words}, not {v!r}")
    return v


def group_settings(spec: dict) -> tuple:
    """An ebbtide variant's (communicator mode, NCCL_CUMEM_ENABLE, teardown) as ``spec`` asks."""
    return (choice(spec, "groups", "lazy", GROUP_MODES), choice(spec, "nccl_cumem", "off", CUMEM_MODES),
            choice(spec, "comm_teardown", "background", TEARDOWNS))


def pipeline_times(times: dict, moments: str) -> dict:
    """Where an ebbtide CPU optimizer step went (its ``last_step_times``): the pipeline, the kernel, the copies'
    waits, the kernel's bytes per second ({} before a step that ran the kernel)."""
    if not times or times["kernel_s"] <= 0:
        return {}
    return dict(pipeline_s=times["seconds"], kernel_s=times["kernel_s"], copy_wait_s=times["wait_s"],
                kernel_gbps=STEP_BYTES[moments] * times["elements"] / times["kernel_s"] / 1e9)


def only(d: dict, *keys: str) -> dict:
    """The entries of ``d`` named in ``keys`` (a reply's payload without its timing and memory fields)."""
    return {k: d[k] for k in keys if k in d}


def rank_main(trainer_cls, argv=None) -> int:
    """Run one rank of ``trainer_cls`` (``python -m MODULE SPEC_JSON OUT_JSON``, started by the launcher) and write
    its result file; 0 on success."""
    args = argv or sys.argv[1:]
    spec, out_path = json.loads(args[0]), args[1]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    result: dict = {"ok": False, "rank": rank}
    tr = None
    t0 = time.perf_counter()
    try:
        die_with_parent(spec.get("launcher_pid"))
        tr = trainer_cls(spec, rank, world)
        result["setup"] = tr.setup
        tr.run()
        result["ok"] = True
    except Exception:  # noqa: BLE001 (written to the result file and printed; the launcher reports it)
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    finally:
        if tr is not None:
            result.update(phases=tr.rec.phases, memory=tr.rec.memory, checks=tr.checks, setup=tr.setup)
            try:
                tr.close()
            except Exception:  # noqa: BLE001
                result.setdefault("close_error", traceback.format_exc())
        result["wall_s"] = time.perf_counter() - t0
        with open(out_path, "w") as f:
            json.dump(result, f)
    return 0 if result["ok"] else 1


def exit_now(code: int) -> None:
    """End the process with ``code`` after flushing its output, without interpreter teardown (see the policies)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
