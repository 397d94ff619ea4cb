"""Discard-mode pause/resume cost on a GPU, with the engine's breakdown (not a test: a probe for the H100/H200).

    python tests/memory/discard_probe.py [--n 1024] [--mib 16] [--cycles 5]      one process, current settings
    python tests/memory/discard_probe.py --no-coalesce                             per-allocation mappings
    python tests/memory/discard_probe.py --compare          per size: per-allocation, create-ahead, coalesced

Prints one JSON line per setting: median wall ms of pause and resume, and the last cycle's report (sync, unmap,
unmap_calls, create, map, access, total). unmap_calls == 1 for one VA-contiguous region means the driver accepted
one cuMemUnmap over many mappings; n + 1 means it refused and the engine fell back to one call per allocation.
Coalesced resume (the default; --no-coalesce or EBBTIDE_MEM_COALESCE=0 turns it off) maps each VA-contiguous run
as one mapping: "mappings" in the report says how many the driver saw (pause: unmapped, resume: created).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def probe(n: int, mib: int, cycles: int, coalesce) -> dict:
    import ebbtide.memory as em
    import torch

    if coalesce is not None:  # None: the process's setting
        em.set_coalescing(coalesce)
    with em.region("probe", backup="none"):
        ts = [torch.empty(mib << 20, dtype=torch.uint8, device="cuda") for _ in range(n)]
    for t in ts:
        t.fill_(1)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    em.pause("probe")
    freed = torch.cuda.mem_get_info()[0] - free0
    em.resume("probe")
    ps, rs = [], []
    for _ in range(cycles):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = em.pause("probe")
        t1 = time.perf_counter()
        r = em.resume("probe")
        t2 = time.perf_counter()
        ps.append(t1 - t0)
        rs.append(t2 - t1)
    for t in ts:  # resumed memory is usable
        t.fill_(2)
    torch.cuda.synchronize()
    ms = lambda x: round(x * 1e3, 3)
    return {"n": n, "mib": mib, "create_ahead": os.environ.get("EBBTIDE_MEM_CREATE_AHEAD", "0"),
            "coalesce": em.coalescing(),
            "pause_ms": ms(statistics.median(ps)), "resume_ms": ms(statistics.median(rs)),
            "freed_fraction": round(freed / (n * (mib << 20)), 4),
            "pause": {"sync": ms(p.sync_s), "unmap": ms(p.unmap_s), "unmap_calls": p.unmap_calls,
                      "mappings": p.mappings, "total": ms(p.total_s)},
            "resume": {"create": ms(r.create_s), "map": ms(r.map_s), "access": ms(r.access_s),
                       "mappings": r.mappings, "total": ms(r.total_s)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--coalesce", dest="coalesce", action="store_true", default=None,
                    help="coalesced resume on (ebbtide.memory.set_coalescing; the default)")
    ap.add_argument("--no-coalesce", dest="coalesce", action="store_false", help="one mapping per allocation")
    a = ap.parse_args()
    if not a.compare:
        print(json.dumps(probe(a.n, a.mib, a.cycles, a.coalesce)), flush=True)
        return
    for n, mib in ((a.n, a.mib), (8, a.n * a.mib // 8), (128, 16)):
        for ahead, coalesce in (("0", False), ("8", False), ("0", True)):
            env = dict(os.environ, EBBTIDE_MEM_CREATE_AHEAD=ahead)
            cmd = [sys.executable, __file__, "--n", str(n), "--mib", str(mib), "--cycles", str(a.cycles)]
            subprocess.run(cmd + (["--coalesce"] if coalesce else ["--no-coalesce"]), env=env, check=True)


if __name__ == "__main__":
    main()
