"""The one watch stream of a store, on its own thread, keeping the cache coherent.

The stream is driven directly over etcd's gRPC ``Watch`` API (python3-etcd3's ``Watcher``
dies silently and cannot resume). It carries one etcd watch per scope of the cache
(``scoping.py``): the whole prefix, or, for a store that watches only what it touched, an
*anchor* (one internal key nobody writes, so that the stream is created, checked and probed
before any scope exists) and each scope opened since, added on the live stream by
:meth:`Watcher.add`. etcd and grpc-proxy number a stream's watches in the order of its
creates, so each creation response is matched to its scope by watch id (the proxy may
answer out of order, see :class:`~cachedstore.watchstream.WatchStream`), and so are
events. The stream:

- resumes after a disconnect, each scope from (its last applied event revision + 1), on
  the next endpoint, after a jittered back-off. Progress responses are *not* used to advance the resume point:
  etcd before 3.5.8 can send one ahead of events of the same revision;
- resyncs a scope whose resume revision etcd reports compacted: forgets it and starts it
  from a fresh revision (never retrying the compacted one);
- treats a cancel (permission, auth) and a clean end of the stream as failures;
- checks that a quiet stream is alive with an HTTP/2 PING (wire transport, no etcd
  request) or a progress request, and declares it stalled when nothing at all arrived for
  ``stall_timeout``: a silent partition is detected within ``stall_timeout``
  (``liveness.py`` says when each is sent). A stream of progress requests that has not
  answered one (etcd's grpc-proxy ignores them) is first probed with a unary range on the
  same channel; only if that fails too is it stalled (``+ progress_interval``). If etcd
  refuses the PINGs (``too_many_pings``), the store uses progress requests from then on;
- with credentials, re-checks every ``auth_check_interval`` (and after a token renewal)
  that they still grant reading the prefix, since etcd never re-checks an open watch: a
  deleted user or a revoked role ends the stream (restart reason ``auth``) within that
  interval plus one request;
- opens streams only on members checked to belong to the store's cluster, and sends
  etcd's require-leader flag, so that a member cut off from its peers ends the stream
  (after about three election timeouts) instead of answering from its frozen state;
- stops the cache from being served (``cache.watch_down()``) from the moment any of this
  goes wrong until the stream is healthy again, and counts every restart by reason.

This module is the loop (streams, restarts, resyncs) and the stream's response side; the
request side (creates, progress requests, the stall watchdog and the access re-check) is
``watchstream.py``, the snapshot reads that resyncs make ``snapshot.py``.

The thread never dies silently: every exception is caught, logged, counted as a restart
(reason ``error``) and followed by a new attempt, until :meth:`Watcher.stop`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from . import etcdapi
from .cache import CoherentCache, Ticket
from .clock import SYSTEM_CLOCK, Clock
from .config import StoreConfig
from .connection import Connection
from .consistent import Progress
from .errors import CachedStoreError, StoreClosedError
from .etcdapi import EVENT_PUT, TRANSPORT_FAILURES, Failure
from .keys import KeySpace
from .liveness import pings_fit
from .metrics import NullMetrics, StoreMetrics
from .scoping import Scope
from .snapshot import Entries, current_revision, read_scope, read_scopes, snapshot
from .watchstream import RequestSide, WatchStream
from .wire import PONG

__all__ = ["Watcher"]

log = logging.getLogger("cachedstore.watch")

#: Why etcd may cancel a watch that renewed credentials can fix (or that says access is gone).
_AUTH_FAILURES = frozenset({Failure.PERMISSION, Failure.TOKEN, Failure.AUTH_FAILED,
                            Failure.AUTH_NOT_ENABLED})


def one_line(exc: BaseException | None) -> str:
    """An error as one log line: a gRPC error's status code and details, not its
    multi-line repr; anything else its first line."""
    if exc is None:
        return "stream ended"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        details = (exc.details() if hasattr(exc, "details") else "") or ""
        return f"{exc.code().name}: {' '.join(details.split())}"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__



class Watcher:
    """Runs the watch stream of one store on a named daemon thread. ``start`` once,
    ``stop`` once (from ``EtcdStore.close``). Thread-safe state for readers: ``up``,
    ``ready``, ``last_contact``, ``last_error``.

    Longer than this project's classes usually are: the restart loop and the response side
    share one stream's state (the scopes being created, the revision to resume from, whether
    to resync); one stream's request side is ``watchstream.py``, the snapshot reads
    ``snapshot.py``.
    """

    def __init__(self, conn: Connection, keyspace: KeySpace, cache: CoherentCache,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics, name: str,
                 clock: Clock = SYSTEM_CLOCK, progress: Progress | None = None) -> None:
        self._conn = conn
        #: Every timer of the watch (progress, stall, access checks, back-off) reads it;
        #: gRPC's own timeouts (the liveness probe) are real seconds.
        self._clock = clock
        self._keyspace = keyspace
        self._cache = cache
        self._config = config
        self._metrics = metrics
        self._stopping = threading.Event()
        self._call: Any = None
        self._revision = 0
        #: Scopes whose events were lost (compaction): read afresh before the next stream.
        self._needs_resync: set[Scope] = set()
        self._scopes_lock = threading.Lock()
        self._stream: WatchStream | None = None
        #: A store that watches only what it touched also watches this one internal key,
        #: which nobody writes: its creation says the stream is up.
        anchor_key = keyspace.internal + b"anchor"
        self._anchor = Scope(None, anchor_key, anchor_key + b"\0")
        self._rescope = False
        #: The fall-back was etcd's history going back (rule 10 of cache.py).
        self._rewinding = False
        #: The cache's rewinds counted as restarts (reason ``rewound``): each once, found
        #: by a live stream's check, a caller's request, or while between streams.
        self._rewinds_counted = cache.rewinds
        #: Scopes replaying since the stream was created: when first seen so (clock).
        self._lagging_since: dict[Scope, float] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        #: Set once the first stream is created (the constructor waits for it).
        self.ready = threading.Event()
        #: True while the stream is healthy and the cache may be served.
        self.up = False
        #: The clock's time of the last message from etcd that found the cache caught
        #: up (the reference of ``max_staleness``). Reconnect attempts do not move it; a
        #: denied access check sets it to -inf (nothing stale is served to a revoked user).
        self.last_contact = 0.0
        #: etcd closed a connection for PINGing too often: progress requests from then on.
        self._pings_refused = False
        #: The error that ended the last stream, if any (for the constructor's message).
        self.last_error: BaseException | None = None
        self.restarts = 0
        self._stream_was_healthy = False
        #: Told of every response handled, and of progress responses' revisions, for the
        #: consistent reads waiting on the watch (``consistent.py``).
        self.progress = progress or Progress(clock)

    def start(self, revision: int) -> None:
        """Start the stream; the cache's scopes were reset at ``revision`` or later."""
        self._revision = revision
        self._thread.start()

    def add(self, scope: Scope) -> None:
        """Watch ``scope``, just opened in the cache, on the live stream (from its
        ``applied`` + 1); a stream started later watches it anyway. Thread-safe, does not
        block."""
        with self._scopes_lock:
            stream = self._stream
            if stream is None or scope in stream.on_stream:
                return
            stream.on_stream.add(scope)
            stream.to_send.append(scope)
            if not stream.send_queued():  # else sent from here: no thread woken to send it
                stream.kick.set()

    def rescope(self, scope: Scope) -> None:
        """The cache fell back to the root ``scope`` (opening): read it and restart the
        stream with it; the old watches' late events are ignored by the cache.
        Thread-safe, does not block."""
        self._needs_resync.add(scope)
        self._rescope = True
        call = self._call
        if call is not None:
            call.cancel()

    def rewound(self, scope: Scope, known: int, revision: int) -> None:
        """etcd answered at ``revision`` a request sent after it had committed ``known``:
        its history went back (rule 10 of cache.py), and the cache started over with the
        root ``scope`` (opening). Logs it, then reads the scope and restarts the stream
        on it. Thread-safe, does not block."""
        log.error("cachedstore: etcd's history went back: it answered at revision %d a "
                  "request sent after revision %d was committed (a member that lost "
                  "acknowledged writes, members that diverged after a crash, or a restore "
                  "from a backup without --bump-revision). The cache starts over from "
                  "etcd's current state and watches the whole prefix; what was written "
                  "in the lost revisions may be gone from etcd.", revision, known)
        self._revision = revision
        self._rewinding = True
        self.rescope(scope)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the stream and join the thread. Idempotent."""
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._set_down()

    def hurry(self) -> None:
        """A thread began waiting for what the watch delivers: end a pacing wait of the
        stream now (``StoreConfig.watch_pacing``). Any thread; does not block."""
        hurry = getattr(self._call, "hurry", None)
        if hurry is not None:
            hurry()

    def request_progress(self) -> None:
        """Ask etcd for a progress response on the live stream (a consistent read waits
        for the watch); requests made before it is sent share it. Any thread; does not
        block; nothing happens while no stream is up."""
        with self._scopes_lock:
            stream = self._stream
            if stream is None or stream.progress_wanted:
                return
            stream.progress_wanted = True
            stream.kick.set()
        self.hurry()  # a paced transport reads the answer at once

    @property
    def _progress_answered(self) -> bool:
        """Whether the current stream has answered a progress request (etcd itself is at
        its other end: see :attr:`WatchStream.progress_answered`)."""
        stream = self._stream
        return stream is not None and stream.progress_answered

    # -- state -------------------------------------------------------------------------------
    def _set_up(self, creation_revision: int, scope: Scope | None) -> None:
        self._cache.watch_up(creation_revision, scope)
        if not self.up:
            self.up = True
            self._metrics.watch_up.inc()
        self.ready.set()

    def _set_down(self) -> None:
        self._cache.watch_down()
        if self.up:
            self.up = False
            self._metrics.watch_up.dec()

    def _revoked(self, error: BaseException | None = None) -> None:
        """etcd denied the store's credentials (``error``, if given, is kept in
        ``last_error``): stop serving now, and nothing under ``max_staleness`` either
        (what the cache holds is no longer theirs to read) until a stream is healthy
        again."""
        if error is not None:
            self.last_error = error
        self.last_contact = float("-inf")
        self._cache.watch_down()

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            self._stream_was_healthy = False
            # A fall-back (rescope) from now on cancels the stream built below, however
            # early it lands: the flag is only cleared here, before the resync it asks.
            self._rescope = False
            try:
                if self._needs_resync:
                    rewinding = self._rewinding
                    self._resync()
                    if rewinding and not self._rescope:  # its root is read: told by now
                        self._rewinding = False
                    self._count_rewinds()  # one found between streams counts now
                reason = self._stream_once()
            except StoreClosedError:
                break
            except CachedStoreError as exc:  # resync could not reach etcd, auth failed...
                self.last_error = exc
                reason = "auth" if isinstance(exc, PermissionError) else "disconnect"
                if isinstance(exc, PermissionError):
                    self._revoked()
            except Exception as exc:  # never die silently
                self.last_error = exc
                log.exception("cachedstore watch: unexpected error; restarting the stream")
                reason = "error"
            if self._stopping.is_set():
                break
            self._set_down()
            if reason != "rewound":  # a rewind counts once, here or after a resync
                self.restarts += 1
                self._metrics.restart(reason)
            self._count_rewinds()
            # Warn once per outage; the retries that follow are logged at debug level.
            log.log(logging.INFO if reason == "rescoped"
                    else logging.ERROR if reason == "rewound"
                    else logging.WARNING if self._stream_was_healthy or attempt == 0
                    else logging.DEBUG,
                    "cachedstore watch restarting (%s) from revision %d: %s",
                    reason, self._revision + 1, one_line(self.last_error))
            # A stream that got as far as being created starts the back-off over.
            attempt = 0 if self._stream_was_healthy else attempt + 1
            self._clock.wait(self._stopping, self._config.backoff.delay(attempt))
        self._set_down()

    def _count_rewinds(self) -> None:
        """Count each rewind the cache found since the last count as one restart, reason
        ``rewound`` (watch thread only)."""
        found = self._cache.rewinds
        for _ in range(found - self._rewinds_counted):
            self.restarts += 1
            self._metrics.restart("rewound")
        self._rewinds_counted = found

    def _resync(self) -> None:
        """Events of some scopes were lost: for each, take a fresh revision (and snapshot)
        first, then forget the scope, so that a fill begun after the reset reads at or
        after the new start. Key scopes (one key each) are read together, as many per
        read-only Txn as etcd takes, at one revision; a directory scope, which may hold
        many keys, in a request of its own, and the root as a snapshot."""
        keys: list[Scope] = []
        for scope in list(self._needs_resync):
            if scope.removed:
                self._needs_resync.discard(scope)
            elif scope.key is not None and not scope.end:  # one key (etcd: no range end)
                keys.append(scope)
            else:
                sent = self._cache.known_revision
                if scope.key is None:  # the root: the whole prefix
                    revision, entries = snapshot(self._conn, self._keyspace,
                                                 self._config.snapshot_limit,
                                                 self._conn.deadline())
                else:
                    revision, entries = read_scope(self._conn, self._keyspace, scope,
                                                   self._config.snapshot_limit,
                                                   self._conn.deadline())
                self._reset(sent, revision, [(scope, entries)])
        step = max(1, self._config.max_txn_ops)
        for first in range(0, len(keys), step):
            batch = [s for s in keys[first:first + step] if not s.removed]
            if batch:
                sent = self._cache.known_revision
                revision, found = read_scopes(self._conn, self._keyspace, batch,
                                              self._config.snapshot_limit,
                                              self._conn.deadline())
                self._reset(sent, revision, list(zip(batch, found, strict=True)))

    def _reset(self, sent: Ticket, revision: int, read: list[tuple[Scope, Entries | None]]
               ) -> None:
        """Reset the scopes just read at ``revision`` and forget they needed it; unless
        that answer shows etcd's history went back since ``sent`` (rule 10 of cache.py:
        the cache started over, and the root it opened is read next)."""
        if self._cache.answered(sent, revision):
            for scope, _ in read:
                self._needs_resync.discard(scope)
            return
        for scope, entries in read:
            self._cache.reset(revision, entries, scope)
            self._needs_resync.discard(scope)
        self._revision = max(self._revision, revision)

    # -- one stream ------------------------------------------------------------------------------
    def _stream_once(self) -> str:
        """Run one watch stream until it ends; return why it ended (a restart reason)."""
        # A member of another cluster is never watched: its revisions are not ours. The
        # first created answer checks the member (see _handle): no Status call first.
        index, endpoint = self._conn.endpoint()
        self._lagging_since = {}
        with self._scopes_lock:  # atomic with add(): every open scope is watched once
            scopes = self._cache.watched_scopes()
            if self._cache.scoped:
                scopes.insert(0, self._anchor)
            stream = self._stream = WatchStream(
                scopes, self._anchor, known=lambda: self._cache.known_revision)
        side = self._request_side(stream, endpoint)
        stream.heard = self._clock.monotonic()
        call = side.call = endpoint.watch_stream.Watch(side.requests(),
                                                       metadata=self._conn.metadata())
        send = getattr(call, "send", None)  # the wire transport's: creates sent directly
        if send is not None:
            with self._scopes_lock:
                stream.send = send
                stream.send_queued()
        pace = getattr(call, "pace", None)  # the wire transport's; grpcio reads regardless
        if pace is not None and self._config.watch_pacing > 0:
            pace(self._config.watch_pacing, self._cache.awaited, self._clock.monotonic)
        self._call = call
        if self._stopping.is_set() or self._rescope:
            call.cancel()
        try:
            return self._receive(call, index, stream)
        except grpc.RpcError as exc:
            self.last_error = exc
            return self._broken(exc, index, side)
        finally:
            self._end(call, stream, side)

    def _request_side(self, stream: WatchStream, endpoint: Any) -> RequestSide:
        """The request side of ``stream``, to be opened on ``endpoint``: PINGs where the
        transport sends them, etcd has not refused them and they fit ``stall_timeout``."""
        config = self._config
        pinging = (getattr(endpoint.watch_stream, "pings", False) and not self._pings_refused
                   and pings_fit(config.ping_interval, config.stall_timeout))
        return RequestSide(stream, self._scopes_lock, endpoint=endpoint,
                           pinging=pinging, conn=self._conn, keyspace=self._keyspace,
                           cache=self._cache, config=config, metrics=self._metrics,
                           clock=self._clock, stopping=self._stopping, revoked=self._revoked)

    def _receive(self, call: Any, index: int, stream: WatchStream) -> str:
        """Handle the responses of ``call`` until one ends the stream (its restart reason)
        or etcd ends it cleanly (``ended``). Raises grpc.RpcError when the stream breaks."""
        clock = self._clock
        for response in call:
            stream.heard = clock.monotonic()
            reason = self._handle(response, index, stream)
            if reason is not None:
                return reason
            if self._cache.floor == 0:  # caught up: the cache is confirmed current
                self.last_contact = stream.heard
        self.last_error = None
        return "ended"

    def _broken(self, exc: grpc.RpcError, index: int, side: RequestSide) -> str:
        """The restart reason of a stream that broke with ``exc``: the watcher's own
        cancel, the request side's verdict, or what the error says."""
        if self._stopping.is_set():
            return "closed"
        if self._rescope:
            rewound, self._rewinding = self._rewinding, False  # told once, not lost to the
            return "rewound" if rewound else "rescoped"  # loop's clearing of _rescope
        if side.stalled.is_set():
            self._conn.failover(index)
            return "stalled"
        if side.denied.is_set():
            return "auth"
        failure = etcdapi.classify_rpc_error(exc)[0]
        if failure is Failure.TOKEN:
            self._conn.authenticate(self._conn.deadline(), stale_token=self._conn.token)
            return "auth"
        if failure in TRANSPORT_FAILURES:  # resume on the next endpoint
            if side.pinging and "too_many_pings" in str(exc):
                self._pings_refused = True  # the same stream, progress requests
                log.warning("cachedstore watch: etcd refused the stream's PINGs "
                            "(ping_interval %g s is below its "
                            "--grpc-keepalive-min-time); using progress requests "
                            "every %g s from now on", self._config.ping_interval,
                            self._config.progress_interval)
                return "disconnect"
            self._conn.failover(index)
            return "disconnect"
        if failure is Failure.CANCELLED:
            return "canceled"
        return "error"

    def _end(self, call: Any, stream: WatchStream, side: RequestSide) -> None:
        """The stream is over: end its request side and cancel the call."""
        side.ended.set()
        with self._scopes_lock:
            stream.kick.set()
            self._stream = None
        call.cancel()
        # The request side returns now (ended, kicked); the wire transport's thread
        # that runs it is waited for, so that none outlives the stream (or close()).
        # Bounded: the request side may be inside a liveness probe or access check.
        join = getattr(call, "join", None)
        if join is not None:
            join(self._config.progress_interval + 1.0)
        self._call = None

    # -- the response side -----------------------------------------------------------------------
    def _handle(self, response: Any, index: int, stream: WatchStream) -> str | None:
        """Apply one watch response from endpoint ``index``; return a restart reason if
        the stream must end. Raises ClusterMismatchError for a stream created on a member
        of another cluster (its member was replaced since it was checked)."""
        if response is PONG:  # a PING acknowledged: liveness only (the caller noted it)
            return None
        if response.created:  # matched by id: grpc-proxy may answer out of order
            scope = self._created(response, index, stream)
            if scope is None and not response.canceled:
                # Not an id this stream's creates were given: its events would be lost.
                self.last_error = CachedStoreError(
                    f"etcd answered a watch create with id {response.watch_id}, which no "
                    f"create on this stream was given")
                return "error"
        else:
            scope = stream.by_id.get(response.watch_id)
        if response.canceled:
            return self._canceled(response, scope)
        if response.created:
            self._stream_was_healthy = True
            if self._went_back(response, stream):
                return "rewound"  # counted once, by _count_rewinds; the resync clears
            if scope is not None and scope.removed and self._rescope:
                return None  # the store fell back or started over: this stream is ending
            self._set_up(response.header.revision, scope)
            self._metrics.watch_revision.set(max(self._revision, response.header.revision))
        elif not response.events:  # a progress response: liveness only, never ordering
            self._progressed(response.header.revision, stream)
        elif scope is not None and scope is not self._anchor:
            self._apply(response.events, scope, response.header.revision)
        # (else: a watch of a dropped scope; the store fell back to its prefix)
        return None

    def _created(self, response: Any, index: int, stream: WatchStream) -> Scope | None:
        """The scope of the create that ``response`` answers (None: not ours), once the
        member behind endpoint ``index`` is known to be of the store's cluster."""
        # Before anything of this stream is used: its member is the store's cluster's
        # (a proxy's answers carry no cluster id: then one Status call, once).
        self._conn.check_cluster(index, response.header)
        self._conn.check_member(index, self._conn.deadline())
        with self._scopes_lock:
            return stream.created(response.watch_id)

    def _went_back(self, response: Any, stream: WatchStream) -> bool:
        """Rule 10 of cache.py for a store that reads only what it caches (it sends etcd
        nothing else that would show it): a watch created (``response``: the create's
        answer) behind what the cache knew etcd had committed when the create was sent is
        checked with one linearizable read. A member that merely lags (a follower after a
        failover) answers it at a revision at least that new; an older one means etcd's
        history went back, and the cache starts over (True). Once a check found etcd at
        revision V, creates sent knowing no more than V on that stream are not checked
        again. grpc-proxy answers a create that joins a watch it has with a header of its
        own making (the create's start revision, no cluster id): it tells nothing, and is
        not checked. Raises cachedstore errors when etcd cannot be read."""
        header = response.header
        sent = stream.known_when_sent(response.watch_id)
        if header.revision >= sent[1] or sent[1] <= stream.confirmed \
                or not header.cluster_id:
            return False
        ticket = self._cache.known_revision  # taken before the read is sent
        revision = current_revision(self._conn, self._keyspace, self._conn.deadline())
        if self._cache.answered(ticket, revision):
            return True
        stream.confirmed = max(stream.confirmed, revision)
        return False

    def _canceled(self, response: Any, scope: Scope | None) -> str:
        """etcd canceled the watch of ``scope`` (None: not known): the restart reason.
        A compaction marks every scope that lost events for a resync; a cancel for
        permission stops serving; one that fresh credentials may fix renews them."""
        if response.compact_revision:
            if scope is not None and scope is not self._anchor:
                self._needs_resync.add(scope)
            # Every scope not past the compacted revision lost events too.
            self._needs_resync.update(
                s for s in self._cache.watched_scopes()
                if s.applied + 1 < response.compact_revision)
            resume = scope.applied + 1 if scope is not None else self._revision + 1
            self.last_error = CachedStoreError(
                f"revision {resume} compacted (etcd compacted up to "
                f"{response.compact_revision})")
            return "compacted"
        reason = response.cancel_reason or "watch canceled by etcd"
        self.last_error = CachedStoreError(reason)
        failure = etcdapi.classify(None, reason)
        if failure is Failure.PERMISSION:
            self._revoked()
        if failure in _AUTH_FAILURES:
            self._conn.authenticate(self._conn.deadline(), stale_token=self._conn.token)
            return "auth"
        return "canceled"

    def _progressed(self, revision: int, stream: WatchStream) -> None:
        """A progress response at ``revision``: etcd itself answers the stream. Used for
        liveness and hints, never to move a resume point."""
        stream.progress_answered = True
        self._metrics.watch_revision.set(max(self._revision, revision))
        self._refresh_quiet_scopes()
        # A hint for consistent reads to stop waiting (never a proof of order).
        self.progress.progressed(revision)

    def _refresh_quiet_scopes(self) -> None:
        """Read afresh the scopes still replaying, a progress interval after the stream
        was created: a scope whose range did not change while the stream was down gets no
        event to end its replay (etcd's revision moved elsewhere), so without this the
        cache would not be served until that range changed. Runs on the watch thread,
        which applies no event meanwhile; events the reset covers are then ignored (rule
        4). A failed read is tried again at the next progress response."""
        now = self._clock.monotonic()
        lagging = [s for s in self._cache.watched_scopes() if s.catch_up_to]
        since = self._lagging_since
        for scope in [s for s in since if s not in lagging]:
            del since[scope]
        due = [s for s in lagging
               if now - since.setdefault(s, now) >= self._config.progress_interval]
        if not due:
            return
        due = due[:max(1, self._config.max_txn_ops)]
        sent = self._cache.known_revision
        try:
            revision, found = read_scopes(self._conn, self._keyspace, due,
                                          self._config.snapshot_limit,
                                          self._conn.deadline())
        except CachedStoreError as exc:
            log.debug("cachedstore watch: re-reading quiet scopes failed: %s", exc)
            return
        if self._cache.answered(sent, revision):  # rule 10: the cache started over
            return
        for scope, entries in zip(due, found, strict=True):
            self._cache.reset(revision, entries, scope)
            del since[scope]
        self._metrics.quiet_refreshes.inc(len(due))

    def _apply(self, events: Sequence[Any], scope: Scope, header_revision: int) -> None:
        """Apply the events of one response (one or more whole revisions) to ``scope``."""
        name_of = self._keyspace.name_of
        batch = []
        puts = 0
        for event in events:
            kv = event.kv
            name = name_of(kv.key)
            if name is None:
                continue
            if event.type == EVENT_PUT:
                puts += 1
                batch.append((name, kv.value, kv.mod_revision))
            else:
                batch.append((name, None, kv.mod_revision))
        last = events[-1].kv.mod_revision
        self._cache.apply_events(batch, last, scope)
        self.progress.advanced()
        self._revision = max(self._revision, last)
        self._metrics.events_put.inc(puts)
        self._metrics.events_delete.inc(len(batch) - puts)
        self._metrics.watch_revision.set(max(self._revision, header_revision))
