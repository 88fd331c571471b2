"""One watch stream's state and its request side: what the store sends on the stream, and
the checks that run where it is sent from.

:class:`WatchStream` is the stream's book of watches (the creates to send, those sent and
not yet answered, the scope of each watch id) and what both of its sides share (when it
last heard anything; whether etcd itself answered a progress request). The watcher's
response side (``watcher.py``) reads and fills it as responses arrive.

:class:`RequestSide` is the iterator of requests the stream is opened with. The transport
consumes it on a thread of its own (grpcio's request consumer, the wire transport's
sender), so it also runs, between the requests it yields:

- the **stall watchdog** (``liveness.py`` says when a quiet stream PINGs or sends a
  progress request, and when it is stalled). A stream that never answered a progress
  request is first probed with a unary range on its own channel (etcd's grpc-proxy ignores
  progress requests); a stalled stream stops the cache from being served at once and is
  cancelled (restart reason ``stalled``);
- with credentials, the **access re-check**: every ``auth_check_interval`` (and after a
  token renewal) one count-only range says whether the credentials still grant reading
  the prefix, since etcd never re-checks an open watch. A denial stops serving (nothing
  under ``max_staleness`` either) and cancels the stream (restart reason ``auth``). The
  check never delays the watchdog: it runs after a liveness step, within the time left
  until the next wake-up.

Nothing here reads a response; the watcher ends the request side by setting ``ended`` and
kicking the stream.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from . import etcdapi
from .cache import CoherentCache, Ticket
from .clock import Clock
from .config import StoreConfig
from .connection import Connection
from .errors import CachedStoreError, EtcdPermissionError
from .keys import KeySpace
from .liveness import Liveness
from .metrics import NullMetrics, StoreMetrics
from .scoping import Scope
from .snapshot import current_revision
from .wire import PING

__all__ = ["RequestSide", "WatchStream"]

log = logging.getLogger("cachedstore.watch")


class WatchStream:
    """The watches of one stream: creates to send, creates sent and not yet answered,
    and the scope of each watch id. Guarded by the watcher's ``_scopes_lock``; ``heard``
    and ``progress_answered`` are plain values its two sides read and write.

    A create is matched to its answer by watch id, not by order: etcd and its grpc-proxy
    both number a stream's watches 0, 1, 2 ... in the order the creates arrive (the store
    asks for automatic ids), but the proxy answers a create that joins a watch it already
    has at once, ahead of an earlier create still waiting for etcd, so answers can come
    out of order. A create etcd refuses outright (permission denied) takes no id; the
    stream then ends, so the numbering never drifts.

    Creates go out in the order they are given ids, by one of two routes, both under the
    lock: yielded by the request side (its transport's thread sends them), or, once the
    watcher set :attr:`send` (a transport whose calls take a request from any thread: the
    wire transport's), sent by whoever queued them (:meth:`send_queued`), with no
    wake-up of the request side's thread. A create yielded and not yet taken by the
    transport (``in_flight``) holds the direct route shut until it is: a create sent
    directly meanwhile would overtake it."""

    __slots__ = ("on_stream", "to_send", "awaiting", "by_id", "next_id", "kick",
                 "progress_wanted", "heard", "progress_answered", "send", "in_flight",
                 "anchor", "known", "known_at", "confirmed")

    def __init__(self, scopes: list[Scope], anchor: Scope | None = None,
                 known: Callable[[], Ticket] | None = None) -> None:
        #: The scope whose watch starts at etcd's current revision (the one internal key
        #: of a store that watches what it touched); every other watch resumes after what
        #: its scope applied.
        self.anchor = anchor
        self.on_stream = set(scopes)
        self.to_send: deque[Scope] = deque(scopes)
        #: Creates sent and not yet answered, by the watch id they will be given.
        self.awaiting: dict[int, Scope] = {}
        self.by_id: dict[int, Scope] = {}
        self.next_id = 0
        #: Set to wake the request side: a create to send, or the stream is over.
        self.kick = threading.Event()
        #: A consistent read asked for a progress response (sent once, at the next wake).
        self.progress_wanted = False
        #: The clock's time of the stream's start or last message (the stall watchdog's).
        self.heard = 0.0
        #: Whether the stream has answered a progress request: etcd itself is at its
        #: other end. grpc-proxy never answers one (the headers of its other answers are
        #: etcd's: they do not tell). Until then, and for good through a proxy, the stream
        #: does not PING (the proxy would answer for etcd).
        self.progress_answered = False
        #: The call's ``send(request) -> bool`` (set by the watcher, under the lock, once
        #: the call exists), for transports whose calls have one; else None.
        self.send: Callable[[Any], bool] | None = None
        #: The request side yielded a create its transport has not taken yet.
        self.in_flight = False
        #: What the cache knew etcd had committed (``CoherentCache.known_revision``), and
        #: so the least revision etcd answers a create with unless its member lags or its
        #: history went back (rule 10 of cache.py): taken as each create is sent.
        self.known = known
        self.known_at: dict[int, Ticket] = {}
        #: The newest revision a linearizable check on this stream found etcd at.
        self.confirmed = 0

    def create_request(self, scope: Scope) -> Any:
        """The create of ``scope``'s watch: from what the scope applied, or from etcd's
        current revision for the anchor."""
        return etcdapi.watch_create(scope.start, scope.end,
                                    0 if scope is self.anchor else scope.applied + 1)

    def send_queued(self) -> bool:
        """Under the lock: send every queued create through :attr:`send` (each recorded
        as awaiting its answer). False, sending nothing, while there is no ``send`` or a
        yielded create is in flight: the request side sends them then."""
        send = self.send
        if send is None or self.in_flight:
            return False
        to_send = self.to_send
        while to_send:
            scope = to_send.popleft()
            self.sent(scope)
            send(self.create_request(scope))  # False: the call is over, and so the stream
        return True

    def sent(self, scope: Scope) -> None:
        """``scope``'s create was sent: it will be the next watch id."""
        self.awaiting[self.next_id] = scope
        if self.known is not None:
            self.known_at[self.next_id] = self.known()
        self.next_id += 1

    def created(self, watch_id: int) -> Scope | None:
        """The scope of the create etcd answered with ``watch_id`` (None: not ours)."""
        scope = self.awaiting.pop(watch_id, None)
        if scope is not None:
            self.by_id[watch_id] = scope
        return scope

    def known_when_sent(self, watch_id: int) -> Ticket:
        """What the cache knew when the create answered with ``watch_id`` was sent (once;
        ``(0, 0)``, nothing, when not recorded)."""
        return self.known_at.pop(watch_id, (0, 0))


class RequestSide:
    """The requests of one watch stream (see the module docstring). :meth:`requests` is
    iterated once, by the transport, on its own thread; it blocks on the clock between
    requests and returns once ``ended`` is set and the stream kicked, once the watcher is
    stopping, or after it cancelled ``call`` (``stalled`` or ``denied`` then set). ``call``
    is set by the watcher as soon as the transport returned it.

    ``pinging``: liveness by PINGs on this stream (else progress requests).
    ``revoked(error)``: etcd denied the credentials (the watcher stops serving)."""

    def __init__(self, stream: WatchStream, lock: threading.Lock, *,
                 endpoint: Any, pinging: bool, conn: Connection, keyspace: KeySpace,
                 cache: CoherentCache, config: StoreConfig,
                 metrics: StoreMetrics | NullMetrics, clock: Clock,
                 stopping: threading.Event,
                 revoked: Callable[[BaseException], None]) -> None:
        self._stream, self._lock = stream, lock
        self._endpoint = endpoint
        self.pinging = pinging
        self._clock, self._stopping = clock, stopping
        # What the requests and the stall watchdog read and tell.
        self._config, self._metrics, self._cache = config, metrics, cache
        # What the probe and the access re-check use.
        self._conn, self._keyspace, self._revoked = conn, keyspace, revoked
        self._progress = etcdapi.watch_progress()
        self._auth_interval = config.auth_check_interval if conn.has_identity else None
        #: When the next access check is due (None: no credentials to check), and the
        #: token the last one was made with.
        self._next_auth: float | None = None
        self._checked_token: str | None = None
        #: Set by the watcher when the stream is over (the stream is kicked too).
        self.ended = threading.Event()
        #: Set before the request side cancels the call: the stream stalled; access denied.
        self.stalled = threading.Event()
        self.denied = threading.Event()
        self.call: Any = None

    def requests(self) -> Iterator[Any]:
        """The stream's requests: its creates, then whatever liveness, a consistent read
        or a scope opened later asks for, until the stream is over."""
        # Heard "now": the connection (TCP, TLS) is up once this runs on the wire
        # transport, however long it took.
        stream, clock, config = self._stream, self._clock, self._config
        stream.heard = clock.monotonic()
        yield from self._creates()
        live = Liveness(clock.monotonic(), progress_interval=config.progress_interval,
                        stall_timeout=config.stall_timeout,
                        ping_interval=config.ping_interval, pinging=self.pinging,
                        confirmed=False)
        auth_interval = self._auth_interval
        self._next_auth = clock.monotonic() + auth_interval if auth_interval else None
        self._checked_token = self._conn.token
        while True:
            wake = live.next_wake(stream.heard)
            if self._next_auth is not None:
                wake = min(wake, self._next_auth)
            if clock.wait(stream.kick, max(0.0, wake - clock.monotonic())):
                if self.ended.is_set():
                    return  # the stream is over
                yield from self._creates()  # a scope was opened, or progress is wanted
                continue
            if self._stopping.is_set():
                return
            # etcd's grpc-proxy would answer PINGs itself, which says nothing of etcd:
            # a stream PINGs only once etcd itself answered it (progress_answered).
            live.confirmed = stream.progress_answered
            step = live.step(clock.monotonic(), stream.heard, self._lagging())
            if step.stalled:
                if self._answers_probe():
                    continue
                self._stall()
                return
            if step.ping:
                self._metrics.watch_pings.inc()
                yield PING
            if step.progress:
                self._metrics.progress_requests.inc()
                yield self._progress
            if not self._access_still_granted(live):
                return

    def _creates(self) -> Iterator[Any]:
        """The creates queued on this stream, each recorded as awaiting its answer,
        then the progress request a consistent read asked for, if any (checked after
        the kick is cleared, so that a request made at any time is sent)."""
        stream = self._stream
        while True:
            with self._lock:
                stream.in_flight = False  # the transport took what was yielded before
                if stream.send_queued() or not stream.to_send:
                    stream.kick.clear()
                    break
                scope = stream.to_send.popleft()
                stream.sent(scope)
                stream.in_flight = True
            yield stream.create_request(scope)
        if stream.progress_wanted:  # a consistent read waits for the watch
            stream.progress_wanted = False
            self._metrics.progress_requests.inc()
            yield self._progress

    def _lagging(self) -> bool:
        """Whether a watched scope is replaying (asks liveness for progress requests)."""
        return any(s.catch_up_to for s in self._cache.watched_scopes())

    # -- the stall watchdog ---------------------------------------------------------------
    def _answers_probe(self) -> bool:
        """A stream found stalled that never answered a progress request: whether its
        channel answers a unary range (then it counts as heard now)."""
        if self._stream.progress_answered or not self._probe(self._config.progress_interval):
            return False
        # Quiet, not stalled: this endpoint ignores progress requests (etcd's grpc-proxy)
        # but answers on the channel.
        self._stream.heard = self._clock.monotonic()
        return True

    def _probe(self, timeout: float) -> bool:
        """Liveness of a stream that never answered a progress request: one count-only
        range on the stream's own channel. True if answered within ``timeout``."""
        request = etcdapi.range_prefix(self._keyspace.range_start, self._keyspace.range_end,
                                       count_only=True)
        try:
            self._endpoint.kv.Range(request, timeout=timeout, metadata=self._conn.metadata())
        except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
            return False
        return True

    def _stall(self) -> None:
        """The stream is stalled: stop serving now, not after the cancel, and end it."""
        self.stalled.set()
        self._cache.watch_down()
        self.call.cancel()

    # -- the access re-check --------------------------------------------------------------
    def _access_still_granted(self, live: Liveness) -> bool:
        """With credentials, once due (or after a token renewal): check them within the
        time left until the next wake-up. False (the call cancelled) if etcd denied them;
        a check that got no answer in time is made again at the next wake-up."""
        if self._next_auth is None or self._auth_interval is None:
            return True
        clock = self._clock
        token = self._conn.token
        if clock.monotonic() < self._next_auth and token == self._checked_token:
            return True
        budget = max(0.05, live.next_wake(self._stream.heard) - clock.monotonic())
        granted = self._access_granted(budget)
        if granted is False:
            self.call.cancel()
            return False
        if granted:  # None (no answer in time): ask again at the next wake-up
            self._checked_token = self._conn.token  # renewed by the check, if at all
            self._next_auth = clock.monotonic() + self._auth_interval
        return True

    def _access_granted(self, timeout: float) -> bool | None:
        """Whether the store's credentials still let it read its prefix: one count-only
        range with the current token (renewed if expired), given ``timeout`` seconds.
        False when etcd denies it (``denied`` set, the watcher told); None when there
        was no answer (a transport failure is the stall watchdog's business)."""
        try:
            current_revision(self._conn, self._keyspace, self._conn.deadline(timeout))
        except EtcdPermissionError as exc:  # AuthenticationError included
            log.warning("cachedstore watch: access to the prefix was revoked (%s); the "
                        "cache is not served until it is granted again", exc)
            self.denied.set()
            self._revoked(exc)
            return False
        except CachedStoreError:
            return None
        return True
