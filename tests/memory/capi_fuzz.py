"""A seeded random driver for the memory C ABI, against the host-memory fake driver with fault injection.

Run as ``python capi_fuzz.py SEED SECONDS [MAX_OPS]`` with EBBTIDE_LIBCUDA pointing at libebbtide_fake_cuda.so (the test
module does this). It calls the exported ``ebt_mem_*`` functions through ctypes with random, often invalid,
arguments, arms random driver faults, and after every call checks what must always hold:

- a failing call returns a known status and leaves a message (``ebt_last_error``);
- every allocation the model holds is still the engine's, with its base, size and tag (invalid calls and failed
  operations lose nothing);
- the engine's live-allocation count equals the model's;
- no tag is left busy by a synchronous call;
- a CPU-backed allocation that is active holds the bytes last written to it, across pauses, resumes and their
  rollbacks (a discard allocation is refilled whenever it is found active);
- at the end, with faults cleared: everything frees, and after reset no handle, mapping, physical byte or
  reservation is left.

Exit status 0 and a last line "OK <ops>" = pass; on failure the seed and the op log tail are printed.
"""
from __future__ import annotations

import ctypes
import os
import random
import sys
import time

from ebbtide import _native

MiB = 1 << 20
FAKE = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
FAKE.ebt_fake_calls.restype = ctypes.c_long
LIB = ctypes.CDLL(_native.runtime_library_path())
LIB.ebt_last_error.restype = ctypes.c_char_p
LIB.ebt_mem_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p,
                               ctypes.c_int]
LIB.ebt_mem_free.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
LIB.ebt_mem_pause.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
LIB.ebt_mem_resume.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
LIB.ebt_mem_mark_clean.argtypes = [ctypes.c_char_p]
LIB.ebt_mem_lookup.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                               ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
LIB.ebt_mem_tag_state.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_ulonglong)]
LIB.ebt_mem_region_push.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
LIB.ebt_mem_region_pop.argtypes = [ctypes.c_int]
LIB.ebt_mem_set_memory_margin.argtypes = [ctypes.c_size_t]
LIB.ebt_mem_set_coalescing.argtypes = [ctypes.c_int]
LIB.ebt_mem_stats.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
LIB.ebt_mem_global_stats.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIB.ebt_mem_get_cpu_backup.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.POINTER(ctypes.c_size_t)]
N = _native.load().memory

STATUS_COUNT = _native.load().status_count()
TAGS = [b"w", b"kv", b"act"]
BAD_TAGS = [None, b"", b"x" * 64, b"nosuchtag"]
FAULT_CALLS = [b"cuMemCreate", b"cuMemMap", b"cuMemSetAccess", b"cuMemRelease", b"cuMemUnmap", b"cuMemcpyDtoHAsync",
               b"cuMemcpyHtoDAsync", b"cuEventSynchronize", b"cuEventRecord", b"cuCtxSynchronize",
               b"cuMemHostRegister", b"cuStreamSynchronize", b"cuMemAddressReserve", b"cuMemGetInfo"]
TAG_PAUSED = 1


def fake_counters() -> dict:
    a = (ctypes.c_longlong * 8)()
    FAKE.ebt_fake_counters(a)
    return dict(zip(["handles", "phys", "mappings", "reservations", "reserved", "registered"], a))


class Failure(AssertionError):
    pass


class Fuzz:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.live: dict[int, dict] = {}   # ptr -> {size, tag, backup, data}
        self.tokens: list[int] = []      # region tokens pushed on this thread
        self.log: list[str] = []
        self.ops = 0
        self.armed = None  # (call name, its call count once the armed fault has fired)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def call(self, name: str, *args) -> int:
        st = getattr(LIB, name)(*args)
        self.log.append(f"{name}{tuple(a if isinstance(a, (int, bytes, type(None))) else '.' for a in args)} -> {st}")
        if not 0 <= st < STATUS_COUNT:
            raise Failure(f"{name} returned unknown status {st}")
        if st != 0 and not LIB.ebt_last_error():
            raise Failure(f"{name} failed ({st}) without a message")
        return st

    def lookup(self, ptr: int):
        base, size, paused = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_int()
        tag = ctypes.create_string_buffer(64)
        st = LIB.ebt_mem_lookup(ptr, ctypes.byref(base), ctypes.byref(size), tag, ctypes.byref(paused))
        return st, base.value, size.value, tag.value, paused.value

    def fill(self, ptr: int, a: dict) -> None:
        n = min(a["size"], 4096)  # the first page: enough to see lost or stale content, cheap to write and read
        data = bytes(self.rng.getrandbits(8) for _ in range(16)) * (n // 16) + bytes(n % 16)
        ctypes.memmove(ptr, data, n)
        a["data"] = data

    def check(self) -> None:
        for ptr, a in self.live.items():
            st, base, size, tag, paused = self.lookup(ptr)
            if st != 0 or base != ptr or size != a["size"] or tag != a["tag"]:
                raise Failure(f"allocation 0x{ptr:x} {a['tag']} {a['size']}: lookup -> {st} {base} {size} {tag} "
                              f"({LIB.ebt_last_error()})")
            if paused:
                continue
            if a["backup"] == 1 and a["data"] is not None:
                got = ctypes.string_at(ptr, len(a["data"]))
                if got != a["data"]:
                    raise Failure(f"CPU-backed allocation 0x{ptr:x} ({a['tag']}) lost its content")
            if a["backup"] == 0 or a["data"] is None:
                self.fill(ptr, a)
        g = N.global_stats()
        if g["live_allocations"] != len(self.live):
            raise Failure(f"engine holds {g['live_allocations']} allocations, model {len(self.live)}")
        # The engine keeps no handle reference (a mapping alone holds its memory), so the driver's live handles are
        # exactly its mappings, and those are the engine's mappings plus quarantined ranges.
        c = fake_counters()
        mapped = sum(row["handles"] for row in N.stats()) + g["quarantined_ranges"]
        if c["handles"] != c["mappings"] or c["mappings"] != mapped:
            raise Failure(f"driver holds {c['handles']} handles and {c['mappings']} mappings; engine maps {mapped}")
        for t in TAGS:
            state, pauses = ctypes.c_int(), ctypes.c_ulonglong()
            if LIB.ebt_mem_tag_state(t, ctypes.byref(state), ctypes.byref(pauses)) == 0 and state.value not in (0, 1):
                raise Failure(f"tag {t} left in state {state.value} after a synchronous call")

    # ---- operations -------------------------------------------------------------------------------------------
    def op_malloc(self) -> None:
        r = self.rng
        bad = r.random() < 0.2
        size = r.choice([0, 1, 4096, 3 * MiB]) if bad else r.choice([300, 4096, MiB, 2 * MiB + 5, 3 * MiB])
        tag = r.choice(BAD_TAGS[:3]) if bad and r.random() < 0.5 else r.choice(TAGS)
        backup = r.choice([0, 1, 7, -1]) if bad else r.choice([0, 1])
        device = r.choice([0, 1, -1]) if bad else 0
        p = ctypes.c_void_p()
        st = self.call("ebt_mem_malloc", ctypes.byref(p), size, device, tag, backup)
        if st == 0:
            a = {"size": size, "tag": tag, "backup": backup, "data": None}
            self.live[p.value] = a
            self.fill(p.value, a)
        elif p.value:
            raise Failure(f"failed malloc ({st}) returned a pointer")

    def op_free(self) -> None:
        found = ctypes.c_int(-1)
        if self.live and self.rng.random() < 0.8:
            ptr = self.rng.choice(list(self.live))
            self.call("ebt_mem_free", ptr, ctypes.byref(found))
            if found.value == 1:
                del self.live[ptr]  # gone for the caller whatever the status (a refused unmap is quarantined)
            elif found.value != 0:
                raise Failure("free did not set found")
        else:
            ptr = self.rng.choice([0x1000, 0xdead0000, (max(self.live) + 64) if self.live else 0x2000])
            if self.call("ebt_mem_free", ptr, ctypes.byref(found)) != 0 or found.value != 0:
                raise Failure(f"free of a foreign pointer 0x{ptr:x}: found={found.value}")

    def op_pause_resume(self) -> None:
        tag = self.rng.choice(TAGS + [None] + BAD_TAGS[1:])
        self.call(self.rng.choice(["ebt_mem_pause", "ebt_mem_resume"]), tag, None)

    def op_region(self) -> None:
        r = self.rng
        if self.tokens and r.random() < 0.5:
            tok = self.tokens.pop() if r.random() < 0.8 else r.choice([-1, 99])
            st = self.call("ebt_mem_region_pop", tok)
            if tok in (-1, 99) and st == 0:
                raise Failure("region_pop accepted a bad token")
            return
        tok = ctypes.c_int(-1)
        bad = r.random() < 0.3
        tag = r.choice(BAD_TAGS[:3]) if bad else r.choice(TAGS)
        if self.call("ebt_mem_region_push", tag, r.choice([0, 1, 5]) if bad else 0, ctypes.byref(tok)) == 0:
            self.tokens.append(tok.value)

    def op_misc(self) -> None:
        r = self.rng
        k = r.randrange(6)
        if k == 0:
            self.call("ebt_mem_mark_clean", r.choice(TAGS + BAD_TAGS))
        elif k == 1:
            self.call("ebt_mem_set_memory_margin", r.choice([0, 0, 0, 8 * MiB, 1 << 62]))
        elif k == 2:
            self.call("ebt_mem_set_coalescing", r.choice([0, 1, 2, -1]))
        elif k == 3:
            n = ctypes.c_size_t()
            buf = ctypes.create_string_buffer(4096)
            self.call("ebt_mem_stats", buf if r.random() < 0.7 else None, r.choice([8, 200, 4096 // 8]),
                      r.choice([0, 1, 8]), ctypes.byref(n))
        elif k == 4:
            buf = ctypes.create_string_buffer(512)
            self.call("ebt_mem_global_stats", buf if r.random() < 0.8 else None, r.choice([8, 64, 512]))
        else:
            host, after = ctypes.c_void_p(), ctypes.c_size_t()
            ptr = r.choice(list(self.live)) if self.live and r.random() < 0.7 else 0x1234
            self.call("ebt_mem_get_cpu_backup", ptr, ctypes.byref(host), ctypes.byref(after))

    def op_fault(self) -> None:
        # One armed fault at a time: the invariants are for a single driver failure. A second one inside the
        # cleanup of the first (an undo's own cuMemRelease refused) is not something cleanup can always survive.
        if self.armed and FAKE.ebt_fake_calls(self.armed[0]) < self.armed[1]:
            return
        r = self.rng
        name, nth, err = r.choice(FAULT_CALLS), r.randint(1, 6), r.choice([1, 2, 999])
        self.armed = (name, FAKE.ebt_fake_calls(name) + nth)
        FAKE.ebt_fake_set_fault(name, nth, err)
        self.log.append(f"fault {name.decode()} nth={nth} err={err}")

    def run(self, seconds: float, max_ops: int = 0) -> None:
        ops = [(self.op_malloc, 30), (self.op_free, 20), (self.op_pause_resume, 25), (self.op_region, 8),
               (self.op_misc, 12), (self.op_fault, 5)]
        funcs, weights = zip(*ops)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and (not max_ops or self.ops < max_ops):
            self.rng.choices(funcs, weights)[0]()
            self.ops += 1
            self.check()
        self.finish()

    def finish(self) -> None:
        for name in FAULT_CALLS:
            FAKE.ebt_fake_set_fault(name, 0, 0)
        while self.tokens:
            LIB.ebt_mem_region_pop(self.tokens.pop())
        LIB.ebt_mem_set_memory_margin(0)
        for t in TAGS:  # every tag that fits comes back with its content; one that does not fit stays paused
            st = LIB.ebt_mem_resume(t, None)
            if st not in (0, 3, 7):
                raise Failure(f"final resume of {t} failed: {LIB.ebt_last_error()}")
        self.check()
        for ptr in list(self.live):
            found = ctypes.c_int()
            if LIB.ebt_mem_free(ptr, ctypes.byref(found)) != 0 or found.value != 1:
                raise Failure(f"final free of 0x{ptr:x}: {LIB.ebt_last_error()}")
            del self.live[ptr]
        N.release_host_memory()
        if N.global_stats()["live_allocations"] != 0:
            raise Failure("allocations left after freeing everything")
        N.reset_for_testing()
        left = fake_counters()
        if any(left.values()):
            raise Failure(f"left behind after reset: {left}")


def main() -> None:
    seed, seconds = int(sys.argv[1]), float(sys.argv[2])
    max_ops = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # replay: stop after this many ops
    f = Fuzz(seed)
    try:
        f.run(seconds, max_ops)
    except Failure as e:
        print(f"FAIL seed {seed} after {f.ops} ops: {e}")
        print("\n".join(f.log[-int(os.environ.get("EBT_FUZZ_LOG_LINES", "30")):]))
        sys.exit(1)
    print(f"OK {f.ops}")


if __name__ == "__main__":
    main()
