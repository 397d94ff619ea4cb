"""The rollout process: holds "weights", a "KV cache" and a sync staging buffer in pausable regions and serves the
trainer's commands over a socket (``python -m ebbtide.bench.colocate.rollout SPEC_JSON``; started by the trainer
through ``RolloutClient``). Where its memory lives is one object per variant (``_EbbtideMemory``, ``_TmsMemory``,
``_NoMemory`` on the CPU); the rest is the same code in every variant.

Policies:
- Variant "ebbtide": started under the LD_PRELOAD shim (``ebbtide.memory.preload_env`` with a default tag), so
  every allocation of every thread -- decode activations, cuBLAS workspaces -- is pausable; weights, KV cache and
  staging get their own tags (discarded on pause: weights are rewritten by every sync, the cache by every
  generation). The process refuses to start if the shim is not active. The untagged rest (the shim's default tag:
  cuBLAS workspaces, live decode scratch) follows ``--scratch-backup``: ``keep``
  (default) leaves it resident and pauses the three named tags only, as the anchor leaves its untagged memory;
  ``cpu`` pauses it too with a CPU backup (that much less held, a copy each way in the rollout's pause and
  resume); ``none`` discards it.
- Variant "anchor": torch_memory_saver in its torch hook mode with the same tags; what lies outside its regions is
  released with ``torch.cuda.empty_cache()`` at pause.
- Decode ``"eager"``: ``greedy_decode``, one eager forward per token. ``"cuda-graph"`` (the launcher's default): a
  ``GraphDecoder`` (eager prefill, the per-token step captured once on the first generate and replayed after).
  Same code in both variants; only where the graph's memory lives differs. ebbtide: captured with
  ``ebbtide.memory.graph(tag="kv_cache", backup="none")``, so the rollout pause releases it with the cache and the
  resume maps it back at the same addresses (the replay recomputes its content). Anchor: torch_memory_saver's
  torch hook mode cannot pause a graph's private pool, so the graph is captured with plain ``torch.cuda.graph``
  outside its regions and the anchor rollout keeps holding that memory while paused (reported as
  ``graph_bytes``). The graph's static token/position buffers are allocated in the ``kv_cache`` region in both
  (rewritten before every replay). On the CPU (orchestration check) the same static step runs eagerly.
- One command at a time; each reply carries ``ok``, the time spent inside (device work complete) and, on failure,
  the traceback. The process never exits on a command error: the trainer decides.
- ``spec["arch"]``: "tiny" (``TinyLM``, the toy trainer's model; weights through the shared host buffer
  ``buf_fd``), "megatron" (``MegatronGPT``, the Megatron trainer's architecture; weights by CUDA IPC over
  the socket ``sync_fd``, mode ``spec["sync"]``: "ebbtide" or "slime", see ``sync``) or "qwen3" (transformers'
  Qwen3 as the FSDP trainer trains it, ``ebbtide.testing.qwen3.Qwen3LM``; by CUDA IPC in mode "ebbtide" or "verl",
  or on the CPU through the shared host buffer; eager decode only, its cache transformers' static one, allocated
  whole in the ``kv_cache`` region); ``spec["moe"]`` (megatron only): ``MoEConfig`` fields of a MoE model, served
  whole (every expert) whatever the trainer's expert parallelism. Every variant other than "ebbtide" runs the rollout on
  torch_memory_saver ("slime-ebbtide": on ebbtide.compat.torch_memory_saver; ``ebbtide.anchors.tms``).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from ...anchors import tms as anchor_tms
from ...anchors.areal import PRELOAD_INIT_VARS
from ...errors import InvalidArgumentError, StateError
from ...testing.bits import digests
from ...testing.models import GraphDecoder, KVCache, MegatronGPT, ModelConfig, MoEConfig, TinyLM, greedy_decode
from ...testing.qwen3 import Qwen3Cache, Qwen3LM
from .options import ARCHS, DECODE_MODES
from .rank import die_with_parent, exit_now, prompts
from .sync import PLANS, IpcRolloutSync, RolloutSync

__all__ = ["main", "RolloutClient", "rollout_env", "MODELS", "GRAPH_TAG", "SCRATCH_TAG"]

MODELS = {"tiny": TinyLM, "megatron": MegatronGPT, "qwen3": Qwen3LM}  # spec["arch"] -> the rollout's model
CACHES = {"tiny": KVCache, "megatron": KVCache, "qwen3": Qwen3Cache}  # ... and what its decode continues from
EAGER_ONLY = ("qwen3",)  # transformers' model: no decode_step of the harness's to capture as a graph
assert tuple(MODELS) == ARCHS == tuple(CACHES)
GRAPH_TAG = "kv_cache"  # the ebbtide rollout's decode graph lives with the cache: discarded on pause, replay refills
SCRATCH_TAG = "rollout_scratch"  # the ebbtide rollout's untagged allocations (the shim's default tag)
PAUSED_TAGS = ("weights", "kv_cache", "sync_staging")  # what a pause releases when the scratch is kept


# ---- the trainer's side: the environment it starts the rollout in, and its client ---------------------------
def rollout_env(em, scratch_backup: str) -> dict:
    """The rollout process's environment: this one without the launcher's rank variables; with ``em`` (the
    ebbtide.memory module) also under the LD_PRELOAD shim, its untagged allocations in ``SCRATCH_TAG`` (``keep``:
    never paused, so no backup), and without ``expandable_segments:True`` in PyTorch's allocator settings (its
    memory bypasses cudaMalloc, so the shim could pause none of the rollout's allocations; the rollout uses the plain
    caching allocator instead)."""
    # a trainer under AReaL's preload hook (areal.tms_env): its rollout starts without it, as AReaL's does
    dropped = ("LD_PRELOAD", "RANK", "WORLD_SIZE", "LOCAL_RANK", *PRELOAD_INIT_VARS)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    if em is None:
        return env
    backup = "none" if scratch_backup == "keep" else scratch_backup
    return em.preload_env(em.without_expandable_segments(env), default_tag=SCRATCH_TAG, default_backup=backup)


def keep_buffers(model: torch.nn.Module, scratch_backup: str) -> None:
    """Move ``model``'s buffers (transformers' rotary ``inv_freq``: values no weight sync carries) out of the
    weights' region, whose pause keeps no copy since every sync refills the parameters: each is cloned outside any
    region, into the untagged memory that ``--scratch-backup keep`` or ``cpu`` carries across the pause (``none``,
    which discards it, is refused for a model with buffers)."""
    held = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    if held and scratch_backup == "none":
        raise InvalidArgumentError(f"--scratch-backup none would discard the rollout model's buffers "
                                   f"({held[0][1]}, ...), which no weight sync refills: use keep or cpu")
    for module, name, buf in held:
        module._buffers[name] = buf.clone()


class RolloutClient:
    """The rollout process and its socket; ``call`` raises with the rollout's traceback on failure. ``fds``: file
    descriptors the rollout inherits, named in its spec (``buf_fd``: the shared host buffer; ``sync_fd``: the
    socket of the IPC weight sync). ``send`` + ``reply`` split a call around work the trainer does meanwhile."""

    def __init__(self, spec: dict, env: dict, fds: dict):
        parent, child = socket.socketpair()
        spec = dict(spec, sock_fd=child.fileno(), **fds)
        self.proc = subprocess.Popen([sys.executable, "-m", "ebbtide.bench.colocate.rollout", json.dumps(spec)],
                                     env=env, pass_fds=(child.fileno(), *fds.values()))
        child.close()
        self.conn = Connection(parent.detach())
        self.info = self._recv(timeout=spec.get("timeout_s", 600))

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the rollout did not answer within {timeout} s (exit code {self.proc.poll()})")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = None
            raise RuntimeError(f"the rollout process went away ({type(e).__name__}; exit code {rc}); its output "
                               f"is in this log above") from None
        if not msg.get("ok"):
            raise RuntimeError(f"rollout failed:\n{msg.get('error', msg)}")
        return msg

    def call(self, cmd: str, timeout: float = 600, **args) -> dict:
        self.send(cmd, **args)
        return self._recv(timeout)

    def send(self, cmd: str, **args) -> None:
        self.conn.send({"cmd": cmd, "args": args})

    def reply(self, timeout: float = 600) -> dict:
        return self._recv(timeout)

    def close(self):
        try:
            if self.proc.poll() is None:
                self.conn.send({"cmd": "exit"})
                self.conn.poll(30) and self.conn.recv()
        except (OSError, EOFError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- where the rollout's memory lives ------------------------------------------------------------------------
class _NoMemory:
    """The orchestration check without a GPU: nothing to pause."""
    em = None
    label = "none (cpu)"

    def region(self, tag: str, *, shareable: bool = False):
        return contextlib.nullcontext()

    def pause(self) -> dict:
        return {}

    def resume(self) -> dict:
        return {}

    def graph_context(self):
        return None

    def self_memory(self) -> dict:
        return {}


def _thread_usage():
    """The calling thread's resource usage (Linux's RUSAGE_THREAD), None where there is none."""
    import resource  # noqa: PLC0415

    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else resource.getrusage(who)


class _EbbtideMemory:
    """ebbtide.memory under the LD_PRELOAD shim (see the module policies): the named tags discarded on pause, the
    untagged rest (``SCRATCH_TAG``) kept resident or paused as ``--scratch-backup`` says, the decode graph in
    ``GRAPH_TAG``."""

    def __init__(self, keep_scratch: bool):
        import ebbtide.memory as em  # noqa: PLC0415

        if em.hook_mode() != "preload":
            raise RuntimeError("the ebbtide rollout must run under the LD_PRELOAD shim (preload_env); "
                               f"LD_PRELOAD={os.environ.get('LD_PRELOAD')!r}")
        self.em, self.keep_scratch = em, keep_scratch
        self.label = em.hook_mode()

    def region(self, tag: str, *, shareable: bool = False):
        # backup "none": discarded on pause. Over CUDA IPC the trainer quantizes straight into the staging:
        # ebbtide's region memory is shared by its fd export, which needs a shareable region
        return self.em.region(tag, shareable=True) if shareable else self.em.region(tag)

    def pause(self) -> dict:
        torch.cuda.empty_cache()  # cached scratch blocks go back now instead of being paused
        if self.keep_scratch:  # the untagged scratch stays resident, as torch_memory_saver leaves it
            reps = [self.em.pause(t) for t in PAUSED_TAGS]
            return {"bytes": sum(r.bytes_copied for r in reps), "bytes_released": sum(r.bytes for r in reps),
                    "driver_delta": reps[-1].driver_free_after - reps[0].driver_free_before}
        rep = self.em.pause()
        return {"bytes": rep.bytes_copied, "bytes_released": rep.bytes, "driver_delta": rep.driver_delta}

    def resume(self) -> dict:
        reps = [self.em.resume(t) for t in PAUSED_TAGS] if self.keep_scratch else [self.em.resume()]
        return {"bytes": sum(r.bytes_copied for r in reps), "bytes_mapped": sum(r.bytes for r in reps)}

    def graph_context(self):
        """Pausable: released by the rollout pause, mapped back at the same addresses by the resume."""
        return lambda g, stream: self.em.graph(g, tag=GRAPH_TAG, backup="none", stream=stream)

    def tag_active(self, tag: str) -> int:
        return sum(r["bytes_active"] for r in self.em.stats()["tags"] if r["tag"] == tag)

    def self_memory(self) -> dict:
        """Engine bytes the rollout's pause releases (the kept scratch tag, never paused, is not counted; NVML
        shows it with the CUDA context)."""
        return {"rollout": sum(r["bytes_active"] for r in self.em.stats()["tags"]
                               if not (self.keep_scratch and r["tag"] == SCRATCH_TAG))}


class _TmsMemory:
    """torch_memory_saver in its torch hook mode with the same tags (``dropin``: ebbtide.compat's, the one import
    swapped); what lies outside its regions goes back with ``empty_cache`` at pause. Its torch hook mode cannot
    pause a graph's private pool: the graph is captured with plain ``torch.cuda.graph``, held while paused."""
    em = None

    def __init__(self, dropin: bool):
        self.tms = anchor_tms.torch_memory_saver(dropin=dropin)
        self.label = "ebbtide-compat-torch" if dropin else "tms-torch"

    def region(self, tag: str, *, shareable: bool = False):
        return self.tms.region(tag=tag)

    def pause(self) -> dict:
        anchor_tms.pause(self.tms, empty_cache_first=False)
        return {}

    def resume(self) -> dict:
        self.tms.resume()
        return {}

    def graph_context(self):
        return None

    def self_memory(self) -> dict:
        return {}


def _memory(variant: str, cuda: bool, keep_scratch: bool):
    if not cuda:
        return _NoMemory()
    if variant == "ebbtide":
        return _EbbtideMemory(keep_scratch)
    return _TmsMemory(dropin=variant == "slime-ebbtide")  # every other variant runs today's tools


# ---- the rollout process --------------------------------------------------------------------------------------
class _Rollout:
    def __init__(self, spec: dict):
        self.spec = spec
        self.variant = spec["variant"]
        self.cuda = spec["device"] != "cpu"
        self.dev = torch.device("cuda", spec["device"]) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.dev)
        self.cfg = ModelConfig(**spec["model"])
        self.codec = "ebbtide" if self.variant == "ebbtide" else "torch"
        self.decode = spec.get("decode", "eager")
        if self.decode not in DECODE_MODES:
            raise InvalidArgumentError(f"decode must be one of {DECODE_MODES}, got {self.decode!r}")
        self.decoder = None  # the GraphDecoder, built on the first generate
        self.last = None  # (tokens, last logits) of the latest verified generate, for check_decode
        self.generated = None  # (tokens, last logits) of the latest generate, for verify_generate
        self.mem = _memory(self.variant, self.cuda, spec.get("scratch_backup", "keep") == "keep")
        region = self.mem.region
        B, P, N = spec["gen_batch"], spec["prompt_len"], spec["new_tokens"]
        arch = spec.get("arch", "tiny")
        if arch not in MODELS:
            raise InvalidArgumentError(f"arch must be one of {sorted(MODELS)}, got {arch!r}")
        moe = spec.get("moe")
        if moe and arch != "megatron":
            raise InvalidArgumentError(f"a MoE rollout needs arch 'megatron', got {arch!r}")
        if arch in EAGER_ONLY and self.decode != "eager":
            raise InvalidArgumentError(f"arch {arch!r} decodes with eager forwards (decode 'eager'), got "
                                       f"{self.decode!r}")
        moe_kw = {"moe": MoEConfig(**moe)} if moe else {}
        with region("weights"):
            # a different seed from the trainer's: only a correct sync makes the logits match
            self.model = MODELS[arch].random(self.cfg, seed=spec["seed"] + 1, device=self.dev, **moe_kw)
        keep_buffers(self.model, spec.get("scratch_backup", "keep"))
        self.model.requires_grad_(False)
        with region("kv_cache"):
            self.cache = CACHES[arch](self.cfg, B, P + N, device=self.dev, dtype=torch.bfloat16)
            extra = int(spec.get("kv_reserve_bytes", 0))
            self.reserve = torch.empty(extra, dtype=torch.uint8, device=self.dev) if extra else None
        ipc_mode = spec.get("sync") if "sync_fd" in spec else None
        self.staging = None
        plan_of = PLANS[arch]
        if ipc_mode not in ("slime", "verl"):  # their loads copy each bucket straight into the parameters
            sync_cls = IpcRolloutSync if ipc_mode else RolloutSync
            with region("sync_staging", shareable=bool(ipc_mode)):
                n = sync_cls.staging_bytes(self.model, plan_of)
                self.staging = torch.empty(n, dtype=torch.uint8, device=self.dev)
        if ipc_mode:
            conn = Connection(socket.socket(fileno=spec["sync_fd"]).detach())
            self.sync = IpcRolloutSync(self.model, conn, ipc_mode, staging=self.staging, plan_of=plan_of)
        else:
            self.sync = RolloutSync(self.model, self.codec, spec["buf_fd"], spec["buf_bytes"], pin=self.cuda,
                                    staging=self.staging, plan_of=plan_of)
        # kept on the CPU and moved per call: device scratch is discarded on pause with --scratch-backup none
        self.prompts = prompts(self.cfg, B, P, spec["seed"] + 7, "cpu")
        self.verify_tokens = prompts(self.cfg, spec["verify_batch"], spec["verify_len"], spec["seed"] + 11, "cpu")
        self._sync()
        self.info = {"pid": os.getpid(), "arch": arch, "sync": ipc_mode or "host buffer",
                     "weights_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
                     "kv_cache_bytes": self.cache.nbytes + extra,
                     "staging_bytes": 0 if self.staging is None else self.staging.numel(),
                     "hook_mode": self.mem.label, "decode": self.decode}

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    # ---- commands --------------------------------------------------------------------------------------------
    def pause(self):
        self._sync()
        return self.mem.pause()

    def resume(self):
        return self.mem.resume()

    def load(self, version: int):
        out = {"bytes": self.sync.load(version), "version": version}
        ipc = getattr(self.sync, "ipc", None)  # the ebbtide IPC receiver: its commit's apply (the wait included)
        if getattr(ipc, "last_apply_s", None) is not None:
            out["apply_s"] = ipc.last_apply_s
        return out

    def verify_load(self):
        """Untimed (the trainer calls it between phases): logits on the verification prompts and weight digests."""
        self._sync()
        return {"logits": self.model(self.verify_tokens.to(self.dev))[:, -1].float().cpu().tolist(),
                "digests": digests(dict(self.model.named_parameters()))}

    def _decode(self, prompt, events=None):
        n = self.spec["new_tokens"]
        if self.decode == "eager":
            return greedy_decode(self.model, prompt, n, self.cache)
        if self.decoder is None:
            with self.mem.region("kv_cache"):  # the static token/position buffers
                self.decoder = GraphDecoder(self.model, self.cache, prompt.shape[0], capture=self.cuda,
                                            graph_context=self.mem.graph_context())
        return self.decoder.generate(prompt, n, events=events)

    def _device_mallocs(self):
        """cudaMalloc calls of torch's caching allocator so far (None on the CPU or where torch does not count)."""
        return torch.cuda.memory_stats(self.dev).get("num_device_alloc") if self.cuda else None

    def generate(self):
        capturing = self.decode != "eager" and self.cuda and (self.decoder is None or self.decoder.graph is None)
        before = self.mem.tag_active(GRAPH_TAG) if capturing and self.mem.em else None
        events = {} if self.cuda else None
        mallocs = self._device_mallocs()
        usage, cpu0 = _thread_usage(), time.thread_time()
        seq, last = self._decode(self.prompts.to(self.dev), events)
        if self.cuda:
            torch.cuda.synchronize(self.dev)
        cpu_s, usage_after = time.thread_time() - cpu0, _thread_usage()
        out = {"tokens": int(seq.shape[0] * self.spec["new_tokens"]), "checksum": int(seq.sum().item()),
               "decode": self.decoder.mode if self.decoder else "eager"}
        if events and "end" in events:  # GPU time of the prefill and of the decode steps (the rest is host time)
            out["prefill_gpu_s"] = events["start"].elapsed_time(events["prefilled"]) / 1e3
            out["decode_gpu_s"] = events["prefilled"].elapsed_time(events["end"]) / 1e3
            out["host_enqueue_s"] = events["host_enqueue_s"]
            out["prefill_host_s"] = events["prefill_host_s"]
        out["host_cpu_s"] = cpu_s  # this thread's CPU time (launches, Python, the driver's work in this thread)
        if usage is not None and usage_after is not None:
            out["switches_voluntary"] = usage_after.ru_nvcsw - usage.ru_nvcsw  # it blocked (a wait in the driver)
            out["switches_involuntary"] = usage_after.ru_nivcsw - usage.ru_nivcsw  # the scheduler preempted it
        if mallocs is not None:  # segments the caching allocator had to get from below (after the pause's empty_cache)
            out["device_mallocs"] = self._device_mallocs() - mallocs
        if self.decoder is not None and self.decoder.graph_bytes is not None:
            out["graph_bytes"] = self.decoder.graph_bytes
        if before is not None:  # the capture (and the static buffers) landed in the engine: paused with the tag
            out["graph_engine_bytes"] = self.mem.tag_active(GRAPH_TAG) - before
        self.generated = (seq, last)  # for verify_generate, before the rollout pauses
        return out

    def verify_generate(self):
        """Untimed (between generate and the rollout's pause): the cached decode's last logits against one full
        forward over the same sequence; keeps them for check_decode when the decode was not eager."""
        if self.generated is None:
            raise StateError("verify_generate needs a generate first")
        (seq, last), self.generated = self.generated, None
        full = self.model(seq[:, :-1])[:, -1].float()
        out = {"decode_vs_full_max_abs": float((full - last).abs().max().item())}
        out["decode_vs_full_rel"] = out["decode_vs_full_max_abs"] / max(float(full.abs().max().item()), 1e-30)
        out["decode_vs_full_argmax_equal"] = bool(torch.equal(full.argmax(-1), last.argmax(-1)))
        if self.decode != "eager":
            self.last = (seq, last)
        return out

    def check_decode(self):
        """The latest verified generate against the eager ``greedy_decode`` on the same weights and prompts
        (untimed; meaningful when decode is not "eager"). Token equality is reported, not required: on a GPU the
        two attention kernels round differently and a near-tie may flip one greedy choice."""
        if self.last is None:
            raise StateError("check_decode needs verify_generate after a generate with decode != 'eager'")
        seq, last = self.last
        self.last = None
        ref_seq, ref_last = greedy_decode(self.model, self.prompts.to(self.dev), self.spec["new_tokens"], self.cache)
        same = (ref_seq == seq).all(0)
        first_diff = int((~same).nonzero()[0].item()) - self.prompts.shape[1] if not bool(same.all()) else None
        out = {"decode_vs_eager_tokens_equal": bool(same.all().item()), "decode_vs_eager_first_diff": first_diff}
        if first_diff is None:  # same sequence: the last logits are comparable
            out["decode_vs_eager_max_abs"] = float((ref_last - last).abs().max().item())
        return out

    def self_memory(self) -> dict:
        return self.mem.self_memory()


def serve(conn, spec: dict) -> int:
    try:
        r = _Rollout(spec)
        r.pause()  # the trainer starts with the GPU
        conn.send({"ok": True, **r.info, "mem": r.self_memory()})
    except Exception:  # noqa: BLE001 (reported to the trainer, which prints it)
        conn.send({"ok": False, "error": traceback.format_exc()})
        return 1
    while True:
        msg = conn.recv()
        cmd = msg.get("cmd")
        if cmd == "exit":
            conn.send({"ok": True})
            return 0
        try:
            if cmd not in ("pause", "resume", "load", "verify_load", "generate", "verify_generate", "check_decode"):
                raise ValueError(f"unknown command {cmd!r}")
            t0 = time.perf_counter()
            out = getattr(r, cmd)(**msg.get("args", {}))
            r._sync()
            out["inside_s"] = time.perf_counter() - t0
            out["mem"] = r.self_memory()
            conn.send({"ok": True, **out})
        except Exception:  # noqa: BLE001
            conn.send({"ok": False, "error": traceback.format_exc()})


def main(argv=None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    die_with_parent(spec.get("trainer_pid"))
    sock = socket.socket(fileno=spec["sock_fd"])
    conn = Connection(sock.detach())
    with contextlib.suppress(EOFError, BrokenPipeError):
        return serve(conn, spec)
    return 1


if __name__ == "__main__":
    exit_now(main())
