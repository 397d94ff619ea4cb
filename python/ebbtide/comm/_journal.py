"""The replay journal: one entry per group-creation call, in call order, replayed by reload().

What holds:
- Every creation call is journaled with all its arguments, on every rank, members and non-members alike (with a
  bound device, non-members take part in ``ncclCommSplit``). Entries every rank has carry ``gidx``, their position
  among such entries; groups created with ``use_local_synchronization=True`` exist on their members only
  (``gidx == -1``) and are never part of a cross-rank agreement.
- Before release() or reload() acts, ranks compare a hash of the entries' signatures (:func:`journal_hash`); a
  signature holds rank-invariant facts only (device *type*, never each rank's own device index).
- A split's backend options are journaled as a scalar snapshot (:class:`OptionsSnapshot`), never as the native
  object: see Note [Split options are not replayed].
- An entry belongs to the group it created (``Entry.group``; None on non-members), and the group holds its entry
  (``ReloadableGroup._ebt_entry``): the runtime walks entries, the group answers for its own state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import re

from ..errors import StateError

__all__ = ["Entry", "OptionsSnapshot", "journal_hash", "check_agreement", "combine_plans", "creation_connects",
           "split_depth", "is_local_name"]

_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def is_local_name(name: str) -> bool:
    """c10d names a ``use_local_synchronization`` group by a hash of its ranks (40 hex digits)."""
    return bool(_HEX40.match(name))


def _device_kind(dev) -> str:
    """Each rank binds its own GPU (cuda:0 on one, cuda:1 on the next): only the device type is rank-invariant."""
    if dev is None:
        return ""
    return getattr(dev, "type", None) or str(dev).split(":")[0]


def _td(t) -> str:
    return "" if t is None else f"{t.total_seconds():g}"


@dataclasses.dataclass(eq=False)  # identity semantics: entries are dict keys
class Entry:
    """One journaled creation call. ``call`` holds the arguments replayed on reload."""

    kind: str  # "world", "group" or "split"
    name: str  # c10d name at creation (the wrapper keeps it forever)
    ranks: tuple  # "world"/"group": global ranks (() for WORLD); "split": the ranks passed to split_group
    call: dict
    group: object | None  # the ReloadableGroup; None on non-members
    local_sync: bool = False  # created by members only (new_group(use_local_synchronization=True))
    parent: object | None = None  # split parent (a ReloadableGroup)
    gidx: int = -1  # position among entries every rank has (non-local); -1 for local entries
    plan: str | None = None  # strategy agreed at release; None while live / when not released
    reason: str = ""
    initialized: bool = False  # a communicator existed at release (so reload connects it eagerly)

    def __post_init__(self):
        if self.group is not None:
            with contextlib.suppress(AttributeError, TypeError):
                self.group._ebt_entry = self

    def signature(self) -> str:
        """Rank-invariant description, hashed for the cross-rank agreement check."""
        c = self.call
        if self.kind == "split":
            parent = self.parent._ebt_name if self.parent else "?"
            return f"split|{parent}|{c.get('group_desc')}|{_td(c.get('timeout'))}"
        opts = c.get("backend_options")
        return "|".join([self.kind, ",".join(map(str, self.ranks)), str(c.get("backend")), _td(c.get("timeout")),
                         str(c.get("group_desc")), type(opts).__name__ if opts is not None else "",
                         _device_kind(c.get("device_id")), self.name])

    def agreement_key(self) -> str:
        """How ranks name this entry in an exchange: its position for shared entries, its c10d name (the same on
        every member) for local ones."""
        return str(self.gidx) if self.gidx >= 0 else f"local:{self.name}"


def journal_hash(journal: list[Entry]) -> list:
    sigs = [e.signature() for e in journal if not e.local_sync]
    return [len(sigs), hashlib.sha1("\n".join(sigs).encode()).hexdigest()[:16]]


def check_agreement(everyone: list[dict], what: str) -> None:
    """Raise StateError naming the ranks whose journal hash differs from rank 0's."""
    ref = everyone[0]["journal"]
    bad = [r for r, p in enumerate(everyone) if p["journal"] != ref]
    if bad:
        raise StateError(
            f"ebbtide.comm.{what}(): ranks {bad} disagree with rank 0 about the process-group creation history "
            f"(rank 0: {ref[0]} groups, hash {ref[1]}; " +
            ", ".join(f"rank {r}: {everyone[r]['journal'][0]} groups, hash {everyone[r]['journal'][1]}"
                      for r in bad) + "); every rank must create the same groups in the same order")


def combine_plans(everyone: list[dict], combine) -> dict[int, str]:
    """gidx -> agreed strategy (``combine`` of the members' choices). A group any member destroyed itself is left
    alone by everyone."""
    choices: dict[int, list[str]] = {}
    gone = set()
    for p in everyone:
        gone.update(p["gone"])
        for k, c in p["choices"].items():
            choices.setdefault(int(k), []).append(c)
    return {k: combine(v) for k, v in choices.items() if k not in gone}


def split_depth(e: Entry, by_group: dict) -> int:
    """Split level: WORLD 0; new_group groups 1 (ncclCommSplit children of a bound WORLD, or independent);
    a split_group child one below its parent. ``by_group``: group -> its entry."""
    if e.kind == "world":
        return 0
    if e.kind == "split" and e.parent is not None and e.parent in by_group:
        return 1 + split_depth(by_group[e.parent], by_group)
    return 1


def creation_connects(e: Entry) -> bool:
    """Does replaying this journal entry create its NCCL communicator by itself? True for split children
    (``ProcessGroupNCCL::split`` ends in ``eagerConnectSingleDevice``) and for groups created with a bound device
    (c10d's helper calls ``eager_connect_single_device(device_id)``; with a bound WORLD that is an
    ``ncclCommSplit`` of WORLD). Such groups must not be connected again: in torch 2.x ``eagerConnectSingleDevice``
    calls ``initNCCLComm``, which does not look at the cache and makes a *second* communicator (the first one
    leaks, never aborted) and, for a split child, issues a second ``ncclCommSplit`` on the parent that only the
    members call - the parent's non-members never join it, so the members hang. Derived from the journal only,
    so every rank decides the same way."""
    if e.kind == "split":
        return True
    return e.call.get("device_id") is not None


# Note [Split options are not replayed]
#     dist.split_group passes an Options object to ProcessGroupNCCL::split (the caller's, or the parent's own /
#     a copy of it), and split() writes into it: ``split_from`` = the parent backend (an owning pointer),
#     ``global_ranks_in_group``, ``split_color``, ``group_name``; the child keeps that same object as its options.
#     Replaying the journaled object after the parent was rebuilt (release(include_world=True)) would hand NCCL a
#     structure that belongs to torn-down backends: split() overwrites ``split_from``, which can drop the last
#     reference to the old, aborted parent backend and destroy it in the middle of the new split; the config it
#     carries was filled in for the old communicator. So the journal keeps only the scalar settings a user can
#     choose (a snapshot), and replay builds fresh options from the *live* parent's (what dist.split_group does
#     for a new split) with the snapshot applied (``_backend.replay_split_options``). At teardown, ``split_from``
#     of the dying backend's options is cleared, so an old parent is freed there (a controlled point, after its
#     abort) rather than by a later split.
_OPT_SKIP = frozenset({"split_from", "split_color", "global_ranks_in_group", "group_name", "config", "backend"})


def _scalar_attrs(obj, skip=frozenset()) -> dict:
    """Public settable scalar attributes (bool/int/float/timedelta) of a pybind options/config object."""
    out = {}
    if obj is None:
        return out
    for name in dir(obj):
        if name in skip or (name.startswith("_") and name != "_timeout"):
            continue
        try:
            v = getattr(obj, name)
        except Exception:
            continue
        if isinstance(v, (bool, int, float, datetime.timedelta)):
            out[name] = v
    return out


@dataclasses.dataclass(frozen=True)
class OptionsSnapshot:
    """The user-choosable scalar settings of a split's backend options (see Note [Split options are not
    replayed])."""

    type_name: str
    fields: dict
    config: dict

    @classmethod
    def take(cls, opts) -> "OptionsSnapshot":
        return cls(type(opts).__name__, _scalar_attrs(opts, _OPT_SKIP),
                   _scalar_attrs(getattr(opts, "config", None)))

    def apply(self, opts) -> None:
        for k, v in self.fields.items():
            with contextlib.suppress(Exception):
                setattr(opts, k, v)
        cfg = getattr(opts, "config", None)
        if cfg is None or not self.config:
            return
        for k, v in self.config.items():
            with contextlib.suppress(Exception):
                setattr(cfg, k, v)
        with contextlib.suppress(Exception):
            opts.config = cfg  # where the property hands out a copy
