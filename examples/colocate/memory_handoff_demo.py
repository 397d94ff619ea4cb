#!/usr/bin/env python3
"""Memory hand-off demo: a "trainer" and a "rollout engine" take turns on one GPU through pause/resume alone.

    python examples/colocate/memory_handoff_demo.py [--steps 2] [--weights-gib 2] [--fraction 0.55]

Two spawned processes. Each holds CPU-backed weights (``--weights-gib``) and a discardable working set (trainer:
activations, rollout: KV cache) of ``--fraction`` of the GPU's free memory, so the two working sets never fit at
once: the processes can only run because each pauses before the other resumes. Every phase prints the free device
memory it sees after resuming and after pausing, and checks that its weights survived. Host memory used: the two
weight copies (pinned) only. Exit status 0 when every phase checked out.

Nothing but ``ebbtide.memory`` is involved (no model, optimizer or weight sync): run.py beside it is the full
colocated RL loop.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

GiB = 1 << 30


def _free_gib(torch) -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GiB


def _worker(name: str, my_turn, other_turn, steps: int, weights_gib: float, work_bytes: int, out) -> None:
    import torch  # noqa: PLC0415

    import ebbtide.memory as em  # noqa: PLC0415

    def log(msg: str) -> None:
        out.put(f"[{name}] {msg}")

    torch.cuda.init()
    wtag, work_tag = f"{name}-weights", f"{name}-work"
    my_turn.wait()
    my_turn.clear()
    with em.region(wtag, backup="cpu"):
        weights = torch.randn(int(weights_gib * GiB) // 4, device="cuda")
    with em.region(work_tag, backup="none"):
        work = torch.empty(work_bytes, dtype=torch.uint8, device="cuda")
    checksum = float(weights.double().sum())
    for step in range(steps):
        if step > 0:
            my_turn.wait()
            my_turn.clear()
            em.resume(wtag)
            em.resume(work_tag)
        log(f"step {step}: running, free {_free_gib(torch):.2f} GiB (holding {weights_gib:.1f} GiB weights + "
            f"{work_bytes / GiB:.1f} GiB {'activations' if name == 'trainer' else 'KV cache'})")
        assert abs(float(weights.double().sum()) - checksum) <= 1e-6 * abs(checksum) + 1e-3, "weights changed"
        work.fill_(step + 1)  # the phase's work touches all of its memory
        assert int(work[-1].item()) == step + 1
        rep = em.pause()
        log(f"step {step}: paused {rep.bytes / GiB:.2f} GiB in {rep.total_s * 1e3:.0f} ms, free "
            f"{_free_gib(torch):.2f} GiB")
        other_turn.set()
    out.put(f"[{name}] done")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--weights-gib", type=float, default=2.0)
    ap.add_argument("--fraction", type=float, default=0.55, help="working set per process, of the free memory")
    args = ap.parse_args(argv)
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    free = torch.cuda.mem_get_info()[0]
    work = int(free * args.fraction) - int(args.weights_gib * GiB)
    if work <= 0:
        print("--fraction too small for --weights-gib", file=sys.stderr)
        return 2
    print(f"GPU free {free / GiB:.2f} GiB; each process: {args.weights_gib:.1f} GiB weights (CPU-backed) + "
          f"{work / GiB:.2f} GiB working set: the two cannot fit at once", flush=True)
    ctx = mp.get_context("spawn")
    t_turn, r_turn, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=("trainer", t_turn, r_turn, args.steps, args.weights_gib, work, out)),
             ctx.Process(target=_worker, args=("rollout", r_turn, t_turn, args.steps, args.weights_gib, work, out))]
    for p in procs:
        p.start()
    t_turn.set()  # the trainer goes first
    done = 0
    while done < 2 and any(p.is_alive() for p in procs):
        try:
            line = out.get(timeout=5)
        except Exception:  # noqa: BLE001 (queue.Empty: check the workers are alive)
            continue
        print(line, flush=True)
        done += line.endswith("done")
    for p in procs:
        p.join(timeout=60)
    while not out.empty():  # whatever a failing worker said last
        print(out.get(), flush=True)
    ok = done == 2 and all(p.exitcode == 0 for p in procs)
    print("memory hand-off: OK" if ok else f"memory hand-off FAILED: exit codes {[p.exitcode for p in procs]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
