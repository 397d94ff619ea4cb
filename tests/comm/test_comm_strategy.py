"""Strategy selection, cross-rank combination and the NCCL environment check (pure functions; no processes)."""
from __future__ import annotations

import dataclasses

import pytest

from ebbtide.comm import _strategy as S
from ebbtide.errors import UnsupportedError

GOOD = S.Facts(accelerator=True, torch_version=(2, 12), nccl_version=(2, 29, 7), backend_has_suspend=True,
               cumem=True, split_share=False, comm_initialized=True)


def test_auto_destroys_and_suspend_is_opt_in():
    """The "auto" strategy selects only what has run on a GPU here (destroy-and-rebuild); suspend is opt-in."""
    assert S.select_strategy(GOOD) == (S.DESTROY, S.AUTO_REASON)
    assert S.select_strategy(GOOD, "suspend") == (S.SUSPEND, "native NCCL suspend (requested)")
    assert S.select_strategy(dataclasses.replace(GOOD, torch_version=(3, 0), nccl_version=(2, 30, 7)),
                             "suspend")[0] == S.SUSPEND


@pytest.mark.parametrize("change, why", [
    ({"torch_version": (2, 11)}, "torch 2.11 < 2.12"),
    ({"nccl_version": (2, 29, 6)}, "NCCL 2.29.6 < 2.29.7"),
    ({"nccl_version": (2, 28, 9)}, "NCCL 2.28.9 < 2.29.7"),
    ({"nccl_version": None}, "no NCCL"),
])
def test_suspend_without_the_versions_is_unsupported(change, why):
    f = dataclasses.replace(GOOD, **change)
    assert S.select_strategy(f)[0] == S.DESTROY  # auto never asks
    with pytest.raises(UnsupportedError, match=why):
        S.select_strategy(f, "suspend")
    with pytest.raises(UnsupportedError, match=why):
        S.check_suspend_supported(f.torch_version, f.nccl_version)


@pytest.mark.parametrize("change, why", [
    ({"backend_has_suspend": False}, "backend has no suspend()"),
    ({"cumem": False}, "cuMem off (NCCL_CUMEM_ENABLE=0)"),
    ({"cumem": None}, "cuMem state unknown"),
    ({"split_share": True}, "split-shared communicator"),
    ({"comm_initialized": False}, "communicator not created yet"),
])
def test_each_group_blocker_falls_back_to_destroy_and_says_why(change, why):
    f = dataclasses.replace(GOOD, **change)
    assert S.select_strategy(f, "suspend") == (S.DESTROY, why)
    assert S.select_strategy(f) == (S.DESTROY, S.AUTO_REASON)


def test_blockers_are_all_listed():
    f = dataclasses.replace(GOOD, cumem=False, split_share=True, comm_initialized=False)
    assert S.select_strategy(f, "suspend")[1] == ("cuMem off (NCCL_CUMEM_ENABLE=0); split-shared communicator; "
                                                  "communicator not created yet")


def test_requested_destroy_and_cpu_groups():
    assert S.select_strategy(GOOD, "destroy") == (S.DESTROY, "requested")
    cpu = dataclasses.replace(GOOD, accelerator=False)
    assert S.select_strategy(cpu)[0] == S.KEEP
    assert S.select_strategy(cpu, "destroy")[0] == S.KEEP  # Gloo groups are untouched unless asked
    assert S.select_strategy(dataclasses.replace(cpu, include_cpu=True)) == (S.DESTROY, "CPU-only group")
    with pytest.raises(ValueError):
        S.select_strategy(GOOD, "sleep")


def test_combine_takes_the_weakest_member_choice():
    assert S.combine([S.SUSPEND, S.SUSPEND]) == S.SUSPEND
    assert S.combine([S.SUSPEND, S.DESTROY]) == S.DESTROY
    assert S.combine([S.DESTROY, S.SUSPEND]) == S.DESTROY
    assert S.combine([S.KEEP, S.SUSPEND]) == S.SUSPEND
    assert S.combine([]) == S.KEEP


def test_cumem_detection():
    assert S.cumem_enabled({"NCCL_CUMEM_ENABLE": "0"}, (2, 29, 7)) is False
    assert S.cumem_enabled({"NCCL_CUMEM_ENABLE": "1"}, (2, 18, 0)) is True
    assert S.cumem_enabled({}, (2, 29, 7)) is True
    assert S.cumem_enabled({"NCCL_CUMEM_ENABLE": "-2"}, (2, 29, 7)) is True
    assert S.cumem_enabled({}, (2, 18, 5)) is False
    assert S.cumem_enabled({}, None) is None


def test_env_warnings():
    new, old = (2, 29, 7), (2, 28, 9)
    sus = "suspend"
    assert S.env_warnings({"NCCL_NVLS_ENABLE": "0"}, new, (2, 12), sus) == []
    assert S.env_warnings({}, old, (2, 11)) == []  # nothing defeats destroy-and-rebuild by default
    assert S.env_warnings({}, new, (2, 12)) == []  # auto never suspends: suspend-only settings are not noise
    names = lambda env, nv=new, tv=(2, 12), req=sus: [v for v, _ in S.env_warnings(env, nv, tv, req)]  # noqa: E731
    assert names({"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}) == ["NCCL_CUMEM_ENABLE"]
    assert names({"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}, req="auto") == []
    assert names({"NCCL_CUMEM_ENABLE": "0"}, old, (2, 11)) == []  # suspend impossible anyway: no noise
    assert names({}) == ["NCCL_NVLS_ENABLE"]
    for req in (sus, "auto"):
        assert names({"NCCL_NVLS_ENABLE": "0", "NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"}, req=req) == \
            ["NCCL_COMM_SPLIT_SHARE_RESOURCES"]
        assert names({"NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_REGISTER": "1"}, req=req) == ["NCCL_GRAPH_REGISTER"]
        assert names({"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}, req=req) == \
            ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"]
    for _var, msg in S.env_warnings({"NCCL_CUMEM_ENABLE": "0"}, new, (2, 12), sus):
        assert "NCCL" in msg and len(msg) > 40  # every warning says what to do
