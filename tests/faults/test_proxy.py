"""The fault proxy itself: forwards, resets, stalls silently, heals and stops by itself."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from . import split, wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(30)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            try:
                data = self.request.recv(4096)
            except OSError:
                return
            if not data:
                return
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="echo-server", daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _connect(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(split(proxy.endpoint), timeout=2.0)
    return sock


def _roundtrip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_forwards_resets_and_refuses(echo: str) -> None:
    with FaultProxy(echo) as proxy:
        sock = _connect(proxy)
        assert _roundtrip(sock, b"hello") == b"hello"
        wait_until(lambda: proxy.active == 1, 2, "one proxied connection")
        assert proxy.reset(refuse=True) == 1
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"x")
            sock.recv(10)
        sock.close()
        # The listen backlog completes the handshake; the proxy then resets it.
        with pytest.raises((ConnectionResetError, BrokenPipeError)), \
                _connect(proxy) as refused:
            refused.sendall(b"x")
            if not refused.recv(10):
                raise ConnectionResetError("closed")
        proxy.heal()
        with _connect(proxy) as again:
            assert _roundtrip(again, b"back") == b"back"
        assert proxy.accepted == 2 and proxy.resets >= 2


def test_stall_holds_bytes_silently_until_heal(echo: str) -> None:
    with FaultProxy(echo) as proxy, _connect(proxy) as sock:
        assert _roundtrip(sock, b"a") == b"a"
        proxy.stall()
        sock.sendall(b"held")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # silent: no data, no close, no reset
            sock.recv(10)
        late = socket.create_connection(split(proxy.endpoint), timeout=2.0)  # backlog only
        assert proxy.accepted == 1
        proxy.heal()
        sock.settimeout(2.0)
        assert sock.recv(10) == b"held"
        assert _roundtrip(late, b"late") == b"late"
        late.close()


def test_close_and_lifetime_stop_the_thread(echo: str) -> None:
    proxy = FaultProxy(echo).start()
    name = f"faultproxy-{proxy.port}"
    assert any(t.name == name for t in threading.enumerate())
    proxy.close()
    assert not any(t.name == name for t in threading.enumerate())
    proxy.close()  # idempotent
    short = FaultProxy(echo, max_lifetime=0.2).start()
    wait_until(lambda: not any(t.name == f"faultproxy-{short.port}"
                               for t in threading.enumerate()), 3, "the proxy to stop itself")
    with pytest.raises(RuntimeError):
        short.stall()
    short.close()


def test_delay_holds_each_direction_in_order(echo: str) -> None:
    delay = 0.1
    with FaultProxy(echo, delay=delay, max_lifetime=20) as proxy, \
            socket.create_connection(split(proxy.endpoint), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(b"one")
        sock.sendall(b"two")
        received = b""
        while len(received) < 6:
            received += sock.recv(64)
        took = time.monotonic() - started
    assert received == b"onetwo"
    assert 2 * delay <= took < 2 * delay + 1.0  # there and back, each held `delay`


def test_block_origin_drops_only_that_members_connections(echo: str) -> None:
    def request(member: str) -> bytes:
        return (f"GET /raft/stream/message/1 HTTP/1.1\r\nHost: x\r\n"
                f"X-Server-From: {member}\r\n\r\n").encode()

    with FaultProxy(echo, max_lifetime=20) as proxy, \
            socket.create_connection(split(proxy.endpoint), timeout=5) as a, \
            socket.create_connection(split(proxy.endpoint), timeout=5) as b:
        for sock, member in ((a, "aa01"), (b, "bb02")):
            sock.sendall(request(member))
            assert sock.recv(4096).startswith(b"GET")  # classified and forwarded
        assert proxy.block_origin("AA01") == 1
        b.sendall(b"still here")
        assert b.recv(64) == b"still here"
        with pytest.raises(OSError):  # reset
            a.sendall(b"x")
            if not a.recv(64):
                raise ConnectionResetError
        with socket.create_connection(split(proxy.endpoint), timeout=5) as again:
            again.sendall(request("aa01"))  # a new connection from the blocked member
            with pytest.raises(OSError):
                if not again.recv(64):
                    raise ConnectionResetError
