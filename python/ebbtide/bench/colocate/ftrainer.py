"""One trainer rank of the colocated loop with an FSDP2 trainer (``--trainer fsdp``; ``python -m
ebbtide.bench.colocate.ftrainer SPEC_JSON OUT_JSON``, started by the launcher): a transformers Qwen3 with random
weights (``ebbtide.testing.qwen3``, Qwen3-1.7B's shape by default) under ``fully_shard`` over a 1-D mesh of every
rank, its rollout process on the rank's device serving the same architecture under the same (HF) names
(``rollout`` with ``arch="qwen3"``: transformers' model in bf16, greedy eager decode, the same code in every
variant). What differs between the variants is one object each (``fvariants``); the step is ``loop.LoopRank``'s,
the Megatron trainer's too.

Policies:
- Data: the harness's counting task (``rank.train_tokens``, each rank its own rows), ``seq`` tokens as input and
  labels (transformers shifts them); the loss is transformers' (fp32 cross entropy).
- The step's phases as the Megatron loop's: train (forward, backward: FSDP's all-gathers and reduce-scatters) ->
  optimizer (clip + step + ``zero_grad``) -> rollout_resume -> sync -> comm_release -> offload -> generate ->
  rollout_pause -> onload -> comm_reload; each phase ends when its device work is complete.
- Groups: ``init_process_group`` over the launcher's store (NCCL on a GPU, Gloo on the CPU), then
  ``init_device_mesh`` of every rank; the ebbtide variant installs ebbtide.comm first (``install_groups``) and
  takes ``spec["groups"]`` / ``spec["nccl_cumem"]`` / ``spec["comm_teardown"]`` as the Megatron trainer's ebbtide
  variant does; the anchors make their groups as torch does and keep them.
- The weight sync: ``sync.FsdpTrainerSync`` (bf16, HF names; CUDA IPC, or the shared host buffer on the CPU). The
  rollout's weights are checked bit for bit against the trainer's gathered bf16 weights and its logits against
  the trainer's own forward (``LOGITS_RTOL``) on the first and last steps.
- Limits, measured by each trainer on its own device before the rollout starts (``setup["limits"]``, GB/s): pinned
  host-to-device and device-to-host copies and device-to-device copies (``ebbtide.bench.limits``), and the host's
  triad for the CPU optimizer's floor (``setup["optimizer_floor_s"]``): the goals read the run's own limits.
- ``device="cpu"`` (the ebbtide variant only): the same processes, sync and checks over Gloo ranks, without
  memory pause/resume, NVML or limits: how the orchestration is tested without a GPU.
"""
from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch

from ...testing.models import ModelConfig
from .fvariants import variant
from .loop import LoopRank
from .measure import Recorder
from .rank import align_store, exit_now, prompts, rank_main, reference_entry, train_tokens
from .sync import FsdpTrainerSync

__all__ = ["main", "LOGITS_RTOL"]

warnings.filterwarnings("ignore", category=FutureWarning)

# The trainer's FSDP forward and the rollout's plain one are transformers' same code on the same bf16 weights; the
# rollout's last-position logits come from a GEMM of another shape (ebbtide.testing.qwen3), which may round
# otherwise: about two bf16 ulps of the largest |logit| allowed, a wrong name or layout is O(1).
LOGITS_RTOL = 2.0 ** -6


class _FsdpTrainer(LoopRank):
    logits_rtol = LOGITS_RTOL

    def __init__(self, spec: dict, rank: int, world: int):
        self.spec, self.rank, self.world, self.variant = spec, rank, world, spec["variant"]
        cuda = spec.get("device", "cuda") == "cuda"
        self.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.dev)
        self.cfg = ModelConfig(**spec["model"])
        self.rec, self.checks = Recorder(), {"verify": []}
        self.v = variant(self.variant, self.dev)  # AReaL's: the preload hook set before anything is allocated
        self.setup: dict = {"variant": self.variant, "trainer": "fsdp", "rank": rank, "world": world,
                            "device_name": torch.cuda.get_device_name(self.dev) if cuda else "cpu",
                            "torch": torch.__version__, "pid": os.getpid(),
                            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
        torch.zeros(1, device=self.dev)  # the CUDA context
        self._open_probe()
        if cuda:
            self._limits()
        self._init_groups()
        self.model, self.opt = self.v.build(self)
        n = sum(p.numel() for p in self.model.parameters())  # a DTensor's numel is the whole tensor's
        self.setup.update(params=n, params_stepped=-(-n // world), mesh=list(self.mesh.shape))
        if cuda:
            self._host_floor()
        self.verify_tokens = prompts(self.cfg, spec["verify_batch"], spec["verify_len"], spec["seed"] + 11, self.dev)
        self._start_rollout()

    # ---- setup -----------------------------------------------------------------------------------------------
    def _limits(self) -> None:
        """Pinned H2D / D2H and D2D copy bandwidths of this device (GB/s), before the model exists."""
        from ..limits import Limits  # noqa: PLC0415

        lim = Limits(quick=True)
        i = self.dev.index
        self.setup["limits"] = {"h2d_gbps": round(lim.h2d_gbps(i), 2), "d2h_gbps": round(lim.d2h_gbps(i), 2),
                                "d2d_gbps": round(lim.d2d_gbps(i), 2)}
        torch.cuda.empty_cache()

    def _init_groups(self) -> None:
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        import ebbtide.integrations.fsdp as ebt  # noqa: PLC0415

        self.ebt = ebt
        mode, cumem, teardown = self.v.group_settings(self.spec)
        self.reload_eager = mode in ("eager", "used")  # "used": reload connects what the last step connected
        self.background_teardown = teardown == "background"
        self.setup.update(groups=mode, comm_teardown=teardown, releases_groups=self.v.releases_groups)
        if cumem is not None:
            self.setup["nccl_cumem"] = cumem
            if cumem == "off":
                os.environ["NCCL_CUMEM_ENABLE"] = "0"
        if self.v.releases_groups:
            ebt.install_groups()  # before the process group and the mesh: every group they make is reloadable
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                              timeout=timedelta(minutes=10))
        cuda = self.dev.type == "cuda"
        bound = {"device_id": self.dev} if cuda and mode == "eager" else {}
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank, world_size=self.world,
                                timeout=timedelta(minutes=10), **bound)
        self.store = store
        self.align = align_store(self.world)  # its own connection: a background release uses the store
        self.mesh = init_device_mesh(self.dev.type, (self.world,))

    def _start_rollout(self) -> None:
        if self.dev.type != "cuda":  # the shared host buffer (the rollout reads it after each push)
            self.sync = FsdpTrainerSync(self.model, self.v.sync_mode, device=self.dev)
            self._set_sync_setup()
            self._launch_rollout({"buf_fd": self.sync.fd}, arch="qwen3", buf_bytes=self.sync.nbytes)
            return
        import socket  # noqa: PLC0415
        from multiprocessing.connection import Connection  # noqa: PLC0415

        mine, theirs = socket.socketpair()
        self.sync = FsdpTrainerSync(self.model, self.v.sync_mode, device=self.dev, conn=Connection(mine.detach()),
                                    ipc_allocation=getattr(self.v, "ipc_allocation", None))
        self._set_sync_setup()
        try:
            self._launch_rollout({"sync_fd": theirs.fileno()}, arch="qwen3", sync=self.sync.mode)
        finally:
            theirs.close()

    def _set_sync_setup(self) -> None:
        self.setup.update(sync=self.sync.mode, sync_bytes=self.sync.plan.nbytes,
                          sync_bf16_bytes=self.sync.plan.source_bytes)

    # ---- the step's hooks ------------------------------------------------------------------------------------
    def _cuda_sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def _train(self, step: int) -> float:
        s = self.spec
        ids = train_tokens(self.cfg, s["batch"], s["seq"], step, self.rank)[:, :-1].contiguous().to(self.dev)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self._cuda_sync()
        return float(loss.item())

    def _step_optimizer(self) -> dict:
        out = self.v.step(self.model, self.opt)
        self._cuda_sync()
        return out

    def _reference(self) -> dict:
        ref = self.sync.reference()  # the bf16 weights the rollout must hold, gathered
        return reference_entry({}, ref, lambda: self.model(input_ids=self.verify_tokens).logits)


def main(argv=None) -> int:
    return rank_main(_FsdpTrainer, argv)


if __name__ == "__main__":
    exit_now(main())  # no interpreter teardown: paused pools and communicators go with the process
