"""The memory C ABI under random call sequences with injected driver faults (tests/memory/capi_fuzz.py).

Seeded and time-bounded: EBT_FUZZ_SEEDS (comma list, default 1,2,3) and EBT_FUZZ_SECONDS per seed (default 6) set
the budget; a failure prints the seed and the calls before it, and ``python capi_fuzz.py SEED SECONDS MAX_OPS``
(with EBBTIDE_LIBCUDA at the fake) replays it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ebbtide import _native
from ebbtide.testing import spawn

HERE = Path(__file__).resolve().parent
FAKE = _native.PACKAGE_DIR / "libebbtide_fake_cuda.so"
SEEDS = [int(s) for s in os.environ.get("EBT_FUZZ_SEEDS", "1,2,3").split(",") if s.strip()]
SECONDS = float(os.environ.get("EBT_FUZZ_SECONDS", "6"))

pytestmark = pytest.mark.skipif(not FAKE.exists(), reason=f"{FAKE.name} not built (EBBTIDE_TEST_FAKES=OFF)")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_calls_keep_the_invariants(seed):
    env = dict(os.environ, EBBTIDE_LIBCUDA=str(FAKE), EBT_FAKE_DEVICE_BYTES=str(64 << 20), EBBTIDE_MEM_PREPIN="0",
               EBBTIDE_DEBUG="NONE")
    env.pop("LD_PRELOAD", None)
    p = spawn.command([sys.executable, HERE / "capi_fuzz.py", seed, SECONDS], env=env, timeout=SECONDS + 120,
                      check=False)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0 and last.startswith("OK "), f"{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-3000:]}"
    assert int(last.split()[1]) > 100  # it did run
