"""ebbtide.testing.ports.free_port: a port the kernel handed out on loopback, free to bind right after."""
import socket

from ebbtide.testing.ports import LOOPBACK, free_port


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind((LOOPBACK, port))
        s.listen()
        assert s.getsockname() == (LOOPBACK, port)

