"""A rendezvous store that listens where it is told, loopback by default.

torch's ``TCPStore(..., is_master=True)`` listens on every interface whatever host name it is given, and whoever can
reach the port can read and write every key: for ebbtide.comm that includes the control plane's journal hashes and
its "gave-up" marks. :func:`serve_store` binds the listening socket itself, to one address (``127.0.0.1`` unless
the caller names another, e.g. for ranks on several hosts), and hands it to torch (``master_listen_fd``).

What holds:
- The server store listens on ``bind`` only; ``0.0.0.0`` / ``::`` (every interface) must be asked for by name.
- The returned store is also a client of itself (``store.host``/``store.port`` are the address ranks connect to).
- A bad address is an InvalidArgumentError naming it; nothing is left open.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket

from ..errors import InvalidArgumentError

__all__ = ["serve_store", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def _resolve(bind: str, port: int):
    if not isinstance(bind, str) or not bind.strip():
        raise InvalidArgumentError(f"store bind address must be a host name or an IP address, not {bind!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"store port must be an int in [0, 65535], not {port!r}")
    try:
        infos = socket.getaddrinfo(bind.strip(), port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidArgumentError(f"store bind address {bind!r} does not resolve: {e}") from None
    return infos[0]


def serve_store(*, bind: str = LOOPBACK, port: int = 0, world_size: int | None = None,
                timeout: datetime.timedelta = datetime.timedelta(seconds=300)):
    """A ``torch.distributed.TCPStore`` server listening on ``bind`` only (port 0: any free port). Ranks connect
    with ``TCPStore(store.host, store.port, is_master=False)``. Keep the returned object alive while ranks use it;
    dropping it stops the server."""
    import torch.distributed as dist

    family, socktype, proto, _canon, addr = _resolve(bind, port)
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        host, bound_port = sock.getsockname()[:2]
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {bind!r} port {port}: {e}") from None
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified:  # every interface, asked for by name: clients on this host come in over loopback
        host = "::1" if ip.version == 6 else LOOPBACK
    fd = sock.detach()  # the store owns the socket from here
    try:
        return dist.TCPStore(host, bound_port, world_size, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
