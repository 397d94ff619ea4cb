"""The colocated step the Megatron and FSDP trainers share (``mtrainer``, ``ftrainer``), one rank of either a
``LoopRank``: the trainer builds its model, optimizer, weight sync and variant object (``mvariants`` /
``fvariants``) and supplies three hooks, ``_train(step)`` (the loss), ``_step_optimizer()`` (the phase's record) and
``_reference()`` (what the rollout must show after the sync: ``rank.reference_entry``); the step, its records and
its checks are this module's, the same code for every variant of both.

Policies:
- The step: train -> optimizer -> rollout_resume -> sync (the rollout holds the new weights) -> comm_release ->
  offload -> generate -> rollout_pause -> onload -> comm_reload. Each phase ends when its device work is complete
  (a variant's onload may leave an upload to the next first forward, inside the next train phase).
- ``v.early_sync`` (ebbtide's variants): the rollout's resume and load are sent and the update opened right after
  the backward, beside the CPU optimizer step (the GPU is idle then): rollout_resume only collects the reply, sync
  fills and commits; a failed step gives the opened update up (the rollout keeps its weights). ``v.streamed_sync``:
  each tensor filled as the step uploads it (the optimizer's bucket hook). Otherwise each happens in its phase; the
  rollout's load is sent before the push where the sync needs the receiver serving (``sync.receiver_first``: CUDA
  IPC), after it otherwise (the shared host buffer).
- Groups: with ``v.releases_groups`` every group (WORLD included) is released after the sync and reloaded after the
  onload through ``self.ebt`` (the trainer's integration: its ``release_groups`` / ``reload_groups``), the teardown
  in the background with ``background_teardown`` (its report lands in the phase that sees it finish), joined
  otherwise; Gloo groups too on the CPU. Without it (verl, AReaL) the groups stay, as those trainers keep theirs.
- Verification (untimed, the first and last steps): ``_reference()`` beside the rollout's logits and weight digests
  (``rank.verify_entry`` within ``logits_rtol``), the rollout's decode checked against its full forward; the ranks
  aligned after every untimed piece, so the next timed phase does not measure their difference.
- Memory: after every phase NVML's per-process bytes (the trainer, its rollout, other ranks' processes), the
  device's use and each process's own view (``v.self_bytes``).
"""
from __future__ import annotations

import os
import time
from concurrent import futures

import torch

from ..limits import host_triad
from ._records import note_release, note_residual
from .measure import GENERATE_KEYS, NvmlProbe
from .options import STEP_BYTES
from .rank import align_ranks, only, verify_entry
from .rollout import RolloutClient, rollout_env

__all__ = ["LoopRank", "ROLLOUT_KEYS"]

# what the trainer's spec passes on to its rollout as it is
ROLLOUT_KEYS = ("model", "variant", "seed", "gen_batch", "prompt_len", "new_tokens", "kv_reserve_bytes",
                "verify_batch", "verify_len", "timeout_s", "scratch_backup")


class LoopRank:
    """One trainer rank of the shared step (see the module policies)."""

    logits_rtol = 2.0 ** -4
    releasing = None  # a background group release not joined yet (its Future)

    # ---- setup pieces the trainers call -------------------------------------------------------------------------
    def _open_probe(self) -> None:
        """NVML on this rank's device (none on the CPU), the processes there before this one named "other", this
        one "trainer", and its CUDA context's bytes."""
        if self.dev.type == "cuda":
            props = torch.cuda.get_device_properties(self.dev)
            self.nvml = NvmlProbe(uuid=str(getattr(props, "uuid", "") or ""), index=self.dev.index)
        else:
            self.nvml = NvmlProbe.unavailable("device is cpu")
        self.setup["nvml"] = self.nvml.why or "ok"
        self.nvml.assign(self.spec.get("baseline_pids", []), "other")
        self.nvml.claim("trainer", pid=os.getpid())
        self.setup["context_bytes"] = self._sample(-1, "context")["nvml"].get("trainer")

    def _host_floor(self) -> None:
        """The CPU optimizer step's host-memory floor on this machine, measured before the rollout starts: the
        step's bytes per parameter (``setup["moments"]``) times ``setup["params_stepped"]`` over the in-place triad
        bandwidth of every thread."""
        gbps = host_triad(512 << 20, passes=8)
        self.setup["host_triad_gbps"] = round(gbps, 2)
        # every rank of the host steps its share at the same time, over the same memory bandwidth
        local = self.setup["local_world"]
        self.setup["optimizer_floor_s"] = (STEP_BYTES[self.setup["moments"]] * self.setup["params_stepped"] * local
                                           / (gbps * 1e9))

    def _launch_rollout(self, fds: dict, **extra) -> None:
        """Start the rollout on this rank's device (``fds``: descriptors it inherits, named in its spec; ``extra``:
        its spec's other entries, ``arch`` and ``sync`` among them), then name its NVML process."""
        s = self.spec
        spec = {k: s[k] for k in ROLLOUT_KEYS}
        spec.update(decode=s.get("decode", "eager"), device=self.dev.index if self.dev.type == "cuda" else "cpu",
                    trainer_pid=os.getpid(), **extra)
        self.rollout = RolloutClient(spec, rollout_env(self.v.em, s["scratch_backup"]), fds)
        self.nvml.claim("rollout", pid=self.rollout.info.get("pid"))
        self.setup["nvml_roles"] = {str(k): v for k, v in self.nvml.roles.items()}
        self.setup["rollout"] = {k: v for k, v in self.rollout.info.items() if k not in ("ok", "mem")}

    # ---- measurement -----------------------------------------------------------------------------------------
    def _sample(self, step: int, phase: str, rollout_mem: dict | None = None) -> dict:
        m = self.nvml.sample()
        if m.get("device_used") is None and self.dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.dev)
            m["device_used"] = total - free
        selfm = dict(rollout_mem or {})
        mine = self.v.self_bytes(self.dev)
        if mine is not None:
            selfm["trainer"] = mine
        m["self"] = selfm
        self.rec.sample(step, phase, m)
        return m

    def _note_decode(self, gen: dict):
        ro = self.setup.setdefault("rollout", {})
        ro.setdefault("decode_used", gen.get("decode"))
        if "graph_bytes" in gen and "graph_bytes" not in ro:
            ro.update(graph_bytes=gen["graph_bytes"], graph_pausable=self.v.name == "ebbtide")

    # ---- groups ----------------------------------------------------------------------------------------------
    def _release(self, info: dict) -> None:
        if not self.v.releases_groups:
            info["report"] = "kept (this trainer keeps its process groups)"
            return
        cpu = self.dev.type == "cpu"  # the groups are Gloo's
        if self.background_teardown:  # agreed, detached; teardown beside offload, generate
            previous = self.releasing
            # release() joins the previous teardown itself: a failure there raises on every rank (its agreement)
            self.releasing = self.ebt.release_groups(include_world=True, include_cpu=cpu, wait=False)
            note_release(info, previous)
            info["report"] = "teardown in the background (its report: comm_reload's release_report)"
        else:
            info["report"] = self.ebt.release_groups(include_world=True, include_cpu=cpu).summary()

    def _reload(self, info: dict) -> None:
        if not self.v.releases_groups:
            info["report"] = "kept"
            return
        # a teardown still running (a short generate) goes on beside the reload: not waited for here
        info["release_teardown_running"] = self.releasing is not None and not self.releasing.done()
        info["report"] = self.ebt.reload_groups(eager=self.reload_eager).summary()
        if self.releasing is not None and self.releasing.done():
            note_release(info, self.releasing)
            self.releasing = None

    def _join_teardown(self) -> None:
        """(a generate shorter than the teardown) the step's memory must not count the old communicators beside
        the new ones: wait outside the timed phases, say how long, note the release's report in the last phase."""
        if self.releasing is None:
            return
        t0 = time.perf_counter()
        done, _ = futures.wait([self.releasing], timeout=self.spec["timeout_s"])
        ph = self.rec.phases[-1]
        ph.update(teardown_wait_s=time.perf_counter() - t0, teardown_wait_timed_out=not done)
        if done:
            note_release(ph, self.releasing)
            self.releasing = None

    # ---- the step --------------------------------------------------------------------------------------------
    def _open_early(self, version: int):
        """The rollout's resume and load sent, the update opened beside the CPU step; (opened, bucket hook)."""
        R = self.rollout
        R.send("resume")
        R.send("load", version=version)
        opened = self.sync.open(version, streamed=self.v.streamed_sync)  # joined (its failure raised) by the push
        hook = self.opt.add_bucket_hook(opened) if self.v.streamed_sync else None
        return opened, hook

    def _optimizer_phase(self, step: int, early: bool, verify: bool):
        """The optimizer phase (and, untimed, the reference); an interrupted step gives an early update up."""
        hook = None
        if early:
            _, hook = self._open_early(step + 1)
        try:
            with self.rec.phase(step, "optimizer") as info:
                try:
                    info.update(self._step_optimizer())
                finally:
                    if hook is not None:
                        hook.remove()
            self._sample(step, "optimizer")
            ref = self._reference() if verify else None  # untimed
            if verify:  # the ranks' untimed work differs: the next timed phases start together
                align_ranks(self.align, self.world, f"{self.variant}/{step}/reference")
            return ref
        except BaseException:
            if early:  # the push will not come: the rollout's load ends now, its weights as they were
                self.sync.abort()
            raise

    def _sync_phase(self, step: int, early: bool) -> None:
        R, tmo, version = self.rollout, self.spec["timeout_s"], step + 1
        with self.rec.phase(step, "rollout_resume") as info:
            info.update(only(R.reply(timeout=tmo) if early else R.call("resume", timeout=tmo), "inside_s",
                             "bytes_mapped"))
        self._sample(step, "rollout_resume")
        with self.rec.phase(step, "sync") as info:
            first = not early and self.sync.receiver_first
            if first:
                R.send("load", version=version)
            info["bytes"] = self.sync.push(version)
            info.update(self.sync.last_push)
            if not early and not first:  # the host buffer: the rollout reads the pushed update
                R.send("load", version=version)
            load = R.reply(timeout=tmo)
            info.update(only(load, "apply_s"))  # the rollout's apply of the committed version
            if not early:  # after an early open the rollout's load began beside the optimizer step
                info.update(only(load, "inside_s"))
        self._sample(step, "sync")

    def _generate_phase(self, step: int, verify: bool, ref, loaded) -> None:
        R, tmo = self.rollout, self.spec["timeout_s"]
        clock = self.nvml.sm_clock_mhz()  # the clock the prefill starts at (read outside the timed phase)
        with self.rec.phase(step, "generate") as info:
            if clock is not None:
                info["sm_clock_mhz"] = clock
            gen = R.call("generate", timeout=tmo)
            info.update(only(gen, *GENERATE_KEYS))
        self._sample(step, "generate", gen.get("mem"))
        self._note_decode(gen)
        if verify:
            gen.update(only(R.call("verify_generate", timeout=tmo), "decode_vs_full_max_abs", "decode_vs_full_rel",
                            "decode_vs_full_argmax_equal"))
            if gen.get("decode") != "eager":
                gen.update(R.call("check_decode", timeout=tmo))
            self.checks["verify"].append(verify_entry(step, self.rank, ref, loaded, gen, self.logits_rtol))
            align_ranks(self.align, self.world, f"{self.variant}/{step}/generate")

    def step(self, step: int, verify: bool):
        R, rec, tmo = self.rollout, self.rec, self.spec["timeout_s"]
        with rec.phase(step, "train") as info:
            info["loss"] = self._train(step)
        self._sample(step, "train")
        early = self.v.early_sync
        ref = self._optimizer_phase(step, early, verify)
        self._sync_phase(step, early)
        loaded = R.call("verify_load", timeout=tmo) if verify else None
        if verify:
            align_ranks(self.align, self.world, f"{self.variant}/{step}/load")
        with rec.phase(step, "comm_release") as info:
            self._release(info)
        self._sample(step, "comm_release")
        with rec.phase(step, "offload") as info:
            info.update(self.v.offload())
        if self.v.state is not None:
            note_residual(self.rec.phases[-1], self.v.state)
        self._sample(step, "offload")
        self._generate_phase(step, verify, ref, loaded)
        with rec.phase(step, "rollout_pause") as info:
            info.update(only(R.call("pause", timeout=tmo), "inside_s", "bytes_released"))
        self._sample(step, "rollout_pause")
        with rec.phase(step, "onload") as info:
            info.update(self.v.onload())
        self._sample(step, "onload")
        with rec.phase(step, "comm_reload") as info:
            self._reload(info)
        self._join_teardown()
        self._sample(step, "comm_reload")

    def run(self) -> None:
        steps = self.spec["steps"]
        for s in range(steps):
            self.step(s, s in (0, steps - 1))
            last = [p for p in self.rec.phases if p["step"] == s]
            print(f"[{self.setup['trainer']} {self.variant}] step {s}: {sum(p['s'] for p in last) * 1e3:.1f} ms, "
                  f"loss {last[0].get('loss', float('nan')):.4f}", flush=True)
        if self.releasing is not None:  # the last step's teardown: joined before the process ends, its report kept
            self.releasing.exception()
            last_release: dict = {}
            note_release(last_release, self.releasing)
            self.setup["last_release"], self.releasing = last_release, None

    def close(self):
        try:
            sync = getattr(self, "sync", None)
            if sync is not None:
                sync.close()
        finally:
            rollout = getattr(self, "rollout", None)
            if rollout is not None:
                rollout.close()
