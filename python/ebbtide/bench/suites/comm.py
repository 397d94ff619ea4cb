"""Suite `comm`: release/reload of NCCL process groups beside plain ``destroy_process_group`` + ``new_group``.

Both run in the same processes on the same WORLD (ebbtide.testing.scenarios.comm.cycle_scenario, one rank per GPU):
the anchor first (plain torch groups created, used, destroyed, re-created and used), then ebbtide.comm adopts WORLD
and the same groups go through release/reload cycles and a soak. Memory is cudaMemGetInfo per GPU; times are
wall-clock on each rank (the slowest rank is reported), each followed by a device sync.
2 GPUs: WORLD + 6 overlapping groups + a singleton per rank. 4 or 8 GPUs: additionally the
Megatron-like topology (TP=2 x PP=world/2, embedding, position-embedding, model-parallel, singleton DP groups).
Where deep_ep and megatron-core are installed: Megatron's DeepEP buffer through the cycles
(ebbtide.testing.scenarios.deepep): rebuild time beside DeepEP's own construction, memory, dispatch+combine after.
"""
from __future__ import annotations

import statistics

from ..registry import Row, Skip, suite

GB = 1e9
MiB = 1 << 20


def _slowest(res: list[dict], get) -> float:
    return max(get(r) for r in res)


def _median_slowest(res: list[dict], key: str, field: str) -> float:
    n = len(res[0][key])
    return statistics.median(max(r[key][i][field] for r in res) for i in range(n))


def _rows(res: list[dict], label: str, soak: int):
    r0 = res[0]
    params = {"gpus": r0["world"], "topology": r0["kind"], "torch": r0.get("torch"), "nccl": r0.get("nccl"),
              "strategies": r0["cycles_world"][-1]["strategies"], "env": r0.get("env")}
    row = lambda name, unit, ours, **kw: Row("comm", f"{label}: {name}", unit, ours, params=params, **kw)  # noqa: E731
    comm_bytes = min(r["comm_bytes"] for r in res)
    nccl_base = all(r.get("free_nccl") is not None for r in res)
    base = (lambda r: r["free_nccl"]) if nccl_base else (lambda r: r["free_ctx"])  # noqa: E731
    anchor_bytes = min(base(r) - r["anchor_free_loaded"] for r in res)
    yield row("communicator memory per GPU, all groups used", "GB", comm_bytes / GB, higher_is_better=False,
              anchor=anchor_bytes / GB, anchor_name="plain torch groups",
              note="cudaMemGetInfo above the CUDA context" + (" with NCCL's process state loaded" if nccl_base else ""))
    yield row("small all_reduce issued back to back, per op", "us", 1e6 * _slowest(res, lambda r: r["op_s"]),
              higher_is_better=False, anchor=1e6 * _slowest(res, lambda r: r["anchor_op_s"]),
              anchor_name="plain torch group", note="the wrapper's Python forwarding cost shows here")
    freed_world = min(statistics.median(c["free_released"] for c in r["cycles_world"]) - r["free_loaded"]
                      for r in res)
    yield row("freed by release(include_world=True)", "% of comm memory", 100.0 * freed_world / comm_bytes,
              anchor_note="n/a (torch cannot re-create WORLD in place)", limit=100.0,
              limit_name="all communicator memory",
              note="goal >= 95%; comm memory counted above " + (
                  "the CUDA context with NCCL's process state loaded (throwaway communicator over the same ranks)"
                  if nccl_base else "the bare CUDA context (NCCL-loaded baseline not measured)"))
    if nccl_base:
        state = max(r["free_ctx"] - r["free_nccl"] for r in res)
        yield row("NCCL process state (device code etc.; not communicator memory)", "MiB", state / MiB,
                  higher_is_better=False, anchor_note="n/a",
                  note="loaded by the first communicator of a process; no API returns it while the process lives")
        freed_ctx = min(statistics.median(c["free_released"] for c in r["cycles_world"]) - r["free_loaded"]
                        for r in res)
        yield row("freed by release(include_world=True), from the bare CUDA context", "% of comm memory",
                  100.0 * freed_ctx / min(r["comm_bytes_ctx"] for r in res), anchor_note="n/a",
                  note="NCCL process state counted as communicator memory")
    freed_sub = min(statistics.median(c["free_released"] for c in r["cycles_subgroups"]) - r["free_loaded"]
                    for r in res)
    anchor_freed = min(r["anchor_free_destroyed"] - r["anchor_free_loaded"] for r in res)
    yield row("freed by release(), WORLD kept", "GB", freed_sub / GB, anchor=anchor_freed / GB,
              anchor_name="destroy_process_group on each subgroup")
    td = r0["teardown"]
    ours = _teardown_label(td)
    rel = _median_slowest(res, "cycles_subgroups", "release_s")
    anchor_rel = _slowest(res, lambda r: r["anchor_destroy_s"])
    yield row(f"release, WORLD kept (teardown: {ours})", "s", rel, higher_is_better=False, anchor=anchor_rel,
              anchor_name="destroy_process_group on each subgroup")
    rl = _median_slowest(res, "cycles_subgroups", "reload_first_s")
    anchor_rl = _slowest(res, lambda r: r["anchor_recreate_first_s"])
    yield row("reload + first collective on every group, WORLD kept", "s", rl, higher_is_better=False,
              anchor=anchor_rl, anchor_name="new_group + first collective")
    yield row(f"release + reload + first collective, WORLD kept ({ours})", "s", rel + rl, higher_is_better=False,
              anchor=anchor_rel + anchor_rl, anchor_name="destroy + re-create + first collective",
              note="goal < 0.5 s")
    if "reload_warmup_s" in r0["cycles_subgroups"][0]:  # where reload's time goes (WORLD kept)
        warm = _median_slowest(res, "cycles_subgroups", "reload_warmup_s")
        bar = _median_slowest(res, "cycles_subgroups", "reload_barrier_s")
        rl_only = _median_slowest(res, "cycles_subgroups", "reload_s")
        yield row("reload phases: rebuild (replayed creations, NCCL init by split)", "s", rl_only - warm - bar,
                  higher_is_better=False, anchor_note="n/a", note="reload minus warm-up minus barriers")
        yield row("reload phases: transport warm-up, concurrent across groups", "s", warm, higher_is_better=False,
                  anchor_note="n/a", note="NCCL connects at first use; one group after another ~0.13 s each")
        yield row("reload phases: control-plane barriers", "s", bar, higher_is_better=False, anchor_note="n/a")
        yield row("first collective on every group after reload", "s", rl - rl_only, higher_is_better=False,
                  anchor_note="n/a", note="after the warm-up: no init, no connect left")
    relw = _median_slowest(res, "cycles_world", "release_s")
    rlw = _median_slowest(res, "cycles_world", "reload_first_s")
    yield row("release, WORLD included", "s", relw, higher_is_better=False, anchor_note="n/a")
    yield row("release + reload + first collective, WORLD included", "s", relw + rlw, higher_is_better=False,
              anchor_note="n/a (torch cannot re-create WORLD in place)", note="goal < 0.5 s")
    for i, other in enumerate(r0.get("other_teardowns", [])):  # same order on every rank
        what = _teardown_label(other)
        yield row(f"release, WORLD kept (teardown: {what})", "s",
                  _slowest(res, lambda r: r["other_teardowns"][i]["release_s"]),
                  higher_is_better=False, anchor=anchor_rel, anchor_name="destroy_process_group on each subgroup",
                  note=f"one cycle; ours: {ours}")
        yield row(f"release + reload + first collective, WORLD kept ({what})", "s",
                  _slowest(res, lambda r: r["other_teardowns"][i]["release_s"]
                           + r["other_teardowns"][i]["reload_first_s"]), higher_is_better=False,
                  anchor=anchor_rel + anchor_rl, anchor_name="destroy + re-create + first collective",
                  note=f"one cycle; ours: {ours}")
    if soak:
        drift = max(max(row_[0] for row_ in r["soak"]) - min(row_[0] for row_ in r["soak"]) for r in res)
        yield row(f"free-memory drift after reload over {soak} cycles (WORLD included)", "MiB", drift / MiB,
                  higher_is_better=False, anchor_note="n/a", note="goal 0")
        counts = [row_[1] for r in res for row_ in r["soak"]]
        yield row(f"registered-group drift over {soak} cycles", "groups", float(max(counts) - min(counts)),
                  higher_is_better=False, anchor_note="n/a", note="len(c10d _world.pg_map); goal 0")


def _deepep_rows(res: list[dict]):
    r0 = res[0]
    tokens, hidden, experts, topk = r0["shape"]
    params = {"gpus": r0["world"], "nvl_bytes": r0["nvl_bytes"], "tokens": tokens, "hidden": hidden,
              "experts": experts, "topk": topk}
    row = lambda name, unit, ours, **kw: Row("comm", f"{r0['world']} GPUs DeepEP: {name}", unit, ours,  # noqa: E731
                                             params=params, **kw)
    med = lambda key: _median_slowest(res, "cycles", key)  # noqa: E731
    ctor = _slowest(res, lambda r: r["ctor_s"])
    yield row("rebuild in reload (allocation + IPC exchange)", "s", med("rebuild_s"), higher_is_better=False,
              anchor=ctor, anchor_name="Megatron get_buffer (DeepEP Buffer construction, connected group)",
              note="goal <= 0.1 s with the connect below")
    yield row("EP group's first collective after reload (NCCL connect), before the rebuild", "s", med("connect_s"),
              higher_is_better=False, anchor_note="n/a (every rebuilt communicator pays it at its first op)")
    freed = min(statistics.median(c["freed_bytes"] for c in r["cycles"]) for r in res)
    took = min(r["ctor_bytes"] for r in res)
    yield row("device memory freed by release (WORLD + EP group + DeepEP buffer)", "GB", freed / GB,
              anchor_note="n/a (Megatron keeps the buffer for the process's life)",
              note=f"DeepEP's buffer took {took / GB:.3f} GB at construction; goal: all of it back")
    yield row("dispatch + combine after release/reload cycles", "ms", 1e3 * _slowest(res, lambda r: r["after_s"]),
              higher_is_better=False, anchor=1e3 * _slowest(res, lambda r: r["before_s"]),
              anchor_name="the same buffer before the first cycle", note="goal within 2%; results bitwise equal")


def _teardown_label(td: dict) -> str:
    how = "shutdown (ncclCommFinalize + destroy)" if td["how"] == "shutdown" else td["how"]
    return f"{how}, {'concurrent' if td['concurrent'] else 'one at a time'}"


@suite("comm", needs="multigpu", description="NCCL group release/reload vs destroy + re-create, with soak")
def run(ctx):
    ctx.require_gpu(2)
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError as e:
        raise Skip(f"torch.distributed unavailable: {e}") from e
    if not dist.is_nccl_available():
        raise Skip("torch was built without NCCL")
    from ...testing import spawn  # noqa: PLC0415

    soak = 10 if ctx.quick else 50
    runs = [(2, "flat")]
    n = ctx.gpus - ctx.gpus % 2
    if n > 2:
        runs += [(n, "flat"), (n, "megatron")]
    for world, kind in runs:
        ctx.progress(f"comm: {kind} topology on {world} GPUs, {soak}-cycle soak")
        # A deadline inside one 10-minute device command; a failing rank stops its peers within seconds, and
        # hung ranks' stacks land in $EBBTIDE_COMM_LOGDIR (see ebbtide.testing.spawn).
        res = spawn.ranks("cycle_scenario", world, module="ebbtide.testing.scenarios.comm",
                         timeout=240 if ctx.quick else 540, kind=kind, cycles=3, soak=soak)
        yield from _rows(res, f"{world} GPUs {kind}", soak)
    import importlib.util  # noqa: PLC0415

    missing = [m for m in ("deep_ep", "megatron.core") if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        ctx.progress(f"comm: DeepEP rows skipped ({', '.join(missing)} not installed; scripts/build-deepep)")
        return
    ctx.progress("comm: DeepEP buffer (Megatron's fused_a2a) through release/reload cycles on 2 GPUs")
    res = spawn.ranks("deepep_cycles", 2, module="ebbtide.testing.scenarios.deepep", timeout=240, cycles=3)
    yield from _deepep_rows(res)
