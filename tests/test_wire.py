"""The ``wire`` watch transport (``cachedstore/wire.py``) against a real etcd: what a gRPC
watch gives (events in order, progress answers, errors with grpcio's codes), flow control
both ways, cancellation from another thread, TLS and auth tokens (through the store), and
nothing left running after a call."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from etcd3 import etcdrpc

from cachedstore import EtcdStore, InvalidInputError
from cachedstore.server import LocalEtcd
from cachedstore.testing import make_tls_files
from cachedstore.wire import ACK_DELAY, BUSY, SPELL, WINDOW, WireError, WireStub
from tests.util import eventually, raw_client

pytestmark = pytest.mark.timeout(120)

_DECODE = etcdrpc.WatchResponse.FromString


def _stub(target: str) -> WireStub:
    return WireStub(target, None, 5.0, _DECODE, "test-wire-send")


def _create(prefix: str, start: int = 0) -> Any:
    key = prefix.encode()
    return etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
        key=key, range_end=key[:-1] + bytes([key[-1] + 1]), start_revision=start))


def _requests(*first: Any, then: threading.Event | None = None,
              more: Callable[[], Iterator[Any]] | None = None) -> Iterator[Any]:
    """``first``, then whatever ``more`` yields, then wait for ``then`` (the call's end)."""
    yield from first
    if more is not None:
        yield from more()
    if then is not None:
        then.wait(60)


def _events(call: Any, n: int) -> list[tuple[int, bytes, bytes, int]]:
    seen: list[tuple[int, bytes, bytes, int]] = []
    for response in call:
        seen += [(e.type, e.kv.key, e.kv.value, e.kv.mod_revision) for e in response.events]
        if len(seen) >= n:
            return seen
    raise AssertionError(f"the stream ended after {len(seen)} of {n} events")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name == "test-wire-send"}


def test_events_arrive_in_order_as_grpcio_delivers_them(etcd: LocalEtcd, prefix: str) -> None:
    client = raw_client(etcd)
    done = threading.Event()
    wire = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    grpc_channel = grpc.insecure_channel(etcd.endpoint)
    reference = etcdrpc.WatchStub(grpc_channel).Watch(iter([_create(prefix)]))
    try:
        assert next(wire).created and next(reference).created
        for i in range(50):
            client.put(f"{prefix}k{i % 7}", f"v{i}")
            if i % 5 == 4:
                client.delete(f"{prefix}k{i % 7}")
        assert _events(wire, 60) == _events(reference, 60)
    finally:
        done.set()
        wire.cancel()
        reference.cancel()
        grpc_channel.close()
        client.close()


def test_progress_requests_are_answered(etcd: LocalEtcd, prefix: str) -> None:
    """More progress requests than etcd's initial 64 KiB receive window holds (7 bytes
    each framed): all go out, as etcd credits them, and each gets its answer."""
    n = 12_000
    done = threading.Event()
    progress = etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())
    call = _stub(etcd.endpoint).Watch(_requests(
        _create(prefix), then=done, more=lambda: iter([progress] * n)))
    try:
        answers = 0
        for response in call:
            if not response.created and not response.events:
                answers += 1
                if answers == n:
                    break
        assert answers == n
    finally:
        done.set()
        call.cancel()


def test_requests_wait_for_the_peers_credit() -> None:
    """A peer that never credits its window (a listener that reads and answers nothing)
    receives at most its initial 65,535 bytes of request data, however many requests
    are queued."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(2.0)
        with conn:
            try:
                while chunk := conn.recv(1 << 16):
                    received.extend(chunk)
            except OSError:
                pass

    server = threading.Thread(target=serve, name="test-wire-peer", daemon=True)
    server.start()
    progress = etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())
    call = _stub(f"127.0.0.1:{listener.getsockname()[1]}").Watch(iter([progress] * 20_000))
    def read() -> None:  # sends the queued requests until the peer goes away
        with pytest.raises(grpc.RpcError):
            next(call)

    reader = threading.Thread(target=read, name="test-wire-reader", daemon=True)
    try:
        reader.start()
        server.join(10)  # the peer reads until 2 s pass without data
        data = bytes(received)
        assert data.startswith(b"PRI * HTTP/2.0")
        pos, sent = 24, 0
        while pos + 9 <= len(data):
            length = int.from_bytes(data[pos:pos + 3], "big")
            if data[pos + 3] == 0:  # DATA
                sent += length
            pos += 9 + length
        assert 60_000 < sent <= 65_535, sent
    finally:
        call.cancel()
        reader.join(5)
        listener.close()


def test_a_request_larger_than_the_window_goes_out_in_parts(etcd: LocalEtcd, prefix: str
                                                           ) -> None:
    """A watch create of a 100 KB key is more than etcd's initial 64 KiB window: the
    part that fits goes first, the rest as etcd credits it, and etcd answers."""
    done = threading.Event()
    key = (prefix + "k" * 100_000).encode()
    create = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(key=key))
    call = _stub(etcd.endpoint).Watch(_requests(create, then=done))
    try:
        assert next(call).created
    finally:
        done.set()
        call.cancel()


def _peer_says(frames: bytes) -> tuple[socket.socket, threading.Event]:
    """A listener that answers the first connection with ``frames`` in one write, then
    holds it open until the returned event is set: an HTTP/2 peer's last words."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(frames)
            done.wait(10)

    threading.Thread(target=serve, name="test-wire-peer", daemon=True).start()
    return listener, done


def _response_frames(*messages: Any, trailers: dict[str, str] | None = None) -> bytes:
    """SETTINGS, response headers, one DATA frame per message, and trailers."""
    import hpack

    from cachedstore.wire import _frame

    encoder = hpack.Encoder()
    out = _frame(4, 0, 0) + _frame(1, 4, 1, encoder.encode(
        [(":status", "200"), ("content-type", "application/grpc")]))
    for message in messages:
        data = message.SerializeToString()
        out += _frame(0, 0, 1, b"\0" + len(data).to_bytes(4, "big") + data)
    if trailers is not None:
        out += _frame(1, 4 | 1, 1, encoder.encode(list(trailers.items())))
    return out


def test_responses_before_an_error_are_delivered_first() -> None:
    """etcd's last responses and the error that follows them in the same read: grpcio
    delivers the responses, then raises; so must the wire transport."""
    created = etcdrpc.WatchResponse(created=True, watch_id=0)
    canceled = etcdrpc.WatchResponse(canceled=True, watch_id=0, cancel_reason="boom")
    listener, done = _peer_says(_response_frames(created, canceled)
                                + (b"\0\0\x04\x03\0\0\0\0\x01" + (2).to_bytes(4, "big")))
    call = _stub(f"127.0.0.1:{listener.getsockname()[1]}").Watch(iter([]))
    try:
        assert next(call).created
        assert next(call).cancel_reason == "boom"
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() is grpc.StatusCode.INTERNAL  # RST_STREAM INTERNAL_ERROR
    finally:
        done.set()
        call.cancel()
        listener.close()


def test_frames_after_a_clean_end_change_nothing() -> None:
    """Status OK in the trailers, then a RST_STREAM(NO_ERROR) in the same read (grpc-go
    sends one to a client that has not half-closed): the call ended cleanly."""
    created = etcdrpc.WatchResponse(created=True, watch_id=0)
    listener, done = _peer_says(_response_frames(created, trailers={"grpc-status": "0"})
                                + (b"\0\0\x04\x03\0\0\0\0\x01" + (0).to_bytes(4, "big")))
    call = _stub(f"127.0.0.1:{listener.getsockname()[1]}").Watch(iter([]))
    try:
        assert [r.created for r in call] == [True]  # then StopIteration, not an error
    finally:
        done.set()
        call.cancel()
        listener.close()


def test_receive_window_is_credited_back(etcd: LocalEtcd, prefix: str) -> None:
    """More event bytes than the window the transport advertises: etcd stops sending
    unless the reader credits what it consumed."""
    value = b"x" * 1_000_000
    n = WINDOW // len(value) + 8
    client = raw_client(etcd)
    revision = client.put(f"{prefix}start", "0").header.revision
    for i in range(n):
        client.put(f"{prefix}big{i}", value)
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix, revision + 1), then=done))
    try:
        seen = _events(call, n)
        assert [kv for _, kv, _, _ in seen] == [f"{prefix}big{i}".encode() for i in range(n)]
        assert all(v == value for _, _, v, _ in seen)
    finally:
        done.set()
        call.cancel()
        client.delete_prefix(prefix)
        client.close()


def test_cancel_from_another_thread_ends_a_blocked_read(etcd: LocalEtcd, prefix: str) -> None:
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    assert next(call).created
    timer = threading.Timer(0.3, call.cancel)
    timer.start()
    with pytest.raises(grpc.RpcError) as info:
        next(call)  # nothing arrives: blocked until the cancel
    assert info.value.code() is grpc.StatusCode.CANCELLED
    done.set()
    eventually(lambda: not _threads(), what="the sender thread ended")
    call.cancel()  # idempotent
    with pytest.raises(grpc.RpcError):
        next(call)


def test_a_call_never_read_is_released_by_cancel(etcd: LocalEtcd, prefix: str) -> None:
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    assert next(call).created
    call.cancel()  # nobody is reading: the connection is closed here
    assert call._sock is not None and call._sock.fileno() == -1
    done.set()
    eventually(lambda: not _threads(), what="the sender thread ended")


def test_an_unreachable_endpoint_fails_on_the_first_read(prefix: str) -> None:
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    call = _stub(f"127.0.0.1:{port}").Watch(iter([_create(prefix)]))  # does not raise
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert isinstance(info.value, WireError) and "refused" in info.value.details().lower()


def test_a_dying_etcd_ends_the_stream_unavailable(etcd_factory: Callable[..., LocalEtcd],
                                                  prefix: str) -> None:
    server = etcd_factory()
    done = threading.Event()
    call = _stub(server.endpoint).Watch(_requests(_create(prefix), then=done))
    assert next(call).created
    server.stop()
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    done.set()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_request_iterator_that_raises_ends_the_call_unknown(etcd: LocalEtcd, prefix: str
                                                              ) -> None:
    def broken() -> Iterator[Any]:
        yield _create(prefix)
        time.sleep(0.2)
        raise RuntimeError("boom")

    call = _stub(etcd.endpoint).Watch(broken())
    assert next(call).created
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() is grpc.StatusCode.UNKNOWN


def test_etcd_errors_arrive_with_their_grpc_status(etcd: LocalEtcd, prefix: str) -> None:
    """A method etcd does not have: etcd answers with trailers only (UNIMPLEMENTED)."""
    from cachedstore.wire import WireCall

    call = WireCall(("127.0.0.1", int(etcd.endpoint.rsplit(":", 1)[1])), etcd.endpoint, None,
                    5.0, "/etcdserverpb.Watch/NoSuchMethod", (), iter([_create(prefix)]),
                    _DECODE, "test-wire-send")
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_the_store_over_tls_and_auth(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path,
                                     prefix: str) -> None:
    """The store's watch over the wire transport with a client certificate and an etcd
    user: writes by another client reach the cache, and the stream carries the token."""
    files = make_tls_files(tmp_path / "pki", client_cert_auth=True)
    server = etcd_factory(tls=files)
    server.etcdctl("user", "add", "bob", "--interactive=false", input="b0b-pw\n")
    server.etcdctl("role", "add", "r")
    server.etcdctl("role", "grant-permission", "r", "--prefix=true", "readwrite", prefix)
    server.etcdctl("user", "grant-role", "bob", "r")
    server.enable_auth("r00t-pw")
    with EtcdStore(endpoints=[server.endpoint], prefix=prefix, ca_cert=files.ca_cert,
                   cert_key=files.client_key, cert_cert=files.client_cert, user="bob",
                   password="b0b-pw", watch_transport="wire") as store:
        store.set("k", "1")
        assert store.get("k") == b"1"
        server.etcdctl("put", prefix + "k", "2", user="root", password="r00t-pw")
        eventually(lambda: store._cache.peek("k") is not None
                   and store._cache.peek("k")[0] == b"2", what="the event reached the cache")
        assert store.watch_healthy and store._watcher.restarts == 0


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="watch_transport"):
        EtcdStore(endpoints=["127.0.0.1:1"], watch_transport="quic")


# -- pacing (StoreConfig.watch_pacing) --------------------------------------------------------
_HOUR = 3600.0  # a pacing interval no test outlives: only hurry() or cancel() ends a wait
_LONG = 200.0  # a store's, below its stall_timeout of 300 s (no PING, no progress request
#                before 120 s)


def _unread_bytes(call: Any) -> int:
    """Bytes etcd sent that sit in the call's socket, not yet read (SIOCINQ)."""
    import fcntl
    import struct
    import termios

    raw = fcntl.ioctl(call._sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", raw)[0])


def _pacing_reader(call: Any) -> tuple[list[Any], list[BaseException], threading.Thread]:
    got: list[Any] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for response in call:
                got.append(response)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    reader = threading.Thread(target=read, name="test-wire-reader", daemon=True)
    reader.start()
    return got, errors, reader


def _busy_spell(call: Any, put: Callable[[int], None], seen: Callable[[int], bool]) -> None:
    """Drive a pacing reader into a busy spell: one put at a time (``put(i)``), each read
    as it comes (``seen(i)``), until the reader paces, which it does once it has read
    BUSY responses (its create's answer included) within its interval (here a long one)."""
    for i in range(4 * BUSY):
        before = call._last_wait
        put(i)
        # Read, and the reader past its pacing decision: waiting again, paced or not.
        eventually(lambda i=i, before=before: call._pacing_now
                   or (seen(i) and call._last_wait != before),
                   what=f"busy-spell event {i} read")
        if call._pacing_now:
            return
    raise AssertionError(f"no busy spell after {4 * BUSY} events")


def _read_keys(got: list[Any]) -> set[bytes]:
    return {e.kv.key for r in got for e in r.events}


def _raw_spell(client: Any, prefix: str, call: Any, got: list[Any]) -> int:
    """:func:`_busy_spell` for a bare call read into ``got``; returns the responses read."""
    _busy_spell(call, lambda i: client.put(f"{prefix}busy{i}", "x"),
                lambda i: f"{prefix}busy{i}".encode() in _read_keys(got))
    return len(got)


def test_a_lone_event_after_a_quiet_spell_is_not_paced(etcd: LocalEtcd, prefix: str) -> None:
    """Pacing engages under load only: events a millisecond apart, fewer than BUSY within
    SPELL intervals, are each read as they come (no pacing wait begins, counted by the
    call), however recently the previous one was read; the BUSY-th within SPELL intervals
    makes the spell busy and the reader paces. The call's clock is injected: every read's
    time is the one set before its put, whatever the machine's load."""
    client = raw_client(etcd)
    done = threading.Event()
    now = [0.0]
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    call.pace(0.005, lambda: False, lambda: now[0])
    try:
        assert next(call).created
        got, errors, reader = _pacing_reader(call)
        # After a quiet second, BUSY - 1 events a millisecond apart: each read at once.
        times = [1.0 + 0.001 * i for i in range(BUSY - 1)]
        for i, at in enumerate(times):
            now[0] = at
            client.put(f"{prefix}k{i}", "v")
            eventually(lambda i=i: len(got) == i + 1, what=f"event {i} read")
            eventually(lambda at=at: call._last_wait == at, what="the reader waiting again")
            assert call.paced == 0 and not call._pacing_now, f"event {i} paced"
        # One more: BUSY responses within SPELL intervals (10 ms), a busy spell.
        assert (BUSY - 1) * 0.001 < SPELL * 0.005
        now[0] = times[-1] + 0.0005
        client.put(f"{prefix}k{BUSY}", "v")
        eventually(lambda: call.paced == 1, what="the reader pacing in a busy spell")
        assert len(got) == BUSY and not errors
        # A second of quiet later a lone event is read as it comes again.
        now[0] += 1.0
        client.put(prefix + "lone", "v")
        eventually(lambda: len(got) == BUSY + 1, what="the lone event read")
        eventually(lambda: call._last_wait == now[0], what="the reader waiting again")
        assert call.paced == 1
    finally:
        done.set()
        call.cancel()
        client.close()
    reader.join(10)
    assert not reader.is_alive()


def test_a_pacing_reader_leaves_a_busy_spell_in_the_socket_until_hurried(
        etcd: LocalEtcd, prefix: str) -> None:
    """Within its interval a pacing reader reads nothing, though etcd's event sits in its
    socket; hurry() (urgent now) makes it read at once."""
    client = raw_client(etcd)
    done = threading.Event()
    urgent = [False]
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    call.pace(_HOUR, lambda: urgent[0])
    try:
        assert next(call).created  # the first wait is not paced: the interval starts here
        got, errors, reader = _pacing_reader(call)
        n = _raw_spell(client, prefix, call, got)
        client.put(prefix + "k", "v")
        eventually(lambda: _unread_bytes(call) > 0, what="the event in the socket")
        assert len(got) == n and call._pacing_now and not errors
        urgent[0] = True
        call.hurry()
        eventually(lambda: len(got) > n, what="the event read after hurry()")
        assert [(e.kv.key, e.kv.value) for e in got[n].events] == [
            ((prefix + "k").encode(), b"v")]
        client.put(prefix + "k", "w")  # urgent: no pacing, read as it comes
        eventually(lambda: len(got) == n + 2, what="the next event read unpaced")
    finally:
        done.set()
        call.cancel()
        client.close()
    reader.join(10)
    assert not reader.is_alive()
    assert [type(e) for e in errors] == [WireError]


def test_cancel_ends_a_pacing_wait(etcd: LocalEtcd, prefix: str) -> None:
    client = raw_client(etcd)
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    call.pace(_HOUR, lambda: False)
    assert next(call).created
    got, errors, reader = _pacing_reader(call)
    n = _raw_spell(client, prefix, call, got)
    client.close()
    call.cancel()
    reader.join(10)
    done.set()
    assert not reader.is_alive() and len(got) == n
    assert len(errors) == 1 and errors[0].code() is grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
    eventually(lambda: not _threads(), what="the sender thread ended")


def _store_spell(store: EtcdStore, client: Any, prefix: str, call: Any,
                 key: str | None = None) -> None:
    """:func:`_busy_spell` for a store's watch: puts of ``busy<i>`` (or all of ``key``)."""
    def put(i: int) -> None:
        client.put(prefix + (key or f"busy{i}"), f"busy{i}")

    def seen(i: int) -> bool:
        entry = store._cache.peek(key or f"busy{i}")
        return entry is not None and entry[0] == f"busy{i}".encode()

    _busy_spell(call, put, seen)


def test_a_blocked_get_ends_the_stores_pacing(etcd: LocalEtcd, prefix: str) -> None:
    """A store pacing its watch (here for 200 s) stops as soon as a thread blocks on it:
    the put it waits for is applied as it comes, not an interval later. (No progress
    request ends the pacing meanwhile: the first is two minutes away.)"""
    client = raw_client(etcd)
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_pacing=_LONG,
                      progress_interval=120, stall_timeout=300,
                      ping_interval=0)
    try:
        call = store._watcher._call
        _store_spell(store, client, prefix, call)
        client.put(prefix + "unread", "2")
        eventually(lambda: _unread_bytes(call) > 0, what="the event in the socket")
        assert store._cache.peek("unread") is None  # paced: not applied yet
        result: list[bytes] = []
        getter = threading.Thread(target=lambda: result.append(store.get("k", timeout=60)),
                                  daemon=True)
        getter.start()
        eventually(lambda: store._cache.n_waiters == 1, what="the get blocked on the watch")
        client.put(prefix + "k", "v")
        getter.join(30)
        assert result == [b"v"], "the blocked get was not woken by its put"
        assert store._cache.peek("unread") is not None
    finally:
        store.close()
        client.close()


def test_a_scope_opened_while_pacing_has_its_create_answered(etcd: LocalEtcd,
                                                              prefix: str) -> None:
    """Opening a scope on a pacing stream: sending its create ends the pacing wait, and
    the answer is read as it comes (no progress request ends the pacing meanwhile)."""
    client = raw_client(etcd)
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_scope="touched",
                      watch_pacing=_LONG, progress_interval=120, stall_timeout=300,
                      ping_interval=0)
    try:
        client.put(prefix + "a", "1")
        client.put(prefix + "b", "2")
        assert store.get("a") == b"1"  # opens a's scope; its create is answered
        stream = store._watcher._stream
        eventually(lambda: len(stream.by_id) == 2, what="a's create answered")  # + anchor
        call = store._watcher._call
        _store_spell(store, client, prefix, call, key="a")
        assert store.get("b") == b"2"  # opens b's scope (served from its snapshot)
        eventually(lambda: len(stream.by_id) == 3 and not stream.awaiting,
                   what="b's create answered while pacing")
    finally:
        store.close()
        client.close()


def test_send_writes_from_the_calling_thread_on_a_plaintext_stream(etcd: LocalEtcd,
                                                                   prefix: str) -> None:
    """``WireCall.send`` on a connected plaintext stream writes the request itself: etcd
    answers it while no thread reads the call and the sender thread waits in the request
    iterator (a request queued for the reader would wait for the next read)."""
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    try:
        first = next(call)
        assert first.created and first.watch_id == 0
        assert call.send(_create(prefix + "more/"))
        eventually(lambda: _unread_bytes(call) > 0, what="etcd's answer in the socket")
        second = next(call)
        assert second.created and second.watch_id == 1
    finally:
        done.set()
        call.cancel()
    assert not call.send(_create(prefix)), "a call that is over sends nothing"


def test_a_request_sent_before_the_call_connects_follows_its_handshake(
        etcd: LocalEtcd, prefix: str) -> None:
    """Before the first iteration connects, ``send`` queues the request for the reader,
    which sends it behind the connection preface and the call's HEADERS."""
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(then=done))
    try:
        assert call.send(_create(prefix))
        response = next(call)
        assert response.created and response.watch_id == 0
    finally:
        done.set()
        call.cancel()


def test_a_backlog_is_read_at_full_speed(etcd: LocalEtcd, prefix: str) -> None:
    """A pacing reader that finds etcd's bytes already waiting after a read (more than one
    read's worth arrived) reads on without pacing; it paces once the socket is drained."""
    client = raw_client(etcd)
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    call.pace(_HOUR, lambda: False)
    try:
        assert next(call).created
        got, errors, reader = _pacing_reader(call)
        busy = _raw_spell(client, prefix, call, got)
        n = 120  # 120 KiB of values: two reads of 64 KiB at least
        for i in range(n):
            client.put(f"{prefix}k{i}", "x" * 1024)
        eventually(lambda: _unread_bytes(call) > 1 << 16, what="a backlog in the socket")
        call.hurry()  # ends this pacing wait only (urgent() stays false)
        eventually(lambda: sum(len(r.events) for r in got) == busy + n, timeout=30,
                   what="the whole backlog read")
        eventually(lambda: call._pacing_now, what="pacing again once drained")
        assert not errors
    finally:
        done.set()
        call.cancel()
        client.close()


def test_a_replay_after_a_reconnect_is_not_paced(etcd: LocalEtcd, prefix: str) -> None:
    """The cache serves nothing until a restarted stream has replayed what it missed, and
    etcd sends a replay of over 1,000 revisions in batches 100 ms apart (its unsynced
    watchers' loop): none of them waits out a pacing interval (here 200 s)."""
    client = raw_client(etcd)
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_pacing=_LONG,
                      progress_interval=120, stall_timeout=300,
                      ping_interval=0)
    try:
        call = store._watcher._call
        _store_spell(store, client, prefix, call)
        for i in range(2_500):  # 2,500 revisions, left unread in the paced socket
            client.put(f"{prefix}k{i}", "v")
        call.cancel()  # they are lost with the connection: the new stream replays them
        eventually(lambda: store._watcher._call not in (None, call), what="a new stream")
        eventually(lambda: store._cache.floor == 0 and store._cache.peek("k2499"),
                   timeout=60, what="the replay applied")
        assert store._watcher.restarts == 1
    finally:
        store.close()
        client.close()


def test_creates_back_to_back_cost_etcd_few_pings(etcd: LocalEtcd, prefix: str) -> None:
    """grpc-go pings (to estimate the bandwidth) on every request it reads while none of
    its PINGs is unacknowledged: acknowledged once ``ACK_DELAY`` old, 40 creates answered
    one after another get one PING or a few, not one each (each of those cost the reader a
    wakeup and a write)."""
    done = threading.Event()
    call = _stub(etcd.endpoint).Watch(_requests(_create(prefix), then=done))
    try:
        assert next(call).created
        started = time.monotonic()
        for i in range(40):
            assert call.send(_create(f"{prefix}{i}/"))
            assert next(call).watch_id == i + 1
        took = time.monotonic() - started
        assert 1 <= call.pings_received <= min(20, 2 + took / ACK_DELAY), (
            call.pings_received, took)
    finally:
        done.set()
        call.cancel()


def test_a_ping_held_for_ack_delay_is_acknowledged_by_an_idle_reader() -> None:
    """A bandwidth-estimation PING on a stream that has nothing else to send is
    acknowledged by the reader once ``ACK_DELAY`` old (its wait for the socket ends then);
    any other PING (a keepalive: grpc-go drops a connection that leaves it unanswered for
    its keepalive timeout, 1 s or more) at once, ahead of it."""
    from cachedstore.wire import BDP_PING, _frame

    listener = socket.create_server(("127.0.0.1", 0))
    acked: dict[bytes, float] = {}
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            pinged, buf = time.monotonic(), b""
            conn.sendall(_frame(4, 0, 0) + _frame(6, 0, 0, BDP_PING)
                         + _frame(6, 0, 0, b"keepaliv"))
            conn.settimeout(0.05)
            while not done.is_set() and len(acked) < 2:
                try:
                    buf += conn.recv(1 << 16)
                except TimeoutError:
                    continue
                for payload in (BDP_PING, b"keepaliv"):
                    if payload not in acked and _frame(6, 1, 0, payload) in buf:
                        acked[payload] = time.monotonic() - pinged
            done.wait(10)

    server = threading.Thread(target=serve, name="test-wire-peer", daemon=True)
    server.start()
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    call = _stub(target).Watch(_requests(then=done))

    def read() -> None:
        with contextlib.suppress(WireError):  # CANCELLED, at the end
            list(call)

    reader = threading.Thread(target=read, name="test-wire-reader", daemon=True)
    reader.start()
    try:
        eventually(lambda: len(acked) == 2, timeout=5, what="both acknowledgements")
        assert acked[BDP_PING] - acked[b"keepaliv"] >= ACK_DELAY / 2, acked  # not held
        assert ACK_DELAY <= acked[BDP_PING] < 0.9, acked
    finally:
        done.set()
        call.cancel()
        reader.join(10)
        server.join(10)
        listener.close()
