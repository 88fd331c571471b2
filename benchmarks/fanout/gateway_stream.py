"""One etcd watch over etcd's gRPC gateway (JSON over HTTP/1.1), read on one thread.

Status: a measured candidate transport for the store's watch (issue 11, goal 6), used by
``watch_transport.py``; the store does not use it (see FANOUT.md, "CPU per watch event").

Why: a watch event received through grpcio costs ~150 µs of client CPU, nearly all of it in
grpcio's own threads (completion queue, channel spin thread, GIL hand-offs), whatever the
code that applies it does. The same watch read as etcd's gateway JSON stream from a plain
socket costs a fraction of that, with no thread besides the reader
(``python -m benchmarks.fanout.watch_transport`` measures both).

Protocol: ``POST /v3/watch`` with one JSON ``WatchRequest`` (a ``create_request``); etcd
answers ``200`` and a chunked body of one JSON object per ``WatchResponse``,
``{"result": {...}}``, or ``{"error": {...}}`` when the gRPC stream fails (no leader, ...).
int64 fields are JSON strings, bytes are base64, and fields holding their default (0,
false, ``PUT``) are left out.

What it keeps of the gRPC watch: event order and transactions (one response per revision,
as etcd sends it), compaction (``canceled`` with ``compact_revision``), cancels with their
``cancel_reason`` (permission denied, ...), the require-leader flag (HTTP header
``Grpc-Metadata-hasleader: true``: a leaderless member refuses a new watch with HTTP 503
"no leader" and ends an open one, though as a clean end without the reason), the auth
token (``Authorization`` header), TLS (an :class:`ssl.SSLContext`).

What it loses: etcd's HTTP/1.1 server reads the whole request body before it answers, so
nothing can be sent on an open stream: no progress requests and no cancel requests. A
caller detects a stalled stream otherwise (TCP keepalive, set on the socket here, catches a
dead peer; a paused or wedged etcd needs a probe, e.g. a unary range on the same member,
as the store already does for grpc-proxy streams, which ignore progress requests). etcd's
grpc-proxy does not serve the gateway at all.

Thread-safety: one thread iterates; :meth:`GatewayWatchStream.close` may be called from any
thread and makes a blocked iteration end (quietly). Blocking: the constructor blocks up to
``timeout`` to connect and send the request; iteration blocks until etcd sends something
(no read timeout: etcd sends nothing on a quiet watch).
"""

from __future__ import annotations

import base64
import binascii
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from cachedstore.errors import EtcdConnectionError, EtcdError, EtcdPermissionError

_loads: Callable[[bytes], Any]
try:  # orjson parses a response ~4x faster than json (~0.8 vs ~3 µs); json is the fallback
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

__all__ = ["DELETE", "PUT", "Event", "GatewayWatchStream", "WatchResponse"]

#: Event types, as etcd's ``mvccpb.Event.EventType``.
PUT = 0
DELETE = 1

#: ``(type, key, value, mod_revision)``; a delete has an empty value.
Event = tuple[int, bytes, bytes, int]

_a2b = binascii.a2b_base64
_CHUNK = 65536
#: gRPC codes that mean the caller's credentials do not grant the watch.
_PERMISSION_CODES = frozenset({7, 16})  # PERMISSION_DENIED, UNAUTHENTICATED
#: gRPC codes that mean "this member cannot serve now; try again / another one".
_UNAVAILABLE_CODES = frozenset({1, 4, 14})  # CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE


class WatchResponse(NamedTuple):
    """One decoded ``WatchResponse``. ``watch_id`` is ``-1`` for a progress response."""

    watch_id: int
    created: bool
    canceled: bool
    compact_revision: int
    cancel_reason: str
    header_revision: int
    events: list[Event]
    cluster_id: int


def _error(payload: Any, what: str) -> Exception:
    """The cachedstore error for a gateway error object (``{"code":..,"message":..}`` or
    ``{"grpc_code":..,"message":..}``)."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        payload = payload["error"]
    if not isinstance(payload, dict):
        return EtcdError(f"{what}: {payload!r}")
    code = payload.get("grpc_code", payload.get("code", 2))
    message = str(payload.get("message") or payload.get("error") or "")
    text = f"{what}: {message} (gRPC code {code})"
    if code in _PERMISSION_CODES:
        return EtcdPermissionError(text)
    if code in _UNAVAILABLE_CODES:
        return EtcdConnectionError(text)
    return EtcdError(text)


def _decode(result: dict[str, Any]) -> WatchResponse:
    header = result.get("header") or {}
    events: list[Event] = []
    raw = result.get("events")
    if raw:
        append = events.append
        for event in raw:
            kv = event["kv"]
            value = kv.get("value")
            append((DELETE if event.get("type") == "DELETE" else PUT, _a2b(kv["key"]),
                    _a2b(value) if value else b"", int(kv["mod_revision"])))
    return WatchResponse(int(result.get("watch_id", 0)), bool(result.get("created")),
                         bool(result.get("canceled")), int(result.get("compact_revision", 0)),
                         result.get("cancel_reason", ""), int(header.get("revision", 0)),
                         events, int(header.get("cluster_id", 0)))


class GatewayWatchStream:
    """A watch on ``[key, range_end)`` from ``start_revision``; iterate for its responses.

    The first response is etcd's ``created`` one (or a cancel: compacted start revision,
    permission denied). Iteration raises :class:`~cachedstore.errors.EtcdConnectionError`
    when the connection breaks or etcd ends the stream (a watch that just ends is a failure),
    or when etcd reports a gRPC error such as "no leader";
    :class:`~cachedstore.errors.EtcdPermissionError` for an auth error;
    :class:`~cachedstore.errors.EtcdError` for anything else etcd reports. After
    :meth:`close`, iteration just stops.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key: bytes,
        range_end: bytes | None = None,
        start_revision: int = 0,
        prev_kv: bool = False,
        token: str | None = None,
        require_leader: bool = True,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 5.0,
        keepalive: tuple[int, int, int] | None = (10, 3, 3),
    ) -> None:
        """Connect and send the watch request; blocks up to ``timeout`` for that.

        ``keepalive`` is TCP keepalive ``(idle s, interval s, probes)``, ``None`` for none.
        Raises :class:`~cachedstore.errors.EtcdConnectionError` if etcd cannot be reached.
        """
        create: dict[str, Any] = {"key": base64.b64encode(key).decode()}
        if range_end is not None:
            create["range_end"] = base64.b64encode(range_end).decode()
        if start_revision:
            create["start_revision"] = start_revision
        if prev_kv:
            create["prev_kv"] = True
        body = json.dumps({"create_request": create}).encode()
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = ["POST /v3/watch HTTP/1.1", f"Host: {authority}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}"]
        if require_leader:
            lines.append("Grpc-Metadata-hasleader: true")
        if token is not None:
            lines.append(f"Authorization: {token}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body

        self._lock = threading.Lock()
        self._closed = False
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise EtcdConnectionError(f"cannot connect to etcd at {authority}: {exc}") from exc
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if keepalive is not None:
                idle, interval, probes = keepalive
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                if hasattr(socket, "TCP_KEEPIDLE"):
                    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
                    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
            sock = raw
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(raw, server_hostname=server_hostname or host)
            sock.sendall(request)
            sock.settimeout(None)
        except OSError as exc:
            raw.close()
            raise EtcdConnectionError(f"watch request to etcd at {authority} failed: {exc}") \
                from exc
        self._sock: socket.socket = sock
        self._authority = authority
        self._reader = self._responses()

    # -- reading ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[WatchResponse]:
        return self._reader  # the one reader: iterating twice continues, never restarts

    def __next__(self) -> WatchResponse:
        """The next response; blocks until etcd sends one. ``StopIteration`` once closed."""
        return next(self._reader)

    def _responses(self) -> Iterator[WatchResponse]:
        recv = self._sock.recv
        buf = b""
        try:
            # status line and headers
            while b"\r\n\r\n" not in buf:
                data = recv(_CHUNK)
                if not data:
                    raise EtcdConnectionError(f"etcd at {self._authority} closed the watch "
                                              "before answering")
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            parts = status_line.split(" ", 2)
            status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (h.partition(":") for h in header_lines)}
            if status != 200 or "chunked" not in headers.get("transfer-encoding", ""):
                raise self._http_error(status, headers, buf)
            # chunked body: etcd flushes one chunk per response line; the fast path takes a
            # chunk holding whole lines as it is, anything else is joined and split on "\n"
            message = self._message
            line = b""
            pos = 0
            while True:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    buf = buf[pos:]
                    pos = 0
                    data = recv(_CHUNK)
                    if not data:
                        raise EtcdConnectionError(f"etcd at {self._authority} ended the "
                                                  "watch stream")
                    buf += data
                    continue
                size_field = buf[pos:end]
                size = int(size_field.split(b";", 1)[0] if b";" in size_field else size_field,
                           16)
                if size == 0:
                    raise EtcdConnectionError(f"etcd at {self._authority} ended the watch "
                                              "stream")
                start = end + 2
                stop = start + size
                while len(buf) < stop + 2:
                    data = recv(_CHUNK)
                    if not data:
                        raise EtcdConnectionError(f"etcd at {self._authority} closed the "
                                                  "watch stream mid-response")
                    buf += data
                chunk = buf[start:stop]
                pos = stop + 2
                if pos >= len(buf):
                    buf = b""
                    pos = 0
                if not line and chunk[-1:] == b"\n":
                    if chunk.count(b"\n") == 1:
                        yield message(chunk)
                        continue
                    lines = chunk.split(b"\n")
                    line = b""
                else:
                    lines = (line + chunk).split(b"\n")
                    line = lines.pop()
                for text in lines:
                    if text.strip():
                        yield message(text)
        except (OSError, ValueError) as exc:
            if self._closed:
                return
            if isinstance(exc, EtcdError | EtcdConnectionError | EtcdPermissionError):
                raise
            raise EtcdConnectionError(f"watch stream from etcd at {self._authority} "
                                      f"failed: {exc}") from exc
        except EtcdError:
            if self._closed:
                return
            raise

    def _message(self, text: bytes) -> WatchResponse:
        obj = _loads(text)
        result = obj.get("result")
        if result is None:
            raise _error(obj, f"watch stream from etcd at {self._authority}")
        return _decode(result)

    def _http_error(self, status: int, headers: dict[str, str], buf: bytes) -> Exception:
        """The error for a refused request; etcd's JSON reason (e.g. "no leader") is read
        from the body, waiting at most 2 s for it."""
        what = f"watch request to etcd at {self._authority}: HTTP {status}"
        try:
            self._sock.settimeout(2.0)
            while b"}" not in buf and len(buf) < _CHUNK:
                data = self._sock.recv(_CHUNK)
                if not data:
                    break
                buf += data
        except OSError:
            pass
        start, end = buf.find(b"{"), buf.rfind(b"}")
        if start >= 0 and end > start:
            try:
                return _error(_loads(buf[start:end + 1]), what)
            except ValueError:
                pass
        return EtcdConnectionError(what)

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """End the stream from any thread; a blocked iteration returns. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:  # the plain socket's shutdown wakes a recv blocked in another thread (TLS too)
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> GatewayWatchStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
