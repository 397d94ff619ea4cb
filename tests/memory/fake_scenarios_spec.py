"""Which fake-driver scenarios the tests run, and which program (fake_<topic>.py) defines each. Kept apart from the
programs, which load the native engine at import."""
import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _programs() -> dict:
    """Scenario name -> file name, from the public top-level functions of every fake_*.py program."""
    found = {}
    for path in sorted(HERE.glob("fake_*.py")):
        if path.name == Path(__file__).name:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                assert node.name not in found, f"scenario {node.name} in both {found[node.name]} and {path.name}"
                found[node.name] = path.name
    return found


PROGRAM = _programs()

SIMPLE = [
    "va_stability_and_roundtrip",
    "selective_tags_and_stats",
    "state_errors",
    "regions_and_threads",
    "oom_at_resume",
    "free_while_paused",
    "async_overlap",
    "mark_clean_skips_copy",
    "batched_set_access_and_drain_order",
    "set_access_fallback",
    "unmap_runs_and_handle_release",
    "background_pinning",
    "cpu_backup_view",
    "fork_child_disabled",
    "thread_safety",
    "timeout_wait",
    "memory_margin_and_tag_epochs",
    "release_report_without_torch",
    "shareable_ipc",
    "import_handle_checks",
    "register_workers_keep_capture_mode",
    "cupy_allocator_routing",
    "versioned_stats",
    "partial_span_unmap",
]

# (operation, "symbol:nth"): the nth call of symbol fails during the operation (nth -1: every call). cuMemUnmap
# faults run with the fake in exact-unmap mode: the pause's one call over the VA-contiguous run (call 1) is
# refused, so calls 2.. are the per-allocation fallback and :4 fails after two allocations were released.
FAULTS = {
    "malloc": ["cuMemAddressReserve:1", "cuMemCreate:1", "cuMemMap:1", "cuMemSetAccess:1", "cuMemRelease:1"],
    "pause": ["cuCtxSynchronize:1", "cuMemHostRegister:1", "cuMemcpyDtoHAsync:2", "cuEventRecord:2",
              "cuEventSynchronize:2", "cuMemUnmap:-1", "cuMemUnmap:2", "cuMemUnmap:4", "cuStreamCreate:1"],
    "resume": ["cuMemGetInfo:1", "cuMemCreate:1", "cuMemCreate:3", "cuMemMap:2", "cuMemRelease:2",
               "cuMemSetAccess:-1", "cuMemcpyHtoDAsync:3", "cuEventRecord:1", "cuEventSynchronize:1"],
}

# Coalescing is on by default: SIMPLE scenarios run with the default and again with EBBTIDE_MEM_COALESCE=0 (the
# per-allocation path), except those that assert one driver call per allocation, which run with it off only
# (their coalesced counterparts are the coalesce_* scenarios).
PER_ALLOCATION_COUNTS = {"oom_at_resume", "batched_set_access_and_drain_order", "set_access_fallback",
                         "unmap_runs_and_handle_release", "memory_margin_and_tag_epochs"}
COALESCED_SIMPLE = [s for s in SIMPLE if s not in PER_ALLOCATION_COUNTS]
COALESCE = ["coalesce_runs_and_zombies", "coalesce_tags_and_shareable", "coalesce_first_member_freed"]
# With EBBTIDE_MEM_COALESCE_MAX_BYTES=8 MiB the tag resumes as two mappings of two allocations each. cuMemUnmap
# faults run in exact-unmap mode: call 1 (the span) is refused, :2 fails the first mapping (nothing released), :3
# the second (the first is mapped back, coalesced). cuMemCreate:2 / cuMemMap:2: the second run.
COALESCE_FAULTS = {
    "pause": ["cuCtxSynchronize:1", "cuMemcpyDtoHAsync:2", "cuEventSynchronize:2", "cuMemUnmap:-1", "cuMemUnmap:2",
              "cuMemUnmap:3"],
    "resume": ["cuMemGetInfo:1", "cuMemCreate:1", "cuMemCreate:2", "cuMemMap:1", "cuMemMap:2", "cuMemRelease:2",
               "cuMemSetAccess:-1", "cuMemcpyHtoDAsync:3", "cuEventRecord:1", "cuEventSynchronize:1"],
}

# Zombie reclaim (fake_reclaim.py): an allocation or resume short of memory gives back what freed members of
# coalesced mappings hold. RECLAIM_FAULTS: a failure at each step (call counts: fake_reclaim.py).
RECLAIM = ["reclaim_on_oom", "reclaim_at_resume", "reclaim_orders_with_ops", "reclaim_picks_cheapest",
           "reclaim_with_coalescing_off"]
RECLAIM_FAULTS = ["cuCtxSynchronize:1", "cuMemHostRegister:1", "cuMemcpyDtoHAsync:2", "cuStreamSynchronize:1",
                  "cuMemUnmap:1", "cuMemCreate:2", "cuMemCreate:3", "cuMemMap:1", "cuMemMap:2", "cuMemRelease:2",
                  "cuMemcpyHtoDAsync:3", "cuMemSetAccess:-1", "cuMemMap:-1"]
# The same through device staging (fake_reclaim.reclaim_on_device; "none": no fault).
RECLAIM_DEVICE_FAULTS = ["none", "cuMemCreate:2", "cuMemMap:1", "cuMemcpyDtoDAsync:-1", "cuMemcpyDtoDAsync:2",
                         "cuMemUnmap:1", "cuMemCreate:3", "cuMemCreate:4", "cuMemcpyDtoDAsync:5"]

# Transient host copies and the disk tier (fake_transient.py, fake_disk.py; run by test_host_tiers_fake.py).
TRANSIENT = ["roundtrip_gives_host_back", "pieces_pipelined_on_threads", "retention_keeps_the_same_copy",
             "pageable_copy_is_not_pinned_while_paused", "host_memory_unavailable_at_pause",
             "register_failure_rolls_back", "resume_copy_failure_keeps_the_copy", "free_gives_the_copy_back",
             "mixed_with_the_arena"]
DISK = ["roundtrip_and_files", "mixed_cpu_and_disk_in_one_pause", "tmpfs_refused", "disk_full_keeps_the_tag_resident",
        "directory_gone_keeps_the_tag_resident", "copy_failure_at_pause_releases_nothing",
        "truncated_or_foreign_file_refused", "free_while_paused_removes_the_file", "exit_while_paused"]

# Scenarios with tests of their own in test_engine_fake.py (a setting, arguments or a second device).
OWN_TESTS = ["fault_injection", "coalesce_fault_injection", "reclaim_fault_injection", "reclaim_on_device", "soak",
             "multi_device", "host_arena_exact_and_chunked", "check_setting"]
