"""Strategy selection and the NCCL environment check: pure functions over plain facts, unit-tested without GPUs.

Policies:
- ``suspend`` (native ``ncclCommSuspend``/``ncclCommResume`` through torch's ``Backend.suspend()/resume()``) is
  chosen only where every precondition holds: torch >= 2.12 exposes the calls, the loaded NCCL is >= 2.29.7,
  cuMem is on (without it NCCL's memory manager tracks nothing and suspend frees nothing), the communicator is not
  split-shared (NCCL refuses those), and it exists already (suspending a lazily-uncreated comm raises).
- ``destroy`` (tear the backend down, rebuild it from the replay journal) is the fallback everywhere else.
- ``keep`` leaves CPU-only (Gloo) groups untouched unless the caller asked for them.
- Ranks agree before acting: the choice of a group is the weakest choice of any of its members
  (:func:`combine`), because suspend is collective over the group's ranks.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

SUSPEND = "suspend"
DESTROY = "destroy"
KEEP = "keep"
STRATEGIES = (SUSPEND, DESTROY, KEEP)
REQUESTS = ("auto", SUSPEND, DESTROY)

MIN_TORCH_SUSPEND = (2, 12)
MIN_NCCL_SUSPEND = (2, 29, 7)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What is known about one group on one rank when release() starts."""

    accelerator: bool  # the group has an accelerator (NCCL) backend; False: CPU-only (Gloo)
    torch_version: tuple[int, int]  # (major, minor)
    nccl_version: tuple[int, int, int] | None  # runtime NCCL; None where there is none
    backend_has_suspend: bool  # the backend object exposes suspend()/resume()
    cumem: bool | None  # cuMem allocations on (None: unknown, treated as off)
    split_share: bool  # communicator shares resources with its split parent
    comm_initialized: bool  # the NCCL communicator exists already (not lazily pending)
    include_cpu: bool = False  # the caller asked to release CPU-only groups too


def suspend_blockers(f: Facts) -> list[str]:
    """Every reason native suspend cannot serve this group (empty: it can)."""
    why = []
    if not f.accelerator:
        why.append("CPU-only group")
    if f.torch_version < MIN_TORCH_SUSPEND:
        why.append(f"torch {f.torch_version[0]}.{f.torch_version[1]} < 2.12")
    if f.nccl_version is None:
        why.append("no NCCL")
    elif f.nccl_version < MIN_NCCL_SUSPEND:
        why.append("NCCL {}.{}.{} < 2.29.7".format(*f.nccl_version))
    if not f.backend_has_suspend:
        why.append("backend has no suspend()")
    if not f.cumem:
        why.append("cuMem off (NCCL_CUMEM_ENABLE=0)" if f.cumem is False else "cuMem state unknown")
    if f.split_share:
        why.append("split-shared communicator")
    if not f.comm_initialized:
        why.append("communicator not created yet")
    return why


def select_strategy(f: Facts, requested: str = "auto") -> tuple[str, str]:
    """(strategy, reason) for one group on one rank. ``requested`` is "auto", "suspend" or "destroy"; asking for
    suspend where it cannot work falls back to destroy and says why (never a GPU fault)."""
    if requested not in REQUESTS:
        raise ValueError(f"strategy must be one of {REQUESTS}, not {requested!r}")
    if not f.accelerator:
        if not f.include_cpu:
            return KEEP, "CPU-only group (pass include_cpu=True to release it)"
        return DESTROY, "CPU-only group"
    if requested == DESTROY:
        return DESTROY, "requested"
    blockers = suspend_blockers(f)
    if not blockers:
        return SUSPEND, "native NCCL suspend available"
    return DESTROY, "; ".join(blockers)


def combine(choices: Iterable[str]) -> str:
    """The group-wide strategy from each member's local choice: keep < suspend < destroy (weakest wins, so a
    collective suspend never runs on some members only)."""
    order = {KEEP: 0, SUSPEND: 1, DESTROY: 2}
    best = KEEP
    for c in choices:
        if order[c] > order[best]:
            best = c
    return best


def cumem_enabled(env: Mapping[str, str], nccl_version: tuple[int, int, int] | None) -> bool | None:
    """Whether NCCL allocates with cuMem: NCCL_CUMEM_ENABLE=0/1 decides; unset (or -2, auto) means on for
    NCCL >= 2.19 on drivers that support it, which is every driver torch 2.11+ runs on."""
    v = env.get("NCCL_CUMEM_ENABLE", "").strip()
    if v in ("0",):
        return False
    if v in ("1",):
        return True
    if nccl_version is None:
        return None
    return nccl_version >= (2, 19, 0)


def env_warnings(env: Mapping[str, str], nccl_version: tuple[int, int, int] | None,
                 torch_version: tuple[int, int]) -> list[tuple[str, str]]:
    """(variable, message) for every setting that defeats or weakens release. Checked once at install()."""
    out: list[tuple[str, str]] = []
    suspend_possible = (torch_version >= MIN_TORCH_SUSPEND and nccl_version is not None
                        and nccl_version >= MIN_NCCL_SUSPEND)
    if env.get("NCCL_CUMEM_ENABLE", "").strip() == "0" and suspend_possible:
        out.append(("NCCL_CUMEM_ENABLE",
                    "NCCL_CUMEM_ENABLE=0: NCCL's memory manager tracks nothing, so native suspend would free "
                    "nothing; ebbtide uses destroy-and-rebuild instead (slower reload). Unset it or set it to 1."))
    if env.get("NCCL_COMM_SPLIT_SHARE_RESOURCES", "").strip() == "1":
        out.append(("NCCL_COMM_SPLIT_SHARE_RESOURCES",
                    "NCCL_COMM_SPLIT_SHARE_RESOURCES=1: split communicators share their parent's buffers, so "
                    "native suspend refuses them and releasing a child frees little until its parent goes too. "
                    "Unset it."))
    nvls = env.get("NCCL_NVLS_ENABLE", "").strip()
    if nvls not in ("0",) and suspend_possible:
        out.append(("NCCL_NVLS_ENABLE",
                    "NVLS is not disabled: native suspend leaves NVLS multicast buffers resident (nccl#2337). "
                    "Set NCCL_NVLS_ENABLE=0 or install(strategy='destroy') to free them."))
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
