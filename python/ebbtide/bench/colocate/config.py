"""The colocated loop's configuration: ``RunConfig`` (every option, validated before anything starts), the model
shapes, and the spec each trainer rank receives. Bad values raise ``ebbtide.InvalidArgumentError`` naming the
option; the words each option accepts are ``options``'."""
from __future__ import annotations

import dataclasses

from ...errors import InvalidArgumentError
from ...testing.models import ModelConfig
from .measure import STEADY_TOLERANCE
from .options import (CACHE_TRIMS, CUMEM_MODES, DECODE_MODES, GROUP_MODES, MOMENTS, ON_OFF, SCRATCH_BACKUPS,
                      STEADY_GUARDS, SYNC_FILLS, TEARDOWNS, TRAINERS)

__all__ = ["RunConfig", "QUICK_MODEL", "MEGATRON_MODEL", "MEGATRON_QUICK", "FSDP_MODEL", "FSDP_QUICK", "quick_overrides",
           "trainer_defaults", "model_for", "CHOICES", "TRAINER_OPTIONS"]

GiB = 1 << 30
QUICK_MODEL = ModelConfig(vocab=8192, d_model=1024, n_layers=8, n_heads=8, d_ff=4096, max_seq=512)  # ~0.12 B params
# Megatron GPT (untied output layer, biases): 2*V*d + L*(12 d^2 + 13 d) params. ~1.34 B (the megatron suite's
# default shape); --quick ~0.12 B.
MEGATRON_MODEL = ModelConfig(vocab=32768, d_model=2048, n_layers=24, n_heads=16, d_ff=8192, max_seq=2048)
MEGATRON_QUICK = ModelConfig(vocab=32768, d_model=1024, n_layers=4, n_heads=16, d_ff=4096, max_seq=512)
# transformers' Qwen3 (ebbtide.testing.qwen3: head_dim d_model / n_heads, n_heads / 2 KV heads, tied embeddings):
# Qwen3-1.7B's shape, 1.72 B params; --quick 0.13 B
FSDP_MODEL = ModelConfig(vocab=151936, d_model=2048, n_layers=28, n_heads=16, d_ff=6144, max_seq=4096)
FSDP_QUICK = ModelConfig(vocab=32000, d_model=1024, n_layers=8, n_heads=8, d_ff=3072, max_seq=512)

# option -> the words it accepts (checked in this order)
CHOICES = {"scratch_backup": SCRATCH_BACKUPS, "decode": DECODE_MODES, "steady_guard": STEADY_GUARDS,
            "groups": GROUP_MODES, "nccl_cumem": CUMEM_MODES, "moments": MOMENTS, "comm_teardown": TEARDOWNS,
            "cache_trim": CACHE_TRIMS, "sync_fill": SYNC_FILLS, "anchor_precision_aware": ON_OFF}
# options only some trainers take: option -> (its flag, the trainers that take it, why the others do not); the
# others refuse any value but the default
TRAINER_OPTIONS = {
    "cache_trim": ("--cache-trim", ("megatron",), " (the toy one trims offloading, the FSDP one in its offload)"),
    "comm_teardown": ("--comm-teardown", ("megatron", "fsdp"),
                      " (the toy trainer releases its groups with the teardown joined)"),
    "sync_fill": ("--sync-fill", ("megatron",), ""),
    "memory_history": ("--memory-history", ("megatron",), ""),
    "anchor_precision_aware": ("--anchor-precision-aware", ("megatron",), ""),
    "moments": ("--moments bf16", ("megatron", "fsdp"), " (the toy trainer's optimizer keeps fp32 moments)"),
}
# what a trainer changes in the defaults (an option left at RunConfig's default takes this value)
_TRAINER_DEFAULTS = {"fsdp": {"decode": "eager"}}  # the rollout's HF model decodes with eager forwards


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
    # dense) or after the step ("after"; "auto" = after: docs/results.md has the measured reason)
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
        self._validate_sizes()
        bad = [v for v in self.variants if v not in known]
        if bad or not self.variants or len(set(self.variants)) != len(self.variants):
            raise InvalidArgumentError(f"variants must be distinct names from {known} (trainer {self.trainer}), "
                                       f"got {self.variants!r}")
        if self.trainer == "megatron":
            self._validate_megatron()
        elif self.tp != 1 or self.ep != 1 or self.moe_experts:
            raise InvalidArgumentError(f"--tp, --ep and --moe-experts: each an option of --trainer megatron (the toy "
                                       f"trainer is dense and data parallel only); got --tp {self.tp} --ep {self.ep} "
                                       f"--moe-experts {self.moe_experts}")
        if self.device not in ("cuda", "cpu"):
            raise InvalidArgumentError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cpu" and self.variants != ("ebbtide",):
            raise InvalidArgumentError("device 'cpu' (the orchestration check) runs the ebbtide variant only: "
                                       "pass --variants ebbtide")
        if not isinstance(self.store_bind, str) or not self.store_bind.strip():
            raise InvalidArgumentError(f"store_bind must be a host name or an IP address, got {self.store_bind!r}")
        if (not isinstance(self.steady_tolerance, (int, float)) or isinstance(self.steady_tolerance, bool)
                or not 0 <= self.steady_tolerance <= 1):
            raise InvalidArgumentError(f"steady_tolerance must be a fraction in [0, 1], got {self.steady_tolerance!r}")
        if not isinstance(self.memory_history, bool):
            raise InvalidArgumentError(f"memory_history must be a bool, got {self.memory_history!r}")
        for name, words in CHOICES.items():
            if getattr(self, name) not in words:
                raise InvalidArgumentError(f"{name} must be one of {words}, got {getattr(self, name)!r}")
        default = RunConfig()
        for name, (flag, trainers, why) in TRAINER_OPTIONS.items():
            if self.trainer not in trainers and getattr(self, name) != getattr(default, name):
                raise InvalidArgumentError(f"{flag} is an option of --trainer {' or '.join(trainers)}{why}")
        if self.trainer == "fsdp":
            self._validate_fsdp()
        if self.sync_fill == "streamed" and (self.gpus > 1 or self.moe_experts):
            raise InvalidArgumentError("--sync-fill streamed needs one GPU and a dense model (the distributed "
                                       "optimizer and the TP/EP gathers fill after the step)")
        return self

    def _validate_sizes(self) -> None:
        ints = {"gpus": 1, "tp": 1, "ep": 1, "moe_experts": 0, "moe_topk": 1, "steps": 1, "warmup": 0, "batch": 1,
                "seq": 2, "gen_batch": 1, "prompt_len": 1, "new_tokens": 1, "verify_batch": 1, "verify_len": 1,
                "timeout_s": 1}
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

    def _validate_megatron(self) -> None:
        if self.device != "cuda":
            raise InvalidArgumentError("--trainer megatron needs CUDA (Megatron's DDP buffers and rotary "
                                       "embeddings allocate on the GPU): there is no --device cpu run of it")
        if self.gpus % self.tp:
            raise InvalidArgumentError(f"--tp {self.tp} must divide --gpus {self.gpus} (the rest is data parallel)")
        for name in ("n_heads", "d_ff", "vocab"):
            if getattr(self.model, name) % self.tp:
                raise InvalidArgumentError(f"--tp {self.tp} must divide the model's {name} "
                                           f"({getattr(self.model, name)}): Megatron splits it between the ranks")
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

    def _validate_fsdp(self) -> None:
        if self.decode != "eager":
            raise InvalidArgumentError(f"--trainer fsdp's rollout (transformers' Qwen3) decodes with eager forwards: "
                                       f"--decode {self.decode} is not available (pass --decode eager)")
        m = self.model
        if m.n_heads % 2 or m.head_dim % 2:
            raise InvalidArgumentError(f"--trainer fsdp builds a Qwen3 with n_heads / 2 KV heads of head_dim "
                                       f"d_model / n_heads, both even (rotary halves): got n_heads {m.n_heads}, "
                                       f"head_dim {m.head_dim}")
        if self.device == "cuda" and self.gpus > 1:
            raise InvalidArgumentError(f"--trainer fsdp runs on one GPU (--gpus {self.gpus} given); FSDP2 over "
                                       "several ranks, each with its rollout, runs on the CPU: --device cpu --gpus N")

    def worker_spec(self, variant: str) -> dict:
        """What one trainer rank of ``variant`` is told (JSON: the launcher passes it on the command line)."""
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


def model_for(trainer: str, quick: bool) -> ModelConfig:
    """The default model shape of ``trainer`` (``quick``: the small one)."""
    if trainer == "megatron":
        return MEGATRON_QUICK if quick else MEGATRON_MODEL
    if trainer == "fsdp":
        return FSDP_QUICK if quick else FSDP_MODEL
    return QUICK_MODEL if quick else ModelConfig()


def trainer_defaults(trainer: str) -> dict:
    """The options ``trainer`` runs at other values than RunConfig's defaults, where none is given."""
    return dict(_TRAINER_DEFAULTS.get(trainer, {}))


def quick_overrides() -> dict:
    """The --quick run's sizes (where a flag does not name another value)."""
    return {"steps": 5, "warmup": 1, "batch": 4, "seq": 256, "gen_batch": 8, "prompt_len": 64, "new_tokens": 32,
            "kv_reserve_gb": 0.5}
