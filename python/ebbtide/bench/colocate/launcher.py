"""Launch the colocated RL loop: for each variant (ebbtide, then the anchors), one trainer process per GPU, each
with its rollout process on the same GPU; collect their results, print the table, write JSON and the PNG.

    ebbtide colocate --gpus 1 --steps 10 --out colocate-out          # = python -m ebbtide.bench.colocate
    ebbtide colocate --gpus 2 --steps 10 --out colocate-out
    ebbtide colocate --trainer megatron --quick --out colocate-out    # Megatron-core GPT, one GPU
    ebbtide colocate --trainer fsdp --quick --out colocate-out        # transformers Qwen3 under FSDP2, one GPU

Policies:
- Every variant runs in fresh processes (neither inherits the other's pools, pinned memory or hooks); the trainer
  ranks never carry LD_PRELOAD, except those of ``options.PRELOADED_TRAINERS`` (AReaL's: torch_memory_saver's
  preload hook with CPU backup, ``ebbtide.anchors.areal.tms_env``); each variant gets its own rendezvous store, served
  by the launcher and listening on
  loopback only (``--store-bind`` names another address, e.g. for ranks on several hosts).
- ``run_loop`` is the entry point for other code (the bench suites): the loop at its default or ``quick`` size.
- Argument errors raise ``ebbtide.InvalidArgumentError`` before anything starts (``config.RunConfig``). A failing
  rank does not hide the others: every rank's result file, exit code and log tail are kept in the results.
- ``--trainer``: "toy" (default; the loop's own model, ``trainer``; variants "ebbtide" and "anchor") or
  "megatron" (a Megatron-core GPT, ``mtrainer``; CUDA only, megatron-core needed; ``--tp``/``--ep``/``--moe-experts``
  for tensor and expert parallelism and a MoE model, the rest of ``--gpus`` data parallel; variants "ebbtide",
  "slime", "slime-ebbtide" and "gpu-tms"). Its default size is ``MEGATRON_MODEL`` (~1.3 B params), ``--quick``
  ``MEGATRON_QUICK``. Or "fsdp" (a transformers Qwen3 under ``fully_shard``, ``ftrainer``; one GPU, or ranks on the
  CPU over Gloo; variants "ebbtide", "verl", "tms" and "cpu-offload"; ``FSDP_MODEL``, Qwen3-1.7B's shape, ``--quick``
  ``FSDP_QUICK``; the rollout decodes eagerly).
- The variants on the torch_memory_saver package (``options.NEEDS_TMS``) run where it is installed; otherwise they
  are reported as "not installed".
- The steady phases (``measure.STEADY_PHASES``: the trainer's forward + backward and the rollout's generate) run the
  same code in every variant; the report puts ebbtide's medians beside each anchor's, and with ``steady_guard``
  "error" (the default) ``main`` exits with status 3 when ebbtide's is more than ``steady_tolerance`` slower.
- Each trainer rank runs in a session of its own with its rollout child: killing a rank (deadline, failed peer,
  Ctrl-C) kills the whole group, and a rollout its trainer left behind is killed once the variant is over, so no
  process keeps holding GPU memory into the next variant. Ranks and rollouts also die with their parent
  (PR_SET_PDEATHSIG): a launcher killed from outside (a test deadline) leaves nothing running.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta

from ...errors import InvalidArgumentError, UnsupportedError
from ...testing.models import ModelConfig
from ._procs import _kill_group, _reap_group, _tail, _wait_all
from .config import (CHOICES, FSDP_MODEL, FSDP_QUICK, MEGATRON_MODEL, MEGATRON_QUICK, QUICK_MODEL, RunConfig,
                     model_for, quick_overrides, trainer_defaults)
from .measure import (STEADY_TOLERANCE, format_report, growth_check, nvml_all_pids, plot_timeline, steady_check,
                      summarize)
from .options import NEEDS_TMS, PRELOADED_TRAINERS, TRAINERS

__all__ = ["parse_args", "run", "run_loop", "main", "run_variant", "PROG"]

PROG = "ebbtide colocate"  # the command users run (also: python -m ebbtide.bench.colocate)


# --flag (config field) -> its help; the words each accepts are config.CHOICES' (options')
_CHOICE_HELP = {
    "scratch_backup": ("the rollout's untagged allocations (cuBLAS workspaces, decode scratch) across its pause: keep "
                       "(default: stay resident and are not paused, as torch_memory_saver leaves untagged memory), "
                       "cpu (paused with a CPU backup: less held, a copy each way), none (discarded)"),
    "decode": ("rollout decode: the per-token step captured once in a CUDA graph and replayed (default), or eager "
               "forwards (same code in both variants; the anchor rollout keeps the graph's memory while paused, "
               "ebbtide's pauses it). On --device cpu the static step runs eagerly; --trainer fsdp decodes eagerly "
               "(its default and only mode)"),
    "groups": ("megatron, ebbtide variant: communicators made at each group's first collective (lazy, default; "
               "release frees those that exist), at creation and reload (eager: WORLD bound to the device), or lazily "
               "and again at reload for the groups the last step used (used: reload_groups(eager=True) over lazy "
               "groups, their warm-ups concurrent). The anchors run slime's settings whatever this says"),
    "nccl_cumem": ("megatron, ebbtide variant: NCCL_CUMEM_ENABLE off (default: slime's actor environment, as the "
                   "anchors run) or on (NCCL's own default; each lazily connected communicator costs ~0.1 s more "
                   "between two GPUs with NCCL 2.28)"),
    "comm_teardown": ("megatron, ebbtide variant: the released communicators' teardown runs in the background, beside "
                      "offload and generate (default), or inside comm_release (joined: the trainer does nothing while "
                      "the rollout generates; for telling the teardown's effect on generate apart)"),
    "cache_trim": ("megatron, ebbtide variant: the caching allocator's free blocks (the activations) go back to the "
                   "device on a thread while the CPU optimizer steps (step), inside the offload (offload), or step at "
                   "DP=EP=1 and offload with the sharded optimizer (auto, default)"),
    "moments": ("megatron, ebbtide variant: Adam's moments in fp32 (default) or bf16 (Megatron's precision-aware "
                "exp_avg_dtype/exp_avg_sq_dtype; 20 instead of 28 bytes per parameter through host memory). The slime "
                "anchors keep fp32 moments: HybridDeviceOptimizer's CPU AdamW has no moment dtype"),
    "sync_fill": ("megatron, ebbtide variant: the weight update filled while the CPU step uploads each bucket "
                  "(streamed; one GPU, dense) or after the step (after; auto, the default, is after: streamed "
                  "measured slower, its fills' Python contending with the CPU step for the GIL)"),
    "anchor_precision_aware": ("megatron, slime anchors: Megatron's --use-precision-aware-optimizer as slime's model "
                               "scripts pass it (on, default: the DistributedOptimizer keeps no fp32 main params on "
                               "the GPU, HybridDeviceOptimizer's CPU copy is the master) or not (off)"),
    "steady_guard": ("when ebbtide's train (forward + backward) or generate median is more than --steady-tolerance "
                     "slower than an anchor's: error (default: exit status 3) or warn"),
}


_TRAINER_DEFAULTED = ("decode",)  # options some trainer defaults otherwise (config.trainer_defaults)


def _parser() -> argparse.ArgumentParser:
    d, m = RunConfig(), ModelConfig()
    p = argparse.ArgumentParser(prog=PROG,
                                description="A colocated RL loop (trainer + rollout on the same GPUs), measured "
                                            "against the same loop on torch_memory_saver / torch tools: ebbtide's "
                                            "benchmark harness (examples/colocate/ shows the public API alone).")
    p.add_argument("--trainer", default=d.trainer, choices=tuple(TRAINERS),
                   help="toy: the loop's own small model (default, no dependencies); megatron: a Megatron-core "
                        "GPT (local layer spec, bf16, DDP; dense or MoE) on ebbtide's adapter, beside the slime "
                        "configuration and the GPU optimizer under torch_memory_saver; fsdp: a transformers Qwen3 "
                        "under FSDP2's fully_shard on ebbtide's adapter, beside verl's paths, AReaL's "
                        "torch_memory_saver preload and CPUOffloadPolicy")
    p.add_argument("--gpus", type=int, default=d.gpus, help="trainer ranks, one per GPU, each with its rollout")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="megatron: tensor-parallel size (divides --gpus; the rest is data parallel, where the ebbtide "
                        "variant runs its distributed optimizer and the anchors Megatron's)")
    p.add_argument("--ep", type=int, default=d.ep,
                   help="megatron MoE: expert-parallel size (divides --gpus and --moe-experts; whole experts per rank)")
    p.add_argument("--moe-experts", type=int, default=d.moe_experts,
                   help="megatron: every layer's MLP a MoE of this many experts of --d-ff each (Megatron's local spec, "
                        "alltoall dispatcher, fp32 router; default 0: dense)")
    p.add_argument("--moe-topk", type=int, default=d.moe_topk, help="megatron MoE: experts per token")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of the medians")
    p.add_argument("--quick", action="store_true", help="a small model and short decode (the bench suite's size)")
    for f in dataclasses.fields(ModelConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f"model_{f.name}", type=int, default=None,
                       help=f"model {f.name} (default {getattr(m, f.name)}; --quick: {getattr(QUICK_MODEL, f.name)}; "
                            f"megatron {getattr(MEGATRON_MODEL, f.name)}, quick {getattr(MEGATRON_QUICK, f.name)}; "
                            f"fsdp {getattr(FSDP_MODEL, f.name)}, quick {getattr(FSDP_QUICK, f.name)})")
    p.add_argument("--batch", type=int, default=d.batch, help="training sequences per rank per step")
    p.add_argument("--seq", type=int, default=d.seq, help="training sequence length")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--kv-reserve-gb", type=float, default=d.kv_reserve_gb,
                   help="extra KV-cache pool the rollout holds (as an engine would), paused with it")
    p.add_argument("--verify-batch", type=int, default=d.verify_batch, help="prompts of the logits check")
    p.add_argument("--verify-len", type=int, default=d.verify_len, help="tokens per prompt of the logits check")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--variants", default=None,
                   help="comma list of: " + "; ".join(f"{', '.join(v)} ({t})" for t, (_m, v) in TRAINERS.items())
                        + "; default all")
    for dest, text in _CHOICE_HELP.items():  # a trainer's own default (trainer_defaults) where the flag is absent
        default = None if dest in _TRAINER_DEFAULTED else getattr(d, dest)
        p.add_argument("--" + dest.replace("_", "-"), default=default, choices=CHOICES[dest], help=text)
    p.add_argument("--memory-history", action="store_true",
                   help="megatron, a diagnostic: each trainer records its allocations' frames, so the offload "
                        "phase's residual_blocks name what keeps torch's pool reserved (the steps run slower)")
    p.add_argument("--steady-tolerance", type=float, default=d.steady_tolerance,
                   help=f"allowed slowdown of the steady phases, a fraction (default {STEADY_TOLERANCE})")
    p.add_argument("--timeout", type=int, default=d.timeout_s, dest="timeout_s", help="seconds per variant")
    p.add_argument("--out", default=d.out, help="directory for results.json, timeline.png and logs")
    p.add_argument("--store-bind", default=d.store_bind,
                   help="address the ranks' rendezvous store listens on (default loopback: nothing off this host "
                        "can reach it); 0.0.0.0 listens on every interface")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="cuda (default where a CUDA GPU is visible) or cpu (default without one): the orchestration "
                        "check without a GPU (no pause/resume, no NVML; ranks use Gloo; the ebbtide variant and the "
                        "eager decode unless --variants / --decode name others)")
    return p


def _cuda_devices() -> int:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_for_hardware(trainer, device, variants, decode, cuda_devices: int) -> tuple:
    """(device, variants, decode, what was picked, "" if nothing) for the flags the user left out (variants and
    decode stay None where nothing is picked: the trainer's defaults apply): the GPU where
    one is visible, else the CPU with what runs there (the ebbtide variant: the anchors pause and resume through
    torch_memory_saver on a GPU; the eager decode: a CUDA graph needs a GPU). The Megatron trainer has no CPU run:
    it stays on cuda (and run() says no GPU is visible)."""
    said = []
    if device is None and trainer == "megatron":
        device = "cuda"
    if device is None:
        device = "cuda" if cuda_devices else "cpu"
        said.append(f"device {device} ({cuda_devices} CUDA GPU(s) visible)" if cuda_devices else
                    "device cpu (no CUDA GPU visible: the orchestration check)")
    if device == "cpu":
        if variants is None:
            variants = ("ebbtide",)
            said.append("variants ebbtide (the anchors need a GPU)")
        if decode is None and "decode" not in trainer_defaults(trainer):  # (a trainer that always decodes eagerly)
            decode = "eager"
            said.append("decode eager (a CUDA graph needs a GPU)")
    return device, variants, decode, "; ".join(said)


def parse_args(argv=None, *, cuda_devices: int | None = None, log=None) -> RunConfig:
    """Command line -> validated RunConfig. With ``cuda_devices`` (the CUDA GPUs visible; ``main`` asks torch) the
    device, and on the CPU the variants and decode, are picked for that hardware where no flag names them, and
    ``log`` (if given) is told what was picked; None assumes a GPU (device cuda). Bad values raise
    InvalidArgumentError (argparse's own type errors exit with usage, as argparse does)."""
    return _parse_args(argv, cuda_devices=cuda_devices, log=log)


def _parse_args(argv, *, cuda_devices, log) -> RunConfig:
    a = _parser().parse_args(argv)
    base = model_for(a.trainer, a.quick)
    model = ModelConfig(**{f.name: (getattr(a, f"model_{f.name}") if getattr(a, f"model_{f.name}") is not None
                                    else getattr(base, f.name)) for f in dataclasses.fields(ModelConfig)})
    kw = {k: getattr(a, k) for k in ("gpus", "tp", "ep", "moe_experts", "moe_topk", "steps", "warmup", "batch",
                                     "seq", "gen_batch", "prompt_len", "new_tokens", "kv_reserve_gb", "lr", "seed",
                                     "scratch_backup", "decode", "groups", "nccl_cumem", "comm_teardown", "cache_trim",
                                     "moments", "memory_history", "sync_fill", "anchor_precision_aware",
                                     "steady_guard", "steady_tolerance",
                                     "timeout_s", "verify_batch", "verify_len", "out", "store_bind")}
    if a.quick:
        q = quick_overrides()
        for k, v in q.items():
            if getattr(a, k) == getattr(RunConfig(), k):
                kw[k] = v
    variants = None if a.variants is None else tuple(v.strip() for v in a.variants.split(",") if v.strip())
    device = a.device or ("cuda" if cuda_devices is None else None)
    kw["device"], variants, kw["decode"], said = pick_for_hardware(a.trainer, device, variants, kw["decode"],
                                                                   cuda_devices or 0)
    for k in _TRAINER_DEFAULTED:
        if kw[k] is None:
            kw[k] = trainer_defaults(a.trainer).get(k, getattr(RunConfig(), k))
    cfg = RunConfig(model=model, trainer=a.trainer, variants=variants, **kw).validate()
    if said and log is not None:
        log(f"{PROG}: picked {said}")
    return cfg


def run_variant(cfg: RunConfig, variant: str, log=print) -> dict:
    """Run one variant on cfg.gpus ranks; returns {"ranks": [...], "failed": [...], ...}."""
    os.makedirs(cfg.out, exist_ok=True)
    spec = cfg.worker_spec(variant)
    spec["baseline_pids"] = [p for p in nvml_all_pids() if p != os.getpid()] if cfg.device == "cuda" else []
    spec["baseline_pids"].append(os.getpid())  # the launcher itself (the bench runner holds a context)
    spec["launcher_pid"] = os.getpid()  # ranks (and their rollouts) die with the launcher (PR_SET_PDEATHSIG)
    spec = json.dumps(spec)
    base_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if (cfg.trainer, variant) in PRELOADED_TRAINERS:  # as AReaL starts its trainer (its rollout starts without)
        from ...anchors.areal import tms_env  # noqa: PLC0415

        try:
            base_env = tms_env(base_env)
        except RuntimeError as e:  # the package without its preload library: this variant cannot start
            return {"ranks": [], "failed": [{"rank": 0, "rc": None, "why": str(e), "log": ""}]}
    from ebbtide.comm import serve_store  # noqa: PLC0415

    # Served here for the variant's lifetime (ranks only connect): one listener, on store_bind only.
    store = serve_store(bind=cfg.store_bind, timeout=timedelta(seconds=cfg.timeout_s + 60))
    procs = []
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host: Gloo groups listen on loopback
    for r in range(cfg.gpus):
        env = dict(base_env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(cfg.gpus),
                   LOCAL_WORLD_SIZE=str(cfg.gpus), MASTER_ADDR=store.host,
                   MASTER_PORT=str(store.port))
        res = os.path.join(cfg.out, f"{variant}-rank{r}.json")
        logp = os.path.join(cfg.out, f"{variant}-rank{r}.log")
        if os.path.exists(res):
            os.remove(res)
        logf = open(logp, "w")  # noqa: SIM115 (closed below)
        module = TRAINERS[cfg.trainer][0]
        procs.append((r, subprocess.Popen([sys.executable, "-m", module, spec, res], env=env,
                                          stdout=logf, stderr=subprocess.STDOUT, start_new_session=True),
                      res, logp, logf))
    where = f"{cfg.gpus} GPU(s)" if cfg.device == "cuda" else f"{cfg.gpus} CPU rank(s)"
    log(f"colocate: {variant} on {where}, logs in {cfg.out}/{variant}-rank*.log")
    try:
        killed = _wait_all([p for _, p, *_ in procs], cfg.timeout_s)
    finally:  # Ctrl-C or an error here: no rank (nor its rollout) outlives the launcher
        for _, p, *_ in procs:
            if p.poll() is None:
                _kill_group(p)
        del store
    ranks, failed = [], []
    for r, p, res, logp, logf in procs:
        rc = p.wait()
        _reap_group(p.pid)
        logf.close()
        if r in killed:
            failed.append({"rank": r, "rc": rc, "why": killed[r], "log": _tail(logp)})
        try:
            with open(res) as f:
                out = json.load(f)
            os.remove(res)  # its content goes into results.json (fewer files to carry back from a GPU host)
        except (OSError, ValueError) as e:
            out = {"ok": False, "error": f"no result file ({e})"}
        out["rc"] = rc
        ranks.append(out)
        if rc != 0 or not out.get("ok"):
            failed.append({"rank": r, "rc": rc, "why": out.get("error", "").strip().splitlines()[-1:] or "exit code",
                           "log": _tail(logp)})
    return {"ranks": ranks, "failed": failed}


def _checks(ranks: list[dict], warmup: int) -> dict:
    verify = [v for r in ranks for v in r.get("checks", {}).get("verify", [])]
    growth = [growth_check(r.get("memory", []), warmup) for r in ranks]
    by_step: dict = {}
    for v in verify:
        by_step.setdefault(v["step"], set()).add(v.get("trainer_weights_digest"))
    return {
        "correct": all(v["ok"] for v in verify) if verify else None,
        "ranks_in_sync": all(len(d) == 1 for d in by_step.values()) if len(ranks) > 1 and by_step else None,
        "verify": verify,
        "no_growth": all(g["ok"] for g in growth) if all(g["ok"] is not None for g in growth) else None,
        "growth": [{k: g.get(k) for k in ("ok", "growth_bytes", "tolerance", "phase", "why")} for g in growth],
    }


def _goals(res: dict) -> dict:
    v = res["variants"]
    out = {}
    ours = v.get("ebbtide", {}).get("summary")
    for name, info in v.items():
        anchor = info.get("summary")
        if name == "ebbtide" or not (ours and anchor and ours["step_s"]):
            continue
        sp = anchor["step_s"] / ours["step_s"]
        if name == "anchor":
            out["step speed-up vs anchor (goal >= 2x)"] = f"{sp:.2f}x ({'met' if sp >= 2 else 'NOT met'})"
        else:  # the Megatron loop: the whole step, and the step outside train and generate (the overhead)
            o_ours, o_anchor = _overhead(ours), _overhead(anchor)
            out[f"step speed-up vs {name}"] = (f"{sp:.2f}x; overhead (everything but train and generate) "
                                               f"{o_anchor / o_ours:.2f}x ({o_ours * 1e3:.1f} vs "
                                               f"{o_anchor * 1e3:.1f} ms)" if o_ours else f"{sp:.2f}x")
    if ours:
        ctx = v["ebbtide"]["ranks"][0].get("setup", {}).get("context_bytes")
        held = ours["memory"].get("generate", {}).get("trainer_nvml")
        if ctx is not None and held is not None:
            beyond = held - ctx
            out["trainer GPU memory during generation beyond its CUDA context (goal <= 1 GB)"] = (
                f"{beyond / 1e9:.3f} GB ({'met' if beyond <= 1e9 else 'NOT met'}; held {held / 1e9:.3f} GB, "
                f"context {ctx / 1e9:.3f} GB)")
        else:
            out["trainer GPU memory during generation"] = "no NVML per-process reading (see nvml in setup)"
        paths, opt = ours.get("paths_s") or {}, ours["phase_s"].get("optimizer")
        if paths.get("update") and opt:
            r = paths["update"] / opt
            out["backward done -> rollout holds the new weights (goal <= 1.1x the optimizer step)"] = (
                f"{r:.2f}x ({'met' if r <= 1.1 else 'NOT met'}; {paths['update'] * 1e3:.1f} vs {opt * 1e3:.1f} ms)")
            over = _overhead(ours)
            out["everything but train and generate (goal <= 1.15x the optimizer step)"] = (
                f"{over / opt:.2f}x ({'met' if over / opt <= 1.15 else 'NOT met'})")
        if paths.get("restart") is not None:
            r = paths["restart"]
            out["rollout paused -> the first forward (goal <= 20 ms)"] = (
                f"{r * 1e3:.1f} ms ({'met' if r <= 0.02 else 'NOT met'})")
    return out


def _overhead(summary: dict) -> float:
    """Seconds of a step outside the train and generate phases (the median phases' sum)."""
    return sum(t for k, t in summary["phase_s"].items() if k not in ("train", "generate"))


def run(cfg: RunConfig, log=print) -> dict:
    """Run every requested variant and build the results (also written to cfg.out/results.json)."""
    cfg.validate()
    if cfg.trainer == "megatron" and importlib.util.find_spec("megatron") is None:
        raise UnsupportedError("--trainer megatron needs megatron-core (pip install megatron-core==0.16.1)")
    if cfg.trainer == "fsdp" and importlib.util.find_spec("transformers") is None:
        raise UnsupportedError("--trainer fsdp needs transformers (its Qwen3 model: pip install transformers)")
    import torch  # noqa: PLC0415

    have = torch.cuda.device_count()
    if cfg.device == "cuda" and have < cfg.gpus:
        hint = ("; --trainer megatron needs CUDA (the toy trainer, the default, runs on the CPU)"
                if cfg.trainer == "megatron" else "; --device cpu runs the orchestration check without one")
        raise InvalidArgumentError(f"--gpus {cfg.gpus} but {have} CUDA device(s) are visible"
                                   + (hint if not have else ""))
    try:  # before any variant runs (and after the refusals above, which leave nothing behind): an --out that cannot hold the results would lose the whole run
        os.makedirs(cfg.out, exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError(f"--out {cfg.out}: cannot be made a directory for the results "
                                   f"({e.strerror or e}); name a directory that can be written") from None
    results = {"config": dataclasses.asdict(cfg), "variants": {}}
    for variant in cfg.variants:
        if variant in NEEDS_TMS and importlib.util.find_spec("torch_memory_saver") is None:
            results["variants"][variant] = {"why": "not installed (torch_memory_saver: this variant's rollout, or "
                                                   "its trainer, runs on it; pip install torch-memory-saver)"}
            log(f"colocate: {variant} not run: torch_memory_saver is not installed")
            continue
        vr = run_variant(cfg, variant, log)
        if not vr["failed"]:
            vr["summary"] = summarize(vr["ranks"], cfg.warmup)
        else:
            vr["why"] = "; ".join(f"rank {f['rank']}: {f['why']}" for f in vr["failed"])
            for f in vr["failed"]:
                log(f"colocate: {variant} rank {f['rank']} FAILED (exit {f['rc']}): {f['why']}\n{f['log']}")
        vr["checks"] = _checks(vr["ranks"], cfg.warmup)
        results["variants"][variant] = vr
        if variant != cfg.variants[-1]:  # a run cut short (a time limit, Ctrl-C) keeps the variants that finished
            _write_results(cfg.out, dict(results, incomplete=f"written after {variant}; the run had not finished"))
    results["goals"] = _goals(results)
    results["steady"] = steady_check(results, cfg.steady_tolerance)
    os.makedirs(cfg.out, exist_ok=True)
    png = os.path.join(cfg.out, "timeline.png")
    results["timeline"] = png if not (why := plot_timeline(results, png)) else f"not drawn: {why}"
    _write_results(cfg.out, results)
    return results


def _write_results(out: str, results: dict) -> None:
    """results.json, replaced whole (written beside it, then renamed: a reader never sees half a file)."""
    path = os.path.join(out, "results.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def run_loop(*, gpus: int = 1, out: str, quick: bool = False, log=print, **overrides) -> dict:
    """Run the example at its default size (or the ``quick`` size: a 0.12 B-param model, 5 steps) on ``gpus``
    GPUs, every variant, results and logs in ``out``; ``overrides``: other RunConfig fields (``trainer="megatron"``
    picks the Megatron loop and its sizes). Returns the results (``results["config"]`` is the configuration that
    ran). Bad values raise InvalidArgumentError before anything starts."""
    trainer = overrides.get("trainer", "toy")
    base = {"model": model_for(trainer, quick), **trainer_defaults(trainer), **(quick_overrides() if quick else {})}
    cfg = RunConfig(**{**base, "gpus": gpus, "out": out, **overrides})
    return run(cfg, log=log)


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv, cuda_devices=_cuda_devices(), log=lambda line: print(line, flush=True))
        results = run(cfg)
    except (InvalidArgumentError, UnsupportedError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(format_report(results))
    print(f"\nresults: {cfg.out}/results.json, timeline: {results['timeline']}")
    # the ebbtide variant decides; a run without it (anchors alone) succeeds when every variant that ran is correct
    ran = [n for n in cfg.variants if "not installed" not in results["variants"][n].get("why", "")]
    names = ["ebbtide"] if "ebbtide" in cfg.variants else ran
    ok = bool(names) and all(bool(results["variants"][n].get("summary"))
                             and results["variants"][n].get("checks", {}).get("correct") is True for n in names)
    if not ok:
        return 1
    slower = [c for c in results["steady"] if not c["ok"]]
    if slower:
        what = "; ".join(f"{c['phase']} {c['ratio']:.3f}x {c['anchor']}'s" for c in slower)
        print(f"{PROG}: ebbtide's steady phases are slower than the anchors' by more than "
              f"{cfg.steady_tolerance:.0%}: {what} (--steady-guard warn reports this without failing)",
              file=sys.stderr)
        if cfg.steady_guard == "error":
            return 3
    return 0
