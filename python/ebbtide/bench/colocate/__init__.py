"""ebbtide.bench.colocate — the colocated RL loop as a benchmark harness: a trainer and a rollout process share each
GPU and hand the memory back and forth every step, measured beside the same loop on today's tools (the anchors of
``ebbtide.anchors``). ``ebbtide colocate`` runs it (also ``python -m ebbtide.bench.colocate``); the bench suites
``colocate``, ``megatron`` and ``steady`` use it. The public API alone, in a few hundred lines, is
``examples/colocate/``.

Modules: ``options`` (every word the options accept; imports nothing), ``config`` (``RunConfig``, the model shapes),
``launcher`` (arguments, processes, results, ``run_loop``), ``trainer`` / ``mtrainer`` (a rank of the toy and of the
Megatron-core trainer; ``mvariants``: the Megatron variants), ``rollout`` (the rollout process and its client),
``sync`` (the weight sync's two ends), ``rank`` (what every rank shares: data, verification, alignment),
``measure`` (phases, NVML memory, summaries, checks, the table and the timeline). The models are
``ebbtide.testing.models``. Importing this package imports nothing; its modules import torch, except ``options``,
``measure`` and ``_procs``.
"""
