"""ebbtide.integrations.sglang — weight updates into SGLang, built from ebbtide.sync's buckets.

Trainer side (``forms``): the requests of SGLang's weight-update endpoints (``update_weights_from_tensor`` in its
flattened-bucket, named and ebbtide forms; ``update_weights_from_distributed``; the group and session requests) and
two sending ends for ``ebbtide.sync.Sender``: ``SGLangTensorSender`` (a colocated engine, CUDA IPC) and
``SGLangDistributedSender`` (engines on other GPUs, NCCL broadcast). Server side (``loader``): ebbtide's custom weight
loader, which replays a record of SGLang's own placement in one launch per bucket. Start the server with

    python -m sglang.launch_server ... --custom-weight-loader ebbtide.integrations.sglang.load_weights

and send with ``SGLangTensorSender(post, form="ebbtide")``. SGLang itself is imported only where present. See
docs/sync.md.
"""
from .forms import (FORMS, SGLangDistributedSender, SGLangTensorSender, begin_request, destroy_group_request,
                    distributed_request, ebbtide_payload, end_request, flattened_payload, init_group_request,
                    serialize, tensor_request)
from .loader import LOADER, LoaderState, load_weights, state

__all__ = ["FORMS", "SGLangTensorSender", "SGLangDistributedSender", "serialize", "tensor_request",
           "ebbtide_payload", "flattened_payload", "distributed_request", "init_group_request",
           "destroy_group_request", "begin_request", "end_request", "LOADER", "load_weights", "state",
           "LoaderState"]
