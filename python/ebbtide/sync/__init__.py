"""ebbtide.sync — weight updates from a trainer to rollout engines: bucketed, quantized in one launch per bucket,
named as the serving loader expects, moved by one of several transports, applied whole or not at all.

    plan = Plan.of(model.named_parameters(), scale="fp32", bucket_bytes=512 << 20)
    sender = Sender(dict(model.named_parameters()), IpcSender(conn), plan=plan)      # trainer
    receiver = Receiver(rollout_model, plan)                                         # rollout
    sender.push(version)            |  IpcReceiver(conn).receive(receiver, version)

Pieces: ``plan`` (what is sent, names, buckets, byte layout), ``Sender`` / ``Receiver``, transports (``HostSender``
/ ``HostReceiver`` through a shared pinned buffer, ``IpcSender`` / ``IpcReceiver`` by CUDA IPC on one GPU,
``NcclSender`` / ``NcclReceiver`` by broadcast), ``expected`` (the reference a receiver must equal). SGLang's
request forms, senders and custom loader are ``ebbtide.integrations.sglang``. See docs/sync.md. Importing this
package imports torch.
"""
from ._fill import expected, fill_bucket, load_bucket
from .errors import PartialUpdateError, PlanMismatchError, WeightVersionError
from .nccl import NcclReceiver, NcclSender
from .plan import DEFAULT_BUCKET_BYTES, KINDS, BucketPlan, Item, Output, Plan
from .receiver import Receiver
from .sender import PushReport, Sender
from .transport import HostReceiver, HostSender, IpcReceiver, IpcSender, SharedHostBuffer

__all__ = ["Plan", "BucketPlan", "Item", "Output", "KINDS", "DEFAULT_BUCKET_BYTES", "Sender", "PushReport",
           "Receiver", "HostSender", "HostReceiver", "IpcSender", "IpcReceiver", "NcclSender", "NcclReceiver",
           "SharedHostBuffer", "expected", "fill_bucket", "load_bucket", "WeightVersionError",
           "PartialUpdateError", "PlanMismatchError"]
