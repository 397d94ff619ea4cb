"""Every word the colocated loop's options accept, in one place: the launcher validates against these, the trainer
ranks and the rollout refuse anything else, the command line offers them as choices. Imports nothing (no torch), so
argument handling and its tests stay light; tests/bench/test_colocate_options.py checks that in a fresh process."""
from __future__ import annotations

__all__ = ["TRAINERS", "TOY_VARIANTS", "MEGATRON_VARIANTS", "FSDP_VARIANTS", "NEEDS_TMS", "PRELOADED_TRAINERS",
           "SCRATCH_BACKUPS", "DECODE_MODES", "GROUP_MODES", "CUMEM_MODES", "MOMENTS", "TEARDOWNS", "CACHE_TRIMS",
           "SYNC_FILLS", "STEADY_GUARDS", "ON_OFF", "CODECS", "IPC_MODES", "ARCHS", "STEP_BYTES"]

# The toy trainer (the loop's own small model): ebbtide and the same loop on today's tools.
TOY_VARIANTS = ("ebbtide", "anchor")
# The Megatron-core trainer: ebbtide's adapter, slime's colocated configuration, slime's with
# ebbtide.compat.torch_memory_saver swapped in, Megatron's GPU optimizer under torch_memory_saver.
MEGATRON_VARIANTS = ("ebbtide", "slime", "slime-ebbtide", "gpu-tms")
# The FSDP2 trainer (a transformers Qwen3 under fully_shard): ebbtide's adapter, verl's paths, AReaL's
# torch_memory_saver preload with CPU backup, FSDP2's CPUOffloadPolicy with torch's AdamW on the CPU.
FSDP_VARIANTS = ("ebbtide", "verl", "tms", "cpu-offload")
# --trainer NAME -> (the module each rank runs, its variants)
TRAINERS = {"toy": ("ebbtide.bench.colocate.trainer", TOY_VARIANTS),
            "megatron": ("ebbtide.bench.colocate.mtrainer", MEGATRON_VARIANTS),
            "fsdp": ("ebbtide.bench.colocate.ftrainer", FSDP_VARIANTS)}
# the variants that run on the torch_memory_saver package (the others need only ebbtide): their rollouts, and the
# trainers of "anchor", "slime", "gpu-tms" and "tms"
NEEDS_TMS = ("anchor", "slime", "gpu-tms", "verl", "tms", "cpu-offload")
# (trainer, variant) whose trainer ranks start under torch_memory_saver's preload hook with every allocation backed
# up to the CPU, as AReaL starts its trainer (every other rank starts without LD_PRELOAD)
PRELOADED_TRAINERS = (("fsdp", "tms"),)

# the ebbtide rollout's untagged allocations across its pause: kept resident, backed up to the CPU, discarded
SCRATCH_BACKUPS = ("keep", "cpu", "none")
# the rollout's per-token decode: one eager forward, or a step captured once in a CUDA graph and replayed
DECODE_MODES = ("eager", "cuda-graph")
# the rollout's model: the toy trainer's TinyLM, Megatron's architecture (MegatronGPT), or transformers' Qwen3
ARCHS = ("tiny", "megatron", "qwen3")
# the steady phases' guard: exit status 3, or a warning, when ebbtide's are slower than an anchor's
STEADY_GUARDS = ("error", "warn")
ON_OFF = ("on", "off")

# ebbtide's Megatron trainer, the first four also its FSDP trainer (the anchors run their own projects' settings
# whatever these say; config.TRAINER_OPTIONS says which trainer takes which):
GROUP_MODES = ("lazy", "eager", "used")  # when its communicators are made (at first use, creation, reload)
CUMEM_MODES = ("off", "on")  # NCCL_CUMEM_ENABLE
MOMENTS = ("fp32", "bf16")  # Adam's moments in its host state
TEARDOWNS = ("background", "joined")  # where its group release tears the communicators down
CACHE_TRIMS = ("auto", "step", "offload")  # when it empties torch's cache
SYNC_FILLS = ("auto", "streamed", "after")  # when it fills the weight update

# The weight sync's codecs over the toy loop's shared host buffer (ebbtide.sync, or the torch formula per tensor)
# and its modes over CUDA IPC in the Megatron and FSDP loops (ebbtide.sync, slime's update, verl's update).
CODECS = ("ebbtide", "torch")
IPC_MODES = ("ebbtide", "slime", "verl")

# One CPU Adam step's bytes through host memory per parameter: fp32 master read + write (8), both moments read +
# write (16 in fp32, 8 in bf16), the bf16 gradient read (2) and the bf16 parameter written back (2); the DMA
# traffic of the gradient download and the parameter upload (another ~4) is not counted, so the floor is a lower
# bound.
STEP_BYTES = {"fp32": 28, "bf16": 20}
