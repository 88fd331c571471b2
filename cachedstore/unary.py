"""Unary gRPC calls without grpcio, each on the caller's thread over one HTTP/2 connection
of a small pool: the store's range, txn, put... (``StoreConfig.unary_transport="wire"``).

Why: grpcio costs ~300 µs of CPU per unary call on the machines this project is measured
on (its completion queue, channel threads and GIL hand-offs), against ~140 µs here, calls
back to back from one thread: a peek, a ``send``, a ``poll`` and a ``recv`` on a plaintext
connection (non-blocking: no socket timeouts, see :meth:`_Http2._arm`), a protobuf decode.
``benchmarks/FANOUT.md`` ("Unary calls without grpcio") has one run's figures, also for
many threads of one process calling at once, where the two cost the same. The watch
stream has its own connection (:mod:`cachedstore.wire`).

What it speaks, per call: HEADERS (request metadata as literals never indexed, see
:func:`~cachedstore.wire.header_block`, with ``grpc-timeout``) and the length-prefixed
request in DATA frames within the server's flow-control windows; then the response's
headers, message and trailers (or a Trailers-Only response), etcd's header blocks decoded
by ``hpack``. Also SETTINGS (acknowledged), PING (answered with the next request, or by a
call that waits for its answer; grpc-go's bandwidth estimates once ``ACK_DELAY`` old: see
:data:`~cachedstore.wire.ACK_DELAY`), WINDOW_UPDATE both ways,
RST_STREAM and GOAWAY. One call at a time per connection: a connection is taken from the
pool (or opened) for a call and given back when the call ended cleanly; concurrent calls
use different connections.

Errors are :class:`~cachedstore.wire.WireError` (a ``grpc.RpcError`` with grpcio's codes and
the details :mod:`cachedstore.etcdapi` classifies): UNAVAILABLE "failed to connect ..." for
a connection that could not be made (the request never left: retried even when it must
not be sent twice), UNAVAILABLE "connection ... lost" once it may have been sent,
DEADLINE_EXCEEDED when the call's timeout passes (the connection is then closed, which
cancels the call on etcd's side, as grpcio's RST_STREAM does; a call given a ``patience``
is instead left to finish, see :meth:`UnaryChannel.method`), and the status of the
trailers otherwise. A connection that etcd closed while it sat in the pool, or idle longer
than :data:`MAX_IDLE`, is never reused.

Thread-safety: :class:`UnaryChannel` may be used from any number of threads; ``close()``
from any thread ends the calls in flight (UNAVAILABLE), those left to finish included
(their threads, ``cachedstore-unary-finish``, end then; ``drain()`` waits for them first).
After a fork the child's copy closes nothing it shares with the parent.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import grpc
import hpack

from .wire import (
    _ACK,
    _CODES,
    _CONTINUATION,
    _DATA,
    _DEFAULT_WINDOW,
    _END_HEADERS,
    _END_STREAM,
    _GOAWAY,
    _HEADERS,
    _HTTP_CODES,
    _PADDED,
    _PING,
    _PREFACE,
    _RST_CODES,
    _RST_STREAM,
    _SETTINGS,
    _WINDOW_UPDATE,
    ACK_DELAY,
    BDP_PING,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    WINDOW,
    WireError,
    _frame,
    grpc_message,
    header_block,
    header_fragment,
    settings_of,
)

__all__ = ["MAX_IDLE", "UnaryChannel"]

#: A pooled connection idle longer than this (seconds) is closed instead of reused: a
#: long-idle connection may have been dropped without a word by a load balancer or NAT
#: on the way (their idle timeouts are commonly 4 minutes or more). A call that finds
#: none pays a new connection (TCP, TLS, HTTP/2: one round trip more, and its CPU).
MAX_IDLE = 120.0
#: Stream ids are odd and below 2**31: a connection is retired before it runs out.
_LAST_STREAM = (1 << 31) - 1
_MAX_TIMEOUT_MS = 99_999_999  # grpc-timeout has at most 8 digits
#: A bandwidth-estimation PING is acknowledged once :data:`~cachedstore.wire.ACK_DELAY` old
#: (why: there), any other at once: with the first request sent from then on, behind its
#: frames, or by a call that waits for its answer past then. (Module-level, so tests may
#: change it.)
_ACK_DELAY = ACK_DELAY


#: Header blocks decoded on any connection, by the blocks that changed its HPACK table
#: before them (from its start, at most _HISTORY_MAX) and the block: decoding is a pure
#: function of those (every connection's decoder has the same limits), and etcd answers
#: every new connection's first calls with the same blocks, literals that cost a Huffman
#: decode in pure Python. Bounded; plain dict reads and writes (atomic in CPython; two
#: threads that both miss store the same value).
_SHARED_DECODED: dict[tuple[bytes, ...], dict[str, str]] = {}
_SHARED_MAX = 256
_HISTORY_MAX = 8
_HISTORY_BYTES = 4096


def _decode(decoder: hpack.Decoder, block: bytes) -> dict[str, str]:
    return {bytes(k).decode("latin-1"): bytes(v).decode("latin-1")
            for k, v in decoder.decode(block, raw=True)}


def _replayed(history: tuple[bytes, ...]) -> hpack.Decoder:
    """A decoder whose table is what ``history``'s blocks built on a new connection."""
    decoder = hpack.Decoder()
    for block in history:
        decoder.decode(block, raw=True)
    return decoder


def _poll_ms(seconds: float) -> int:
    """``poll()``'s timeout for a wait of ``seconds``: whole milliseconds, rounded up and at
    least one, so that a poll never returns early while time is left (and never waits
    forever, as a negative timeout would)."""
    return max(1, math.ceil(seconds * 1000))


def _lost(authority: str, exc: OSError) -> str:
    """The details of a connection lost once the request may have been sent: the error's
    kind and number only, never its text, which could read like a failure to connect
    ("Connection refused", "No route to host" after the connection was made) and have the
    request retried as never sent."""
    number = f" {errno.errorcode.get(exc.errno, exc.errno)}" if exc.errno else ""
    return f"connection to {authority} lost after the request was sent: " \
           f"{type(exc).__name__}{number}"


class _Http2:
    """One HTTP/2 connection, used by one call at a time (the pool hands it out).

    Longer than this project's classes usually are: it is one connection's state (windows,
    the HPACK table, buffers, the call in progress), which the handshake, a call, the
    frame handlers and the pool's liveness peek all read and change; split, the parts
    would pass that state to each other (as :class:`~cachedstore.wire.WireCall` does not).
    """

    def __init__(self, address: tuple[str, int], authority: str, tls: ssl.SSLContext | None,
                 deadline: float,
                 connected: Callable[[_Http2], None] | None = None) -> None:
        """Connect (TCP, TLS, and HTTP/2 up to etcd's SETTINGS) by ``deadline`` (a
        ``time.monotonic()`` value); raises WireError UNAVAILABLE "failed to connect ..."
        otherwise: nothing was sent that etcd could act on. ``connected(self)`` is called
        once the TCP connection is up, before the handshake, which :meth:`interrupt` cuts
        from then on; what it raises fails the connection."""
        self.authority = authority
        self.pid = os.getpid()
        self.interrupted = False
        self.idle_since = 0.0
        self.reusable = True
        self._tls = tls is not None
        #: The blocks that changed the HPACK table so far (None past _HISTORY_MAX), and
        #: the connection's own decoder (None until a block misses _SHARED_DECODED).
        self._history: tuple[bytes, ...] | None = ()
        self._decoder: hpack.Decoder | None = None
        #: Header blocks that change no table, decoded (see _on_headers).
        self._decoded: dict[bytes, dict[str, str]] = {}
        self._inbuf = bytearray()
        self._stream = -1  # the next call's stream is 1
        self._send_window = _DEFAULT_WINDOW  # the connection's
        self._stream_window = 0
        self._peer_initial_window = _DEFAULT_WINDOW
        self._max_frame = 16_384
        self._settings_seen = False
        self._uncredited = 0
        #: Frames owed to etcd (PING acknowledgements), sent once ``_owed_since`` is
        #: :data:`_ACK_DELAY` old (time.monotonic(): when a BDP PING came, that less
        #: _ACK_DELAY for any other PING, the earliest of those owed).
        self._owed = b""
        self._owed_since = 0.0
        #: PINGs etcd sent on this connection (tests read it).
        self.pings_received = 0
        # The call in progress: its header blocks, message bytes, status.
        self._block = b""
        self._block_ends = False
        self._headers_seen = False
        self._message = bytearray()
        self._status: tuple[grpc.StatusCode, str] | None = None
        #: What sends and waits are bounded by (a ``time.monotonic()`` value: ``_arm``).
        self._deadline = deadline
        self.sock: socket.socket | ssl.SSLSocket
        #: A plaintext socket stays non-blocking once connected, and its waits are these
        #: polls (see _arm); under TLS, and during the handshake (whose SETTINGS are
        #: acknowledged through _sendall), Python's socket timeouts bound each operation.
        self._pollin: Any = None
        self._pollout: Any = None
        try:
            self.sock = socket.create_connection(
                address, max(0.001, deadline - time.monotonic()))
        except OSError as exc:
            raise WireError(grpc.StatusCode.UNAVAILABLE,
                            f"failed to connect to {authority}: {exc}") from None
        try:
            if connected is not None:
                connected(self)
            self._handshake(address[0], tls, deadline)
        except BaseException as exc:
            self.sock.close()
            if isinstance(exc, ssl.SSLCertVerificationError):
                hostname = "hostname verification failed: " \
                    if "hostname" in str(exc).lower() else ""
                raise WireError(grpc.StatusCode.UNAVAILABLE, f"failed to connect to "
                                f"{authority}: {hostname}TLS handshake failed: {exc}") from None
            if isinstance(exc, Exception):  # TLS errors, timeouts, a SETTINGS that is not
                details = exc.details() if isinstance(exc, WireError) else \
                    f"{type(exc).__name__}: {exc}"
                raise WireError(grpc.StatusCode.UNAVAILABLE,
                                f"failed to connect to {authority}: {details}") from None
            raise
        if self._tls:
            self.sock.settimeout(None)  # blocking; each call arms its timeouts (_arm)
        else:
            self.sock.settimeout(0.0)  # non-blocking for good; waits are polls (_arm)
            self._pollin, self._pollout = select.poll(), select.poll()
            self._pollin.register(self.sock.fileno(), select.POLLIN)
            self._pollout.register(self.sock.fileno(), select.POLLOUT)

    def _handshake(self, host: str, tls: ssl.SSLContext | None, deadline: float) -> None:
        """TLS if asked, the client preface, and etcd's SETTINGS: a request is never sent
        on a connection etcd has not spoken on (a port that accepts and stays silent, a
        proxy with nothing behind it, fails here, as never sent)."""
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            # The TLS handshake runs on the wrapped socket, which interrupt() can shut down
            # (one during the wrap found the plain socket detached: hence the check).
            self.sock = tls.wrap_socket(self.sock, server_hostname=host,
                                        do_handshake_on_connect=False)
            if self.interrupted:
                raise ConnectionError("interrupted")
            self.sock.do_handshake()
            if self.sock.selected_alpn_protocol() != "h2":
                raise WireError(grpc.StatusCode.UNAVAILABLE,
                                "the endpoint did not agree to HTTP/2")
        settings = (2).to_bytes(2, "big") + (0).to_bytes(4, "big") \
            + (4).to_bytes(2, "big") + WINDOW.to_bytes(4, "big")  # no push; our window
        self.sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(
            _WINDOW_UPDATE, 0, 0, (WINDOW - _DEFAULT_WINDOW).to_bytes(4, "big")))
        while not self._settings_seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no HTTP/2 SETTINGS from the server in time")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 18)
            except TimeoutError:
                raise TimeoutError("no HTTP/2 SETTINGS from the server in time") from None
            if not data:
                raise ConnectionError("closed by the server before its HTTP/2 SETTINGS")
            self._receive(data, -1)
        if not self.reusable:
            raise ConnectionError("the server went away (GOAWAY) at once")

    # -- a call -----------------------------------------------------------------------------
    def call(self, headers: bytes, body: bytes, deadline: float,
             patience: float | None = None) -> bytes:
        """Send one request (``headers``: its header block, less ``grpc-timeout``, added
        here from ``deadline``) and return the response message's bytes. Raises WireError;
        on any error but a status from etcd the connection is left unusable (``reusable``
        False). Nothing is sent once ``deadline`` has passed (UNAVAILABLE, never sent).
        ``patience`` (a ``time.monotonic()`` value before ``deadline``): once the request
        is sent whole, the answer is waited for until then only, and :class:`_Late` is
        raised with the call still running (see :meth:`finish`)."""
        now = time.monotonic()
        if now >= deadline:
            raise WireError(grpc.StatusCode.UNAVAILABLE, f"failed to connect to "
                            f"{self.authority} in time: no time left to send the request")
        millis = min(_MAX_TIMEOUT_MS, max(1, int((deadline - now) * 1000)))
        headers += header_block((("grpc-timeout", f"{millis}m"),))
        self._stream += 2
        stream = self._stream
        if stream >= _LAST_STREAM - 2:
            self.reusable = False
        self._stream_window = self._peer_initial_window
        self._block, self._block_ends, self._headers_seen = b"", False, False
        self._message.clear()
        self._status = None
        message = grpc_message(body)
        try:
            self._arm(deadline)
            out = _frame(_HEADERS, _END_HEADERS, stream, headers)
            acks = b""
            if self._owed and now >= self._owed_since + _ACK_DELAY:
                # After the request's frames: etcd reads its DATA while its PING is still
                # unacknowledged, and so sends no new one for it.
                acks, self._owed = self._owed, b""
            while True:
                room = min(self._send_window, self._stream_window, self._max_frame)
                if len(message) <= room:
                    self._send_window -= len(message)
                    self._stream_window -= len(message)
                    self._sendall(out + _frame(_DATA, _END_STREAM, stream, message) + acks)
                    break
                if room > 0:
                    out += _frame(_DATA, 0, stream, message[:room])
                    message = message[room:]
                    self._send_window -= room
                    self._stream_window -= room
                    continue
                if out:  # (with the acknowledgements: the wait may be long)
                    self._sendall(out + acks)
                    out = acks = b""
                self._read(stream, deadline)  # until a WINDOW_UPDATE (or the answer)
                if self._status is not None:  # answered before the request was whole
                    self.reusable = False
                    break
            until = deadline if patience is None else min(patience, deadline)
            while self._status is None:
                try:
                    self._read(stream, until)
                except TimeoutError:
                    if until < deadline:  # patience over: the call runs on
                        raise _Late from None
                    raise
        except _Late:
            raise  # the call runs on: the connection stays as it is, for finish()
        except WireError:
            self.reusable = False
            raise
        except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            # The socket's timeout (the deadline) passed, or a wait that would block.
            self.reusable = False
            raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as exc:  # ssl.SSLError included; the request may have been sent
            self.reusable = False
            raise WireError(grpc.StatusCode.UNAVAILABLE, _lost(self.authority, exc)) from None
        except Exception as exc:  # a frame or header block that does not parse
            self.reusable = False
            raise WireError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}") from None
        except BaseException:  # KeyboardInterrupt...: a request or a frame half handled
            self.reusable = False
            raise
        code, details = self._status
        if code is not grpc.StatusCode.OK:
            raise WireError(code, details)
        message_bytes = bytes(self._message)
        if len(message_bytes) < 5 or message_bytes[0] \
                or int.from_bytes(message_bytes[1:5], "big") != len(message_bytes) - 5:
            self.reusable = False
            raise WireError(grpc.StatusCode.INTERNAL, "the response is not one whole message")
        return message_bytes[5:]

    def finish(self, deadline: float) -> None:
        """Read the rest of the call a :class:`_Late` left running (up to ``deadline``,
        its own) and drop its answer; the connection stays reusable if the call ended
        cleanly. Never raises."""
        try:
            while self._status is None:
                self._read(self._stream, deadline)
        except BaseException:  # noqa: BLE001 -- the answer is dropped; so is the connection
            self.reusable = False

    def _read(self, stream: int, deadline: float) -> None:
        """Wait for what etcd sends (up to ``deadline``, a ``time.monotonic()`` value) and
        handle every whole frame of it. PING acknowledgements owed are sent once
        :data:`_ACK_DELAY` old."""
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError
        until = deadline
        if self._owed:
            due = self._owed_since + _ACK_DELAY
            if now >= due:
                owed, self._owed = self._owed, b""
                self._arm(deadline)
                try:
                    self._sendall(owed)
                except BaseException:  # perhaps half written: a later call would follow it
                    self.reusable = False
                    raise
            else:
                until = due
        try:
            if self._pollin is None:  # TLS: the socket's timeout bounds the wait
                self.sock.settimeout(max(0.001, until - now))
            elif not self._pollin.poll(_poll_ms(until - now)):
                raise TimeoutError
            data = self.sock.recv(1 << 18)
        except BlockingIOError:  # polled ready, nothing to read after all: read again
            return
        except TimeoutError:
            if until < deadline:
                return  # time to acknowledge what is owed; the caller reads again
            raise
        if not data:
            raise WireError(grpc.StatusCode.UNAVAILABLE,
                            f"connection to {self.authority} lost after the request was "
                            f"sent: closed by the server")
        self._receive(data, stream)

    def _arm(self, deadline: float) -> None:
        """Let the socket's sends and receives wait until ``deadline`` at most.

        A plaintext socket is non-blocking: a send or receive is one system call, and a
        wait is one ``poll`` against the time left (:meth:`_sendall`, :meth:`_read`), so a
        call is four system calls that let go of the GIL (the pool's peek, a send, a poll,
        a receive) where Python's socket timeouts made eight (a timeout set is an
        ``ioctl`` each time, and a send with a timeout polls first), each a hand-off of
        the GIL when the process's other threads want it. Under TLS the socket keeps
        Python's timeouts, which also resume after a signal with what is left and bound a
        ``sendall`` as a whole."""
        self._deadline = deadline
        if self._pollin is None:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))

    def _sendall(self, data: bytes | memoryview) -> None:
        """Send all of ``data`` by the armed deadline (TimeoutError past it)."""
        if self._pollout is None:
            self.sock.sendall(data)
            return
        while True:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent >= len(data):
                return
            data = memoryview(data)[sent:]  # the rest, not copied
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._pollout.poll(_poll_ms(left))

    def _receive(self, data: bytes, stream: int) -> None:
        buf = self._inbuf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            on = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFF_FFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            if kind == _DATA:
                self._on_data(on, flags, payload, stream)
            elif kind in (_HEADERS, _CONTINUATION):
                self._on_headers(kind, flags, payload, on == stream)
            elif kind == _SETTINGS:
                if not flags & _ACK:
                    self._on_settings(payload)
            elif kind == _PING:
                if not flags & _ACK:
                    self.pings_received += 1
                    since = time.monotonic()  # a BDP PING's is due _ACK_DELAY later,
                    if payload != BDP_PING:  # any other's at once
                        since -= _ACK_DELAY
                    self._owed_since = min(self._owed_since, since) if self._owed else since
                    self._owed += _frame(_PING, _ACK, 0, payload)
            elif kind == _WINDOW_UPDATE:
                credit = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
                if on == 0:
                    self._send_window += credit
                elif on == stream:
                    self._stream_window += credit
            elif kind == _RST_STREAM and on == stream and self._status is None:
                code = int.from_bytes(payload[:4], "big")
                self._status = (_RST_CODES.get(code, grpc.StatusCode.INTERNAL),
                                f"stream reset by the server (HTTP/2 error {code})")
            elif kind == _GOAWAY:
                self.reusable = False
                last = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
                if last < stream and self._status is None:  # ours was not processed
                    raise WireError(grpc.StatusCode.UNAVAILABLE, (
                        f"failed to connect to {self.authority}: the server went away "
                        f"before the request (GOAWAY, HTTP/2 error "
                        f"{int.from_bytes(payload[4:8], 'big')})"))
        del buf[:pos]

    def _on_settings(self, payload: bytes) -> None:
        for ident, value in settings_of(payload):
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:  # moves an open stream's window too
                self._stream_window += value - self._peer_initial_window
                self._peer_initial_window = value
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                self._max_frame = value
        self._settings_seen = True
        self._sendall(_frame(_SETTINGS, _ACK, 0))

    def _on_data(self, on: int, flags: int, payload: bytes, stream: int) -> None:
        self._uncredited += len(payload)
        if self._uncredited >= WINDOW // 2:
            credit = self._uncredited.to_bytes(4, "big")
            self._uncredited = 0
            self._sendall(_frame(_WINDOW_UPDATE, 0, 0, credit)
                          + _frame(_WINDOW_UPDATE, 0, on, credit))
        if on != stream:
            return
        if flags & _PADDED:
            payload = payload[1:len(payload) - payload[0]]
        self._message += payload
        if flags & _END_STREAM and self._status is None:
            self._status = (grpc.StatusCode.INTERNAL, "the stream ended without a status")

    def _on_headers(self, kind: int, flags: int, payload: bytes, ours: bool) -> None:
        # Every header block is decoded, ours or not: HPACK's table is the connection's.
        if kind == _HEADERS:
            self._block = header_fragment(flags, payload)
            self._block_ends = bool(flags & _END_STREAM)
        else:
            self._block += payload
        if not flags & _END_HEADERS:
            return
        block, self._block = self._block, b""
        headers = self._decoded.get(block)
        if headers is None:
            # A block of one-byte indexed fields only (every byte has its high bit set)
            # changes no HPACK table, so it means the same until a block that does: etcd's
            # headers and trailers once indexed. Any other block may have moved the table.
            indexed = all(byte & 0x80 for byte in block)
            headers = self._decode(block, indexed)
            if indexed:
                if len(self._decoded) < 64:
                    self._decoded[block] = headers
            else:
                self._decoded.clear()
        if not ours or self._status is not None:
            return
        if not self._headers_seen:
            self._headers_seen = True
            status = int(headers.get(":status", "0") or 0)
            if status != 200:
                self._status = (_HTTP_CODES.get(status, grpc.StatusCode.UNKNOWN),
                                f"HTTP status {status}")
                return
        if "grpc-status" in headers:
            self._status = (_CODES.get(int(headers["grpc-status"]), grpc.StatusCode.UNKNOWN),
                            unquote(headers.get("grpc-message", "")))
        elif self._block_ends:
            self._status = (grpc.StatusCode.INTERNAL, "the stream ended without a status")

    def _decode(self, block: bytes, indexed: bool) -> dict[str, str]:
        """``block`` decoded: from _SHARED_DECODED while this connection's table history
        is one seen before, else by the connection's own decoder (made on the first miss
        by replaying the history, then kept), remembered for the next connections while
        the history is short."""
        history, decoder = self._history, self._decoder
        key = None if history is None else history + (block,)
        if decoder is None:
            assert key is not None  # without a decoder of its own, the history is kept
            headers = _SHARED_DECODED.get(key)
            if headers is not None:
                if not indexed:
                    self._moved(key)
                return headers
            decoder = self._decoder = _replayed(key[:-1])
        headers = _decode(decoder, block)
        if key is not None:
            if len(_SHARED_DECODED) < _SHARED_MAX and sum(map(len, key)) <= _HISTORY_BYTES:
                _SHARED_DECODED[key] = headers
            if not indexed:
                self._moved(key)
        return headers

    def _moved(self, history: tuple[bytes, ...]) -> None:
        """The table is now what ``history`` built; past _HISTORY_MAX blocks it is no longer
        tracked, and the connection decodes with a decoder of its own from then on."""
        if len(history) < _HISTORY_MAX:
            self._history = history
            return
        if self._decoder is None:
            self._decoder = _replayed(history)
        self._history = None

    # -- in the pool --------------------------------------------------------------------------
    def alive(self) -> bool:
        """Whether this idle connection may carry a call: handles what etcd sent meanwhile
        (a GOAWAY retires it; a closed socket is dead). Does not block."""
        sock = self.sock
        try:
            # Non-blocking (a call arms its own timeouts): with a timeout Python would wait
            # for the socket before even a peek. (A plaintext one always is.)
            self._deadline = 0.0  # nothing here waits
            if self._pollin is None:
                sock.settimeout(0.0)
            # Unless TLS holds decrypted bytes, a peek at the TCP socket itself (below
            # TLS): nothing (BlockingIOError), data, or its end.
            decrypted = isinstance(sock, ssl.SSLSocket) and sock.pending() > 0
            if not decrypted and not socket.socket.recv(sock, 1, socket.MSG_PEEK):
                return False
            data = sock.recv(1 << 18)  # something came: read it
        except (BlockingIOError, ssl.SSLWantReadError):
            return self.reusable
        except (OSError, ValueError, AttributeError, WireError):
            return False
        if not data:
            return False
        try:
            self._receive(data, -1)
        except Exception:  # noqa: BLE001 -- a connection that sends garbage is not reused
            return False
        return self.reusable

    def interrupt(self) -> None:
        """End a call or a handshake in progress on another thread (its waits fail at
        once): shut the TCP socket down, under TLS too (``SSLSocket.shutdown`` would first
        drop the TLS object, and a send racing it would go out in clear). Its owner closes
        it."""
        self.interrupted = True
        if self.pid == os.getpid():
            try:
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close the socket (by the thread that owns the connection, or for an idle
        one); in a forked child, only our copy of it."""
        self.interrupt()
        self.sock.close()


class _Late(Exception):
    """A patient call's caller stopped waiting; the call runs on (:meth:`_Http2.finish`)."""


class UnaryChannel:
    """Unary calls to one endpoint ``target`` (``host:port`` or ``[v6]:port``) over pooled
    HTTP/2 connections; ``tls``: a client SSL context speaking h2 (None: plaintext).
    Thread-safe; :meth:`method` returns a callable with grpcio's signature."""

    def __init__(self, target: str, tls: ssl.SSLContext | None, connect_timeout: float,
                 monotonic: Callable[[], float] = time.monotonic,
                 finish_thread_name: str = "cachedstore-unary-finish") -> None:
        host, _, port = target.rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self._target, self._tls = target, tls
        self._connect_timeout = connect_timeout
        self._monotonic = monotonic
        self._finish_thread_name = finish_thread_name
        self._scheme = "https" if tls is not None else "http"
        self._lock = threading.Lock()
        self._idle: list[_Http2] = []
        self._open: set[_Http2] = set()
        #: Connections in their handshake (close() cuts them: a silent or stopped etcd
        #: would otherwise hold their threads until the connect timeout).
        self._connecting: set[_Http2] = set()
        self._closed = False
        self._pid = os.getpid()
        #: Connections opened so far (tests count them against a proxy's accepts).
        self.opened = 0
        #: Threads finishing calls whose callers stopped waiting (see method()).
        self._finishing: set[threading.Thread] = set()
        self._metadata_blocks: dict[tuple[tuple[str, str], ...], bytes] = {}

    def method(self, path: str, deserialize: Callable[[bytes], Any]) -> Callable[..., Any]:
        """``path`` (``/etcdserverpb.KV/Range``) as ``f(request, timeout=, metadata=,
        patience=)``, which blocks up to ``timeout`` seconds and returns the decoded
        response. With ``patience`` (seconds, less than ``timeout``) the caller waits that
        long for the answer at most: then DEADLINE_EXCEEDED is raised and the call is left
        to finish, never cancelled (etcd before 3.5.5 panics when a read-only Txn is
        cancelled while it executes, etcd-io/etcd#14110), on a thread of its own
        (``cachedstore-unary-finish``) that reads its answer, drops it and gives the
        connection back; the call keeps ``timeout`` as its deadline, which etcd enforces
        too. :meth:`drain` waits for such calls."""
        static = header_block(((":method", "POST"), (":scheme", self._scheme),
                               (":path", path), (":authority", self._target),
                               ("content-type", "application/grpc"), ("te", "trailers"),
                               ("user-agent", "cachedstore-wire")))

        def call(request: Any, timeout: float | None = None,
                 metadata: tuple[tuple[str, str], ...] = (),
                 patience: float | None = None) -> Any:
            return deserialize(self._call(static, request.SerializeToString(), timeout,
                                          metadata, patience))
        return call

    def _call(self, static: bytes, body: bytes, timeout: float | None,
              metadata: tuple[tuple[str, str], ...], patience: float | None = None) -> bytes:
        now = time.monotonic()
        deadline = now + (86_400.0 if timeout is None else max(timeout, 0.0))
        block = self._metadata_blocks.get(metadata)
        if block is None:
            block = header_block((k.lower(), v) for k, v in metadata)
            if len(self._metadata_blocks) < 16:  # a token per renewal: a few at most
                self._metadata_blocks[metadata] = block
        headers = static + block
        patient_until = None if patience is None else now + max(patience, 0.0)
        conn = self._take(deadline if patient_until is None else min(deadline, patient_until))
        left_running = False
        try:
            return conn.call(headers, body, deadline, patient_until)
        except _Late:
            self._leave_running(conn, deadline)
            left_running = True
            raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "Deadline Exceeded (the call was left to finish)") from None
        finally:
            if not left_running:
                self._give_back(conn)  # only a connection still reusable rejoins the pool

    def _leave_running(self, conn: _Http2, deadline: float) -> None:
        """Hand ``conn``, whose call's caller stopped waiting, to a thread that finishes
        the call (by ``deadline``) and gives the connection back."""
        def finish() -> None:
            try:
                conn.finish(deadline)
            finally:
                self._give_back(conn)
                with self._lock:
                    self._finishing.discard(thread)

        thread = threading.Thread(target=finish, name=self._finish_thread_name, daemon=True)
        with self._lock:
            self._finishing.add(thread)
        thread.start()

    @property
    def unfinished(self) -> int:
        """Calls left to finish (see :meth:`method`) still running."""
        with self._lock:
            return len(self._finishing)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the calls left to finish; True if none is
        left. Thread-safe."""
        until = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._finishing)
            if not threads:
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            threads[0].join(left)

    def _take(self, deadline: float) -> _Http2:
        """An idle connection that is alive, else a new one (by ``deadline`` at most, and
        ``connect_timeout``). Raises WireError UNAVAILABLE "failed to connect ...", or for a
        closed channel."""
        if self._pid != os.getpid():
            self._forked()
        while True:
            stale: list[_Http2] = []
            with self._lock:
                if self._closed:
                    raise WireError(grpc.StatusCode.UNAVAILABLE, "the channel is closed")
                now = self._monotonic()
                # The pool is a stack: the bottom's idle ones would never be looked at.
                while self._idle and now - self._idle[0].idle_since > MAX_IDLE:
                    stale.append(self._idle.pop(0))
                conn = self._idle.pop() if self._idle else None
            for old in stale:
                self._discard(old)
            if conn is None:
                break
            try:
                usable = now - conn.idle_since <= MAX_IDLE and conn.alive()
            except BaseException:
                self._discard(conn)
                raise
            if usable:
                return conn
            self._discard(conn)
        begun: list[_Http2] = []

        def connected(conn: _Http2) -> None:
            with self._lock:
                if self._closed:
                    raise ConnectionError("the channel is closed")
                self._connecting.add(conn)
                begun.append(conn)

        try:
            conn = _Http2(self._address, self._target, self._tls,
                          min(time.monotonic() + self._connect_timeout, deadline), connected)
        except WireError:
            if self._closed:
                raise WireError(grpc.StatusCode.UNAVAILABLE, "the channel is closed") from None
            raise
        finally:
            if begun:
                with self._lock:
                    self._connecting.discard(begun[0])
        with self._lock:
            self.opened += 1
            if not self._closed:
                self._open.add(conn)
                return conn
        conn.close()
        raise WireError(grpc.StatusCode.UNAVAILABLE, "the channel is closed")

    def warm(self, timeout: float) -> None:
        """Open one connection into the pool now if none is idle, so that the first call
        pays no connection set-up (TCP, TLS, SETTINGS: ~0.3 ms of CPU and two round trips
        on loopback). Blocks ``timeout`` seconds at most; raises WireError UNAVAILABLE as
        a call would (nothing is sent). Thread-safe."""
        with self._lock:
            if self._idle:
                return
        self._give_back(self._take(time.monotonic() + max(timeout, 0.0)))

    def _forked(self) -> None:
        """In a forked child: forget the parent's connections (closing only our copies of
        their sockets) and its lock (a parent thread may have held it)."""
        self._lock = threading.Lock()
        self._finishing = set()  # the parent's threads: not in this process
        conns, self._open, self._idle = list(self._open), set(), []
        self._connecting = set()  # the parent's threads' handshakes
        self._pid = os.getpid()
        for conn in conns:
            conn.close()  # not shut down: the connection is the parent's

    def _give_back(self, conn: _Http2) -> None:
        with self._lock:
            if conn.reusable and not self._closed:
                conn.idle_since = self._monotonic()
                self._idle.append(conn)
                return
        self._discard(conn)

    def _discard(self, conn: _Http2) -> None:
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def close(self) -> None:
        """Close every connection; calls in flight and connections in their handshake fail
        at once (UNAVAILABLE "the channel is closed" for a handshake), and their threads
        close their connections. Idempotent."""
        with self._lock:
            self._closed = True
            idle = self._idle
            busy = [conn for conn in self._open if conn not in idle]
            busy.extend(self._connecting)
            self._open, self._idle, self._connecting = set(), [], set()
        for conn in idle:
            conn.close()
        for conn in busy:
            conn.interrupt()
