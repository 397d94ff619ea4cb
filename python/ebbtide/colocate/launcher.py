"""Launch the colocated RL loop: for each variant (ebbtide, then the anchor), one trainer process per GPU, each
with its rollout process on the same GPU; collect their results, print the table, write JSON and the PNG.

    python -m ebbtide.colocate --gpus 1 --steps 10 --out colocate-out
    python -m ebbtide.colocate --gpus 2 --steps 10 --out colocate-out
    python -m ebbtide.colocate --trainer megatron --quick --out colocate-out    # Megatron-core GPT, one GPU

Policies:
- Every variant runs in fresh processes (neither inherits the other's pools, pinned memory or hooks); the trainer
  ranks never carry LD_PRELOAD; each variant gets its own rendezvous store, served by the launcher and listening on
  loopback only (``--store-bind`` names another address, e.g. for ranks on several hosts).
- ``run_loop`` is the entry point for other code (the bench suite): the example at its default or ``quick`` size.
- Argument errors raise ``ebbtide.InvalidArgumentError`` before anything starts. A failing rank does not hide the
  others: every rank's result file, exit code and log tail are kept in the results.
- ``--trainer``: "toy" (default; the example's own model, ``trainer``; variants "ebbtide" and "anchor") or
  "megatron" (a Megatron-core GPT, ``mtrainer``; CUDA only, megatron-core needed; ``--tp``/``--ep``/``--moe-experts``
  for tensor and expert parallelism and a MoE model, the rest of ``--gpus`` data parallel; variants "ebbtide",
  "slime", "slime-ebbtide" and "gpu-tms"). Its default size is ``MEGATRON_MODEL`` (~1.3 B params), ``--quick``
  ``MEGATRON_QUICK``.
- The variants on the torch_memory_saver package (``NEEDS_TMS``) run where it is installed; otherwise they are
  reported as "not installed".
- The steady phases (``measure.STEADY_PHASES``: the trainer's forward + backward and the rollout's generate) run the
  same code in every variant; the report puts ebbtide's medians beside each anchor's, and with ``steady_guard``
  "error" (the default) ``main`` exits with status 3 when ebbtide's is more than ``steady_tolerance`` slower.
- Each trainer rank runs in a session of its own with its rollout child: killing a rank (deadline, failed peer,
  Ctrl-C) kills the whole group, and a rollout its trainer left behind is killed once the variant is over, so no
  process keeps holding GPU memory into the next variant. Ranks and rollouts also die with their parent
  (PR_SET_PDEATHSIG): a launcher killed from outside (a test deadline) leaves nothing running.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta

from ..errors import InvalidArgumentError, UnsupportedError
from .measure import (STEADY_TOLERANCE, format_report, growth_check, nvml_all_pids, plot_timeline, steady_check,
                      summarize)
from ._procs import _kill_group, _reap_group, _tail, _wait_all
from .model import ModelConfig

__all__ = ["RunConfig", "parse_args", "run", "run_loop", "main", "QUICK_MODEL", "MEGATRON_MODEL", "MEGATRON_QUICK",
           "TRAINERS"]

GiB = 1 << 30
QUICK_MODEL = ModelConfig(vocab=8192, d_model=1024, n_layers=8, n_heads=8, d_ff=4096, max_seq=512)  # ~0.12 B params
# Megatron GPT (untied output layer, biases): 2*V*d + L*(12 d^2 + 13 d) params. ~1.34 B (the megatron suite's
# default shape); --quick ~0.12 B.
MEGATRON_MODEL = ModelConfig(vocab=32768, d_model=2048, n_layers=24, n_heads=16, d_ff=8192, max_seq=2048)
MEGATRON_QUICK = ModelConfig(vocab=32768, d_model=1024, n_layers=4, n_heads=16, d_ff=4096, max_seq=512)
VARIANTS = ("ebbtide", "anchor")
SCRATCH_BACKUPS = ("keep", "cpu", "none")
TRAINERS = {"toy": ("ebbtide.colocate.trainer", VARIANTS),
            "megatron": ("ebbtide.colocate.mtrainer", ("ebbtide", "slime", "slime-ebbtide", "gpu-tms"))}
# = mtrainer.VARIANTS; the variants that run on the torch_memory_saver package (the others need only ebbtide)
NEEDS_TMS = ("anchor", "slime", "gpu-tms")
GROUP_MODES = ("lazy", "eager", "used")  # = mtrainer.GROUP_MODES
CUMEM_MODES = ("off", "on")  # = mtrainer.CUMEM_MODES
MOMENTS = ("fp32", "bf16")  # = mtrainer.MOMENTS: Adam's moments in the ebbtide variant's host state
TEARDOWNS = ("background", "joined")  # = mtrainer.TEARDOWNS: where the ebbtide variant's release tears down
CACHE_TRIMS = ("auto", "step", "offload")  # = mtrainer.CACHE_TRIMS: when the ebbtide trainer empties its cache
SYNC_FILLS = ("auto", "streamed", "after")  # = mtrainer.SYNC_FILLS: when the ebbtide trainer fills the update
STEADY_GUARDS = ("error", "warn")
DECODE_MODES = ("eager", "cuda-graph")  # = rollout.DECODE_MODES (not imported: the rollout module imports torch)


@dataclasses.dataclass
class RunConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    trainer: str = "toy"
    gpus: int = 1
    tp: int = 1  # megatron: tensor parallel; the rest of --gpus is data parallel (distributed optimizer)
    ep: int = 1  # megatron MoE: expert parallel (experts split over ep ranks, whole experts: expert TP 1)
    moe_experts: int = 0  # megatron: 0 = dense MLPs; else every layer's MLP is a MoE of this many experts
    moe_topk: int = 2
    steps: int = 10
    warmup: int = 2
    batch: int = 8
    seq: int = 512
    gen_batch: int = 16
    prompt_len: int = 128
    new_tokens: int = 128
    kv_reserve_gb: float = 2.0
    lr: float = 1e-4
    seed: int = 0
    variants: tuple | None = None  # None: every variant of the trainer
    scratch_backup: str = "keep"
    # "cuda-graph" (default): the per-token decode step replayed from a CUDA graph in both variants, as rollout
    # engines decode; "eager": one eager forward per token (launch bound: ~80% of the step at the default size)
    decode: str = "cuda-graph"
    verify_batch: int = 4
    verify_len: int = 64
    timeout_s: int = 900
    out: str = "colocate-out"
    device: str = "cuda"
    store_bind: str = "127.0.0.1"  # where the ranks' rendezvous store listens (loopback unless asked)
    # the ebbtide Megatron trainer's communicators: "lazy" (made at a group's first collective, as slime's are;
    # release frees only those that exist), "eager" (WORLD bound to the device: every group connects at creation
    # and again at reload) or "used" (lazy, and the reload connects and warms up, concurrently, only the groups
    # that had a communicator at the release). The anchors always run slime's own settings (lazy,
    # NCCL_CUMEM_ENABLE=0).
    groups: str = "lazy"
    # the ebbtide Megatron trainer's NCCL_CUMEM_ENABLE: "off" (slime's actor environment, as the anchors run) or "on"
    nccl_cumem: str = "off"
    moments: str = "fp32"
    # the ebbtide Megatron trainer's communicator teardown at release: "background" (overlaps offload and generate)
    # or "joined" (inside comm_release: nothing of the trainer runs beside the rollout's generate)
    comm_teardown: str = "background"
    cache_trim: str = "auto"  # ebbtide Megatron trainer's cache emptied during the CPU step or in the offload
    # the steady phases (forward + backward, generate) of ebbtide against each anchor's: "error" (exit status 3 when
    # ebbtide is more than steady_tolerance slower), "warn" (say so, exit as usual)
    steady_guard: str = "error"
    steady_tolerance: float = STEADY_TOLERANCE
    # megatron: torch records every allocation's frames in each trainer (a diagnostic of what the offload leaves in
    # torch's pool: the offload phase's residual_blocks/residual_segments get frames; the steps run slower)
    memory_history: bool = False
    # megatron, ebbtide variant: the update filled while the CPU step uploads the weights ("streamed", one GPU,
    # dense) or after the step ("after"; "auto" = after: docs/colocate.md has the measured reason)
    sync_fill: str = "auto"
    # megatron, slime anchors: --use-precision-aware-optimizer as slime's model scripts pass it ("on") or not ("off")
    anchor_precision_aware: str = "on"

    def validate(self) -> "RunConfig":
        if self.trainer not in TRAINERS:
            raise InvalidArgumentError(f"trainer must be one of {tuple(TRAINERS)}, got {self.trainer!r}")
        known = TRAINERS[self.trainer][1]
        if self.variants is None:
            self.variants = known
        self.model.validate()
        ints = {"gpus": 1, "tp": 1, "ep": 1, "moe_experts": 0, "moe_topk": 1, "steps": 1, "warmup": 0, "batch": 1,
                "seq": 2, "gen_batch": 1, "prompt_len": 1,
                "new_tokens": 1, "verify_batch": 1, "verify_len": 1, "timeout_s": 1}
        for name, lo in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        if self.warmup >= self.steps:
            raise InvalidArgumentError(f"warmup ({self.warmup}) must be smaller than steps ({self.steps}): "
                                       f"nothing would be measured")
        if self.seq > self.model.max_seq:
            raise InvalidArgumentError(f"seq {self.seq} exceeds the model's max_seq {self.model.max_seq}")
        if self.prompt_len + self.new_tokens > self.model.max_seq:
            raise InvalidArgumentError(f"prompt_len + new_tokens = {self.prompt_len + self.new_tokens} exceeds "
                                       f"max_seq {self.model.max_seq}")
        if self.verify_len > self.model.max_seq:
            raise InvalidArgumentError(f"verify_len {self.verify_len} exceeds max_seq {self.model.max_seq}")
        if not isinstance(self.kv_reserve_gb, (int, float)) or not 0 <= self.kv_reserve_gb <= 1024:
            raise InvalidArgumentError(f"kv_reserve_gb must be in [0, 1024], got {self.kv_reserve_gb!r}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise InvalidArgumentError(f"lr must be positive, got {self.lr!r}")
        bad = [v for v in self.variants if v not in known]
        if bad or not self.variants or len(set(self.variants)) != len(self.variants):
            raise InvalidArgumentError(f"variants must be distinct names from {known} (trainer {self.trainer}), "
                                       f"got {self.variants!r}")
        if self.trainer == "megatron":
            if self.device != "cuda":
                raise InvalidArgumentError("--trainer megatron needs CUDA (Megatron's DDP buffers and rotary "
                                           "embeddings allocate on the GPU): there is no --device cpu run of it")
            if self.gpus % self.tp:
                raise InvalidArgumentError(f"--tp {self.tp} must divide --gpus {self.gpus} (the rest is data parallel)")
            for name in ("n_heads", "d_ff", "vocab"):
                if getattr(self.model, name) % self.tp:
                    raise InvalidArgumentError(f"--tp {self.tp} must divide the model's {name} "
                                               f"({getattr(self.model, name)}): Megatron splits it between the ranks")
            self._validate_moe()
        elif self.tp != 1 or self.ep != 1 or self.moe_experts:
            raise InvalidArgumentError(f"--tp, --ep and --moe-experts: each an option of --trainer megatron (the toy "
                                       f"trainer is dense and data parallel only); got --tp {self.tp} --ep {self.ep} "
                                       f"--moe-experts {self.moe_experts}")
        if self.device not in ("cuda", "cpu"):
            raise InvalidArgumentError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cpu" and self.variants != ("ebbtide",):
            raise InvalidArgumentError("device 'cpu' (the orchestration check) runs the ebbtide variant only: "
                                       "pass --variants ebbtide")
        if self.scratch_backup not in SCRATCH_BACKUPS:
            raise InvalidArgumentError(f"scratch_backup must be one of {SCRATCH_BACKUPS}, got {self.scratch_backup!r}")
        if not isinstance(self.store_bind, str) or not self.store_bind.strip():
            raise InvalidArgumentError(f"store_bind must be a host name or an IP address, got {self.store_bind!r}")
        if self.decode not in DECODE_MODES:
            raise InvalidArgumentError(f"decode must be one of {DECODE_MODES}, got {self.decode!r}")
        if self.steady_guard not in STEADY_GUARDS:
            raise InvalidArgumentError(f"steady_guard must be one of {STEADY_GUARDS}, got {self.steady_guard!r}")
        if (not isinstance(self.steady_tolerance, (int, float)) or isinstance(self.steady_tolerance, bool)
                or not 0 <= self.steady_tolerance <= 1):
            raise InvalidArgumentError(f"steady_tolerance must be a fraction in [0, 1], got {self.steady_tolerance!r}")
        if self.groups not in GROUP_MODES:
            raise InvalidArgumentError(f"groups must be one of {GROUP_MODES}, got {self.groups!r}")
        if self.nccl_cumem not in CUMEM_MODES:
            raise InvalidArgumentError(f"nccl_cumem must be one of {CUMEM_MODES}, got {self.nccl_cumem!r}")
        if self.moments not in MOMENTS:
            raise InvalidArgumentError(f"moments must be one of {MOMENTS}, got {self.moments!r}")
        if self.comm_teardown not in TEARDOWNS:
            raise InvalidArgumentError(f"comm_teardown must be one of {TEARDOWNS}, got {self.comm_teardown!r}")
        if self.cache_trim not in CACHE_TRIMS:
            raise InvalidArgumentError(f"cache_trim must be one of {CACHE_TRIMS}, got {self.cache_trim!r}")
        if self.cache_trim != "auto" and self.trainer != "megatron":
            raise InvalidArgumentError("--cache-trim is an option of --trainer megatron (the toy one trims offloading)")
        if self.comm_teardown != "background" and self.trainer != "megatron":
            raise InvalidArgumentError("--comm-teardown is an option of --trainer megatron (the toy trainer "
                                       "releases its groups with the teardown joined)")
        if self.sync_fill not in SYNC_FILLS:
            raise InvalidArgumentError(f"sync_fill must be one of {SYNC_FILLS}, got {self.sync_fill!r}")
        if self.sync_fill != "auto" and self.trainer != "megatron":
            raise InvalidArgumentError("--sync-fill is an option of --trainer megatron")
        if self.sync_fill == "streamed" and (self.gpus > 1 or self.moe_experts):
            raise InvalidArgumentError("--sync-fill streamed needs one GPU and a dense model (the distributed "
                                       "optimizer and the TP/EP gathers fill after the step)")
        if not isinstance(self.memory_history, bool):
            raise InvalidArgumentError(f"memory_history must be a bool, got {self.memory_history!r}")
        if self.memory_history and self.trainer != "megatron":
            raise InvalidArgumentError("--memory-history is an option of --trainer megatron")
        if self.anchor_precision_aware not in ("on", "off"):
            raise InvalidArgumentError(f"anchor_precision_aware must be 'on' or 'off', got "
                                       f"{self.anchor_precision_aware!r}")
        if self.anchor_precision_aware != "on" and self.trainer != "megatron":
            raise InvalidArgumentError("--anchor-precision-aware is an option of --trainer megatron")
        if self.moments != "fp32" and self.trainer != "megatron":
            raise InvalidArgumentError("--moments bf16 is an option of --trainer megatron (the toy trainer's "
                                       "optimizer keeps fp32 moments)")
        return self

    def _validate_moe(self) -> None:
        if not self.moe_experts:
            if self.ep != 1:
                raise InvalidArgumentError(f"--ep {self.ep} needs a MoE model: pass --moe-experts")
            return
        if self.moe_experts < 2 or self.moe_topk > self.moe_experts:
            raise InvalidArgumentError(f"--moe-experts must be >= 2 and >= --moe-topk; got --moe-experts "
                                       f"{self.moe_experts} --moe-topk {self.moe_topk}")
        if self.gpus % self.ep or self.moe_experts % self.ep:
            raise InvalidArgumentError(f"--ep {self.ep} must divide --gpus {self.gpus} and --moe-experts "
                                       f"{self.moe_experts} (each expert-parallel rank holds experts / ep of them)")
        if self.tp > 1:
            raise InvalidArgumentError(f"--moe-experts with --tp {self.tp}: Megatron trains a MoE layer at tensor "
                                       "parallel > 1 only with sequence parallelism, which this loop does not run")
        if self.ep < 2:
            # megatron-core 0.16.1, local spec: at expert-parallel 1 and tensor-parallel 1 an expert's fc2 output is
            # a view returned by the (identity) TP all-reduce, and SequentialMLP adds its bias to it in place: the
            # backward fails ("a view ... is being modified inplace"); at EP > 1 the experts skip that all-reduce
            raise InvalidArgumentError("--moe-experts needs --ep 2 or more: megatron-core's SequentialMLP experts "
                                       "with biases fail their backward at expert parallel 1 (an in-place bias add "
                                       "on a view)")

    def worker_spec(self, variant: str) -> dict:
        return {"model": dataclasses.asdict(self.model), "trainer": self.trainer, "variant": variant, "tp": self.tp,
                "ep": self.ep,
                "moe": {"experts": self.moe_experts, "topk": self.moe_topk} if self.moe_experts else None,
                "steps": self.steps,
                "batch": self.batch, "seq": self.seq, "gen_batch": self.gen_batch, "prompt_len": self.prompt_len,
                "new_tokens": self.new_tokens, "kv_reserve_bytes": int(self.kv_reserve_gb * GiB), "lr": self.lr,
                "seed": self.seed, "scratch_backup": self.scratch_backup, "decode": self.decode, "groups": self.groups,
                "nccl_cumem": self.nccl_cumem, "comm_teardown": self.comm_teardown, "cache_trim": self.cache_trim,
                "moments": self.moments, "memory_history": self.memory_history, "sync_fill": self.sync_fill,
                "anchor_precision_aware": self.anchor_precision_aware == "on", "verify_batch": self.verify_batch,
                "verify_len": self.verify_len, "timeout_s": self.timeout_s, "device": self.device}


def _parser() -> argparse.ArgumentParser:
    d, m = RunConfig(), ModelConfig()
    p = argparse.ArgumentParser(prog="python -m ebbtide.colocate",
                                description="A colocated RL loop (trainer + rollout on the same GPUs), measured "
                                            "against the same loop on torch_memory_saver / torch tools.")
    p.add_argument("--trainer", default=d.trainer, choices=tuple(TRAINERS),
                   help="toy: the example's own small model (default, no dependencies); megatron: a Megatron-core "
                        "GPT (local layer spec, bf16, DDP; dense or MoE) on ebbtide's adapter, beside the slime "
                        "configuration and the GPU optimizer under torch_memory_saver")
    p.add_argument("--gpus", type=int, default=d.gpus, help="trainer ranks, one per GPU, each with its rollout")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="megatron: tensor-parallel size (divides --gpus; the rest is data parallel, where the ebbtide "
                        "variant runs its distributed optimizer and the anchors Megatron's)")
    p.add_argument("--ep", type=int, default=d.ep,
                   help="megatron MoE: expert-parallel size (divides --gpus and --moe-experts; whole experts per rank)")
    p.add_argument("--moe-experts", type=int, default=d.moe_experts,
                   help="megatron: every layer's MLP a MoE of this many experts of --d-ff each (Megatron's local spec, "
                        "alltoall dispatcher, fp32 router; default 0: dense)")
    p.add_argument("--moe-topk", type=int, default=d.moe_topk, help="megatron MoE: experts per token")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of the medians")
    p.add_argument("--quick", action="store_true", help="a small model and short decode (the bench suite's size)")
    for f in dataclasses.fields(ModelConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f"model_{f.name}", type=int, default=None,
                       help=f"model {f.name} (default {getattr(m, f.name)}; --quick: {getattr(QUICK_MODEL, f.name)}; "
                            f"megatron {getattr(MEGATRON_MODEL, f.name)}, quick {getattr(MEGATRON_QUICK, f.name)})")
    p.add_argument("--batch", type=int, default=d.batch, help="training sequences per rank per step")
    p.add_argument("--seq", type=int, default=d.seq, help="training sequence length")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--kv-reserve-gb", type=float, default=d.kv_reserve_gb,
                   help="extra KV-cache pool the rollout holds (as an engine would), paused with it")
    p.add_argument("--verify-batch", type=int, default=d.verify_batch, help="prompts of the logits check")
    p.add_argument("--verify-len", type=int, default=d.verify_len, help="tokens per prompt of the logits check")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--variants", default=None,
                   help="comma list of: ebbtide, anchor (toy); ebbtide, slime, slime-ebbtide, gpu-tms (megatron); "
                        "default all")
    p.add_argument("--scratch-backup", default=d.scratch_backup, choices=SCRATCH_BACKUPS,
                   help="the rollout's untagged allocations (cuBLAS workspaces, decode scratch) across its pause: "
                        "keep (default: stay resident and are not paused, as torch_memory_saver leaves untagged "
                        "memory), cpu (paused with a CPU backup: less held, a copy each way), none (discarded)")
    p.add_argument("--decode", default=d.decode, choices=DECODE_MODES,
                   help="rollout decode: the per-token step captured once in a CUDA graph and replayed (default), "
                        "or eager forwards (same code in both variants; the anchor rollout keeps the graph's memory "
                        "while paused, ebbtide's pauses it). On --device cpu the static step runs eagerly")
    p.add_argument("--groups", default=d.groups, choices=GROUP_MODES,
                   help="megatron, ebbtide variant: communicators made at each group's first collective (lazy, "
                        "default; release frees those that exist), at creation and reload (eager: WORLD bound to "
                        "the device), or lazily and again at reload for the groups the last step used (used: "
                        "reload_groups(eager=True) over lazy groups, their warm-ups concurrent). The anchors run "
                        "slime's settings whatever this says")
    p.add_argument("--nccl-cumem", default=d.nccl_cumem, choices=CUMEM_MODES,
                   help="megatron, ebbtide variant: NCCL_CUMEM_ENABLE off (default: slime's actor environment, as the "
                        "anchors run) or on (NCCL's own default; each lazily connected communicator costs ~0.1 s "
                        "more between two GPUs with NCCL 2.28)")
    p.add_argument("--comm-teardown", default=d.comm_teardown, choices=TEARDOWNS,
                   help="megatron, ebbtide variant: the released communicators' teardown runs in the background, "
                        "beside offload and generate (default), or inside comm_release (joined: the trainer does "
                        "nothing while the rollout generates; for telling the teardown's effect on generate apart)")
    p.add_argument("--cache-trim", default=d.cache_trim, choices=CACHE_TRIMS,
                   help="megatron, ebbtide variant: the caching allocator's free blocks (the activations) go back to "
                        "the device on a thread while the CPU optimizer steps (step), inside the offload (offload), "
                        "or step at DP=EP=1 and offload with the sharded optimizer (auto, default)")
    p.add_argument("--moments", default=d.moments, choices=MOMENTS,
                   help="megatron, ebbtide variant: Adam's moments in fp32 (default) or bf16 (Megatron's precision-"
                        "aware exp_avg_dtype/exp_avg_sq_dtype; 20 instead of 28 bytes per parameter through host "
                        "memory). The slime anchors keep fp32 moments: HybridDeviceOptimizer's CPU AdamW has no "
                        "moment dtype")
    p.add_argument("--sync-fill", default=d.sync_fill, choices=SYNC_FILLS,
                   help="megatron, ebbtide variant: the weight update filled while the CPU step uploads each bucket "
                        "(streamed; one GPU, dense) or after the step (after; auto, the default, is after: streamed "
                        "measured slower, its fills' Python contending with the CPU step for the GIL)")
    p.add_argument("--anchor-precision-aware", default=d.anchor_precision_aware, choices=("on", "off"),
                   help="megatron, slime anchors: Megatron's --use-precision-aware-optimizer as slime's model scripts "
                        "pass it (on, default: the DistributedOptimizer keeps no fp32 main params on the GPU, "
                        "HybridDeviceOptimizer's CPU copy is the master) or not (off)")
    p.add_argument("--memory-history", action="store_true",
                   help="megatron, a diagnostic: each trainer records its allocations' frames, so the offload "
                        "phase's residual_blocks name what keeps torch's pool reserved (the steps run slower)")
    p.add_argument("--steady-guard", default=d.steady_guard, choices=STEADY_GUARDS,
                   help="when ebbtide's train (forward + backward) or generate median is more than --steady-tolerance "
                        "slower than an anchor's: error (default: exit status 3) or warn")
    p.add_argument("--steady-tolerance", type=float, default=d.steady_tolerance,
                   help=f"allowed slowdown of the steady phases, a fraction (default {STEADY_TOLERANCE})")
    p.add_argument("--timeout", type=int, default=d.timeout_s, dest="timeout_s", help="seconds per variant")
    p.add_argument("--out", default=d.out, help="directory for results.json, timeline.png and logs")
    p.add_argument("--store-bind", default=d.store_bind,
                   help="address the ranks' rendezvous store listens on (default loopback: nothing off this host "
                        "can reach it); 0.0.0.0 listens on every interface")
    p.add_argument("--device", default=d.device, choices=("cuda", "cpu"),
                   help="cpu: check the orchestration without a GPU (no pause/resume, no NVML; ranks use Gloo)")
    return p


def parse_args(argv=None) -> RunConfig:
    """Command line -> validated RunConfig. Bad values raise InvalidArgumentError (argparse's own type errors
    exit with usage, as argparse does)."""
    a = _parser().parse_args(argv)
    base = _model(a.trainer, a.quick)
    model = ModelConfig(**{f.name: (getattr(a, f"model_{f.name}") if getattr(a, f"model_{f.name}") is not None
                                    else getattr(base, f.name)) for f in dataclasses.fields(ModelConfig)})
    kw = {k: getattr(a, k) for k in ("gpus", "tp", "ep", "moe_experts", "moe_topk", "steps", "warmup", "batch",
                                     "seq", "gen_batch", "prompt_len", "new_tokens", "kv_reserve_gb", "lr", "seed",
                                     "scratch_backup", "decode", "groups", "nccl_cumem", "comm_teardown", "cache_trim",
                                     "moments", "memory_history", "sync_fill", "anchor_precision_aware",
                                     "steady_guard", "steady_tolerance",
                                     "timeout_s", "verify_batch", "verify_len", "out", "device", "store_bind")}
    if a.quick:
        q = quick_overrides()
        for k, v in q.items():
            if getattr(a, k) == getattr(RunConfig(), k):
                kw[k] = v
    variants = None if a.variants is None else tuple(v.strip() for v in a.variants.split(",") if v.strip())
    return RunConfig(model=model, trainer=a.trainer, variants=variants, **kw).validate()


def _model(trainer: str, quick: bool) -> ModelConfig:
    if trainer == "megatron":
        return MEGATRON_QUICK if quick else MEGATRON_MODEL
    return QUICK_MODEL if quick else ModelConfig()


def quick_overrides() -> dict:
    return {"steps": 5, "warmup": 1, "batch": 4, "seq": 256, "gen_batch": 8, "prompt_len": 64, "new_tokens": 32,
            "kv_reserve_gb": 0.5}


def run_variant(cfg: RunConfig, variant: str, log=print) -> dict:
    """Run one variant on cfg.gpus ranks; returns {"ranks": [...], "failed": [...], ...}."""
    os.makedirs(cfg.out, exist_ok=True)
    spec = cfg.worker_spec(variant)
    spec["baseline_pids"] = [p for p in nvml_all_pids() if p != os.getpid()] if cfg.device == "cuda" else []
    spec["baseline_pids"].append(os.getpid())  # the launcher itself (the bench runner holds a context)
    spec["launcher_pid"] = os.getpid()  # ranks (and their rollouts) die with the launcher (PR_SET_PDEATHSIG)
    spec = json.dumps(spec)
    from ebbtide.comm import serve_store  # noqa: PLC0415

    # Served here for the variant's lifetime (ranks only connect): one listener, on store_bind only.
    store = serve_store(bind=cfg.store_bind, timeout=timedelta(seconds=cfg.timeout_s + 60))
    procs = []
    base_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host: Gloo groups listen on loopback
    for r in range(cfg.gpus):
        env = dict(base_env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(cfg.gpus),
                   LOCAL_WORLD_SIZE=str(cfg.gpus), MASTER_ADDR=store.host,
                   MASTER_PORT=str(store.port))
        res = os.path.join(cfg.out, f"{variant}-rank{r}.json")
        logp = os.path.join(cfg.out, f"{variant}-rank{r}.log")
        if os.path.exists(res):
            os.remove(res)
        logf = open(logp, "w")  # noqa: SIM115 (closed below)
        module = TRAINERS[cfg.trainer][0]
        procs.append((r, subprocess.Popen([sys.executable, "-m", module, spec, res], env=env,
                                          stdout=logf, stderr=subprocess.STDOUT, start_new_session=True),
                      res, logp, logf))
    where = f"{cfg.gpus} GPU(s)" if cfg.device == "cuda" else f"{cfg.gpus} CPU rank(s)"
    log(f"colocate: {variant} on {where}, logs in {cfg.out}/{variant}-rank*.log")
    try:
        killed = _wait_all([p for _, p, *_ in procs], cfg.timeout_s)
    finally:  # Ctrl-C or an error here: no rank (nor its rollout) outlives the launcher
        for _, p, *_ in procs:
            if p.poll() is None:
                _kill_group(p)
        del store
    ranks, failed = [], []
    for r, p, res, logp, logf in procs:
        rc = p.wait()
        _reap_group(p.pid)
        logf.close()
        if r in killed:
            failed.append({"rank": r, "rc": rc, "why": killed[r], "log": _tail(logp)})
        try:
            with open(res) as f:
                out = json.load(f)
            os.remove(res)  # its content goes into results.json (fewer files to carry back from a GPU host)
        except (OSError, ValueError) as e:
            out = {"ok": False, "error": f"no result file ({e})"}
        out["rc"] = rc
        ranks.append(out)
        if rc != 0 or not out.get("ok"):
            failed.append({"rank": r, "rc": rc, "why": out.get("error", "").strip().splitlines()[-1:] or "exit code",
                           "log": _tail(logp)})
    return {"ranks": ranks, "failed": failed}


def _checks(ranks: list[dict], warmup: int) -> dict:
    verify = [v for r in ranks for v in r.get("checks", {}).get("verify", [])]
    growth = [growth_check(r.get("memory", []), warmup) for r in ranks]
    by_step: dict = {}
    for v in verify:
        by_step.setdefault(v["step"], set()).add(v.get("trainer_weights_digest"))
    return {
        "correct": all(v["ok"] for v in verify) if verify else None,
        "ranks_in_sync": all(len(d) == 1 for d in by_step.values()) if len(ranks) > 1 and by_step else None,
        "verify": verify,
        "no_growth": all(g["ok"] for g in growth) if all(g["ok"] is not None for g in growth) else None,
        "growth": [{k: g.get(k) for k in ("ok", "growth_bytes", "tolerance", "phase", "why")} for g in growth],
    }


def _goals(res: dict) -> dict:
    v = res["variants"]
    out = {}
    ours = v.get("ebbtide", {}).get("summary")
    for name, info in v.items():
        anchor = info.get("summary")
        if name == "ebbtide" or not (ours and anchor and ours["step_s"]):
            continue
        sp = anchor["step_s"] / ours["step_s"]
        if name == "anchor":
            out["step speed-up vs anchor (goal >= 2x)"] = f"{sp:.2f}x ({'met' if sp >= 2 else 'NOT met'})"
        else:  # the Megatron loop: the whole step, and the step outside train and generate (the overhead)
            o_ours, o_anchor = _overhead(ours), _overhead(anchor)
            out[f"step speed-up vs {name}"] = (f"{sp:.2f}x; overhead (everything but train and generate) "
                                               f"{o_anchor / o_ours:.2f}x ({o_ours * 1e3:.1f} vs "
                                               f"{o_anchor * 1e3:.1f} ms)" if o_ours else f"{sp:.2f}x")
    if ours:
        ctx = v["ebbtide"]["ranks"][0].get("setup", {}).get("context_bytes")
        held = ours["memory"].get("generate", {}).get("trainer_nvml")
        if ctx is not None and held is not None:
            beyond = held - ctx
            out["trainer GPU memory during generation beyond its CUDA context (goal <= 1 GB)"] = (
                f"{beyond / 1e9:.3f} GB ({'met' if beyond <= 1e9 else 'NOT met'}; held {held / 1e9:.3f} GB, "
                f"context {ctx / 1e9:.3f} GB)")
        else:
            out["trainer GPU memory during generation"] = "no NVML per-process reading (see nvml in setup)"
        paths, opt = ours.get("paths_s") or {}, ours["phase_s"].get("optimizer")
        if paths.get("update") and opt:
            r = paths["update"] / opt
            out["backward done -> rollout holds the new weights (goal <= 1.1x the optimizer step)"] = (
                f"{r:.2f}x ({'met' if r <= 1.1 else 'NOT met'}; {paths['update'] * 1e3:.1f} vs {opt * 1e3:.1f} ms)")
            over = _overhead(ours)
            out["everything but train and generate (goal <= 1.15x the optimizer step)"] = (
                f"{over / opt:.2f}x ({'met' if over / opt <= 1.15 else 'NOT met'})")
        if paths.get("restart") is not None:
            r = paths["restart"]
            out["rollout paused -> the first forward (goal <= 20 ms)"] = (
                f"{r * 1e3:.1f} ms ({'met' if r <= 0.02 else 'NOT met'})")
    return out


def _overhead(summary: dict) -> float:
    """Seconds of a step outside the train and generate phases (the median phases' sum)."""
    return sum(t for k, t in summary["phase_s"].items() if k not in ("train", "generate"))


def run(cfg: RunConfig, log=print) -> dict:
    """Run every requested variant and build the results (also written to cfg.out/results.json)."""
    cfg.validate()
    if cfg.trainer == "megatron" and importlib.util.find_spec("megatron") is None:
        raise UnsupportedError("--trainer megatron needs megatron-core (pip install megatron-core==0.16.1)")
    import torch  # noqa: PLC0415

    have = torch.cuda.device_count()
    if cfg.device == "cuda" and have < cfg.gpus:
        raise InvalidArgumentError(f"--gpus {cfg.gpus} but {have} CUDA device(s) are visible")
    results = {"config": dataclasses.asdict(cfg), "variants": {}}
    for variant in cfg.variants:
        if variant in NEEDS_TMS and importlib.util.find_spec("torch_memory_saver") is None:
            results["variants"][variant] = {"why": "not installed (torch_memory_saver)"}
            continue
        vr = run_variant(cfg, variant, log)
        if not vr["failed"]:
            vr["summary"] = summarize(vr["ranks"], cfg.warmup)
        else:
            vr["why"] = "; ".join(f"rank {f['rank']}: {f['why']}" for f in vr["failed"])
            for f in vr["failed"]:
                log(f"colocate: {variant} rank {f['rank']} FAILED (exit {f['rc']}): {f['why']}\n{f['log']}")
        vr["checks"] = _checks(vr["ranks"], cfg.warmup)
        results["variants"][variant] = vr
    results["goals"] = _goals(results)
    results["steady"] = steady_check(results, cfg.steady_tolerance)
    os.makedirs(cfg.out, exist_ok=True)
    png = os.path.join(cfg.out, "timeline.png")
    results["timeline"] = png if not (why := plot_timeline(results, png)) else f"not drawn: {why}"
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return results


def run_loop(*, gpus: int = 1, out: str, quick: bool = False, log=print, **overrides) -> dict:
    """Run the example at its default size (or the ``quick`` size: a 0.12 B-param model, 5 steps) on ``gpus``
    GPUs, every variant, results and logs in ``out``; ``overrides``: other RunConfig fields (``trainer="megatron"``
    picks the Megatron loop and its sizes). Returns the results (``results["config"]`` is the configuration that
    ran). Bad values raise InvalidArgumentError before anything starts."""
    base = {"model": _model(overrides.get("trainer", "toy"), quick), **(quick_overrides() if quick else {})}
    cfg = RunConfig(**{**base, "gpus": gpus, "out": out, **overrides})
    return run(cfg, log=log)


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        results = run(cfg)
    except (InvalidArgumentError, UnsupportedError) as e:
        print(f"python -m ebbtide.colocate: {e}", file=sys.stderr)
        return 2
    print(format_report(results))
    print(f"\nresults: {cfg.out}/results.json, timeline: {results['timeline']}")
    # the ebbtide variant decides; a run without it (anchors alone) succeeds when every variant that ran is correct
    ran = [n for n in cfg.variants if "not installed" not in results["variants"][n].get("why", "")]
    names = ["ebbtide"] if "ebbtide" in cfg.variants else ran
    ok = bool(names) and all(bool(results["variants"][n].get("summary"))
                             and results["variants"][n].get("checks", {}).get("correct") is True for n in names)
    if not ok:
        return 1
    slower = [c for c in results["steady"] if not c["ok"]]
    if slower:
        what = "; ".join(f"{c['phase']} {c['ratio']:.3f}x {c['anchor']}'s" for c in slower)
        print(f"python -m ebbtide.colocate: ebbtide's steady phases are slower than the anchors' by more than "
              f"{cfg.steady_tolerance:.0%}: {what} (--steady-guard warn reports this without failing)",
              file=sys.stderr)
        if cfg.steady_guard == "error":
            return 3
    return 0
