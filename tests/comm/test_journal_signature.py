"""The journal signature is what ranks compare before acting, so it must hold only rank-invariant facts.
(On 2 GPUs each rank passes its own device_id, cuda:0 and cuda:1: a signature holding it would refuse every release
as a disagreement.)"""
import datetime

import torch

from ebbtide.comm._journal import Entry


def entry(device_id):
    call = {"backend": "nccl", "timeout": datetime.timedelta(seconds=60), "group_desc": "tp", "device_id": device_id}
    return Entry(kind="group", name="3", ranks=(0, 1), call=call, group=None)


def test_device_index_is_not_part_of_the_signature():
    assert entry(torch.device("cuda", 0)).signature() == entry(torch.device("cuda", 1)).signature()
    assert entry(None).signature() != entry(torch.device("cuda", 0)).signature()
    assert entry(torch.device("cpu")).signature() != entry(torch.device("cuda", 0)).signature()


def test_replay_connects_exactly_once():
    """Reload must not eager-connect what replaying the creation already connected: in torch 2.x
    eagerConnectSingleDevice does not look at the communicator cache, so a second connect makes a second
    communicator (the first leaks) and, for split children, a second ncclCommSplit on the parent that its
    non-members never join (the 2-GPU hang of the split_group test). The rule uses journal facts only, so every
    rank - member or not - decides the same way."""
    from ebbtide.comm._journal import creation_connects

    assert creation_connects(entry(torch.device("cuda", 1)))  # helper(device_id=...) connects (split of WORLD)
    assert not creation_connects(entry(None))  # lazy: reload's eager connect is the only one
    split = Entry(kind="split", name="h", ranks=(0,), call={"args": (), "kwargs": {}}, group=None)
    assert creation_connects(split)  # ProcessGroupNCCL::split connects eagerly
