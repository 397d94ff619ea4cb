"""Rank bodies for the spawned Megatron adapter tests (Gloo, CPU). Each returns a JSON-able dict the test asserts
on; a failed check raises inside the rank and the spawn helper reports its traceback.

Collective checks identify the rank set: all_reduce of (global rank + 1) must equal the sum over the group's
members, so a group rebuilt with the wrong members cannot pass."""
from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

from megatron.core import parallel_state as ps  # noqa: E402

import ebbtide.integrations.megatron as ebt  # noqa: E402
from ebbtide.testing.spawn import join_store  # noqa: E402
from ebbtide.errors import StateError  # noqa: E402


def _init_dist(rank, world, init):
    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _expect_sum(group, rank):
    ranks = dist.get_process_group_ranks(group)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    want = float(sum(r + 1 for r in ranks))
    assert torch.equal(t, torch.full((3,), want)), (group, t, want)


def _getters():
    g = {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
         "dp": ps.get_data_parallel_group, "mp": ps.get_model_parallel_group, "cp": ps.get_context_parallel_group,
         "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
         "dp_gloo": ps.get_data_parallel_group_gloo, "tp_dp": ps.get_tensor_and_data_parallel_group,
         "ep": ps.get_expert_model_parallel_group, "expt_dp": ps.get_expert_data_parallel_group,
         "expt_tp": ps.get_expert_tensor_parallel_group, "expt_tp_ep": ps.get_expert_tensor_and_model_parallel_group,
         "expt_tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group}
    if ps.is_rank_in_embedding_group():
        g["emb"] = ps.get_embedding_group
    if ps.is_rank_in_position_embedding_group():
        g["pos_emb"] = ps.get_position_embedding_group
    return g


def _check_all(held, rank):
    for k, g in held.items():
        assert _getters()[k]() is g, k  # Megatron's module globals still hold the same objects
        _expect_sum(g, rank)


def groups_cycle(rank, world, init, tp=1, pp=1, ep=1, cycles=2):
    """install_groups before init and initialize_model_parallel; every group Megatron holds (the expert-parallel
    ones too) is reloadable; release (Gloo included) makes ops raise; reload brings right sums back, eagerly and
    lazily; a release that keeps the Gloo groups leaves them working."""
    ebt.install_groups()
    _init_dist(rank, world, init)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    report = ebt.check_groups()
    assert report and all(r["reloadable"] for r in report.values()), report
    held = {k: f() for k, f in _getters().items()}
    _check_all(held, rank)
    out = {"n_groups": len(report), "cycles": [],
           "distinct_groups": len({id(g) for g in ebt.megatron_groups().values()})}
    for cycle in range(cycles):
        rep = ebt.release_groups(include_world=cycle % 2 == 1, include_cpu=True)
        assert not rep.noop
        assert ebt.release_groups(include_cpu=True).noop  # a second release is a no-op
        raised = 0
        for g in held.values():
            try:
                dist.all_reduce(torch.ones(1), group=g)
            except StateError:
                raised += 1
        assert raised == len(held), (raised, len(held))
        ebt.reload_groups(eager=cycle % 2 == 0)
        _check_all(held, rank)
        out["cycles"].append({"released": len(rep.groups), "raised": raised})
    # Gloo groups kept: a release without include_cpu leaves every (CPU-only) group usable.
    rep = ebt.release_groups()
    _check_all(held, rank)
    ebt.reload_groups()
    out["kept_release_groups"] = len(rep.groups)
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    out["ep_rank"] = ps.get_expert_model_parallel_rank()
    out["ep_size"] = dist.get_world_size(held["ep"])
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def install_too_late(rank, world, init):
    """Groups made before install_groups: install refuses, check_groups names them, release refuses."""
    _init_dist(rank, world, init)
    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    msgs = {}
    for name, fn in (("install", ebt.install_groups), ("check", ebt.check_groups),
                     ("release", ebt.release_groups), ("reload", ebt.reload_groups)):
        try:
            fn()
        except StateError as e:
            msgs[name] = str(e)
        else:
            raise AssertionError(f"{name} did not refuse")
    _expect_sum(ps.get_pipeline_model_parallel_group(), rank)  # nothing was disturbed
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return msgs
