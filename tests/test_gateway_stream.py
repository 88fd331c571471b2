"""benchmarks.fanout.gateway_stream against real etcd members (plain, TLS, auth, leaderless)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import etcd3
import pytest

from benchmarks.fanout.gateway_stream import DELETE, PUT, GatewayWatchStream, WatchResponse
from cachedstore.errors import EtcdConnectionError
from cachedstore.server import LocalEtcd, free_port
from cachedstore.testing import LocalEtcdCluster, make_tls_files

ROOT_PASSWORD = "gateway-root-pw"
ALICE_PASSWORD = "gateway-alice-pw"


def _range(prefix: str) -> dict[str, bytes]:
    key = prefix.encode()
    return {"key": key, "range_end": key[:-1] + bytes([key[-1] + 1])}


def _host_port(server: LocalEtcd) -> tuple[str, int]:
    return server.host, server.client_port


def _until_events(stream: GatewayWatchStream, count: int) -> list[WatchResponse]:
    responses = []
    seen = 0
    for response in stream:
        if response.events:
            responses.append(response)
            seen += len(response.events)
            if seen >= count:
                break
    return responses


def test_events_in_order_with_transactions(etcd: LocalEtcd, prefix: str) -> None:
    client = etcd3.client(*_host_port(etcd))
    with GatewayWatchStream(*_host_port(etcd), **_range(prefix)) as stream:
        it = iter(stream)
        created = next(it)
        assert created.created and not created.canceled and created.watch_id == 0
        assert created.header_revision > 0 and created.cluster_id != 0
        client.put(prefix + "a", b"\x00\xffbinary")
        client.put(prefix + "b", b"")
        client.transaction(compare=[], success=[client.transactions.put(prefix + "c", "1"),
                                                client.transactions.delete(prefix + "a")],
                           failure=[])
        client.put("/elsewhere/" + prefix, b"not watched")
        responses = _until_events(stream, 4)
    events = [e for r in responses for e in r.events]
    assert [(t, k, v) for t, k, v, _ in events] == [
        (PUT, (prefix + "a").encode(), b"\x00\xffbinary"),
        (PUT, (prefix + "b").encode(), b""),
        (PUT, (prefix + "c").encode(), b"1"),
        (DELETE, (prefix + "a").encode(), b""),
    ]
    revisions = [e[3] for e in events]
    assert revisions[0] < revisions[1] < revisions[2] == revisions[3]
    # the transaction's two events arrive in one response, as over gRPC
    assert len(responses) == 3 and len(responses[2].events) == 2
    assert responses[2].header_revision == revisions[2]


def test_start_revision_replays_history(etcd: LocalEtcd, prefix: str) -> None:
    client = etcd3.client(*_host_port(etcd))
    first = client.put(prefix + "x", "1").header.revision
    client.put(prefix + "x", "2")
    with GatewayWatchStream(*_host_port(etcd), **_range(prefix), start_revision=first,
                            prev_kv=True) as stream:
        responses = _until_events(stream, 2)
    assert [(e[2], e[3]) for r in responses for e in r.events] == [(b"1", first),
                                                                   (b"2", first + 1)]


def test_compacted_start_revision_is_a_cancel(etcd: LocalEtcd, prefix: str) -> None:
    client = etcd3.client(*_host_port(etcd))
    old = client.put(prefix + "k", "1").header.revision
    now = client.put(prefix + "k", "2").header.revision
    client.compact(now)
    with GatewayWatchStream(*_host_port(etcd), **_range(prefix), start_revision=old) as stream:
        responses = []
        for response in stream:
            responses.append(response)
            if response.canceled:
                break
    assert responses[-1].canceled and responses[-1].compact_revision >= now


def test_close_from_another_thread_ends_iteration(etcd: LocalEtcd, prefix: str) -> None:
    stream = GatewayWatchStream(*_host_port(etcd), **_range(prefix))
    got: list[WatchResponse] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            got.extend(stream)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)  # let the reader block in recv
    started = time.monotonic()
    stream.close()
    stream.close()  # idempotent
    reader.join(5)
    assert not reader.is_alive() and time.monotonic() - started < 2
    assert errors == [] and len(got) == 1 and got[0].created and stream.closed


def test_unreachable_and_ended_streams_raise(etcd_factory: Callable[..., LocalEtcd],
                                            prefix: str) -> None:
    with pytest.raises(EtcdConnectionError):
        GatewayWatchStream("127.0.0.1", free_port("127.0.0.1"), **_range(prefix), timeout=2)
    server = etcd_factory()
    stream = GatewayWatchStream(*_host_port(server), **_range(prefix))
    it = iter(stream)
    assert next(it).created
    server.kill()
    with pytest.raises(EtcdConnectionError):
        next(it)
    stream.close()


def test_tls(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path, prefix: str) -> None:
    files = make_tls_files(tmp_path / "pki", client_cert_auth=True)
    server = etcd_factory(tls=files)
    client = etcd3.client(*_host_port(server), ca_cert=files.ca_cert,
                          cert_key=files.client_key, cert_cert=files.client_cert)
    with GatewayWatchStream(*_host_port(server), **_range(prefix),
                            ssl_context=files.ssl_context()) as stream:
        it = iter(stream)
        assert next(it).created
        client.put(prefix + "tls", "v")
        event = next(it).events[0]
    assert event[:3] == (PUT, (prefix + "tls").encode(), b"v")
    # plain text to the TLS port: refused, not hung
    with pytest.raises(EtcdConnectionError):
        plain = GatewayWatchStream(*_host_port(server), **_range(prefix), timeout=2)
        try:
            next(iter(plain))
        finally:
            plain.close()


def _token(server: LocalEtcd, name: str, password: str) -> str:
    conn = http.client.HTTPConnection(*_host_port(server), timeout=5)
    try:
        conn.request("POST", "/v3/auth/authenticate",
                     json.dumps({"name": name, "password": password}))
        return str(json.loads(conn.getresponse().read())["token"])
    finally:
        conn.close()


def test_auth_token_in_authorization_header(etcd_factory: Callable[..., LocalEtcd]) -> None:
    server = etcd_factory()
    server.etcdctl("role", "add", "jobA")
    server.etcdctl("role", "grant-permission", "jobA", "--prefix=true", "readwrite", "/jobA/")
    server.etcdctl("user", "add", "alice", "--interactive=false", input=ALICE_PASSWORD + "\n")
    server.etcdctl("user", "grant-role", "alice", "jobA")
    server.enable_auth(ROOT_PASSWORD)
    token = _token(server, "alice", ALICE_PASSWORD)

    with GatewayWatchStream(*_host_port(server), **_range("/jobA/"), token=token) as stream:
        it = iter(stream)
        assert next(it).created
        server.etcdctl("put", "/jobA/k", "v", user="alice", password=ALICE_PASSWORD)
        assert next(it).events[0][1:3] == (b"/jobA/k", b"v")
    for kwargs in ({"token": token, **_range("/jobB/")},  # outside alice's role
                   _range("/jobA/"),  # no token
                   {"token": "not-a-token", **_range("/jobA/")}):
        with GatewayWatchStream(*_host_port(server), **kwargs) as stream:  # type: ignore[arg-type]
            first = next(iter(stream))
        assert first.canceled and "permission denied" in first.cancel_reason


def test_require_leader() -> None:
    """A member cut off from its peers ends an open require-leader watch (the gateway ends
    the response, without etcd's reason) and refuses new ones with "no leader"; without the
    flag it would serve them from its frozen state."""
    with LocalEtcdCluster(3) as cluster:
        lonely = cluster.members[0]
        open_stream = GatewayWatchStream(*_host_port(lonely), key=b"/x/")
        assert next(open_stream).created
        ended: list[BaseException] = []

        def read() -> None:
            try:
                for _ in open_stream:
                    pass
            except BaseException as exc:  # noqa: BLE001 - checked below
                ended.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        for member in cluster.members[1:]:
            member.kill()
        reader.join(20)  # etcd ends such streams after about three election timeouts
        open_stream.close()
        # the gateway ends the response without etcd's reason: a clean end, a failure
        assert len(ended) == 1 and isinstance(ended[0], EtcdConnectionError)

        deadline = time.monotonic() + 15
        while True:  # a new watch: refused with HTTP 503 "no leader"
            try:
                with GatewayWatchStream(*_host_port(lonely), key=b"/x/", timeout=2) as stream:
                    next(stream)
            except EtcdConnectionError as exc:
                assert "no leader" in str(exc)
                break
            assert time.monotonic() < deadline, "the member never reported no leader"
            time.sleep(0.2)
        with GatewayWatchStream(*_host_port(lonely), key=b"/x/", require_leader=False) as stream:
            assert next(stream).created


def test_chunk_framing_is_not_relied_on(etcd: LocalEtcd, prefix: str) -> None:
    """etcd sends one chunk per line; a proxy in between may re-chunk. Real etcd lines,
    replayed by a loopback server as two lines in one chunk, then one line split over two
    chunks, sent in 7-byte writes, decode the same."""
    import socket

    client = etcd3.client(*_host_port(etcd))
    with GatewayWatchStream(*_host_port(etcd), **_range(prefix)) as stream:
        raw = stream._sock
        assert next(stream).created
        client.put(prefix + "a", "1")
        client.put(prefix + "b", "2")
        raw.settimeout(5)
        data = b""
        while data.count(b"mod_revision") < 2:
            data += raw.recv(65536)
    lines, pos = [], 0
    while pos < len(data):  # etcd's chunks: "<hex size>\r\n<one JSON line>\n\r\n"
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end], 16)
        lines.append(data[end + 2:end + 2 + size])
        pos = end + 4 + size
    assert len(lines) == 2 and all(line.endswith(b"\n") for line in lines)
    both = lines[0] + lines[1]
    half = len(lines[1]) // 2
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (both, lines[1][:half],
                                                             lines[1][half:]))
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            for i in range(0, len(reply), 7):
                conn.sendall(reply[i:i + 7])
            time.sleep(0.5)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with GatewayWatchStream("127.0.0.1", port, **_range(prefix)) as replay:
            got = [next(replay) for _ in range(3)]
    finally:
        thread.join(5)
        server.close()
    keys = [r.events[0][1] for r in got]
    assert keys == [(prefix + "a").encode(), (prefix + "b").encode(), (prefix + "b").encode()]
