"""The ``wire`` unary transport (``cachedstore/unary.py``) against a real etcd, and against
small hand-written peers where etcd cannot be made to misbehave: calls and their errors as
grpcio gives them, flow control both ways, the pool (one connection reused; one per
concurrent call; a connection etcd closed, or idle too long, never reused), deadlines,
``close`` from another thread, a fork, HPACK state across many answers."""

from __future__ import annotations

import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from etcd3 import etcdrpc

from cachedstore import EtcdStore, etcdapi, unary
from cachedstore.connection import Credentials
from cachedstore.etcdapi import Failure
from cachedstore.server import LocalEtcd
from cachedstore.testing import make_tls_files
from cachedstore.unary import MAX_IDLE, UnaryChannel
from cachedstore.wire import _PREFACE, BDP_PING, WireError, _frame

pytestmark = pytest.mark.timeout(120)


def _target(server: LocalEtcd) -> str:
    return server.endpoint.split("://")[-1]


class _Methods:
    def __init__(self, channel: UnaryChannel) -> None:
        self.range = channel.method("/etcdserverpb.KV/Range", etcdrpc.RangeResponse.FromString)
        self.put = channel.method("/etcdserverpb.KV/Put", etcdrpc.PutResponse.FromString)
        self.txn = channel.method("/etcdserverpb.KV/Txn", etcdrpc.TxnResponse.FromString)


def _channel(target: str, tls: ssl.SSLContext | None = None, connect_timeout: float = 2.0,
             **kwargs: Any) -> tuple[UnaryChannel, _Methods]:
    channel = UnaryChannel(target, tls, connect_timeout, **kwargs)
    return channel, _Methods(channel)


def test_calls_round_trip_and_reuse_one_connection(etcd: LocalEtcd, prefix: str) -> None:
    channel, rpc = _channel(_target(etcd))
    try:
        key = (prefix + "k").encode()
        revisions = [rpc.put(etcdrpc.PutRequest(key=key, value=b"v%d" % i), timeout=5)
                     .header.revision for i in range(20)]
        assert revisions == sorted(revisions) and len(set(revisions)) == 20
        got = rpc.range(etcdrpc.RangeRequest(key=key), timeout=5,
                        metadata=(("hasleader", "true"),))
        assert got.kvs[0].value == b"v19" and got.kvs[0].mod_revision == revisions[-1]
        assert len(channel._open) == 1 and len(channel._idle) == 1
    finally:
        channel.close()
    assert not channel._open and not channel._idle


def test_concurrent_calls_use_a_connection_each(etcd: LocalEtcd, prefix: str) -> None:
    channel, rpc = _channel(_target(etcd))
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait(10)
            for i in range(25):
                key = f"{prefix}{t}/{i}".encode()
                rpc.put(etcdrpc.PutRequest(key=key, value=key), timeout=5)
                assert rpc.range(etcdrpc.RangeRequest(key=key), timeout=5).kvs[0].value == key
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,), name=f"test-unary-{t}")
               for t in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert 1 <= len(channel._open) <= 4
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        count = rpc.range(etcdrpc.RangeRequest(key=prefix.encode(), range_end=end.encode(),
                                               count_only=True), timeout=5).count
        assert count == 100
    finally:
        channel.close()


def test_large_requests_and_responses_respect_flow_control(etcd: LocalEtcd, prefix: str
                                                           ) -> None:
    """A 1 MiB value goes out in frames within etcd's 64 KiB windows (which etcd credits
    back), and a response of 4 MiB comes in through ours."""
    channel, rpc = _channel(_target(etcd))
    try:
        big = os.urandom(1 << 20)
        for i in range(4):
            rpc.put(etcdrpc.PutRequest(key=f"{prefix}big{i}".encode(), value=big), timeout=10)
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        got = rpc.range(etcdrpc.RangeRequest(key=prefix.encode(), range_end=end.encode()),
                        timeout=10)
        assert [kv.value == big for kv in got.kvs] == [True] * 4
        assert len(channel._open) == 1
    finally:
        channel.close()


def test_etcd_errors_arrive_with_their_status_and_spare_the_connection(etcd: LocalEtcd,
                                                                       prefix: str) -> None:
    """Answers that alternate between errors of different texts and successes are each
    decoded right: etcd indexes each new trailer text in HPACK's table, so a decoder that
    kept an old meaning of an indexed block would read a later answer wrongly."""
    channel, rpc = _channel(_target(etcd))
    key = (prefix + "k").encode()
    try:
        head = rpc.put(etcdrpc.PutRequest(key=key, value=b"v"), timeout=5).header.revision
        for i in range(1, 6):
            with pytest.raises(WireError) as caught:  # a future revision: OUT_OF_RANGE
                rpc.range(etcdrpc.RangeRequest(key=key, revision=head + 1000 * i), timeout=5)
            assert caught.value.code() is grpc.StatusCode.OUT_OF_RANGE
            assert "future revision" in caught.value.details()
            ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))] * (200 + i)
            with pytest.raises(WireError) as caught:  # over --max-txn-ops
                rpc.txn(etcdrpc.TxnRequest(success=ops), timeout=5)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "too many operations" in caught.value.details()
            assert rpc.range(etcdrpc.RangeRequest(key=key), timeout=5).kvs[0].value == b"v"
        assert len(channel._open) == 1  # an error status leaves the connection usable
    finally:
        channel.close()


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal with incremental indexing, new name: it enters the table."""
    return b"\x40" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _answer(stream: int) -> bytes:
    """The frames of a whole successful answer on ``stream``: ``:status 200`` (indexed),
    an empty RangeResponse, trailers with ``grpc-status: 0``."""
    return (_frame(1, 4, stream, b"\x88") + _frame(0, 0, stream, b"\x00" + bytes(4))
            + _frame(1, 5, stream, _literal(b"grpc-status", b"0")))


def _requests_of(conn: socket.socket, frames: list[tuple[int, int, bytes]] | None = None
                 ) -> Any:
    """The stream ids of the requests a client sends on ``conn`` (after the preface), as
    each one's last frame (DATA with END_STREAM) arrives; every frame (kind, flags,
    payload) is appended to ``frames``."""
    buf = b""
    conn.settimeout(5)
    while len(buf) < len(_PREFACE):
        buf += conn.recv(1 << 16)
    buf = buf[len(_PREFACE):]
    while True:
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            length = int.from_bytes(buf[:3], "big")
            kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big")
            if frames is not None:
                frames.append((kind, flags, buf[9:9 + length]))
            buf = buf[9 + length:]
            if kind == 0 and flags & 1:
                yield stream
        chunk = conn.recv(1 << 16)
        if not chunk:
            return
        buf += chunk


def _fails(call: Callable[..., Any], request: Any, timeout: float) -> tuple[WireError, float]:
    """``call(request, timeout=timeout)`` raises WireError: that error, and the seconds the
    call took."""
    started = time.monotonic()
    with pytest.raises(WireError) as caught:
        call(request, timeout=timeout)
    return caught.value, time.monotonic() - started


def _range_fails_internal(rpc: _Methods, details: str) -> None:
    """A Range on ``rpc`` fails with INTERNAL and ``details`` in its details."""
    error, _ = _fails(rpc.range, etcdrpc.RangeRequest(key=b"k"), 5)
    assert error.code() is grpc.StatusCode.INTERNAL
    assert details in error.details()


def test_an_indexed_block_is_read_with_the_table_of_its_time() -> None:
    """HPACK blocks of indexed fields only are decoded once and remembered, but only until
    a block changes the table: here the same one-byte trailers block (index 62) first means
    ``grpc-status: 0``, then, after a response header entered the table in front of it,
    another header (and the call has no status)."""
    empty = b"\x00" + (0).to_bytes(4, "big")  # a RangeResponse with nothing set

    def serve(conn: socket.socket) -> None:
        answers = [
            # 1: content-type and grpc-status: 0 enter the table (62: grpc-status: 0).
            (b"\x88" + _literal(b"content-type", b"application/grpc"),
             _literal(b"grpc-status", b"0")),
            # 2: the same, indexed only (remembered): 62 is grpc-status: 0.
            (b"\x88\xbf", b"\xbe"),
            # 3: x-pad: 1 enters the table at 62; 62 in the trailers now means it.
            (b"\x88\xbf" + _literal(b"x-pad", b"1"), b"\xbe"),
        ]
        conn.sendall(_frame(4, 0, 0))
        for stream, (headers, trailers) in zip(_requests_of(conn), answers, strict=False):
            conn.sendall(_frame(1, 4, stream, headers) + _frame(0, 0, stream, empty)
                         + _frame(1, 5, stream, trailers))
        time.sleep(0.2)

    peer = _Peer(serve)
    channel, rpc = _channel(peer.target)
    try:
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        _range_fails_internal(rpc, "without a status")
    finally:
        channel.close()
        peer.close()


def test_a_block_decoded_on_one_connection_is_reused_only_after_the_same_table() -> None:
    """Header blocks are remembered across connections (every new connection's first
    answers are the same literals), keyed by the blocks that built the table before them.
    The first connection enters ``grpc-status: 0`` at index 62 and reads it back as the
    one-byte block ``\\xbe``. The second starts the same (remembered), then enters
    ``x-pad: 1`` and reads index 63, which its table has only as those blocks built it.
    The third sends that last block first: 63 is nothing there, whatever it meant on the
    second connection."""
    empty = b"\x00" + (0).to_bytes(4, "big")  # a RangeResponse with nothing set
    status, pad = _literal(b"grpc-status", b"0"), _literal(b"x-pad", b"1")
    script = {1: [status, b"\xbe"], 2: [status, pad + b"\xbf"], 3: [pad + b"\xbf"]}

    def serve(conn: socket.socket) -> None:
        conn.sendall(_frame(4, 0, 0))
        for stream, block in zip(_requests_of(conn), script[peer.accepted], strict=False):
            conn.sendall(_frame(1, 4, stream, b"\x88") + _frame(0, 0, stream, empty)
                         + _frame(1, 5, stream, block))
        time.sleep(0.2)

    peer = _Peer(serve)
    try:
        for _ in (1, 2):
            channel, rpc = _channel(peer.target)
            try:
                rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
                rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
            finally:
                channel.close()
        channel, rpc = _channel(peer.target)
        try:
            _range_fails_internal(rpc, "Invalid")
        finally:
            channel.close()
        assert peer.accepted == 3
    finally:
        peer.close()


def test_settings_at_once_and_pings_once_they_are_ack_delay_old(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd's SETTINGS are acknowledged at once. Its bandwidth-estimation PINGs (grpc-go
    sends one with every request it reads while none of them is unacknowledged) once
    ``_ACK_DELAY`` old, with the next request, behind its frames (so that etcd reads that
    request with its PING still out): answered with the next request, as before, every call
    of a busy connection got a PING ahead of its answer and woke once more for it. Any
    other PING (a keepalive) with the very next request."""
    monkeypatch.setattr(unary, "_ACK_DELAY", 0.5)
    frames: list[tuple[int, int, bytes]] = []

    def serve(conn: socket.socket) -> None:
        conn.sendall(_frame(4, 0, 0))
        for n, stream in enumerate(_requests_of(conn, frames)):  # until the client closes
            pings = _frame(6, 0, 0, BDP_PING) + (_frame(6, 0, 0, b"keepaliv") if n == 3 else b"")
            conn.sendall(pings + _answer(stream))

    peer = _Peer(serve)
    channel, rpc = _channel(peer.target)
    try:
        for _ in range(3):  # back to back: the PINGs are younger than _ACK_DELAY
            rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        time.sleep(0.55)
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)  # carries the three
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)  # the keepalive's, and the 4th
    finally:
        channel.close()
        peer.close()
    ends = [i for i, (kind, flags, _) in enumerate(frames) if kind == 0 and flags & 1]
    acks = [(i, payload) for i, (kind, flags, payload) in enumerate(frames)
            if kind == 6 and flags & 1]
    assert [p for i, p in acks if ends[3] < i < ends[4]] == [BDP_PING] * 3  # behind DATA 4
    assert [p for i, p in acks if i > ends[4]] == [BDP_PING, b"keepaliv"]
    assert len(acks) == 5
    assert (4, 1, b"") in frames  # SETTINGS ACK


def test_back_to_back_calls_cost_etcd_few_pings(etcd: LocalEtcd, prefix: str) -> None:
    """Against etcd itself: 40 calls back to back on one connection get one PING or a few
    (one per ``_ACK_DELAY``), not one per call (with the acknowledgement sent at once,
    grpc-go pings again on every request: 35 of 40 in one run)."""
    channel, rpc = _channel(_target(etcd))
    try:
        key = (prefix + "k").encode()
        started = time.monotonic()
        for _ in range(40):
            rpc.range(etcdrpc.RangeRequest(key=key, serializable=True), timeout=5)
        took = time.monotonic() - started
        (conn,) = channel._idle
        assert 1 <= conn.pings_received <= min(20, 2 + took / unary._ACK_DELAY), (
            conn.pings_received, took)
    finally:
        channel.close()


def test_an_unreachable_endpoint_fails_as_never_sent() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    channel, rpc = _channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(WireError) as caught:
            rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=2)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert etcdapi.classify_rpc_error(caught.value)[0] is Failure.UNSENT
    finally:
        channel.close()


class _Peer:
    """A TCP listener that runs ``serve(conn)`` for each connection, on its own thread."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self._serve = serve
        self._thread = threading.Thread(target=self._run, name="test-unary-peer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                self._serve(conn)

    def close(self) -> None:
        self.listener.close()
        self._thread.join(10)


def _read_preface(conn: socket.socket) -> None:
    data = b""
    conn.settimeout(5)
    while len(data) < len(_PREFACE):
        data += conn.recv(1 << 16)
    assert data.startswith(_PREFACE)


def _silent_peer() -> tuple[_Peer, threading.Event]:
    """A peer that sends its SETTINGS, then nothing until the event is set."""
    done = threading.Event()

    def silent(conn: socket.socket) -> None:
        _read_preface(conn)
        conn.sendall(_frame(4, 0, 0))
        done.wait(30)

    return _Peer(silent), done


def test_close_cuts_a_connection_in_its_handshake() -> None:
    """A call whose new connection waits for the peer's SETTINGS (a stopped etcd accepts
    and stays silent) fails as soon as the channel is closed, not at its connect timeout:
    a store's close() waits for its executor's threads, and an asyncio caller's event loop
    with it."""
    preface_read, done = threading.Event(), threading.Event()

    def mute(conn: socket.socket) -> None:
        _read_preface(conn)  # sent after the connection was registered as connecting
        preface_read.set()
        done.wait(30)

    peer = _Peer(mute)
    channel, rpc = _channel(peer.target, connect_timeout=20)

    def close() -> None:
        assert preface_read.wait(10)
        channel.close()

    try:
        _fails_at_once_when_closed(rpc, close, "the handshake")
    finally:
        done.set()
        peer.close()


def _fails_at_once_when_closed(rpc: _Methods, close: Callable[[], None] | None,
                               what: str) -> None:
    """A Range sent from a thread of its own, then ``close()`` (if given) on this one: the
    call fails within 5 s with UNAVAILABLE "the channel is closed" (``what`` went on
    otherwise)."""
    failures: list[grpc.RpcError] = []

    def call() -> None:
        try:
            rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=20)
        except grpc.RpcError as exc:
            failures.append(exc)

    caller = threading.Thread(target=call, name="test-unary-caller")
    started = time.monotonic()
    caller.start()
    try:
        if close is not None:
            close()
        caller.join(5)
        assert not caller.is_alive(), f"{what} went on after close()"
        assert time.monotonic() - started < 5
        (error,) = failures
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert error.details() == "the channel is closed"
    finally:
        caller.join(30)


class _ClosingOnWrap(ssl.SSLContext):
    """A client context whose wrap closes ``channel`` as it returns: a close() that lands
    while the TLS socket replaces the plain one (whose shutdown then finds it detached)."""

    channel: UnaryChannel | None = None

    def wrap_socket(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        wrapped = super().wrap_socket(*args, **kwargs)
        if self.channel is not None:
            self.channel.close()
        return wrapped


@pytest.mark.parametrize("when", ["in the TLS handshake", "as the socket is wrapped"])
def test_close_cuts_a_connection_in_its_tls_handshake(when: str) -> None:
    """Under TLS too: a peer that accepts and never answers the ClientHello."""
    hello_read, done = threading.Event(), threading.Event()

    def mute(conn: socket.socket) -> None:
        conn.settimeout(5)
        if conn.recv(1 << 16):  # the ClientHello
            hello_read.set()
        done.wait(30)

    peer = _Peer(mute)
    tls = _ClosingOnWrap(ssl.PROTOCOL_TLS_CLIENT)
    tls.set_alpn_protocols(["h2"])
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    channel, rpc = _channel(peer.target, tls, connect_timeout=20)

    def close() -> None:
        assert hello_read.wait(10)
        channel.close()

    if when == "as the socket is wrapped":
        tls.channel = channel
    try:
        _fails_at_once_when_closed(rpc, close if when == "in the TLS handshake" else None,
                                   "the TLS handshake")
    finally:
        done.set()
        peer.close()


def test_a_silent_peer_times_the_call_out_and_the_connection_is_dropped() -> None:
    peer, done = _silent_peer()
    channel, rpc = _channel(peer.target)
    try:
        error, took = _fails(rpc.range, etcdrpc.RangeRequest(key=b"k"), 0.3)
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert etcdapi.classify_rpc_error(error)[0] is Failure.TRANSPORT
        assert 0.25 <= took < 1.5, took
        assert not channel._open and not channel._idle  # not reused: its call may run on
    finally:
        done.set()
        channel.close()
        peer.close()


def test_a_patient_call_is_left_running_past_its_callers_wait() -> None:
    """With ``patience``, a call whose answer is late raises DEADLINE_EXCEEDED once the
    caller's patience is over, and is not cancelled: its connection stays open (etcd
    before 3.5.5 panics on a read-only Txn cancelled while it executes) on a thread that
    waits for the answer; ``drain`` waits for that thread, ``close`` ends it."""
    peer, done = _silent_peer()
    channel, rpc = _channel(peer.target)
    try:
        error, took = _fails(lambda request, timeout: rpc.txn(request, timeout=60,
                                                              patience=timeout),
                             etcdrpc.TxnRequest(), 0.2)
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "left to finish" in error.details()
        assert 0.15 <= took < 1.5, took
        assert channel.unfinished == 1 and len(channel._open) == 1  # still open
        finishing = next(iter(channel._finishing))
        assert finishing.name == "cachedstore-unary-finish" and finishing.daemon
        assert not channel.drain(0.2)  # the peer never answers
        channel.close()  # ends it: the connection is shut down
        assert channel.drain(5) and channel.unfinished == 0
    finally:
        done.set()
        channel.close()
        peer.close()


def test_a_call_left_running_gives_its_connection_back_when_answered(etcd: LocalEtcd,
                                                                      prefix: str) -> None:
    """A call left to finish that etcd then answers puts its connection back in the pool
    (the next call opens none)."""
    channel, rpc = _channel(_target(etcd))
    try:
        rpc.put(etcdrpc.PutRequest(key=prefix.encode() + b"k", value=b"v"), timeout=5)
        assert channel.opened == 1
        # A patience of 0: the caller stops waiting as soon as the request is sent.
        with pytest.raises(WireError) as caught:
            rpc.txn(etcdrpc.TxnRequest(), timeout=5, patience=0)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert channel.drain(5)
        assert len(channel._idle) == 1
        rpc.range(etcdrpc.RangeRequest(key=prefix.encode() + b"k"), timeout=5)
        assert channel.opened == 1
    finally:
        channel.close()


def test_a_silent_tls_peer_times_the_call_out(tmp_path: Path) -> None:
    """Over TLS too, the deadline holds, and a pooled TLS connection is reused: a peer that
    answers the handshake and the first call, then stays silent."""
    files = make_tls_files(tmp_path / "pki")
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(files.server_cert, files.server_key)
    server_side.set_alpn_protocols(["h2"])
    done = threading.Event()

    def serve(raw: socket.socket) -> None:
        with server_side.wrap_socket(raw, server_side=True) as conn:
            conn.sendall(_frame(4, 0, 0))
            for stream in _requests_of(conn):  # type: ignore[arg-type]
                conn.sendall(_answer(stream))
                break
            done.wait(30)

    peer = _Peer(serve)
    client_side = Credentials(ca_cert=files.ca_cert).ssl_context()
    channel, rpc = _channel(peer.target, client_side)
    try:
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        (first,) = channel._open
        error, took = _fails(rpc.range, etcdrpc.RangeRequest(key=b"k"), 0.3)
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.25 <= took < 1.5, took
        assert peer.accepted == 1  # the second call ran on the first call's connection
    finally:
        done.set()
        channel.close()
        peer.close()


def test_a_peer_that_never_speaks_http2_fails_the_call_as_never_sent() -> None:
    """A port that accepts and says nothing (a proxy with nothing behind it): no SETTINGS
    within the connect timeout, so the request was never sent, and a write that must not
    run twice may still be retried elsewhere."""
    done = threading.Event()

    def mute(conn: socket.socket) -> None:
        _read_preface(conn)
        done.wait(30)

    peer = _Peer(mute)
    channel, rpc = _channel(peer.target, connect_timeout=0.3)
    try:
        error, took = _fails(rpc.put, etcdrpc.PutRequest(key=b"k", value=b"v"), 5)
        assert took < 2.0
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert "settings" in error.details().lower()
        assert etcdapi.classify_rpc_error(error)[0] is Failure.UNSENT
        assert not channel._open
    finally:
        done.set()
        channel.close()
        peer.close()


def test_close_from_another_thread_ends_a_blocked_call() -> None:
    peer, done = _silent_peer()
    channel, rpc = _channel(peer.target)
    failed: list[BaseException] = []

    def call() -> None:
        try:
            rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=60)
        except BaseException as exc:  # noqa: BLE001 -- checked below
            failed.append(exc)

    caller = threading.Thread(target=call, name="test-unary-caller")
    try:
        caller.start()
        deadline = time.monotonic() + 10
        while not channel._open and time.monotonic() < deadline:
            time.sleep(0.01)  # until the call holds its connection
        channel.close()
        caller.join(10)
        assert not caller.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], WireError)
        assert failed[0].code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(WireError, match="closed"):
            rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=1)
    finally:
        done.set()
        peer.close()


def test_goaway_before_the_request_fails_it_as_never_sent() -> None:
    """A server that says GOAWAY with a last stream id below ours did not process the
    request: the call may be retried even where it must not run twice."""
    def going_away(conn: socket.socket) -> None:
        _read_preface(conn)
        conn.sendall(_frame(4, 0, 0) + _frame(7, 0, 0, (0).to_bytes(4, "big")
                                            + (0).to_bytes(4, "big") + b"shutting down"))
        time.sleep(0.5)

    peer = _Peer(going_away)
    channel, rpc = _channel(peer.target)
    try:
        with pytest.raises(WireError) as caught:
            rpc.put(etcdrpc.PutRequest(key=b"k", value=b"v"), timeout=5)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert etcdapi.classify_rpc_error(caught.value)[0] is Failure.UNSENT
        assert not channel._open
    finally:
        channel.close()
        peer.close()


def test_a_connection_etcd_closed_in_the_pool_is_not_reused(
        etcd_factory: Callable[..., LocalEtcd], prefix: str) -> None:
    """etcd restarted while the connection sat idle: the next call notices before it sends
    (the peek at the socket) and opens a new one: no failure, not even a retried one."""
    server = etcd_factory()
    channel, rpc = _channel(_target(server))
    try:
        rpc.put(etcdrpc.PutRequest(key=(prefix + "k").encode(), value=b"1"), timeout=5)
        (first,) = channel._open
        server.restart()
        time.sleep(0.2)  # the old connection's end reaches this side
        got = rpc.range(etcdrpc.RangeRequest(key=(prefix + "k").encode()), timeout=10)
        assert got.kvs[0].value == b"1"
        assert first not in channel._open and len(channel._open) == 1
    finally:
        channel.close()


def _retiring_peer(how: str) -> tuple[_Peer, list[int]]:
    """A peer whose first connection answers one call and then, ``how``: ``"closed"``
    (a FIN, no GOAWAY), ``"reset"`` (an RST: neither) or ``"goaway"`` (a GOAWAY, the
    connection kept open, read no more, until the peer is closed). Every later connection
    answers every call. The list counts the calls each connection got."""
    kept: list[socket.socket] = []
    calls: list[int] = []

    def serve(conn: socket.socket) -> None:
        first = not calls
        calls.append(0)
        conn.sendall(_frame(4, 0, 0))
        for stream in _requests_of(conn):
            calls[-1] += 1
            conn.sendall(_answer(stream))
            if first:
                if how == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
                elif how == "goaway":
                    conn.sendall(_frame(7, 0, 0, (1).to_bytes(4, "big") + bytes(4)))
                    kept.append(conn.dup())
                return  # _Peer closes conn

    peer = _Peer(serve)
    close = peer.close

    def close_all() -> None:
        close()
        for sock in kept:
            sock.close()

    peer.close = close_all  # type: ignore[method-assign]
    return peer, calls


@pytest.mark.parametrize("how", ["closed", "reset", "goaway"])
def test_what_came_while_the_connection_sat_in_the_pool_is_seen_before_reusing_it(
        how: str) -> None:
    """The pool's peek before reusing a connection: a peer that closed it without a
    GOAWAY, reset it, or sent a GOAWAY and keeps it open (the peek reads it) gets the next
    call on a new connection, which succeeds; the retired one gets no request. (Reused,
    the closed one would fail the call as possibly sent, the other one would time out.)"""
    peer, calls = _retiring_peer(how)
    channel, rpc = _channel(peer.target)
    try:
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        (first,) = channel._idle
        # What the peer did reaches this side: the idle socket turns readable.
        assert select.select([first.sock], [], [], 5)[0]
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=2)
        assert calls == [1, 1] and first not in channel._open
    finally:
        channel.close()
        peer.close()


def test_a_connection_idle_too_long_is_not_reused(etcd: LocalEtcd, prefix: str) -> None:
    now = [1000.0]
    channel, rpc = _channel(_target(etcd), monotonic=lambda: now[0])
    try:
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        (first,) = channel._open
        now[0] += MAX_IDLE / 2
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        assert channel._open == {first}
        now[0] += MAX_IDLE + 1
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        assert first not in channel._open and len(channel._open) == 1
    finally:
        channel.close()


def test_a_forked_child_closing_its_copy_leaves_the_parents_connection(etcd: LocalEtcd
                                                                       ) -> None:
    channel, rpc = _channel(_target(etcd))
    try:
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        (first,) = channel._open
        pid = os.fork()
        if pid == 0:  # the child: close its copy, exit without running anything else
            try:
                channel.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        assert channel._open == {first}  # still alive: the child shut nothing down
    finally:
        channel.close()


def test_the_store_uses_it_for_every_unary_call(etcd: LocalEtcd, prefix: str) -> None:
    """A store with ``unary_transport="wire"`` (the default) sends its reads, writes and
    leases through its pool; with ``"grpc"`` through grpcio (the pool is never made)."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        store.set("k", "v")
        assert store.add("n", 2) == 2
        lease = store.leases.grant(30)
        assert store.leases.time_to_live(lease) is not None
        _, ep = store._conn.endpoint()
        assert ep.unary is not None and len(ep.unary._open) >= 1
        # Both transports are the wire's: no grpcio channel was opened (~0.3 ms of CPU,
        # and grpc-core's threads once it connects).
        assert store.wait(["k"], timeout=5) is None and ep.channel is None
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, unary_transport="grpc") as store:
        assert store.get("k") == b"v"
        _, ep = store._conn.endpoint()
        assert ep.unary is None and ep.channel is not None
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, unary_transport="grpc",
                   watch_transport="grpc") as store:  # one grpcio channel for everything
        store.set("k2", "v2")
        assert store.get("k2") == b"v2" and store.get("k") == b"v"
        _, ep = store._conn.endpoint()
        assert ep.unary is None and ep.watch_stream is ep.watch and ep.kv is ep.grpc_kv


def test_a_store_that_reads_nothing_at_construction_opens_its_connection_then(
        etcd: LocalEtcd, prefix: str) -> None:
    """A store watching what it touches makes no call while it is built, yet its first read
    finds a connection in the pool: the set-up (~0.3 ms of CPU, two round trips) is paid
    with the construction, as grpcio's channel was with the watch; none more is opened."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_scope="touched") as store:
        _, ep = store._conn.endpoint()
        assert ep.unary is not None
        assert (ep.unary.opened, len(ep.unary._idle)) == (1, 1)
        assert store.get("k", None) is None
        store.set("k", "v")
        assert ep.unary.opened == 1


def test_an_unknown_unary_transport_is_refused() -> None:
    from cachedstore import InvalidInputError

    with pytest.raises(InvalidInputError, match="unary_transport"):
        EtcdStore(endpoints=["127.0.0.1:1"], unary_transport="quic")


# -- regressions of the review of this module ----------------------------------------------
def test_a_connection_lost_after_sending_never_reads_as_never_sent(etcd: LocalEtcd) -> None:
    """"No route to host" or "Connection refused" on an established connection (the kernel
    gave up on it after the request went out) must not be classified as a failure to
    connect: that would retry a write etcd may have applied."""
    import errno

    from cachedstore.unary import _Http2

    class Failing:
        def __init__(self, sock: socket.socket, error: OSError) -> None:
            self._sock, self._error = sock, error

        def __getattr__(self, name: str) -> Any:
            return getattr(self._sock, name)

        def recv(self, size: int) -> bytes:
            raise self._error

    address = etcd.endpoint.split("://")[-1].rsplit(":", 1)
    for number, text in ((errno.EHOSTUNREACH, "No route to host"),
                         (errno.ECONNREFUSED, "Connection refused")):
        conn = _Http2((address[0], int(address[1])), _target(etcd), None,
                      time.monotonic() + 5)
        real = conn.sock
        conn.sock = Failing(real, OSError(number, text))  # type: ignore[assignment]
        try:
            with pytest.raises(WireError) as caught:
                conn.call(b"", b"", time.monotonic() + 5)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "after the request was sent" in caught.value.details()
            assert etcdapi.classify_rpc_error(caught.value)[0] is Failure.TRANSPORT
            assert not conn.reusable
        finally:
            real.close()


def test_a_forked_child_never_uses_the_parents_connection(etcd: LocalEtcd, prefix: str
                                                          ) -> None:
    """Two processes on one HTTP/2 connection would read each other's answers: a child's
    call opens a connection of its own."""
    channel, rpc = _channel(_target(etcd))
    key = (prefix + "k").encode()
    try:
        rpc.put(etcdrpc.PutRequest(key=key, value=b"parent"), timeout=5)
        (first,) = channel._open
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                got = rpc.range(etcdrpc.RangeRequest(key=key), timeout=5)
                code = 0 if (got.kvs[0].value == b"parent" and first not in channel._open
                             and channel._open) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for _ in range(5):
            assert rpc.range(etcdrpc.RangeRequest(key=key), timeout=5).kvs[0].value \
                == b"parent"
        assert channel._open == {first}
    finally:
        channel.close()


def test_signals_do_not_stretch_a_calls_timeout() -> None:
    """A process taking a signal every 0.1 s (a profiler, a timer): each interrupted wait
    resumes with the time left, not a new full timeout."""
    import signal

    peer, done = _silent_peer()
    channel, rpc = _channel(peer.target)
    # SIGUSR1 to this thread every 0.1 s (SIGALRM is pytest-timeout's).
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    target, stop = threading.get_ident(), threading.Event()

    def signals() -> None:
        while not stop.wait(0.1):
            signal.pthread_kill(target, signal.SIGUSR1)

    sender = threading.Thread(target=signals, name="test-unary-signals", daemon=True)
    sender.start()
    try:
        error, took = _fails(rpc.range, etcdrpc.RangeRequest(key=b"k"), 0.5)
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert took < 1.5, took
    finally:
        stop.set()
        sender.join(5)
        signal.signal(signal.SIGUSR1, previous)
        done.set()
        channel.close()
        peer.close()


def test_an_interrupted_call_leaves_its_connection_out_of_the_pool(
        etcd: LocalEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt in the middle of a call (a frame half handled): the connection
    is never reused, and the next call works on a new one."""
    from cachedstore import unary

    channel, rpc = _channel(_target(etcd))
    receive = unary._Http2._receive
    interrupted = []

    def once(self: Any, data: bytes, stream: int) -> None:
        if stream > 0 and not interrupted:
            interrupted.append(self)
            raise KeyboardInterrupt
        receive(self, data, stream)

    try:
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        monkeypatch.setattr(unary._Http2, "_receive", once)
        with pytest.raises(KeyboardInterrupt):
            rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        assert interrupted and interrupted[0] not in channel._open
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        assert len(channel._open) == 1 and interrupted[0] not in channel._open
    finally:
        channel.close()


def test_connecting_and_the_call_share_one_deadline() -> None:
    """A peer that sends its SETTINGS late: the call's timeout covers the connection too,
    and nothing is sent once it has passed (the call failed as never sent)."""
    received: list[bytes] = []
    done = threading.Event()

    def late(conn: socket.socket) -> None:
        _read_preface(conn)
        time.sleep(0.8)
        conn.sendall(_frame(4, 0, 0))
        conn.settimeout(0.5)
        try:
            received.append(conn.recv(1 << 16))
        except OSError:
            pass
        done.wait(5)

    peer = _Peer(late)
    channel, rpc = _channel(peer.target, connect_timeout=5.0)
    try:
        error, took = _fails(rpc.put, etcdrpc.PutRequest(key=b"k", value=b"v"), 0.4)
        assert took < 0.8, took
        assert etcdapi.classify_rpc_error(error)[0] is Failure.UNSENT
    finally:
        done.set()
        channel.close()
        peer.close()
    assert not any(b"/etcdserverpb.KV/Put" in chunk for chunk in received)


def test_pings_are_acknowledged_while_a_call_waits_long() -> None:
    """A keepalive PING that arrives while a call waits for a slow answer is acknowledged
    without waiting for the next request (grpc-go drops a connection that leaves its
    keepalive unanswered)."""
    frames: list[tuple[int, int, bytes]] = []

    def slow(conn: socket.socket) -> None:
        conn.sendall(_frame(4, 0, 0))
        for stream in _requests_of(conn, frames):
            conn.sendall(_frame(6, 0, 0, b"keepaliv"))
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not any(
                    k == 6 and f & 1 for k, f, _ in frames):
                conn.settimeout(0.05)
                try:
                    chunk = conn.recv(1 << 16)
                except OSError:
                    continue
                if chunk[:3] and chunk[3] == 6:
                    frames.append((6, chunk[4], chunk[9:17]))
            conn.sendall(_answer(stream))
            break
        time.sleep(0.2)

    peer = _Peer(slow)
    channel, rpc = _channel(peer.target)
    try:
        started = time.monotonic()
        rpc.range(etcdrpc.RangeRequest(key=b"k"), timeout=5)
        assert time.monotonic() - started < 2.0  # answered once its PING was acknowledged
    finally:
        channel.close()
        peer.close()
    assert (6, 1, b"keepaliv") in frames


#: The socket methods a _RecordingSocket saw called, in order.
_SOCKET_CALLS: list[str] = []


class _RecordingSocket(socket.socket):
    """A connection's own socket, its class swapped in place, recording what it is asked."""

    __slots__ = ()

    def settimeout(self, value: float | None) -> None:
        _SOCKET_CALLS.append("settimeout")
        super().settimeout(value)

    def send(self, data: Any, *args: Any) -> int:
        _SOCKET_CALLS.append("send")
        return super().send(data, *args)

    def sendall(self, data: Any, *args: Any) -> None:
        _SOCKET_CALLS.append("sendall")
        super().sendall(data, *args)

    def recv(self, size: int, *args: Any) -> bytes:
        _SOCKET_CALLS.append("recv")
        return super().recv(size, *args)


def test_a_plaintext_call_sends_and_waits_without_a_socket_timeout(etcd: LocalEtcd,
                                                                    prefix: str) -> None:
    """A plaintext connection stays non-blocking: a call is one send, a poll and a receive
    (and the pool's peek). Python's socket timeouts cost an ``ioctl`` per timeout set and a
    poll before every send, each a release of the GIL (a hand-off when the process's other
    threads want it)."""
    channel, rpc = _channel(_target(etcd))
    try:
        channel.warm(5)
        conn = channel._idle[0]
        conn.sock.__class__ = _RecordingSocket
        _SOCKET_CALLS.clear()
        for i in range(20):
            rpc.put(etcdrpc.PutRequest(key=f"{prefix}k{i}".encode(), value=b"v"), timeout=5)
        assert channel._idle == [conn]  # the same connection all along
        assert "settimeout" not in _SOCKET_CALLS
        assert "sendall" not in _SOCKET_CALLS
        assert _SOCKET_CALLS.count("send") >= 20 and _SOCKET_CALLS.count("recv") >= 20
    finally:
        channel.close()


def test_a_request_the_socket_takes_in_parts_goes_out_whole(etcd: LocalEtcd,
                                                            prefix: str) -> None:
    """With a send buffer of a few KiB each send takes a part of a 1 MiB request; the rest
    waits for room (a poll) and follows, and etcd gets it whole."""
    channel, rpc = _channel(_target(etcd))
    try:
        channel.warm(5)
        conn = channel._idle[0]
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        conn.sock.__class__ = _RecordingSocket
        _SOCKET_CALLS.clear()
        big = os.urandom(1 << 20)
        rpc.put(etcdrpc.PutRequest(key=f"{prefix}big".encode(), value=big), timeout=20)
        assert _SOCKET_CALLS.count("send") > 20  # in parts
        got = rpc.range(etcdrpc.RangeRequest(key=f"{prefix}big".encode()), timeout=20)
        assert got.kvs[0].value == big
    finally:
        channel.close()


def test_a_send_that_finds_no_room_fails_by_the_deadline() -> None:
    """A peer that grants a large flow-control window and then reads nothing: the request
    fills the socket's buffers and the send waits for room until the call's deadline."""
    done = threading.Event()

    def deaf(conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        _read_preface(conn)
        window = (1 << 31) - 1
        conn.sendall(_frame(4, 0, 0, (4).to_bytes(2, "big") + window.to_bytes(4, "big"))
                     + _frame(8, 0, 0, (window - 65_535).to_bytes(4, "big")))
        done.wait(30)

    peer = _Peer(deaf)
    channel, rpc = _channel(peer.target)
    try:
        channel.warm(5)
        channel._idle[0].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        request = etcdrpc.PutRequest(key=b"k", value=os.urandom(1 << 20))
        error, took = _fails(rpc.put, request, 0.5)
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.45 <= took < 2.0, took
        assert not channel._open and not channel._idle  # half sent: never reused
    finally:
        done.set()
        channel.close()
        peer.close()
