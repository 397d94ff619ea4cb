"""ensure_rank_map: the guard in front of ProcessGroupNCCL::split, which reads ``groupRanks()[rank]`` and
crashes on a WORLD rebuilt by reload() (Note [A rebuilt WORLD has no rank map] in ebbtide/comm/_backend.py).
NCCL is not in the CPU build, so the backend options are a minimal stand-in with the one attribute split() reads;
the GPU tests (tests/comm/test_comm_nccl.py::test_nccl_split_group_and_device_mesh) run the real thing."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from ebbtide.comm._backend import ensure_rank_map  # noqa: E402
from ebbtide.errors import StateError  # noqa: E402


class _Opts:
    def __init__(self, ranks):
        self.global_ranks_in_group = list(ranks)


class _FrozenOpts:
    @property
    def global_ranks_in_group(self):
        return []


class _Backend:
    def __init__(self, opts):
        self.options = opts


class _Parent:
    _ebt_name = "0"

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_empty_map_gets_identity():
    b = _Backend(_Opts([]))
    ensure_rank_map(b, _Parent(4), "test")
    assert b.options.global_ranks_in_group == [0, 1, 2, 3]


def test_full_map_is_left_alone():
    b = _Backend(_Opts([3, 5]))
    ensure_rank_map(b, _Parent(2), "test")
    assert b.options.global_ranks_in_group == [3, 5]


def test_other_size_is_left_to_torch(caplog):
    """A non-empty map of another size (a torch that lets split() write into the parent's own options) is
    reported, not rewritten: it is not the empty-vector crash, and rewriting it could change torch's behaviour."""
    b = _Backend(_Opts([1]))
    with caplog.at_level("WARNING", logger="ebbtide.comm"):
        ensure_rank_map(b, _Parent(2), "test")
    assert b.options.global_ranks_in_group == [1]
    assert "maps 1 ranks" in caplog.text


def test_unsettable_map_raises_instead_of_crashing():
    with pytest.raises(StateError, match="read past an empty vector"):
        ensure_rank_map(_Backend(_FrozenOpts()), _Parent(2), "test")
