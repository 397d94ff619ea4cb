"""serve_store: the rendezvous store listens on the address it is given (loopback by default), where torch's own
TCPStore server listens on every interface. Checked from the kernel's socket table (/proc/net/tcp*)."""
from __future__ import annotations

import datetime
import os

import pytest

dist = pytest.importorskip("torch.distributed")

from ebbtide.comm import serve_store  # noqa: E402
from ebbtide.errors import InvalidArgumentError  # noqa: E402

T = datetime.timedelta(seconds=10)


def _listeners(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (hex as in /proc/net/tcp, e.g. 0100007F = 127.0.0.1)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    out.add(addr)
    return out


ANY = {"00000000", "00000000000000000000000000000000"}
LOOPBACK = "0100007F"


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_loopback_by_default_and_torch_default_is_every_interface():
    store = serve_store(timeout=T)
    assert store.host == "127.0.0.1"
    assert _listeners(store.port) == {LOOPBACK}, _listeners(store.port)
    client = dist.TCPStore(store.host, store.port, None, False, timeout=T)
    client.set("k", b"v")
    assert store.get("k") == b"v"
    # What the helper exists for: torch's server, given the same host name, listens on every interface.
    plain = dist.TCPStore("127.0.0.1", 0, None, True, timeout=T, wait_for_workers=False)
    assert _listeners(plain.port) & ANY, _listeners(plain.port)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_every_interface_only_when_asked():
    store = serve_store(bind="0.0.0.0", timeout=T)
    assert _listeners(store.port) & ANY
    assert store.host == "127.0.0.1"  # this host's clients still connect over loopback
    client = dist.TCPStore(store.host, store.port, None, False, timeout=T)
    client.set("k", b"w")
    assert store.get("k") == b"w"


@pytest.mark.parametrize("bind, port, msg", [
    ("", 0, "host name or an IP address"),
    ("no-such-host.invalid", 0, "does not resolve"),
    ("127.0.0.1", -1, "port"),
    ("127.0.0.1", True, "port"),
])
def test_bad_addresses_are_typed_errors(bind, port, msg):
    with pytest.raises(InvalidArgumentError, match=msg):
        serve_store(bind=bind, port=port, timeout=T)


def test_a_taken_port_is_a_typed_error():
    store = serve_store(timeout=T)
    with pytest.raises(InvalidArgumentError, match="cannot listen"):
        serve_store(port=store.port, timeout=T)
