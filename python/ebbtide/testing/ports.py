"""A free TCP port on the loopback interface, for tests and benchmarks that start a rendezvous of their own
(``init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}")``).

The port is bound on 127.0.0.1 only (nothing listens beyond the host) and released before it is returned, so
another process could take it in between; where that matters, let the launcher hold the port instead
(:func:`ebbtide.testing.spawn.ranks` serves the store itself and passes its address to the ranks).
"""
from __future__ import annotations

import socket

__all__ = ["free_port", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
