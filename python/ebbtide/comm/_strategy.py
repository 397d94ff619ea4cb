"""Strategy selection and the NCCL environment check: pure functions over plain facts, unit-tested without GPUs.

Policies:
- ``auto`` (the default) and ``destroy`` select destroy-and-rebuild (tear the backend down, rebuild it from the
  replay journal) for every device group: the strategy this project's GPU tests run.
- ``keep`` leaves CPU-only (Gloo) groups untouched unless the caller asked for them.
- Native NCCL suspend/resume is not selectable (:data:`SUSPEND_UNAVAILABLE`): it has never run on a GPU here. Its
  design, and what must hold before it comes back, is in docs/comm.md ("Native suspend: not selectable yet").
- Ranks agree before acting: the choice of a group is the strongest choice of any of its members (:func:`combine`),
  so a group is torn down on all its members or on none.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from ..errors import InvalidArgumentError, UnsupportedError

DESTROY = "destroy"
KEEP = "keep"
REQUESTS = ("auto", DESTROY)

SUSPEND_UNAVAILABLE = ("ebbtide.comm: strategy 'suspend' (native NCCL suspend/resume) is not available: it has not "
                       "run on a GPU yet, so it is not selectable (docs/comm.md, 'Native suspend'). Use "
                       "strategy='auto' (destroy-and-rebuild).")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What is known about one group on one rank when release() starts."""

    accelerator: bool  # the group has an accelerator (NCCL) backend; False: CPU-only (Gloo)
    include_cpu: bool = False  # the caller asked to release CPU-only groups too


def check_request(requested: str) -> None:
    """Raise where ``requested`` is not a selectable strategy (UnsupportedError for native suspend)."""
    if requested == "suspend":
        raise UnsupportedError(SUSPEND_UNAVAILABLE)
    if requested not in REQUESTS:
        raise InvalidArgumentError(f"strategy must be one of {REQUESTS}, not {requested!r}")


AUTO_REASON = "auto: destroy-and-rebuild"


def select_strategy(f: Facts, requested: str = "auto") -> tuple[str, str]:
    """(strategy, reason) for one group on one rank. ``requested`` is "auto" or "destroy": both destroy device
    groups; CPU-only groups are kept unless ``f.include_cpu``."""
    check_request(requested)
    if not f.accelerator:
        if not f.include_cpu:
            return KEEP, "CPU-only group (pass include_cpu=True to release it)"
        return DESTROY, "CPU-only group"
    return (DESTROY, "requested") if requested == DESTROY else (DESTROY, AUTO_REASON)


def combine(choices: Iterable[str]) -> str:
    """The group-wide strategy from each member's local choice: keep < destroy (a group any member releases is
    released by every member)."""
    return DESTROY if DESTROY in set(choices) else KEEP


def env_warnings(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, message) for every setting that defeats or weakens release. Checked once at install()."""
    out: list[tuple[str, str]] = []
    if env.get("NCCL_COMM_SPLIT_SHARE_RESOURCES", "").strip() == "1":
        out.append(("NCCL_COMM_SPLIT_SHARE_RESOURCES",
                    "NCCL_COMM_SPLIT_SHARE_RESOURCES=1: split communicators share their parent's buffers, so "
                    "releasing a child frees little until its parent goes too. Unset it."))
    if env.get("NCCL_GRAPH_REGISTER", "").strip() not in ("", "0"):
        out.append(("NCCL_GRAPH_REGISTER",
                    "NCCL_GRAPH_REGISTER is on: buffers registered during CUDA-graph capture belong to a "
                    "communicator that release() destroys; recapture graphs after reload(), and set "
                    "NCCL_GRAPH_REGISTER=0 when graph replay is combined with same-address memory pause/resume."))
    if env.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "").strip() == "1":
        out.append(("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
                    "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 registers allocator segments with every "
                    "communicator; rebuilt communicators start unregistered and remapped memory may be stale. "
                    "Unset it."))
    return out
