"""The journal signature is what ranks compare before acting, so it must hold only rank-invariant facts.
(Regression: on 2 GPUs each rank passes its own device_id, cuda:0 and cuda:1, and release was refused as a
disagreement.)"""
import datetime

import torch

from ebbtide.comm._runtime import Entry


def entry(device_id):
    call = {"backend": "nccl", "timeout": datetime.timedelta(seconds=60), "group_desc": "tp", "device_id": device_id}
    return Entry(kind="group", name="3", ranks=(0, 1), call=call, group=None)


def test_device_index_is_not_part_of_the_signature():
    assert entry(torch.device("cuda", 0)).signature() == entry(torch.device("cuda", 1)).signature()
    assert entry(None).signature() != entry(torch.device("cuda", 0)).signature()
    assert entry(torch.device("cpu")).signature() != entry(torch.device("cuda", 0)).signature()
