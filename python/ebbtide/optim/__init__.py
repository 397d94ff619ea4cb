"""ebbtide.optim — Adam/AdamW on the CPU (SIMD kernel, own thread pool) and the pipelined offloaded optimizers.

``CPUAdam``: a ``torch.optim.Optimizer`` over CPU fp32 masters (exact or fast numerics, bf16 grads in, bf16 copy
out). ``OffloadedAdam``: bf16 params on the GPU, fp32 master + state in host memory, one bucketed pipeline
(gradient download, CPU step, bf16 upload) per step. ``ShardedAdam``: the same over one rank's set of local
``Shard``s (a sharded data-parallel trainer's: Megatron's distributed optimizer, FSDP2), with the hooks its
integration supplies. Importing this subpackage imports torch.

All check their input the same way (``_validate.py``): a param passed twice or overlapping another, a
hyper-parameter of the wrong type or range in any group (checked for every group before any group steps), and
loaded state whose tensors do not have their param's exact shape raise InvalidArgumentError and change nothing.
"""
from .cpu_adam import CPUAdam, available_isas
from .offloaded import OffloadedAdam
from .sharded import Shard, ShardedAdam
from .. import settings as _settings

_settings.check_component("optim")  # EBBTIDE_CPU_ISA and EBBTIDE_ADAM_TASKS_PER_THREAD fail at import

__all__ = ["CPUAdam", "OffloadedAdam", "ShardedAdam", "Shard", "available_isas"]
