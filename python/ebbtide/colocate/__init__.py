"""ebbtide.colocate — the end-to-end colocated RL example: a trainer and a rollout process share the GPU(s) and
hand the memory back and forth every step, measured against the same loop on today's tools.

    python -m ebbtide.colocate --gpus 1          # or --gpus 2 (data parallel through ebbtide.comm)

Pieces: ``model`` (a small decoder-only transformer in plain PyTorch, KV cache, greedy decode), ``sync`` (FP8
weight sync through a shared pinned buffer, by ``ebbtide.sync``), ``trainer`` / ``rollout`` (the two processes),
``measure`` (phases, NVML memory, checks, table, timeline), ``launcher`` (argument handling, processes, results).
Importing this subpackage imports torch.
"""
from .launcher import QUICK_MODEL, RunConfig, main, parse_args, run, run_loop
from .measure import PHASES, format_report, growth_check, summarize
from .model import GraphDecoder, KVCache, ModelConfig, TinyLM, greedy_decode
from .sync import RolloutSync, SharedHostBuffer, TrainerSync, sync_plan

__all__ = ["RunConfig", "parse_args", "run", "run_loop", "main", "QUICK_MODEL", "PHASES", "format_report",
           "growth_check", "summarize", "ModelConfig", "TinyLM", "KVCache", "greedy_decode", "GraphDecoder",
           "TrainerSync", "RolloutSync", "SharedHostBuffer", "sync_plan"]
