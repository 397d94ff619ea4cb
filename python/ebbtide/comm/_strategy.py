"""Strategy selection and the NCCL environment check: pure functions over plain facts, unit-tested without GPUs.

Policies:
- ``auto`` selects only what has run on a GPU in this project's tests: ``destroy`` (tear the backend down, rebuild
  it from the replay journal) for every device group.
- ``suspend`` (native ``ncclCommSuspend``/``ncclCommResume`` through torch's ``Backend.suspend()/resume()``) is
  opt-in (``install(strategy="suspend")``) because it has not run on a GPU here. Asking for it where the versions
  lack it (torch < 2.12, NCCL < 2.29.7 or no NCCL) is an :class:`~ebbtide.errors.UnsupportedError`, at install()
  and at release() before anything is detached. Where the versions have it, a group takes it only where every other
  precondition holds: cuMem is on (without it NCCL's memory manager tracks nothing and suspend frees nothing), the
  communicator is not split-shared (NCCL refuses those), the backend exposes the calls, and the communicator exists
  already (suspending a lazily-uncreated comm raises); otherwise that group is destroyed and the report says why.
- ``keep`` leaves CPU-only (Gloo) groups untouched unless the caller asked for them.
- Ranks agree before acting: the choice of a group is the weakest choice of any of its members
  (:func:`combine`), because suspend is collective over the group's ranks.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from ..errors import UnsupportedError

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


def version_blockers(torch_version: tuple[int, int], nccl_version: tuple[int, int, int] | None) -> list[str]:
    """Why this process's torch/NCCL cannot suspend at all (empty: the versions have it)."""
    why = []
    if torch_version < MIN_TORCH_SUSPEND:
        why.append(f"torch {torch_version[0]}.{torch_version[1]} < 2.12")
    if nccl_version is None:
        why.append("no NCCL")
    elif nccl_version < MIN_NCCL_SUSPEND:
        why.append("NCCL {}.{}.{} < 2.29.7".format(*nccl_version))
    return why


def check_suspend_supported(torch_version: tuple[int, int], nccl_version: tuple[int, int, int] | None) -> None:
    """Raise UnsupportedError where native suspend was asked for and the versions lack it."""
    why = version_blockers(torch_version, nccl_version)
    if why:
        raise UnsupportedError("ebbtide.comm: strategy 'suspend' (native NCCL suspend/resume) needs torch >= 2.12 "
                               f"and NCCL >= 2.29.7: {'; '.join(why)}. Use strategy='auto' or 'destroy'.")


def suspend_blockers(f: Facts) -> list[str]:
    """Every reason native suspend cannot serve this group (empty: it can)."""
    why = []
    if not f.accelerator:
        why.append("CPU-only group")
    why += version_blockers(f.torch_version, f.nccl_version)
    if not f.backend_has_suspend:
        why.append("backend has no suspend()")
    if not f.cumem:
        why.append("cuMem off (NCCL_CUMEM_ENABLE=0)" if f.cumem is False else "cuMem state unknown")
    if f.split_share:
        why.append("split-shared communicator")
    if not f.comm_initialized:
        why.append("communicator not created yet")
    return why


AUTO_REASON = "auto: destroy-and-rebuild (native suspend is opt-in: install(strategy='suspend'))"


def select_strategy(f: Facts, requested: str = "auto") -> tuple[str, str]:
    """(strategy, reason) for one group on one rank. ``requested`` is "auto", "suspend" or "destroy". "auto" is
    destroy for device groups. "suspend" raises UnsupportedError where the torch/NCCL versions lack it, and falls
    back to destroy, saying why, where another precondition does not hold for this group (never a GPU fault)."""
    if requested not in REQUESTS:
        raise ValueError(f"strategy must be one of {REQUESTS}, not {requested!r}")
    if not f.accelerator:
        if not f.include_cpu:
            return KEEP, "CPU-only group (pass include_cpu=True to release it)"
        return DESTROY, "CPU-only group"
    if requested == DESTROY:
        return DESTROY, "requested"
    if requested == "auto":
        return DESTROY, AUTO_REASON
    check_suspend_supported(f.torch_version, f.nccl_version)
    blockers = suspend_blockers(f)
    if not blockers:
        return SUSPEND, "native NCCL suspend (requested)"
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
                 torch_version: tuple[int, int], requested: str = "auto") -> list[tuple[str, str]]:
    """(variable, message) for every setting that defeats or weakens release with strategy ``requested``.
    Checked once at install(). Settings that matter to native suspend only are reported where it was asked for
    and the versions have it."""
    out: list[tuple[str, str]] = []
    suspend_possible = requested == SUSPEND and not version_blockers(torch_version, nccl_version)
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
