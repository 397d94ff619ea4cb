"""Native memory settings and the free path's quarantine, against the host-memory fake driver.

Each case runs in its own interpreter: native settings are read once per process (at library load), and fault
injection must not leak into other tests.
"""
from __future__ import annotations

import pytest

from ebbtide import _native
from ebbtide.testing import spawn

FAKE = _native.PACKAGE_DIR / "libebbtide_fake_cuda.so"
RUNTIME = _native.PACKAGE_DIR / "libebbtide.so"
pytestmark = pytest.mark.skipif(not FAKE.exists(), reason=f"{FAKE.name} not built (EBBTIDE_TEST_FAKES=OFF)")


def fake_env(**extra) -> dict:
    env = {"EBBTIDE_LIBCUDA": str(FAKE), "EBT_FAKE_DEVICE_BYTES": str(64 << 20)}
    env.update(extra)
    return env


TMS_BOOLS = "one of 0, false, FALSE, no, NO, 1, true, TRUE, yes, YES"
# Every memory setting with a value that must not parse, and a word of what the message says is accepted.
BAD = [
    ("EBBTIDE_MEM_DEFAULT_BACKUP", "CPU", "one of none, cpu, disk"),  # wrongly cased: was "discard" silently
    ("EBBTIDE_MEM_DEFAULT_BACKUP", "ssd", "one of none, cpu, disk"),
    ("EBBTIDE_MEM_MARGIN_BYTES", "-5", "decimal integer >= 0"),      # was 2**64 - 5
    ("EBBTIDE_MEM_MARGIN_BYTES", "18446744073709551616", "decimal integer >= 0"),  # 2**64: overflow
    ("EBBTIDE_MEM_MARGIN_BYTES", "1G", "digits only"),
    ("EBBTIDE_MEM_COALESCE", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("EBBTIDE_MEM_COALESCE_MAX_BYTES", "0", "decimal integer >= 1"),
    ("EBBTIDE_MEM_CHUNK_BYTES", "0", "decimal integer >= 1"),
    ("EBBTIDE_MEM_CHUNK_BYTES", "0x100000", "digits only"),
    ("EBBTIDE_MEM_UNMAP_RUN_BYTES", "lots", "decimal integer >= 1"),
    ("EBBTIDE_MEM_CREATE_AHEAD", "-1", "decimal integer >= 0"),
    ("EBBTIDE_MEM_POISON", "2", "1/true/yes/on"),
    ("EBBTIDE_MEM_PREPIN", "nope", "1/true/yes/on"),
    ("EBBTIDE_MEM_REGISTER_THREADS", "5000", "in [0, 1024]"),
    ("EBBTIDE_MEM_DEFAULT_TAG", "t" * 64, "a tag of 1..63 bytes"),
    ("EBBTIDE_MEM_SHADOW_PIECE_BYTES", "3145728", "a multiple of 2 MiB"),
    ("EBBTIDE_MEM_SHADOW_POPULATE", "fault", "one of madvise, touch, none"),
    # torch_memory_saver's variables take exactly its spellings (it rejects "on" and "True" too)
    ("TMS_INIT_ENABLE", "2", TMS_BOOLS),
    ("TMS_INIT_ENABLE", "on", TMS_BOOLS),
    ("TMS_INIT_ENABLE_CPU_BACKUP", "True", TMS_BOOLS),
    ("TMS_INIT_ENABLE_DISK_BACKUP", "enabled", TMS_BOOLS),
    ("TMS_RETAIN_CPU_BACKUP", "yes please", TMS_BOOLS),
    ("TMS_INIT_CPU_BACKUP_BACKEND", "MMAP", "one of pinned, mmap"),
    ("TMS_INIT_CPU_BACKUP_BACKEND", "cuda", "one of pinned, mmap"),
]

# Every entry the Python layer reaches, each must raise the same SettingError; ebt_torch_malloc returns NULL.
PROBE = """
    import ctypes
    from ebbtide import _native
    from ebbtide.errors import SettingError
    N = _native.load().memory
    calls = {
        "stats": N.stats, "global_stats": N.global_stats, "malloc": lambda: N.malloc(1 << 20, 0, "t", 0),
        "free": lambda: N.free(4096), "pause": lambda: N.pause("t"), "resume": lambda: N.resume("t"),
        "pause_async": lambda: N.pause_async("t"), "region_push": lambda: N.region_push("t", 0),
        "set_default_region": lambda: N.set_default_region("t", 0), "current_region": N.current_region,
        "memory_margin": N.memory_margin, "set_memory_margin": lambda: N.set_memory_margin(0),
        "coalescing": N.coalescing, "paused_ranges": N.paused_ranges, "tag_state": lambda: N.tag_state("t"),
        "release_host_memory": N.release_host_memory, "reset_for_testing": N.reset_for_testing,
        "shim_active": N.shim_active,
    }
    seen = set()
    for name, call in calls.items():
        try:
            call()
        except SettingError as e:
            seen.add((e.name, e.value, str(e)[str(e).index(e.name + "='"):]))
        else:
            raise SystemExit(f"{name} did not raise SettingError")
    assert len(seen) == 1, seen
    name, value, message = seen.pop()
    R = ctypes.CDLL(_native.runtime_library_path())
    R.ebt_torch_malloc.restype = ctypes.c_void_p
    R.ebt_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert not R.ebt_torch_malloc(1 << 20, 0, None)
    print(name)
    print(value)
    print(message)
"""


@pytest.mark.parametrize("var,value,accepted", BAD, ids=[f"{v}={x[:12]}" for v, x, _ in BAD])
def test_bad_memory_setting_fails_every_memory_call(var, value, accepted):
    p = spawn.python(PROBE, extra_env=fake_env(**{var: value}))
    name, got, message = p.stdout.splitlines()[:3]
    assert (name, got) == (var, value)
    assert message.startswith(f"{var}='{value}' is not a valid setting: expected ") and accepted in message
    assert f"memory engine disabled: {var}='{value}'" in p.stderr  # said once, at library load


def test_good_values_in_every_accepted_spelling():
    p = spawn.python("""
        import ebbtide.memory as em
        from ebbtide import _native
        N = _native.load().memory
        print(N.memory_margin(), N.coalescing(), N.current_region())
    """, extra_env=fake_env(EBBTIDE_MEM_MARGIN_BYTES=" 4096 ", EBBTIDE_MEM_COALESCE="Yes", EBBTIDE_MEM_POISON="off",
                      EBBTIDE_MEM_PREPIN="TRUE", EBBTIDE_MEM_CHUNK_BYTES="1048576", TMS_INIT_ENABLE="true",
                      TMS_INIT_ENABLE_CPU_BACKUP="YES", EBBTIDE_MEM_DEFAULT_BACKUP="none"))
    assert p.stdout.split()[:2] == ["4096", "True"]
    # TMS_INIT_ENABLE: tag "default", a CPU copy with torch_memory_saver's semantics (transient: 1 | 0x200)
    assert "'default', 513" in p.stdout


def test_tms_settings_pick_its_semantics():
    # TMS_INIT_CPU_BACKUP_BACKEND=mmap makes the default region's copies pageable (1 | 0x200 | 0x400);
    # TMS_RETAIN_CPU_BACKUP=1 turns host retention on; TMS_INIT_ENABLE_DISK_BACKUP backs up to disk (2).
    p = spawn.python("""
        from ebbtide import _native
        N = _native.load().memory
        print(N.current_region()[1], N.host_retention())
    """, extra_env=fake_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_INIT_CPU_BACKUP_BACKEND="mmap",
                      TMS_RETAIN_CPU_BACKUP="yes"))
    assert p.stdout.split() == ["1537", "True"], p.stdout
    p = spawn.python("from ebbtide import _native; N = _native.load().memory; print(N.current_region()[1])",
                     extra_env=fake_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_DISK_BACKUP="TRUE"))
    assert p.stdout.split() == ["2"], p.stdout
    # both backups at once: refused by name (the original asserts on it at the first allocation)
    p = spawn.python("""
        from ebbtide import _native
        from ebbtide.errors import SettingError
        try:
            _native.load().memory.stats()
        except SettingError as e:
            print(e)
    """, extra_env=fake_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_INIT_ENABLE_DISK_BACKUP="1"))
    assert "TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are both set" in p.stdout, p.stdout


@pytest.mark.parametrize("var,value,accepted", [
    ("TMS_DISK_BACKUP_CHUNK_MB", "1.5", "decimal integer"),
    ("TMS_DISK_BACKUP_CHUNK_MB", "8192", "in [0, 4096]"),
    ("EBBTIDE_MEM_DISK_CHUNK_BYTES", "1000", "a multiple of 4096"),
    ("EBBTIDE_MEM_DISK_THREADS", "0", "in [1, 64]"),
    ("TMS_DISK_BACKUP_DIR", "relative/dir", "an absolute path"),
])
def test_bad_disk_setting_fails_the_disk_tier_only(var, value, accepted):
    # Read at the disk tier's first use (as torch_memory_saver reads its own): that call raises SettingError
    # naming the variable; the rest of the engine works.
    p = spawn.python("""
        import ebbtide.memory as em
        from ebbtide.errors import SettingError
        em.stats()
        try:
            em.disk_backup_dir()
        except SettingError as e:
            print(e.name, "|", e)
    """, extra_env=fake_env(**{var: value}))
    name, message = p.stdout.strip().split(" | ", 1)
    assert name == var and accepted in message, p.stdout


def test_empty_value_means_default():
    p = spawn.python("""
        from ebbtide import _native
        N = _native.load().memory
        print(N.memory_margin(), N.coalescing())
    """, extra_env=fake_env(EBBTIDE_MEM_MARGIN_BYTES="", EBBTIDE_MEM_COALESCE="  "))
    assert p.stdout.split() == ["0", "True"]  # the defaults: no margin, coalescing on


def test_setting_values_are_logged_at_info():
    p = spawn.python("from ebbtide import _native; print(_native.load().memory.memory_margin())",
                     extra_env=fake_env(EBBTIDE_DEBUG="INFO", EBBTIDE_MEM_MARGIN_BYTES="8192"))
    assert "setting EBBTIDE_MEM_MARGIN_BYTES = 8192" in p.stderr
    assert "setting EBBTIDE_MEM_CHUNK_BYTES = 67108864 (default)" in p.stderr


def test_preloaded_cudamalloc_fails_with_init_error_under_a_bad_setting():
    """Under LD_PRELOAD the interposer refuses every cudaMalloc (cudaErrorInitializationError = 3) and says why
    once: forwarding would silently drop the capture the process asked for."""
    p = spawn.python("""
        import ctypes
        glob = ctypes.CDLL(None)
        ptr = ctypes.c_void_p()
        print(glob.cudaMalloc(ctypes.byref(ptr), 1 << 20), glob.cudaMalloc(ctypes.byref(ptr), 1 << 20))
    """, extra_env=fake_env(LD_PRELOAD=str(RUNTIME), EBBTIDE_MEM_DEFAULT_TAG="trainer",
                            EBBTIDE_MEM_DEFAULT_BACKUP="CPU"))
    assert p.stdout.split() == ["3", "3"]
    assert p.stderr.count("cudaMalloc(1048576) refused: EBBTIDE_MEM_DEFAULT_BACKUP='CPU'") == 1


# ---- quarantine: a free whose unmap the driver refuses -----------------------------------------------------

QUARANTINE = """
    import ctypes, os
    import ebbtide.memory as em
    from ebbtide import _native
    from ebbtide.errors import DriverError
    FAKE = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
    N = _native.load().memory
    MiB = 1 << 20

    def counters():
        a = (ctypes.c_longlong * 8)()
        FAKE.ebt_fake_counters(a)
        return dict(zip(["handles", "phys", "mappings"], a))

    # 1. One refusal: free retries once, the memory goes back, nothing is quarantined.
    p = N.malloc(4 * MiB, 0, "q", 0)
    FAKE.ebt_fake_set_fault(b"cuMemUnmap", 1, 1)
    calls = FAKE.ebt_fake_calls(b"cuMemUnmap")
    assert N.free(p)
    assert FAKE.ebt_fake_calls(b"cuMemUnmap") == calls + 2
    assert counters()["mappings"] == 0 and counters()["phys"] == 0, counters()
    g = N.global_stats()
    assert g["quarantined_ranges"] == 0 and g["quarantined_bytes"] == 0, g

    # 2. Refused twice: the allocation is gone, its range quarantined (counted, reported, never reused).
    p = N.malloc(4 * MiB, 0, "q", 0)
    FAKE.ebt_fake_set_fault(b"cuMemUnmap", -1, 1)
    try:
        N.free(p)
    except DriverError as e:
        assert "quarantined" in str(e) and "twice" in str(e), e
    else:
        raise SystemExit("free did not report the refused unmap")
    FAKE.ebt_fake_set_fault(b"cuMemUnmap", 0, 0)
    g = N.global_stats()
    assert g["quarantined_ranges"] == 1 and g["quarantined_bytes"] == 4 * MiB, g
    assert not N.free(p)                      # no longer the engine's
    assert counters()["mappings"] == 1        # still mapped: the driver kept it
    others = [N.malloc(2 * MiB, 0, "q", 0) for _ in range(8)]
    assert all(not (p <= o < p + 4 * MiB) for o in others), "a quarantined range was handed out again"
    r = em.release_report(device=0)
    assert r.quarantined_ranges == 1 and r.quarantined_bytes == 4 * MiB, r
    assert any("quarantined" in n for n in r.notes), r.notes
    for o in others:
        assert N.free(o)

    # 3. reset tries the quarantined range once more and forgets it: nothing is left behind.
    N.reset_for_testing()
    assert counters()["mappings"] == 0 and counters()["phys"] == 0, counters()
    assert N.global_stats()["quarantined_ranges"] == 0
    print("OK")
"""


def test_free_retries_then_quarantines_a_refused_unmap():
    p = spawn.python(QUARANTINE, extra_env=fake_env(EBBTIDE_MEM_PREPIN="0"))
    assert p.stdout.strip().endswith("OK")
    assert "quarantined (never reused)" in p.stderr  # the WARN line


def test_coalesced_free_quarantines_the_whole_mapping():
    """The last live member's free unmaps the whole coalesced mapping: if the driver refuses twice, the whole
    range is quarantined (no member's VA goes back)."""
    p = spawn.python("""
        import ctypes, os
        import ebbtide.memory as em
        from ebbtide import _native
        from ebbtide.errors import DriverError
        FAKE = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
        N = _native.load().memory
        MiB = 1 << 20
        N.set_coalescing(True)
        with em.region("c"):
            pass
        ps = [N.malloc(2 * MiB, 0, "c", 0) for _ in range(3)]
        em.pause("c")
        em.resume("c")
        assert N.global_stats()["coalesced_mappings"] == 1, N.global_stats()
        assert N.free(ps[0]) and N.free(ps[1])
        FAKE.ebt_fake_set_fault(b"cuMemUnmap", -1, 1)
        try:
            N.free(ps[2])
        except DriverError as e:
            assert "quarantined" in str(e), e
        else:
            raise SystemExit("free did not report the refused unmap")
        FAKE.ebt_fake_set_fault(b"cuMemUnmap", 0, 0)
        g = N.global_stats()
        assert g["quarantined_ranges"] == 1 and g["quarantined_bytes"] == 6 * MiB, g
        N.reset_for_testing()
        print("OK")
    """, extra_env=fake_env(EBBTIDE_MEM_PREPIN="0"))
    assert p.stdout.strip().endswith("OK")


def test_retyped_error_keeps_its_message():
    """A pinned-host registration refused for lack of memory becomes HOST_OUT_OF_MEMORY with the driver's message
    (re-typing an error passes the thread's own message back in: it must survive)."""
    p = spawn.python("""
        import ctypes, os
        from ebbtide import _native
        from ebbtide.errors import HostOutOfMemoryError
        FAKE = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
        N = _native.load().memory
        p = N.malloc(1 << 20, 0, "h", 1)
        FAKE.ebt_fake_set_fault(b"cuMemHostRegister", 1, 2)
        try:
            N.pause("h")
        except HostOutOfMemoryError as e:
            print(str(e))
        N.free(p)
    """, extra_env=fake_env(EBBTIDE_MEM_PREPIN="0"))
    assert "cuMemHostRegister (host arena)" in p.stdout
