"""The anchors: what users run today, re-implemented where needed, so every benchmark and the colocated loop put
ebbtide beside the same thing, measured in the same run: ``megatron`` (Megatron-core's GPT, optimizer configs,
slime's HybridDeviceOptimizer setup and its TensorBackuper), ``sync`` (slime's weight update and its rollout side,
the torch formula through a host buffer), ``quant`` (the torch formulas for FP8 and INT4), ``tms``
(torch_memory_saver as slime configures it), ``groups`` (destroy and re-create the process groups), ``optim``
(torch's fused AdamW on CPU masters with plain copies). Nothing in the library's components imports this
package; it imports only public names of the library."""
