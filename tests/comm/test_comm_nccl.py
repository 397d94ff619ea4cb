"""ebbtide.comm on NCCL, one rank per GPU (``multigpu``), plus the same scenario code on Gloo for CI.

The scenario (ebbtide.testing.scenarios.comm.cycle_scenario) checks every collective's result exactly inside the
ranks and returns the memory and timing figures asserted here. Memory is cudaMemGetInfo on each rank's own GPU (it
counts NCCL's allocations, which torch's caching allocator never sees).

Fail fast: every scenario has a deadline (``DEADLINE_S``, sized so all five fit one 10-minute GPU command even if
each ran to its deadline); a rank that fails stops its peers after a short grace; hung ranks get their Python stacks
dumped into their logs (``$EBBTIDE_COMM_LOGDIR``, set it to a folder that comes back from the GPU machine), and
the failure message carries each rank's last progress line and log tail. Where pytest-timeout is installed,
tests/comm/conftest.py adds a pytest-level timeout a little above each deadline as a backstop.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ebbtide.testing import spawn  # noqa: E402

MiB = 1 << 20
# Seconds per scenario (the spawn helper's deadline); conftest.py reads this for the pytest-timeout backstop.
# run_multigpu.sh gives each test's own pytest process this plus 35 s; the five GPU ones take ~3 min together (2 H200),
# their deadlines 480 s.
DEADLINE_S = {"test_scenario_code_on_gloo": 100, "test_nccl_flat_bound_world": 140, "test_nccl_lazy_world": 90,
              "test_nccl_megatron_topology_all_gpus": 110, "test_nccl_split_group_and_device_mesh": 80,
              "test_release_with_a_collective_that_cannot_finish": 60}


def _run(world, test, **kw):
    return spawn.ranks("cycle_scenario", world, module="ebbtide.testing.scenarios.comm", timeout=DEADLINE_S[test],
                       **kw)


def test_scenario_code_on_gloo():
    """The benchmark/GPU scenario itself, on CPU: anchor phase, adoption of WORLD, cycles, soak."""
    res = _run(2, "test_scenario_code_on_gloo", backend="gloo", cycles=1, soak=2)
    for r in res:
        assert r["registered_before"] == r["registered_after"]
        assert all(row[1] == r["registered_before"] for row in r["soak"])
        assert r["cycles_world"][0]["strategies"] == {"destroy": 1 + 6 + 1}  # WORLD + 6 overlapping + own singleton


# Share of communicator memory release(include_world=True) must free (the goal). Communicator memory is counted
# from a baseline with NCCL's process-wide state already loaded (device code, context stack reservation: no API
# returns it while the process lives; see ebbtide.testing.scenarios.comm.nccl_process_state), measured by a
# throwaway 1-rank communicator; counted from the bare CUDA context instead, ~418 MiB of that state per GPU (2 H200)
# would count as communicator memory. The process state is reported on its own. release() ends with a barrier, so
# no rank measures before its peers have unmapped its buffers.
FREED_SHARE = 0.95


def _check_memory(r, soak):
    comm_bytes = r["comm_bytes"]
    assert comm_bytes > 64 * MiB, f"communicators hold only {comm_bytes / MiB:.0f} MiB: nothing to test"
    assert r["free_nccl"] is not None, "the NCCL-loaded baseline was not measured (see the rank log)"
    for c in r["cycles_world"]:
        freed = c["free_released"] - r["free_loaded"]
        assert freed >= FREED_SHARE * comm_bytes, (freed / MiB, comm_bytes / MiB, r["comm_bytes_ctx"] / MiB,
                                                    c["groups"])
    subgroups = r.get("free_after_anchor", r["free_world"]) - r["free_loaded"]
    for c in r["cycles_subgroups"]:  # WORLD kept: the subgroups' communicators go
        assert c["free_released"] - r["free_loaded"] >= 0.9 * subgroups, (c["groups"], subgroups / MiB)
    frees = [row[0] for row in r["soak"]]
    assert len(frees) == soak
    assert max(frees) - min(frees) <= 64 * MiB, [f / MiB for f in frees]
    assert r["registered_before"] == r["registered_after"]
    assert all(row[1] == r["registered_before"] for row in r["soak"])


@pytest.mark.multigpu
def test_nccl_flat_bound_world():
    """WORLD bound to the device (eager, subgroups split from WORLD): release frees >= 95% of communicator memory
    (from the NCCL-loaded baseline, FREED_SHARE) with WORLD included, collectives are exact after every reload, no
    drift over 10 cycles."""
    res = _run(2, "test_nccl_flat_bound_world", cycles=2, soak=10)
    for r in res:
        _check_memory(r, 10)
        state = (r["free_ctx"] - r["free_nccl"]) / MiB
        freed = (r["cycles_world"][-1]["free_released"] - r["free_loaded"]) / MiB
        print(f"rank: comm {r['comm_bytes'] / MiB:.0f} MiB (NCCL process state {state:.0f} MiB not counted); "
              f"freed(world) {freed:.0f} MiB; "
              f"release(world) {r['cycles_world'][-1]['release_s'] * 1e3:.0f} ms; "
              f"reload+first {r['cycles_world'][-1]['reload_first_s'] * 1e3:.0f} ms; "
              f"anchor destroy {r['anchor_destroy_s'] * 1e3:.0f} ms, re-create+first "
              f"{r['anchor_recreate_first_s'] * 1e3:.0f} ms; strategies {r['cycles_world'][-1]['strategies']}")


@pytest.mark.multigpu
def test_nccl_lazy_world():
    """No device_id: communicators are created lazily by torch; reload(eager=True) recreates them in journal
    order (ncclCommInitRank per group, no split) and results stay exact."""
    res = _run(2, "test_nccl_lazy_world", cycles=2, soak=0, anchor=False, bound=False)
    for r in res:
        assert r["free_nccl"] is not None, "the NCCL-loaded baseline was not measured (see the rank log)"
        for c in r["cycles_world"]:
            assert c["free_released"] - r["free_loaded"] >= FREED_SHARE * r["comm_bytes"], (
                (c["free_released"] - r["free_loaded"]) / MiB, r["comm_bytes"] / MiB, r["comm_bytes_ctx"] / MiB)


@pytest.mark.multigpu
def test_nccl_megatron_topology_all_gpus():
    """TP=2 x PP=world/2 with embedding, position-embedding, model-parallel and singleton groups on every visible
    GPU (2, 4 or 8), batch_isend_irecv first on the pipeline group after each reload."""
    n = torch.cuda.device_count()
    world = n if n % 2 == 0 else n - 1
    res = _run(world, "test_nccl_megatron_topology_all_gpus", kind="megatron", cycles=2, soak=3, anchor=False)
    for r in res:
        assert r["registered_before"] == r["registered_after"]
        for c in r["cycles_world"]:
            assert c["free_released"] > r["free_loaded"]


@pytest.mark.multigpu
def test_nccl_split_group_and_device_mesh():
    """split_group children (members and non-members) and a DeviceMesh survive cycles with WORLD kept and with
    WORLD rebuilt (where split() needs the rank map: Note [A rebuilt WORLD has no rank map]), and a split of the rebuilt
    WORLD made afterwards survives one more cycle."""
    res = spawn.ranks("nccl_split", 2, module="comm_workers",
                      timeout=DEADLINE_S["test_nccl_split_group_and_device_mesh"])
    assert res[0]["groups"] >= 4  # WORLD + pair + solo + first (+ the mesh's group)


@pytest.mark.multigpu
def test_release_with_a_collective_that_cannot_finish():
    """A collective launched on rank 0 only, in flight on a side stream: release(timeout=5) fails on every rank
    within the bound with the same reason (rank 0's device did not drain), nothing is released, and once
    rank 1 joins the collective it completes exactly and a release/reload cycle works (comm_workers.nccl_in_flight)."""
    res = spawn.ranks("nccl_in_flight", 2, module="comm_workers",
                      timeout=DEADLINE_S["test_release_with_a_collective_that_cannot_finish"])
    for r in res:
        assert r["kind"] == "StateError" and "on ranks [0]" in r["msg"] and "did not finish" in r["msg"], r
