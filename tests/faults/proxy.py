"""An in-test TCP proxy between a store and etcd that can break the path on demand.

:class:`FaultProxy` listens on a free loopback port and forwards every connection to one
upstream ``host:port``. Faults:

- :meth:`FaultProxy.reset` — every open connection is closed with a TCP RST on both sides
  (``SO_LINGER`` 0); with ``refuse=True`` new connections are reset too, until
  :meth:`FaultProxy.heal`: an outage that the client notices at once.
- :meth:`FaultProxy.stall` — a silent partition: nothing is read or written any more and
  nothing is closed; bytes wait in the kernel's buffers, new connections wait in the listen
  backlog. The client sees a connection that is up and quiet.
- :meth:`FaultProxy.heal` — forward again (held bytes flow, waiting connections are served).
- ``delay=`` — a slow link: every byte is held ``delay`` seconds in each direction
  (one-way latency; the round trip costs ``2 × delay``), in order.
- :meth:`FaultProxy.block_origin` — for etcd peer links: drop (RST) every connection whose
  HTTP requests carry ``X-Server-From: <member id>`` (etcd's rafthttp sets it on every
  stream and pipeline request), now and later. Proxies in front of each member's peer port
  can so cut one member off from its peers, in both directions, and from nobody else.

One named daemon thread (``faultproxy-<port>``) does all the I/O with ``poll``; public
methods hand it a command and wait for it to be carried out (at most 5 s), so after
``reset()`` returns the connections are gone and after ``stall()`` returns no byte moves.
Bounded: the thread stops by itself after ``max_lifetime`` seconds, and :meth:`close`
(also ``__exit__``) stops it and joins it. Loopback only. Thread-safe.
"""

from __future__ import annotations

import queue
import re
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FaultProxy"]

#: Most bytes buffered per direction before the proxy stops reading that side.
_BUFFER_LIMIT = 1 << 20
_CHUNK = 1 << 16
_POLL_MS = 100
#: etcd's rafthttp names the sending member in every peer request.
_ORIGIN = re.compile(rb"X-Server-From: ([0-9a-fA-F]+)\r\n")
#: How many bytes of a connection are searched for its origin.
_SNIFF_LIMIT = 16 << 10


def _rst_close(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer gets a RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


@dataclass(eq=False)
class _Pair:
    """One proxied connection: the client side, the upstream side and a buffer each way."""

    client: socket.socket
    upstream: socket.socket
    to_upstream: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)
    #: Bytes received but held back by ``delay``: (due time, bytes), oldest first.
    held_up: deque[tuple[float, bytes]] = field(default_factory=deque)
    held_down: deque[tuple[float, bytes]] = field(default_factory=deque)
    #: The first bytes the client sent (searched for the origin), and the origin found.
    head: bytearray = field(default_factory=bytearray)
    origin: str | None = None

    def close(self, rst: bool) -> None:
        for sock in (self.client, self.upstream):
            if rst:
                _rst_close(sock)
            else:
                try:
                    sock.close()
                except OSError:
                    pass


class FaultProxy:
    """A TCP proxy to ``upstream`` (``"host:port"``) with reset/stall/heal faults.

    Use as a context manager or call :meth:`start` and :meth:`close`. ``endpoint`` is the
    ``host:port`` to give the store.
    """

    def __init__(self, upstream: str, *, host: str = "127.0.0.1",
                 max_lifetime: float = 300.0, delay: float = 0.0) -> None:
        up_host, _, up_port = upstream.rpartition(":")
        self._upstream = (up_host.strip("[]"), int(up_port))
        self._host = host
        self._max_lifetime = max_lifetime
        self._delay = delay
        self._blocked_origins: set[str] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._commands: queue.Queue[tuple[Callable[[], object], threading.Event, list[object]]]
        self._commands = queue.Queue()
        self._pairs: list[_Pair] = []
        self._stalled = False
        self._refusing = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"faultproxy-{self.port}",
                                        daemon=True)
        #: Connections accepted and forwarded so far.
        self.accepted = 0
        #: Connections closed by :meth:`reset` (open ones and refused new ones).
        self.resets = 0

    # -- public API ------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def active(self) -> int:
        """Connections open right now (read from the proxy thread; approximate)."""
        return len(self._pairs)

    @property
    def stalled(self) -> bool:
        return self._stalled

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def reset(self, refuse: bool = False) -> int:
        """RST every open connection; with ``refuse``, RST new ones too until :meth:`heal`.
        Returns how many open connections were reset. Blocks until done (≤ 5 s)."""

        def command() -> int:
            n = len(self._pairs)
            for pair in self._pairs:
                pair.close(rst=True)
            self._pairs.clear()
            self.resets += n
            self._refusing = refuse
            return n

        return int(self._do(command))  # type: ignore[call-overload]

    def stall(self) -> None:
        """Stop forwarding silently (a partition that holds bytes). Blocks until done."""

        def command() -> None:
            self._stalled = True

        self._do(command)

    def block_origin(self, member_id: str) -> int:
        """RST every connection whose requests say ``X-Server-From: member_id`` (hex, as
        etcd prints member ids), and every such connection later, until :meth:`heal`.
        Returns how many open connections were dropped. Blocks until done (≤ 5 s)."""
        origin = member_id.lower()

        def command() -> int:
            self._blocked_origins.add(origin)
            dropped = [p for p in self._pairs if p.origin == origin]
            for pair in dropped:
                self._drop(pair, rst=True)
            self.resets += len(dropped)
            return len(dropped)

        return int(self._do(command))  # type: ignore[call-overload]

    def heal(self) -> None:
        """Forward again and accept new connections. Blocks until done."""

        def command() -> None:
            self._stalled = False
            self._refusing = False
            self._blocked_origins.clear()

        self._do(command)

    def close(self) -> None:
        """Reset every connection, stop the thread and join it. Idempotent."""
        self._stopping = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._cleanup()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "stalled" if self._stalled else "refusing" if self._refusing else "forwarding"
        return f"<FaultProxy {self.endpoint} -> {self._upstream[0]}:{self._upstream[1]} {state}>"

    # -- the I/O thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _do(self, command: Callable[[], object]) -> object:
        if not self._thread.is_alive():
            raise RuntimeError(f"{self!r} is not running")
        done = threading.Event()
        result: list[object] = []
        self._commands.put((command, done, result))
        self._wake()
        if not done.wait(5.0):
            raise RuntimeError(f"{self!r} did not carry out a command within 5 s")
        return result[0] if result else None

    def _run(self) -> None:
        end = time.monotonic() + self._max_lifetime
        try:
            while not self._stopping and time.monotonic() < end:
                self._poll_once()
        finally:
            self._stopping = True
            self._cleanup()

    def _cleanup(self) -> None:
        for pair in self._pairs:
            pair.close(rst=True)
        self._pairs.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        while True:  # release callers waiting on commands
            try:
                _, done, _ = self._commands.get_nowait()
            except queue.Empty:
                break
            done.set()

    def _release_held(self) -> int:
        """Move held bytes that are due into the send buffers; the ms until the next is due."""
        now = time.monotonic()
        next_due = _POLL_MS
        for pair in self._pairs:
            for held, buffer in ((pair.held_up, pair.to_upstream),
                                 (pair.held_down, pair.to_client)):
                while held and held[0][0] <= now:
                    buffer += held.popleft()[1]
                if held:
                    next_due = min(next_due, max(1, int((held[0][0] - now) * 1000) + 1))
        return next_due

    def _poll_once(self) -> None:
        timeout_ms = _POLL_MS if self._stalled or not self._delay else self._release_held()
        poller = select.poll()
        by_fd: dict[int, tuple[_Pair, str]] = {}
        poller.register(self._wake_r, select.POLLIN)
        if not self._stalled:
            poller.register(self._listener, select.POLLIN)
            for pair in self._pairs:
                for side, sock, inbound, outbound in (
                        ("c", pair.client, pair.to_upstream, pair.to_client),
                        ("u", pair.upstream, pair.to_client, pair.to_upstream)):
                    mask = 0
                    held = pair.held_up if side == "c" else pair.held_down
                    if len(inbound) + sum(len(b) for _, b in held) < _BUFFER_LIMIT:
                        mask |= select.POLLIN
                    if outbound:
                        mask |= select.POLLOUT
                    if mask:
                        poller.register(sock, mask)
                        by_fd[sock.fileno()] = (pair, side)
        for fd, events in poller.poll(timeout_ms):
            if fd == self._wake_r.fileno():
                self._drain_wake()
                self._run_commands()
                return  # the state may have changed: rebuild the poll set
            if fd == self._listener.fileno():
                self._accept()
                continue
            entry = by_fd.get(fd)
            if entry is None or entry[0] not in self._pairs:
                continue
            self._service(entry[0], entry[1], events)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _run_commands(self) -> None:
        while True:
            try:
                command, done, result = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result.append(command())
            finally:
                done.set()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if self._refusing:
            self.resets += 1
            _rst_close(client)
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=1.0)
        except OSError:
            _rst_close(client)  # upstream down: the client sees a refused/reset connection
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pairs.append(_Pair(client, upstream))
        self.accepted += 1

    def _service(self, pair: _Pair, side: str, events: int) -> None:
        sock = pair.client if side == "c" else pair.upstream
        inbound = pair.to_upstream if side == "c" else pair.to_client
        outbound = pair.to_client if side == "c" else pair.to_upstream
        try:
            if events & select.POLLOUT and outbound:
                sent = sock.send(outbound)
                del outbound[:sent]
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                data = sock.recv(_CHUNK)
                held = pair.held_up if side == "c" else pair.held_down
                if not data:  # orderly close by one side: flush, then close the other side
                    other = pair.upstream if side == "c" else pair.client
                    while held:
                        inbound += held.popleft()[1]
                    try:
                        other.send(inbound)
                    except OSError:
                        pass
                    self._drop(pair, rst=False)
                    return
                if side == "c" and pair.origin is None and len(pair.head) < _SNIFF_LIMIT:
                    pair.head += data
                    found = _ORIGIN.search(pair.head)
                    if found:
                        pair.origin = found.group(1).decode().lower()
                        if pair.origin in self._blocked_origins:
                            self.resets += 1
                            self._drop(pair, rst=True)
                            return
                if self._delay:
                    held.append((time.monotonic() + self._delay, data))
                else:
                    inbound += data
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by one side: pass the reset on
            self._drop(pair, rst=True)

    def _drop(self, pair: _Pair, rst: bool) -> None:
        if pair in self._pairs:
            self._pairs.remove(pair)
        pair.close(rst=rst)
