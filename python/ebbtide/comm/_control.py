"""The CPU control plane: barriers and small all-gathers over the rendezvous store, which release() never touches.

Policies:
- Every call is collective over WORLD's ranks and must be made in the same order everywhere; calls are numbered
  (``seq``) so the keys of one call never meet another's, and each rank works under a fresh prefix per install.
- A rank announces itself with one key per call and waits for everyone's with the store's timeout-bounded
  ``wait``; on timeout it checks which keys are absent and raises :class:`~ebbtide.errors.WaitTimeoutError`
  naming the missing ranks (a hang becomes a message).
- A rank that times out leaves a "gave-up" mark, so a latecomer that then finds every key raises too instead of
  acting alone (a latecomer arriving in the instant between the timeout and the mark is not covered).
- Keys do not pile up over thousands of cycles: when call N completes, every rank has finished reading call
  N-1, so each rank deletes its own key of call N-1.
"""
from __future__ import annotations

import datetime

from ..errors import WaitTimeoutError

__all__ = ["ControlPlane"]


class ControlPlane:
    """Store-backed barrier/all-gather for ``world_size`` ranks. Not thread-safe: the runtime calls it under its
    lock."""

    def __init__(self, store, rank: int, world_size: int, namespace: str):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace  # same on every rank (agreed at install through the store)
        self.seq = 0  # number of calls made; identical on every rank
        self._prev_key: str | None = None

    @classmethod
    def create(cls, store, rank: int, world_size: int) -> "ControlPlane":
        """Agree on a fresh namespace without a round trip: each rank adds 1 to a shared counter, so the k-th
        collective creation on this store sees values in (k*N, (k+1)*N] on every rank and derives the same k."""
        ticket = store.add("ebbtide/comm/creations", 1)
        epoch = (ticket - 1) // world_size
        return cls(store, rank, world_size, f"ebbtide/comm/{epoch}")

    def _key(self, seq: int, tag: str, rank: int) -> str:
        return f"{self.namespace}/{seq}/{tag}/{rank}"

    def allgather(self, tag: str, value: bytes, timeout: datetime.timedelta) -> list[bytes]:
        """Every rank's ``value`` in rank order. Raises WaitTimeoutError naming the ranks that never arrived."""
        seq = self.seq
        self.seq += 1
        mine = self._key(seq, tag, self.rank)
        self.store.set(mine, value)
        keys = [self._key(seq, tag, r) for r in range(self.world_size)]
        abort_key = f"{self.namespace}/{seq}/{tag}/gave-up"
        try:
            self.store.wait(keys, timeout)
        except Exception as e:  # the store raises its own timeout type (DistStoreError / RuntimeError)
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if missing:
                # Tell latecomers not to act alone on a step the others abandoned.
                self.store.set(abort_key, str(self.rank))
                raise WaitTimeoutError(
                    f"ebbtide.comm control plane: '{tag}' timed out after {timeout.total_seconds():g} s on rank "
                    f"{self.rank}; ranks {missing} never arrived (are they stuck in a collective, dead, or not "
                    f"calling release()/reload() with everyone?)") from e
        if self.store.check([abort_key]):
            who = self.store.get(abort_key).decode()
            raise WaitTimeoutError(f"ebbtide.comm control plane: '{tag}': rank {who} gave up waiting (timeout) "
                                   f"before rank {self.rank} arrived; this step was abandoned everywhere")
        if hasattr(self.store, "multi_get"):
            values = self.store.multi_get(keys)
        else:
            values = [self.store.get(k) for k in keys]
        if self._prev_key is not None:
            try:
                self.store.delete_key(self._prev_key)
            except Exception:  # stores without delete (rare) only keep a few bytes per call
                pass
        self._prev_key = mine
        return [bytes(v) for v in values]

    def barrier(self, tag: str, timeout: datetime.timedelta) -> None:
        self.allgather(tag, b"1", timeout)
