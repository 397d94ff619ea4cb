"""ebbtide.integrations — adapters to other projects: a training framework on ebbtide
(``ebbtide.integrations.megatron``: groups, memory, the optimizer, HybridDeviceOptimizer's CPU step;
``ebbtide.integrations.fsdp``: FSDP2 modules, their shards on ``ebbtide.optim.ShardedAdam``) and a serving
engine fed by ebbtide.sync (``ebbtide.integrations.sglang``: request forms, senders, the custom weight loader).
Each adapter imports its framework only when imported itself (SGLang: only where it is installed). ``names``
(``served_names``: a Megatron model's parameter names as a serving engine's copy takes them) sits beside the
Megatron package rather than in it because the rollout side, which has no megatron-core, needs it too, and
importing ``integrations.megatron`` imports megatron-core. The adapters depend on the components and sync; nothing
under ``ebbtide.optim``, ``memory``, ``comm``, ``quant`` or ``sync`` imports them."""
