"""ebbtide's CPU kernel as the CPU optimizer of Megatron-core's ``HybridDeviceOptimizer``.

Megatron-core builds its offloaded optimizer (``--optimizer-cpu-offload``) as
``HybridDeviceOptimizer(..., cpu_optimizer_cls=CPUAdam, ...)`` where ``CPUAdam`` is the module-level name
``megatron.core.optimizer.CPUAdam`` (torch.optim.AdamW) and every CPU optimizer is built as
``cpu_optimizer_cls(param_groups)`` over fp32 pinned masters, one per parameter when D2H/H2D overlap is on.
``install()`` points that name at :class:`MegatronCPUAdam`, which accepts the keys HDO passes (``bias_correction``,
``fused``, ...) and shares one native thread pool across all those instances. What changes: the CPU step (SIMD
kernel, own threads independent of OMP_NUM_THREADS, ``mode`` exact or fast). What stays Megatron's: its transfers
(fp32 masters H2D, per-parameter optimizers); for the pipelined path use :class:`ebbtide.optim.OffloadedAdam`.

The rest of ``ebbtide.integrations.megatron`` replaces Megatron's optimizer (and brings offload, groups and the
sharded form); this module is the one-line change for a trainer that keeps Megatron's HybridDeviceOptimizer as it is
configured today (slime's scripts) and wants only the faster CPU step.

    from ebbtide.integrations.megatron import hybrid_device
    hybrid_device.install(mode="fast", threads=None)   # before get_megatron_optimizer(...)
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ...optim import CPUAdam

try:
    import megatron.core.optimizer as mco
except ImportError as e:  # pragma: no cover - the package is imported through integrations.megatron
    raise ImportError(f"ebbtide.integrations.megatron needs megatron-core (tested with 0.16.1): {e}") from e

__all__ = ["MegatronCPUAdam", "install", "uninstall"]

_SAVED: dict[str, object] = {}


class MegatronCPUAdam(CPUAdam):
    """CPUAdam (AdamW form) with the constructor HybridDeviceOptimizer calls. Subclasses set ``mode``/``threads``."""

    mode = "fast"
    threads = None

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, bias_correction=True, fused=None, foreach=None, capturable=False,
                 differentiable=False, **_megatron_group_keys):
        if not bias_correction:
            raise UnsupportedError("MegatronCPUAdam: bias_correction=False is not supported")
        if capturable or differentiable:
            raise UnsupportedError("MegatronCPUAdam: capturable/differentiable are not supported")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=True,
                         amsgrad=amsgrad, maximize=maximize, mode=type(self).mode, threads=type(self).threads)


def install(mode: str = "fast", threads: int | None = None) -> type:
    """Make Megatron-core's CPU-offload path use ebbtide's kernel. Returns the class installed."""
    if not hasattr(mco, "CPUAdam"):
        raise UnsupportedError("this megatron-core has no megatron.core.optimizer.CPUAdam to replace")
    cls = type("EbbtideMegatronCPUAdam", (MegatronCPUAdam,), {"mode": mode, "threads": threads})
    _SAVED.setdefault("CPUAdam", mco.CPUAdam)
    mco.CPUAdam = cls
    return cls


def uninstall() -> None:
    """Restore Megatron-core's own CPU optimizer class."""
    if "CPUAdam" in _SAVED:
        mco.CPUAdam = _SAVED.pop("CPUAdam")
