"""A CPU stand-in for DeepEP's V1 ``deep_ep`` package, for the Gloo tests of ebbtide.comm's DeepEP support (only
on the ranks' sys.path in those tests). It keeps the parts ebbtide relies on, with DeepEP's semantics:
``Buffer.__init__``'s signature and attributes, a runtime built in ``__init__`` after an all-gather over the group,
``destroy()`` that asserts it was not destroyed yet, and the C++ destructor's destroy-unless-explicit rule (here a
double destroy is recorded in ``ERRORS`` instead of throwing out of a destructor). ``dispatch`` reads the runtime's
buffer, so a use after release reaches the runtime."""
import torch
import torch.distributed as dist

LIVE = []  # runtimes holding their "NVLink buffer"
ERRORS = []  # double destroys (DeepEP: an exception out of ~Buffer)
CONSTRUCTED = [0]


class _Runtime:
    def __init__(self, nbytes, explicitly_destroy, peers):
        self.buf = torch.zeros(max(nbytes // 4, 1))
        self.explicitly_destroy = explicitly_destroy
        self.peers = peers
        self.destroyed = False
        LIVE.append(self)

    def is_available(self):
        return not self.destroyed

    def destroy(self):
        if self.destroyed:
            raise RuntimeError("Assertion error: not destroyed")
        self.destroyed = True
        LIVE.remove(self)
        self.buf = None

    def intranode_dispatch(self, x):
        self.buf[: x.numel()] = x.flatten()
        return self.buf[: x.numel()].view_as(x) * 2

    def __del__(self):
        if not self.explicitly_destroy:
            if self.destroyed:
                ERRORS.append("double destroy")
            else:
                self.destroy()


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None):
        self.rank = group.rank()
        self.group = group
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.runtime = _Runtime(num_nvl_bytes, explicitly_destroy, None)
        handles = [None] * self.group_size
        dist.all_gather_object(handles, ("handle", self.rank), group=group)  # DeepEP exchanges IPC handles
        self.runtime.peers = handles
        CONSTRUCTED[0] += 1

    def destroy(self):
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self.runtime.destroy()
        self.runtime = None

    def dispatch(self, x):
        return self.runtime.intranode_dispatch(x)
