"""One gRPC streaming call on an HTTP/2 connection of its own, read on the caller's thread:
the store's watch stream without grpcio (``StoreConfig.watch_transport="wire"``).

Why: grpcio hands every message it receives through its own threads (completion queue,
channel spin thread, GIL hand-offs) and costs ~150 µs of CPU per watch message whatever
the code that applies it does. Here the consuming thread reads the socket itself: one
``epoll`` wait and one ``recv`` per burst, a few slices, one protobuf decode per message;
and, the wake-up itself costing most of the rest, it can pace its reads in busy spells
(:meth:`WireCall.pace`). ``benchmarks/FANOUT.md`` ("CPU per watch event") has one run's
figures: a store's whole CPU per event of 130 µs here (49 µs pacing at 5 ms) against
293 µs through grpcio. Unary calls have a transport of their own on the same framing
(:mod:`cachedstore.unary`).

What it speaks, for one stream (id 1) per connection:

- HTTP/2 (RFC 9113): the preface and SETTINGS (acknowledged both ways; push disabled),
  PING (etcd's answered at once, its bandwidth estimates once :data:`ACK_DELAY` old; ours
  sent for each :data:`PING` the request iterator yields, each acknowledgement yielded as
  :data:`PONG`), flow control both ways (a request waits for send window; what etcd sends
  is credited back once half the window is consumed), HEADERS with CONTINUATION and
  padding, RST_STREAM and GOAWAY (its code and debug text end up in the error's details,
  e.g. ``too_many_pings``). etcd's header blocks are decoded by the ``hpack`` library;
  ours are literals never indexed (:func:`header_block`: the auth token stays out of every
  table and every other library's log); the frames themselves are nine bytes of header
  each, parsed inline (a frame library's objects would cost more per message than
  everything else here);
- gRPC over HTTP/2: request metadata as headers, length-prefixed messages (uncompressed:
  none is negotiated), the status from the trailers (``grpc-status``, ``grpc-message``) or
  a Trailers-Only response, HTTP and RST_STREAM codes mapped as grpcio maps them.

Errors: every failure of a call is a :class:`WireError`, a ``grpc.RpcError`` with ``code()``
and ``details()`` as grpcio's: UNAVAILABLE for a connection that cannot be made or is lost
(also the TLS handshake), the trailers' status otherwise, CANCELLED once :meth:`WireCall.cancel`
was called, UNKNOWN if the request iterator raised. Like grpcio's, :meth:`WireStub.Watch`
never raises: the first iteration connects and reports a failure.

Threads: one thread iterates a call and does all its socket I/O (TLS objects are not shared
between threads); a named daemon thread per call consumes the request iterator, as grpcio's
request-consumer thread does, and hands each message to the reader through a queue and a
wake-up socket; :meth:`WireCall.send` hands one from the calling thread the same way (the
watcher's creates: no wake-up of the sender thread for them). :meth:`WireCall.cancel` may be
called from any thread, any number of times; :meth:`WireCall.join` waits for the sender
thread, which ends with the request iterator.
"""

from __future__ import annotations

import fcntl
import logging
import select
import socket
import ssl
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import unquote

import grpc
import hpack

__all__ = ["PING", "PONG", "WireCall", "WireError", "WireStub"]

log = logging.getLogger("cachedstore.watch")

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = (
    0, 1, 3, 4, 6, 7, 8, 9)
_END_STREAM = _ACK = 0x1
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20
_STREAM = 1
_LONGEST_PACE = 86_400.0  # epoll refuses timeouts past ~24 days (and infinity)
#: A busy spell, the only time reads are paced: this many responses read within
#: :data:`SPELL` pacing intervals, a rate of 1,000 a second at the default 5 ms held for
#: 10 ms. Fewer are read as they come. A random (Poisson) stream of 200 events a second
#: puts 10 events within 10 ms for about 0.02 % of its events (5 within 5 ms, the rule
#: before: 1.9 %, which a p99 lag saw); one run (benchmarks/FANOUT.md, "Pacing only in
#: busy spells") paced 0 of 1,000 events at 200/s, p99 as unpaced, and the same CPU per
#: event under load as the rule before (29 against 28 µs). At 10,000 a second every
#: interval is busy and reads are batched as before.
BUSY = 10
#: ... within this many pacing intervals (a spell's rate: ``BUSY / (SPELL * interval)``).
SPELL = 2
#: What etcd may send ahead of our reading, per stream and for the connection (bytes).
WINDOW = 1 << 24
#: etcd's bandwidth-estimation PINGs (payload :data:`BDP_PING`) are acknowledged once this
#: old (seconds), not at once. grpc-go's server sends one (with a WINDOW_UPDATE) on every
#: DATA frame it reads while none of them is unacknowledged: answered at once, every watch
#: create (and every unary call, :mod:`cachedstore.unary`) cost a wakeup for it, which
#: arrives ahead of the answer, a write of the acknowledgement, and etcd a PING. Held, a
#: connection gets one per ``ACK_DELAY`` at most. Any other PING (grpc-go's keepalive, the
#: one ahead of a GOAWAY) is answered as before, at once; grpc-go has no deadline for a BDP
#: PING's answer (it only waits for it before it sends the next).
ACK_DELAY = 0.25
#: The payload of grpc-go's bandwidth-estimation PING (``bdpPing`` in its transport).
BDP_PING = bytes([2, 4, 16, 16, 9, 14, 7, 7])
_DEFAULT_WINDOW = 65_535
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_HTTP_CODES = {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED,
               403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.UNIMPLEMENTED,
               429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}
_RST_CODES = {7: grpc.StatusCode.UNAVAILABLE, 8: grpc.StatusCode.CANCELLED,
              11: grpc.StatusCode.RESOURCE_EXHAUSTED, 12: grpc.StatusCode.PERMISSION_DENIED}


def _hpack_int(value: int, prefix_bits: int, flags: int) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) whose first byte carries ``flags``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((flags | value,))
    out = [flags | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(headers: Iterable[tuple[str, str]]) -> bytes:
    """Request headers as HPACK literals *never indexed* (RFC 7541 section 6.2.3), with
    no Huffman coding: nothing of them (an auth token) enters a compression table or
    passes through another library, whose debug log would print it."""
    out = bytearray()
    for name, value in headers:
        out += b"\x10"  # never indexed, new name
        for text in (name.encode("latin-1"), value.encode("latin-1")):
            out += _hpack_int(len(text), 7, 0) + text
    return bytes(out)


def header_fragment(flags: int, payload: bytes) -> bytes:
    """A HEADERS frame's payload less its padding and priority fields (RFC 9113 6.2)."""
    if flags & _PADDED:
        payload = payload[1:len(payload) - payload[0]]
    if flags & _PRIORITY:
        payload = payload[5:]
    return payload


#: SETTINGS parameters this module acts on (RFC 9113 6.5.2).
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5


def settings_of(payload: bytes) -> Iterator[tuple[int, int]]:
    """A SETTINGS frame's ``(identifier, value)`` pairs, in order."""
    for at in range(0, len(payload) - 5, 6):
        yield (int.from_bytes(payload[at:at + 2], "big"),
               int.from_bytes(payload[at + 2:at + 6], "big"))


def grpc_message(body: bytes) -> bytes:
    """``body`` as a gRPC message on the wire: uncompressed, length-prefixed."""
    return b"\0" + len(body).to_bytes(4, "big") + body


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream.to_bytes(4, "big") + payload)


class _Token:
    """A marker that is not a message: see :data:`PING` and :data:`PONG`."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: Yielded by a call's request iterator instead of a message: send an HTTP/2 PING.
PING = _Token("PING")
#: Yielded by a call's iteration, between responses, for each PING acknowledgement.
PONG = _Token("PONG")


class WireError(grpc.RpcError):
    """A failed call, as grpcio reports one: ``code()`` (a ``grpc.StatusCode``) and
    ``details()``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class WireStub:
    """Streaming calls of one method on endpoint ``target`` (``host:port`` or
    ``[v6]:port``), a new connection per call; ``tls`` is a client SSL context for a
    secure endpoint (None: plaintext). ``Watch`` is etcd's watch method (named as the
    grpcio stub's, so the watcher takes either)."""

    #: Its calls take :data:`PING` from the request iterator and yield :data:`PONG`.
    pings = True

    def __init__(self, target: str, tls: ssl.SSLContext | None, connect_timeout: float,
                 deserialize: Callable[[bytes], Any], thread_name: str) -> None:
        host, _, port = target.rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self._target, self._tls = target, tls
        self._connect_timeout = connect_timeout
        self._deserialize = deserialize
        self._thread_name = thread_name

    def Watch(self, requests: Iterable[Any], metadata: Iterable[tuple[str, str]] = ()
              ) -> WireCall:
        """Start etcd's ``Watch`` call; does not block."""
        return WireCall(self._address, self._target, self._tls, self._connect_timeout,
                        "/etcdserverpb.Watch/Watch", tuple(metadata), requests,
                        self._deserialize, self._thread_name)


class WireCall:
    """One call: iterate it for the responses (one thread); ``cancel()`` from any.

    Longer than this project's classes usually are: it is one HTTP/2 connection's state
    (windows, buffers, header decoding, the handshake with the sender thread), which every
    part below reads and changes; split, the parts would pass that state to each other."""

    def __init__(self, address: tuple[str, int], authority: str, tls: ssl.SSLContext | None,
                 connect_timeout: float, path: str, metadata: tuple[tuple[str, str], ...],
                 requests: Iterable[Any], deserialize: Callable[[bytes], Any],
                 thread_name: str) -> None:
        self._address, self._tls, self._connect_timeout = address, tls, connect_timeout
        self._authority = authority
        self._headers = [(":method", "POST"), (":scheme", "https" if tls else "http"),
                         (":path", path), (":authority", authority),
                         ("content-type", "application/grpc"), ("te", "trailers"),
                         ("user-agent", "cachedstore-wire"),
                         *((k.lower(), v) for k, v in metadata)]
        self._requests = requests
        self._deserialize = deserialize
        self._thread_name = thread_name
        self._sender: threading.Thread | None = None
        self._sock: socket.socket | ssl.SSLSocket | None = None
        #: Connected, plaintext, preface and HEADERS sent: send() writes itself (under _io).
        self._writable = False
        self._poller: Any = None  # select.epoll: the socket and the wake-up socket
        self._polled_for_write = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_fd = self._wake_r.fileno()
        self._lock = threading.Lock()  # guards _outbox, _cancelled, _abort
        #: Guards the sending side (_waiting, _unsent, the send windows, writes to the
        #: socket), which send() shares with the reader; taken before _lock, never after.
        self._io = threading.RLock()
        self._outbox: deque[bytes] = deque()  # request messages: the sender thread's, send()'s
        self._waiting: deque[bytes] = deque()  # taken from the outbox, not yet framed
        self._cancelled = False
        self._abort: WireError | None = None  # set by the sender thread
        self._pings = 0  # PINGs the sender asked for, not yet sent (guarded by _lock)
        #: Acknowledgements of etcd's BDP PINGs, sent by the reader at _acks_due (ACK_DELAY).
        self._acks = b""
        self._acks_due = 0.0
        self.pings_received = 0  # PINGs etcd sent (tests count them)
        self._goaway = ""  # what a GOAWAY that spared our stream said, if one came
        self._closed = False
        self._reading = False  # a thread is inside __next__ (only it touches the socket)
        self._error: WireError | None = None
        self._ended = False  # the stream ended with status OK
        self._responses: deque[Any] = deque()
        self._inbuf = b""
        self._message = bytearray()  # a message whose frames have not all arrived
        self._unsent = b""  # frames written in part (the socket buffer was full)
        self._decoder = hpack.Decoder()
        self._headers_seen = False
        self._block = b""  # a header block awaiting its CONTINUATION frames
        self._block_ends_stream = False
        self._send_window = [_DEFAULT_WINDOW, _DEFAULT_WINDOW]  # connection, stream
        self._peer_initial_window = _DEFAULT_WINDOW
        self._max_frame = 16_384
        self._uncredited = 0
        self._half_closed = False
        self._pacing = 0.0  # see pace()
        self._urgent: Callable[[], bool] = bool
        self._monotonic: Callable[[], float] = time.monotonic
        self._last_wait = float("-inf")
        self._pacing_now = False
        self._delivered = 0  # responses decoded since the last wait began
        self._busy = BUSY  # (1 paces after any read: the rule before busy spells)
        self._spell = SPELL
        #: When each of the last ``_busy`` responses was read (the wait after it began).
        self._recent: deque[float] = deque(maxlen=self._busy)
        self.paced = 0  # pacing waits so far (tests and benchmarks count them)
        self._pace_poller: Any = None  # select.epoll: the wake-up socket only

    # -- the caller's side -------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._lock:
            cancelled = self._cancelled
            self._reading = not cancelled
        try:
            if cancelled and self._error is None and not self._ended:
                self._fail(grpc.StatusCode.CANCELLED, "cancelled")
            while not self._responses:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise StopIteration
                try:
                    if self._sock is None:
                        self._connect()
                    self._pump()
                except WireError:
                    if not self._responses:
                        raise  # else: deliver what came before the error, then raise it
                except OSError as exc:  # ssl.SSLError included
                    self._fail(grpc.StatusCode.UNAVAILABLE,
                               f"connection to {self._authority} lost: {exc}"
                               + (f" after {self._goaway}" if self._goaway else ""))
                except Exception as exc:  # a frame or message that does not parse
                    self._fail(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            return self._responses.popleft()
        finally:
            with self._lock:
                self._reading = False
                cancelled = self._cancelled
            if cancelled:
                self._close()

    def send(self, request: Any) -> bool:
        """Send ``request`` (a message) from the calling thread, behind every message
        queued before it (the sender thread's too): on a connected plaintext stream it is
        framed and written here, as far as the send windows and the socket take it, and
        neither the reading nor the sender thread is woken; otherwise (not connected yet,
        TLS, whose objects are not shared between threads) it is queued for the reading
        thread, which is woken. For requests whose order matters against the iterator's,
        the caller orders them (see ``watchstream.WatchStream``). Thread-safe, does not
        block (the socket is non-blocking; what it does not take, the reader writes).
        False, nothing sent, once the call is over."""
        message = grpc_message(request.SerializeToString())
        with self._io, self._lock:  # (the order every thread takes them in)
            if self._cancelled:  # also set by _close, before the socket is closed
                return False
            if not self._writable or self._outbox:
                self._outbox.append(message)
                self._wake_locked()
                return True
            self._waiting.append(message)  # behind any message still waiting for credit
            try:
                self._write_waiting()
            except OSError:  # the connection is lost: the reader finds out and says so
                self._wake_locked()
                return True
            # The reader: to wait for credit or the socket; or to read the answer now,
            # not after a pacing wait (a request to send ends one, see pace()).
            if self._waiting or self._unsent or self._pacing_now:
                self._wake_locked()
        return True

    def cancel(self) -> None:
        """End the call: a blocked or later iteration raises CANCELLED (unless it already
        ended). Thread-safe, idempotent, does not block."""
        with self._lock:
            self._cancelled = True
            reading = self._reading
        if reading:
            self._wake()  # the reading thread closes the connection
        else:
            self._close()

    def pace(self, interval: float, urgent: Callable[[], bool],
             monotonic: Callable[[], float] = time.monotonic) -> None:
        """Interrupt moderation under load: during a busy spell, begin waiting for the
        socket at most once per ``interval`` seconds, so that messages arriving faster are
        read in batches (each wake-up of the reading thread costs tens of µs of CPU
        whatever it reads). A busy spell: the last :data:`BUSY` messages were all read
        within :data:`SPELL` intervals (a rate of ``BUSY / (SPELL * interval)`` or more;
        1,000 a second for 10 ms at the default 5 ms). Outside one, nothing is paced: a
        message after a quiet spell, or at a modest rate (a few per interval), is read as
        it comes; one in a busy spell waits ``interval`` at most. No wait while
        ``urgent()`` is true; :meth:`hurry`, a request to send and :meth:`cancel` end one.
        ``monotonic`` is the clock the spell and the waits are judged by. Call before
        iterating; ``interval`` 0 turns it off."""
        self._pacing, self._urgent, self._monotonic = interval, urgent, monotonic

    def hurry(self) -> None:
        """End a pacing wait now (``urgent()`` has just become true). Thread-safe, does not
        block; a wake-up of the reader only if it is pacing."""
        with self._lock:
            if self._pacing_now:
                self._wake_locked()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the sender thread to end, which it does once
        the request iterator ends (or at its next message after :meth:`cancel`). True if
        it has ended (or never started, or this is it)."""
        sender = self._sender
        if sender is None or sender is threading.current_thread():
            return True
        sender.join(timeout)
        return not sender.is_alive()

    # -- connection ------------------------------------------------------------------------
    def _connect(self) -> None:
        sock: socket.socket | ssl.SSLSocket = socket.create_connection(
            self._address, timeout=self._connect_timeout)
        self._sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._tls is not None:
            sock = self._sock = self._tls.wrap_socket(sock, server_hostname=self._address[0])
            if sock.selected_alpn_protocol() != "h2":
                self._fail(grpc.StatusCode.UNAVAILABLE, "the endpoint did not agree to HTTP/2")
        sock.setblocking(False)
        poller = self._poller = select.epoll()
        poller.register(sock.fileno(), select.EPOLLIN)
        poller.register(self._wake_fd, select.EPOLLIN)
        settings = (2).to_bytes(2, "big") + (0).to_bytes(4, "big") \
            + (4).to_bytes(2, "big") + WINDOW.to_bytes(4, "big")  # no push; our window
        self._send(_PREFACE + _frame(_SETTINGS, 0, 0, settings)
                   + _frame(_WINDOW_UPDATE, 0, 0, (WINDOW - _DEFAULT_WINDOW).to_bytes(4, "big"))
                   + _frame(_HEADERS, _END_HEADERS, _STREAM,
                            header_block(self._headers)))
        if self._tls is None:  # send() may write from now on (behind the preface)
            with self._io:
                self._writable = True
        self._sender = threading.Thread(target=self._consume_requests,
                                        name=self._thread_name, daemon=True)
        self._sender.start()

    def _pump(self) -> None:
        """Wait for the socket or the sender, then read and answer what arrived."""
        sock, poller = self._sock, self._poller
        assert sock is not None
        with self._io:
            if self._outbox or self._pings or self._cancelled or self._abort is not None:
                with self._lock:  # (the peek above is unlocked)
                    cancelled, abort = self._cancelled, self._abort
                    outbox, self._outbox = self._outbox, deque()
                    pings, self._pings = self._pings, 0
                if abort is not None:
                    self._fail(abort.code(), abort.details())
                if cancelled:
                    self._fail(grpc.StatusCode.CANCELLED, "cancelled")
                self._waiting.extend(outbox)
                for _ in range(pings):  # control frames: no flow control, ahead of messages
                    self._send(_frame(_PING, 0, 0, b"cachedst"))
            self._write_waiting()
            ack_wait = -1.0  # no acknowledgement owed: poll without a timeout
            if self._acks:
                ack_wait = self._acks_due - time.monotonic()
                if ack_wait <= 0:  # behind the messages: etcd reads them with its PING
                    acks, self._acks = self._acks, b""  # still out, and sends no new one
                    self._send(acks)
                    ack_wait = -1.0
            if self._polled_for_write != bool(self._unsent):
                self._polled_for_write = bool(self._unsent)
                poller.modify(sock.fileno(), select.EPOLLIN
                              | (select.EPOLLOUT if self._unsent else 0))
        if self._pacing:
            self._pace()
        if not (self._tls is not None and sock.pending()):  # type: ignore[attr-defined]
            readable = False
            for fd, _ in poller.poll(ack_wait):
                if fd == self._wake_fd:
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                else:
                    readable = True
            if not readable:
                return
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        if not data:
            self._fail(grpc.StatusCode.UNAVAILABLE, "the connection was closed"
                       + (f" after {self._goaway}" if self._goaway else ""))
        self._receive(data)

    def _pace(self) -> None:
        """Before a wait for the socket: in a busy spell (the last :data:`BUSY` responses
        read within :data:`SPELL` times ``pacing`` seconds), if the last wait delivered
        responses and began less than ``pacing`` seconds ago, wait (on the wake-up socket
        only) for the rest of that time, unless urgent or etcd's bytes are already waiting
        (a backlog is read at full speed); see :meth:`pace`."""
        now = self._monotonic()
        delivered = self._delivered
        if delivered:
            recent = self._recent
            recent.extend([now] * min(delivered, self._busy))
            due = self._last_wait + self._pacing
            if (len(recent) == self._busy and now - recent[0] < self._pacing * self._spell
                    and now < due
                    and not self._backlog()):
                with self._lock:  # ordered against hurry(): one of the two sees the other
                    self._pacing_now = not self._urgent()
                try:
                    if self._pacing_now:
                        self.paced += 1
                        if self._pace_poller is None:
                            self._pace_poller = select.epoll()
                            self._pace_poller.register(self._wake_fd, select.EPOLLIN)
                        self._pace_poller.poll(min(due - now, _LONGEST_PACE))
                        now = self._monotonic()
                finally:
                    self._pacing_now = False
        self._delivered = 0
        self._last_wait = now

    def _backlog(self) -> bool:
        """Whether bytes from etcd are waiting to be read (decrypted, or in the kernel)."""
        sock = self._sock
        assert sock is not None
        if self._tls is not None and sock.pending():  # type: ignore[attr-defined]
            return True
        unread = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        return int.from_bytes(unread, sys.byteorder) > 0

    def _wake(self) -> None:
        with self._lock:
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._closed:  # never after _close: the fd number may belong to another socket
            return
        try:
            self._wake_w.send(b"\0")
        except OSError:  # its buffer is full: a wake-up is pending anyway
            pass

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with an error (CANCELLED if it was cancelled) and raise it."""
        if self._cancelled and code is not grpc.StatusCode.UNKNOWN:
            code, details = grpc.StatusCode.CANCELLED, "cancelled"
        if self._error is None:
            self._error = WireError(code, details)
        self._close()
        raise self._error

    def _close(self) -> None:
        """Release the connection (once; never while another thread reads it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._cancelled = True  # the sender stops at its next message
            self._wake_w.close()
        for closeable in (self._poller, self._pace_poller, self._sock, self._wake_r):
            if closeable is not None:
                try:
                    closeable.close()
                except OSError:
                    pass

    # -- sending ---------------------------------------------------------------------------
    def _consume_requests(self) -> None:
        """The sender thread: serialize each request; the reader sends it."""
        try:
            for request in self._requests:
                if request is PING:
                    with self._lock:
                        if self._cancelled:
                            return
                        self._pings += 1
                    self._wake()
                    continue
                message = grpc_message(request.SerializeToString())
                with self._lock:
                    if self._cancelled:
                        return
                    self._outbox.append(message)
                self._wake()
            with self._lock:
                self._outbox.append(b"")  # the iterator ended: half-close, as grpcio does
        except Exception:  # never die silently: the call ends with UNKNOWN
            log.exception("cachedstore watch: the request iterator raised")
            with self._lock:
                self._abort = WireError(grpc.StatusCode.UNKNOWN,
                                        "exception iterating requests")
        self._wake()

    def _write_waiting(self) -> None:
        """Frame the waiting messages as far as the send windows allow and write what the
        socket takes (under ``_io``)."""
        waiting = self._waiting
        while waiting and not self._half_closed:
            rest = self._frame_request(waiting[0])
            if rest:  # the windows are full: the rest waits for etcd's credit
                waiting[0] = rest
                break
            waiting.popleft()
        if self._unsent:
            self._flush()

    def _frame_request(self, message: bytes) -> bytes:
        """Frame as much of one request message (b"": end of requests) as the send
        windows allow, in frames of at most the peer's frame size; return the part that
        must wait for etcd's credit (b"": all of it went)."""
        if not message:
            self._half_closed = True
            self._send(_frame(_DATA, _END_STREAM, _STREAM))
            return b""
        room = min(len(message), *self._send_window)
        if room <= 0:
            return message
        for start in range(0, room, self._max_frame):
            self._send(_frame(_DATA, 0, _STREAM,
                              message[start:min(room, start + self._max_frame)]))
        self._send_window[0] -= room
        self._send_window[1] -= room
        return message[room:]

    def _send(self, data: bytes) -> None:
        with self._io:
            self._unsent += data
            self._flush()

    def _flush(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            sent = sock.send(self._unsent)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        self._unsent = self._unsent[sent:]

    # -- receiving -------------------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        buf = self._inbuf + data if self._inbuf else data
        pos, end = 0, len(buf)
        while end - pos >= 9 and not self._ended:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = ((buf[pos + 5] & 0x7F) << 24) | (buf[pos + 6] << 16) \
                | (buf[pos + 7] << 8) | buf[pos + 8]
            payload = buf[pos + 9:pos + 9 + length]
            pos += 9 + length
            if kind == _DATA:
                self._on_data(stream, flags, payload)
            elif kind in (_HEADERS, _CONTINUATION):
                if stream == _STREAM:
                    self._on_headers(kind, flags, payload)
            elif kind == _SETTINGS:
                if not flags & _ACK:
                    self._on_settings(payload)
            elif kind == _PING:
                if not flags & _ACK:
                    self.pings_received += 1
                    if payload != BDP_PING:  # a keepalive, say: answered at once
                        self._send(_frame(_PING, _ACK, 0, payload))
                    else:  # answered once ACK_DELAY old (by _pump)
                        if not self._acks:
                            self._acks_due = time.monotonic() + ACK_DELAY
                        self._acks += _frame(_PING, _ACK, 0, payload)
                else:  # etcd sends PINGs of its own, but acknowledges only ours
                    self._responses.append(PONG)
            elif kind == _WINDOW_UPDATE:
                credit = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
                if stream in (0, _STREAM):
                    with self._io:
                        self._send_window[stream] += credit
            elif kind == _RST_STREAM and stream == _STREAM:
                code = int.from_bytes(payload[:4], "big")
                self._fail(_RST_CODES.get(code, grpc.StatusCode.INTERNAL),
                           f"stream reset by the server (HTTP/2 error {code})")
            elif kind == _GOAWAY:
                code = int.from_bytes(payload[4:8], "big")
                said = f"GOAWAY (HTTP/2 error {code}: {payload[8:].decode('latin-1')!r})"
                if int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF < _STREAM:
                    self._fail(grpc.StatusCode.UNAVAILABLE, f"the server went away: {said}")
                self._goaway = said  # our stream may finish: the closed connection says it
        self._inbuf = buf[pos:]

    def _on_settings(self, payload: bytes) -> None:
        with self._io:
            for ident, value in settings_of(payload):
                if ident == SETTINGS_INITIAL_WINDOW_SIZE:  # moves the stream's window too
                    self._send_window[1] += value - self._peer_initial_window
                    self._peer_initial_window = value
                elif ident == SETTINGS_MAX_FRAME_SIZE:
                    self._max_frame = value
            self._send(_frame(_SETTINGS, _ACK, 0))

    def _on_data(self, stream: int, flags: int, payload: bytes) -> None:
        self._uncredited += len(payload)
        if self._uncredited >= WINDOW // 2:
            credit = self._uncredited.to_bytes(4, "big")
            self._uncredited = 0
            self._send(_frame(_WINDOW_UPDATE, 0, 0, credit)
                       + _frame(_WINDOW_UPDATE, 0, _STREAM, credit))
        if stream != _STREAM:
            return
        if flags & _PADDED:
            payload = payload[1:len(payload) - payload[0]]
        # A message spread over many frames (a catch-up of many revisions) grows a
        # bytearray in place; a frame holding whole messages is parsed as it is.
        message: bytes | bytearray
        if self._message:
            self._message += payload
            message = self._message
        else:
            message = payload
        pos, end = 0, len(message)
        while end - pos >= 5:
            if message[pos]:
                self._fail(grpc.StatusCode.INTERNAL, "a compressed message (none was asked)")
            size = int.from_bytes(message[pos + 1:pos + 5], "big")
            if end - pos < 5 + size:
                break
            self._responses.append(self._deserialize(bytes(message[pos + 5:pos + 5 + size])))
            self._delivered += 1
            pos += 5 + size
        if message is self._message:
            del self._message[:pos]
        elif pos < end:
            self._message = bytearray(message[pos:])
        if flags & _END_STREAM:
            self._fail(grpc.StatusCode.INTERNAL, "the stream ended without a status")

    def _on_headers(self, kind: int, flags: int, payload: bytes) -> None:
        if kind == _HEADERS:
            self._block = header_fragment(flags, payload)
            self._block_ends_stream = bool(flags & _END_STREAM)
        else:
            self._block += payload
        if not flags & _END_HEADERS:
            return
        headers = dict((str(k, "latin-1") if isinstance(k, bytes) else k,
                        str(v, "latin-1") if isinstance(v, bytes) else v)
                       for k, v in self._decoder.decode(self._block, raw=True))
        self._block = b""
        if not self._headers_seen:
            self._headers_seen = True
            status = int(headers.get(":status", "0") or 0)
            if status != 200:
                self._fail(_HTTP_CODES.get(status, grpc.StatusCode.UNKNOWN),
                           f"HTTP status {status}")
        if "grpc-status" in headers:
            code = _CODES.get(int(headers["grpc-status"]), grpc.StatusCode.UNKNOWN)
            if code is grpc.StatusCode.OK:
                self._ended = True
                self._close()
                return
            self._fail(code, unquote(headers.get("grpc-message", "")))
        if self._block_ends_stream:
            self._fail(grpc.StatusCode.INTERNAL, "the stream ended without a status")
