"""align_ranks: the loops' barrier on the launcher's store after their untimed verification."""
import threading
import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from ebbtide.bench.colocate.rank import align_ranks  # noqa: E402
from ebbtide.testing.ports import free_port  # noqa: E402


def _stores(n):
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=30))
    return [master] + [dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
                       for _ in range(n - 1)]


def test_no_rank_leaves_before_the_last_one_arrives_and_keys_are_independent():
    stores = _stores(3)
    left = {}

    def rank(i, delay):
        time.sleep(delay)
        align_ranks(stores[i], 3, "v/0/verify")
        left[i] = time.monotonic()
        align_ranks(stores[i], 3, "v/1/verify")  # a second barrier under another key pairs up again
        left[(i, 1)] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=rank, args=(i, d)) for i, d in enumerate((0.0, 0.0, 0.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(not t.is_alive() for t in threads)
    assert min(left[i] for i in range(3)) - t0 >= 0.45  # the early ranks waited for the late one
    assert all((i, 1) in left for i in range(3))


def test_one_rank_does_not_touch_the_store():
    align_ranks(None, 1, "anything")  # world 1: returns at once, no store needed


def test_aligning_on_its_own_connection_while_the_trainers_client_blocks_in_a_wait():
    """The background group release waits on the trainer's store client; the alignment must not queue behind it."""
    shared, other, own_a, own_b = _stores(4)
    done = []
    blocker = threading.Thread(target=lambda: shared.wait(["release/peer"]))  # as a release barrier would
    blocker.start()
    time.sleep(0.2)
    peer = threading.Thread(target=lambda: (align_ranks(own_b, 2, "v/3/generate"), done.append("b")))
    peer.start()
    align_ranks(own_a, 2, "v/3/generate")
    peer.join(10)
    assert done == ["b"] and blocker.is_alive()  # aligned while the shared client still waits
    other.set("release/peer", b"1")
    blocker.join(10)
    assert not blocker.is_alive()


def test_align_store_is_none_for_one_rank():
    from ebbtide.bench.colocate.rank import align_store  # noqa: PLC0415

    assert align_store(1) is None
