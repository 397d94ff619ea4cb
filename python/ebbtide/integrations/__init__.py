"""ebbtide.integrations — adapters that put a training framework on ebbtide (``ebbtide.integrations.megatron``).
Each adapter imports its framework only when imported itself."""
