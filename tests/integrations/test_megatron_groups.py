"""Megatron-core's own initialize_model_parallel on ebbtide.comm groups through the adapter: install, check, release,
reload (eager and lazy), Gloo groups kept, and the refusals when the adapter comes too late. Gloo ranks on CPU."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")
pytest.importorskip("megatron.core.parallel_state")

from ebbtide.testing import spawn  # noqa: E402

M = "megatron_workers"


@pytest.mark.parametrize("world,tp,pp,ep", [(2, 1, 2, 1), (4, 2, 2, 1), (2, 1, 1, 2), (4, 2, 1, 2)])
def test_groups_install_release_reload(world, tp, pp, ep):
    res = spawn.ranks("groups_cycle", world, module=M, tp=tp, pp=pp, ep=ep, cycles=2, timeout=170)
    for r in res:
        assert r["distinct_groups"] >= 8, r  # TP, PP, DP, MP, CP, DP-with-CP, the Gloo twins, EP, ...
        assert all(c["released"] >= r["distinct_groups"] for c in r["cycles"]), r
        assert r["kept_release_groups"] == 0 or r["kept_release_groups"] < r["cycles"][0]["released"], r
    dp = world // (tp * pp)
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in res) == sorted(
        (p, t) for p in range(pp) for t in range(tp) for _ in range(dp))
    assert all(r["ep_size"] == ep for r in res)
    assert sorted(r["ep_rank"] for r in res) == sorted(e for e in range(ep) for _ in range(world // ep))


def test_groups_adapter_after_megatron_is_refused():
    res = spawn.ranks("install_too_late", 2, module=M, timeout=150)
    for r in res:
        assert "before parallel_state.initialize_model_parallel" in r["install"]
        assert "not reloadable" in r["check"]
        assert "install_groups()" in r["release"] and "install_groups()" in r["reload"]
