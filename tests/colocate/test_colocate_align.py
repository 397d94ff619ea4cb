"""align_ranks: the loops' barrier on the launcher's store after their untimed verification."""
import socket
import threading
import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from ebbtide.colocate.trainer import align_ranks  # noqa: E402


def _stores(n):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
