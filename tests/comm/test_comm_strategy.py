"""Strategy selection, cross-rank combination and the NCCL environment check (pure functions; no processes)."""
from __future__ import annotations

import pytest

from ebbtide.comm import _strategy as S
from ebbtide.errors import InvalidArgumentError, UnsupportedError

DEVICE = S.Facts(accelerator=True)
CPU = S.Facts(accelerator=False)


def test_device_groups_are_destroyed_and_rebuilt():
    assert S.select_strategy(DEVICE) == (S.DESTROY, S.AUTO_REASON)
    assert S.select_strategy(DEVICE, "destroy") == (S.DESTROY, "requested")


def test_cpu_groups_are_kept_unless_asked():
    assert S.select_strategy(CPU)[0] == S.KEEP
    assert S.select_strategy(CPU, "destroy")[0] == S.KEEP  # Gloo groups are untouched unless asked
    assert S.select_strategy(S.Facts(accelerator=False, include_cpu=True)) == (S.DESTROY, "CPU-only group")


def test_native_suspend_is_not_selectable():
    """Native NCCL suspend has never run on a GPU here: asking for it is a clear error, at selection and at
    install() (before anything is hooked), naming where its design is written down."""
    import ebbtide.comm as comm

    for call in (lambda: S.select_strategy(DEVICE, "suspend"), lambda: comm.install(strategy="suspend")):
        with pytest.raises(UnsupportedError, match="not selectable") as err:
            call()
        assert "docs/comm.md" in str(err.value) and "strategy='auto'" in str(err.value)
    assert not comm.is_installed()
    with pytest.raises(InvalidArgumentError, match="strategy must be one of"):
        S.select_strategy(DEVICE, "sleep")
    with pytest.raises(InvalidArgumentError, match="strategy must be one of"):
        comm.install(strategy="sleep")
    assert not comm.is_installed()


def test_combine_releases_a_group_any_member_releases():
    assert S.combine([S.DESTROY, S.DESTROY]) == S.DESTROY
    assert S.combine([S.KEEP, S.DESTROY]) == S.DESTROY
    assert S.combine([S.KEEP, S.KEEP]) == S.KEEP
    assert S.combine([]) == S.KEEP


def test_env_warnings():
    names = lambda env: [v for v, _ in S.env_warnings(env)]  # noqa: E731
    assert names({}) == []  # nothing defeats destroy-and-rebuild by default
    assert names({"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}) == []  # matter to native suspend only
    assert names({"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"}) == ["NCCL_COMM_SPLIT_SHARE_RESOURCES"]
    assert names({"NCCL_GRAPH_REGISTER": "1"}) == ["NCCL_GRAPH_REGISTER"]
    assert names({"NCCL_GRAPH_REGISTER": "0"}) == []
    assert names({"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}) == \
        ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"]
    every = {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1", "NCCL_GRAPH_REGISTER": "1",
             "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}
    for _var, msg in S.env_warnings(every):
        assert "NCCL" in msg and len(msg) > 40  # every warning says what to do
