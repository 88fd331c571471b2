"""The front end: :class:`EtcdStore`, wiring the parts of one store together.

The parts, one concern each: the coherence core (``cache.py``); the watch (``watcher.py``:
the restart loop and responses; ``watchstream.py``: one stream's requests and watchdog;
``snapshot.py``: the reads that open and resync it; ``opener.py``: scopes); read-through
and waiting (``reads.py``, its logic written once for both fronts in ``steps.py``);
writes (``writes.py``); asyncio (``aio.py``); the connection (``connection.py``, its retry
policy in ``retry.py``). Components reached through the store: ``store.queues``
(``queues.py``), ``store.versioned`` (``guarded.py``), ``store.leases`` (``leases.py``).
This module keeps only the hot paths of
``get``/``aget``/``mget`` (inline on purpose: a cache hit is one lookup and one counter
increment), the lifecycle (construction, ``close``, fork) and the documented public
methods, which delegate.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from prometheus_client import CollectorRegistry

from .aio import AsyncFront
from .cache import NOT_SERVING, CoherentCache
from .clock import SYSTEM_CLOCK, Clock
from .config import LATENCY_SAMPLE_EVERY, LivenessPolicy, StoreConfig, seconds
from .connection import Connection, Credentials, parse_endpoint
from .errors import (
    CachedStoreError,
    EtcdConnectionError,
    InvalidInputError,
    InvalidTypeError,
    StoreClosedError,
    StoreForkedError,
)
from .guarded import Snapshot, VersionedKeys
from .keys import KeySpace
from .leases import Leases
from .metrics import make_metrics
from .opener import ScopeOpener
from .queues import Queues, item_prefix
from .reads import MISSING, ReadThrough, Timeout, names_list
from .scoping import Scope, locate
from .snapshot import snapshot
from .watcher import Watcher
from .writes import Versioned, Writer

__all__ = ["MISSING", "EtcdStore", "Snapshot", "Versioned"]

Name = str | bytes
Value = str | bytes
_store_ids = itertools.count(1)
#: Every open store of this process, so that a fork can disable them in the child.
_live: weakref.WeakSet[EtcdStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_live):
        store._forked()  # noqa: SLF001


os.register_at_fork(after_in_child=_after_fork_in_child)


def _host_and_port(host: object, port: object) -> tuple[str, int]:
    """``EtcdStore(host, port)``'s endpoint, checked before anything connects: a URL or a
    ``"host:port"`` given as the host (which would otherwise be tried as an IPv6 address
    until ``connect_timeout``) and a port out of range are refused here.

    Raises:
        InvalidTypeError: ``host`` is not a str or ``port`` not an int (its decimal digits
            in a str are taken too).
        InvalidInputError: ``host`` is empty, a URL or ``"host:port"``; ``port`` is not in
            1..65535.
    """
    if not isinstance(host, str):
        raise InvalidTypeError(f"host must be a str, not {type(host).__name__}; give "
                               f"several endpoints as endpoints=[...]")
    if isinstance(port, str) and port.isdecimal():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int):
        raise InvalidTypeError(f"port must be an int, not {type(port).__name__}")
    bare = host.strip("[]")
    head, colon, tail = bare.rpartition(":")
    if (not bare or "/" in bare or "[" in bare or "]" in bare  # a URL, "[v6]:port"
            or (colon and ":" not in head and tail.isdigit())):  # "name:port", "v4:port"
        raise InvalidInputError(
            f"host must be a host name or address, got {host!r}; give a URL or "
            f"'host:port' as endpoints=[{host!r}]")
    if not 0 < port < 65536:
        raise InvalidInputError(f"port must be in 1..65535, got {port}")
    return bare, port


class EtcdStore:
    """A key-value store on etcd v3 whose reads are served from a coherent local cache.

    Reads (``get``, ``mget``, ``check``, ``wait``, and ``aget``/``amget``) are answered from
    an LRU cache that one background watch on the store's prefix keeps coherent with etcd;
    a miss reads through to etcd and fills the cache. Writes go to etcd and update the
    cache with the revision etcd assigned, so a process reads its own writes.

    Consistency (see README, "Guarantees and failure modes"):

    - once the watch has applied revision R, no read returns a value older than etcd's at R
      (a few milliseconds behind etcd on a healthy watch);
    - read-your-writes and monotonic reads within one store;
    - while the watch is down or resyncing the cache is not served: reads go to etcd, and
      raise :class:`~cachedstore.EtcdConnectionError` if it cannot be reached — unless the
      opt-in ``max_staleness`` allows cached values for that many seconds.

    Names and values are ``str`` or ``bytes`` (str is UTF-8 encoded); reads return ``bytes``.
    The etcd key of a name is ``prefix + name``. All methods are thread-safe. Blocking
    methods say so; every etcd round trip is bounded by ``request_timeout``.

    After ``os.fork()`` the store cannot be used in the child: it has no watch thread
    there, and gRPC channels do not survive a fork. Every operation in the child raises
    :class:`~cachedstore.StoreForkedError` (a StoreClosedError) — nothing inherited is ever
    served — and the child creates its own store. The parent is unaffected.

    Constructing the store contacts etcd (authenticating, reading the current revision,
    creating the watch) and raises :class:`~cachedstore.EtcdConnectionError` if that does not
    succeed within ``connect_timeout`` (10 s by default); ``PermissionError`` subclasses when
    the credentials are wrong or do not cover the prefix.

    Args:
        host, port: the etcd endpoint, unless ``endpoints`` is given.
        endpoints: ``["host:port", ...]``; the store fails over between them.
        prefix: prepended to every name, and the scope of the watch. ``""`` (default) maps
            names 1:1 to etcd keys; use a prefix such as ``"/myjob/"`` on shared clusters.
        cache_size: most cache entries (default 65,536).
        timeout: default wait of ``wait()`` (seconds or ``timedelta``, default 300 s).
        ca_cert, cert_key, cert_cert: TLS: the CA bundle that signs etcd's certificate, and
            the client key and certificate for client-certificate auth.
        user, password: etcd authentication (simple or JWT tokens; renewed as they expire).
        registry: the ``prometheus_client.CollectorRegistry`` for the store's metrics;
            default: a new private registry (``store.registry``). Pass
            ``prometheus_client.REGISTRY`` to use the global one.
        metrics: False to record no metrics at all.
        request_timeout, connect_timeout, max_staleness, max_txn_ops, max_request_bytes,
        preload_limit, watch_scope, max_watches, watch_transport, unary_transport: see
            :class:`~cachedstore.StoreConfig`. ``watch_scope="touched"`` makes the store
            watch only the directories (``"dir/"``) and names its reads touched: for jobs
            whose ranks each use a small part of a shared prefix (torch process groups).
        liveness: a :class:`~cachedstore.config.LivenessPolicy` (PINGs, progress requests,
            stall timeout, pacing), e.g. ``LivenessPolicy.FAST``.
        stall_timeout, progress_interval, ping_interval, watch_pacing: replace those
            fields of ``liveness`` (the one given, else the config's).
        config: a complete :class:`~cachedstore.StoreConfig`; keywords override it.
        clock: where time comes from (:mod:`cachedstore.clock`); tests pass a FakeClock.

    Longer than this project's classes usually are: it is the documented public API (most
    lines are the contracts in docstrings) plus the hot paths of ``get``/``aget``/``mget``,
    inlined on purpose (a helper call would cost a tenth of a hit). The logic lives in the
    parts it wires together.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 2379,
        *,
        endpoints: Sequence[str] | None = None,
        prefix: str | bytes = "",
        cache_size: int | None = None,
        timeout: float | timedelta | None = None,
        ca_cert: str | None = None,
        cert_key: str | None = None,
        cert_cert: str | None = None,
        user: str | None = None,
        password: str | None = None,
        registry: CollectorRegistry | None = None,
        metrics: bool = True,
        request_timeout: float | None = None,
        connect_timeout: float | None = None,
        stall_timeout: float | None = None,
        progress_interval: float | None = None,
        ping_interval: float | None = None,
        max_staleness: float | None = None,
        max_txn_ops: int | None = None,
        max_request_bytes: int | None = None,
        preload_limit: int | None = None,
        watch_scope: str | None = None,
        max_watches: int | None = None,
        watch_transport: str | None = None,
        unary_transport: str | None = None,
        watch_pacing: float | None = None,
        liveness: LivenessPolicy | None = None,
        config: StoreConfig | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._closed = True  # until fully constructed: close() must work on a partial store
        self._fork_pid: int | None = None
        self._watcher: Watcher | None = None
        self._aio: AsyncFront | None = None
        cfg = (config or StoreConfig()).with_overrides(
            cache_size=cache_size, timeout=timeout, request_timeout=request_timeout,
            connect_timeout=connect_timeout, stall_timeout=stall_timeout,
            progress_interval=progress_interval, ping_interval=ping_interval,
            max_staleness=max_staleness, max_txn_ops=max_txn_ops,
            max_request_bytes=max_request_bytes, preload_limit=preload_limit,
            watch_scope=watch_scope, max_watches=max_watches,
            watch_transport=watch_transport, unary_transport=unary_transport,
            watch_pacing=watch_pacing, liveness=liveness)
        self._config = cfg
        self._clock = clock
        self._keys = KeySpace(prefix, cfg.max_request_bytes)
        self.metrics = make_metrics(registry, metrics)
        self._cache = CoherentCache(
            cfg.cache_size, self.metrics,
            locate=locate if cfg.watch_scope == "touched" else None,
            root=(self._keys.range_start, self._keys.range_end))
        if endpoints is not None:
            targets = [parse_endpoint(e) for e in names_list(endpoints, "endpoints")]
        else:
            targets = [_host_and_port(host, port)]
        self._id = next(_store_ids)
        self._conn = Connection(targets, Credentials(ca_cert, cert_key, cert_cert, user,
                                                     password), cfg, self.metrics,
                                clock=clock, name=str(self._id))
        self._opener = ScopeOpener(self._conn, self._keys, self._cache, cfg, self.metrics,
                                   clock)
        self._reads = ReadThrough(self._conn, self._keys, self._cache, cfg, self.metrics,
                                  clock, self._check_open, self._stale_allowed, self._opener)
        self._writes = Writer(self._conn, self._keys, self._cache, cfg, self._check_open)
        self._aio = AsyncFront(self._reads, f"cachedstore-aio-{self._id}", clock)
        #: Versioned reads and conditional writes (``read``, ``put_if``, ``read_many``,
        #: ``put_many_if``): the rendezvous backend's primitives.
        self.versioned = VersionedKeys(self._writes)
        #: etcd leases (``grant``, ``time_to_live``, ``revoke``).
        self.leases = Leases(self._conn, self._check_open)
        #: FIFO queues (torch Store semantics): ``store.queues.push/pop/length``.
        self.queues = Queues(self._conn, self._keys, self._cache, self._opener, cfg.timeout,
                             self._check_open, lambda: self.watch_healthy,
                             self._reads.call_deadline, self._reads.look_deadline,
                             self._reads.wait_until, self._writes._sent, clock)
        # The hot path, bound once: a hit is one lock-free lookup and one counter
        # increment, ``next()`` of an itertools.count read at scrape time (no lock).
        self._lookup = self._cache.lookup
        # The LRU's two dicts, bound once (never replaced: changed in place, under the
        # cache's lock, see CoherentCache.lookup). The lock itself is read from the cache
        # on each hit: a fork replaces it (_after_fork).
        self._entries = self._cache._lru.data  # noqa: SLF001
        self._touched = self._cache._lru.touched  # noqa: SLF001
        # metrics=False: a hit neither counts nor samples latency (both would be no-ops).
        self._metered = bool(metrics)
        self._hits_get = self.metrics.hit_tick("get")
        self._hits_aget = self.metrics.hit_tick("aget")
        # Latency of get/aget/amget is observed for one call in LATENCY_SAMPLE_EVERY (hit or
        # miss alike, so the histogram is an unbiased sample); counts stay exact.
        self._sample_every = LATENCY_SAMPLE_EVERY
        self._tick_get = self._tick_aget = self._tick_amget = 1
        self._observe_get = self.metrics.duration["get"].observe
        self._duration = self.metrics.duration
        self._closed = False
        _live.add(self)
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        cfg = self._config
        deadline = self._conn.deadline(cfg.connect_timeout)
        self._conn.authenticate(deadline)
        revision = 0
        if not self._cache.scoped:  # a touched-scope store reads nothing until it is read
            revision, entries = snapshot(self._conn, self._keys, self._config.snapshot_limit,
                                         deadline)
            self._cache.reset(revision, entries)
        self._watcher = Watcher(self._conn, self._keys, self._cache, cfg, self.metrics,
                                name=f"cachedstore-watch-{self._id}", clock=self._clock,
                                progress=self._reads.progress)  # consistent reads wait on it
        self._opener.watch = self._watcher.add
        self._cache.on_waiter = self._watcher.hurry
        self._reads.progress.request = self._watcher.request_progress
        self._opener.fall_back = self._watcher.rescope
        watcher, opener, progress = self._watcher, self._opener, self._reads.progress

        def went_back(root: Scope, known: int, revision: int) -> None:
            # Rule 10 of cache.py: the cache started over with ``root``; the watch reads
            # it and watches the whole prefix from now on. Any thread that makes a
            # request may run this (the connection checks every answer): none of it waits.
            watcher.rewound(root, known, revision)
            progress.rewound()
            opener.rewound()

        self._cache.on_rewind = went_back
        cache = self._cache
        self._conn.history = (lambda: cache.known_revision, cache.answered)
        self._watcher.start(revision)
        if self._cache.scoped:  # no read yet: the first one would open the connection
            self._conn.warm(deadline)
        if not self._clock.wait(self._watcher.ready,
                                max(0.0, deadline - self._clock.monotonic())):
            cause = self._watcher.last_error
            if isinstance(cause, CachedStoreError):
                raise cause
            raise EtcdConnectionError(
                f"the watch on {self._conn.targets} could not be created within "
                f"connect_timeout={cfg.connect_timeout:g} s: {cause}") from None

    def _stale_allowed(self) -> bool:
        """Whether ``max_staleness`` lets a cached entry be served while the watch is down."""
        max_staleness = self._config.max_staleness
        watcher = self._watcher
        if max_staleness is None or watcher is None or watcher.up:
            return False
        return self._clock.monotonic() - watcher.last_contact <= max_staleness

    # -- properties --------------------------------------------------------------------
    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def prefix(self) -> bytes:
        return self._keys.prefix

    @property
    def registry(self) -> CollectorRegistry | None:
        """The Prometheus registry holding this store's metrics (None with metrics=False)."""
        return self.metrics.registry

    @property
    def watch_healthy(self) -> bool:
        """True while the watch is up and the cache may be served."""
        return (self._watcher is not None and self._watcher.up
                and self._cache.floor != NOT_SERVING)

    @property
    def watch_revision(self) -> int:
        """The newest etcd revision whose events this store has applied. A store watching
        what it touched has one per scope: this is the newest of them (a scope whose keys
        did not change stays behind)."""
        return self._cache.applied_revision

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("watching" if self.watch_healthy else "resyncing")
        return (f"EtcdStore(endpoints={self._conn.targets!r}, prefix={self.prefix!r}, "
                f"entries={len(self._cache)}, {state})")

    def stats(self) -> dict[str, Any]:
        """A snapshot of the store's state (entries, watch health and revision, waiters)."""
        watcher = self._watcher
        return {
            "endpoints": self._conn.targets,
            "prefix": self.prefix.decode("utf-8", "surrogateescape"),
            "entries": len(self._cache),
            "cache_size": self._config.cache_size,
            "watch_up": self.watch_healthy,
            "watch_revision": self._cache.applied_revision,
            "watch_restarts": watcher.restarts if watcher else 0,
            "watch_scope": "touched" if self._cache.scoped else "prefix",
            "watch_scopes": self._cache.n_scopes,
            "waiters": self._cache.n_waiters,
            "closed": self._closed,
        }

    # -- reads -------------------------------------------------------------------------
    def get(self, name: Name, default: Any = MISSING, timeout: Timeout = None, *,
            consistent: bool = False) -> Any:
        """The value of ``name`` as bytes.

        Served from the cache when it holds the key and the watch is healthy; otherwise
        read from etcd (one range request) and cached. If the key is absent: with
        ``timeout``, block until it is created (woken by the store's watch, no polling) and
        return it, or when ``timeout`` passes return ``default`` if given, else raise
        :class:`~cachedstore.StoreTimeoutError`; without ``timeout``, return ``default``
        unchanged if given, else raise :class:`~cachedstore.KeyNotFoundError` (a KeyError).
        ``timeout`` may be ``float("inf")`` or ``timedelta.max``.

        Thread-safe. Non-blocking unless ``timeout`` is given (apart from etcd round trips,
        each bounded by ``request_timeout``). A blocking get outlasts its timeout by at most
        250 ms, etcd round trips included (``timeout=0`` still reads a key the cache does
        not hold): if etcd is unreachable until then it raises
        StoreTimeoutError, whose ``__cause__`` is the EtcdConnectionError. A blocking read
        that finds a counter deleted before its value was read waits for the key again
        (``aget``, ``mget`` and ``amget`` alike).

        ``consistent=True`` makes the read linearizable: it returns a value no older than
        every write acknowledged (to any client) before the call began. The store asks etcd
        for its current revision (one request, shared by the consistent reads in flight)
        and answers from the cache once its watch has applied that revision; a scope the
        watch has not brought there within a few milliseconds (nothing of it changed), and
        every read while the watch is down, is read from etcd instead. Costs: one range
        (shared) and the watch's lag, or two ranges (docs/guarantees.md).
        """
        if consistent:
            return self._reads.get("get", name, default, timeout, True)
        if self._metered:
            tick = self._tick_get - 1
            if tick <= 0:  # one call in LATENCY_SAMPLE_EVERY, hit or miss: timed
                return self._get_timed(name, default, timeout)
            self._tick_get = tick
        # The hot path: CoherentCache.lookup inlined (its call would be a sixth of a hit),
        # the same reads in the same order, lock-free; the argument for that is at the
        # lookup. A change in progress (the lock held) sends the read the locked way.
        cache = self._cache
        try:
            entry = self._entries[name]  # type: ignore[index]
        except (KeyError, TypeError):  # not cached, or unhashable (the slow path says why)
            return self._reads.get("get", name, default, timeout)
        if entry[1] >= cache.floor and not cache._lock.locked():  # noqa: SLF001
            value = entry[0]
            if value.__class__ is bytes:  # not None (absent), not a counter's marker
                self._touched[name] = None  # type: ignore[index]  # found: a str
                if self._metered:
                    next(self._hits_get)
                return value
        return self._reads.get("get", name, default, timeout)

    def _get_timed(self, name: Name, default: Any, timeout: Timeout) -> Any:
        """:meth:`get` with its latency observed (the sampled call, through the locked-path
        lookup)."""
        self._tick_get = self._sample_every
        started = time.perf_counter()
        try:
            entry = self._lookup(name)
            if entry is not None and entry[0].__class__ is bytes:
                next(self._hits_get)
                return entry[0]
            return self._reads.get("get", name, default, timeout)
        finally:
            self._observe_get(time.perf_counter() - started)

    def mget(self, names: Iterable[Name], default: Any = MISSING,
             timeout: Timeout = None, *, consistent: bool = False) -> list[Any]:
        """The values of ``names``, in order, with :meth:`get`'s rules for each key.

        Hits come from the cache; all misses are read together, in Txns of up to
        ``max_txn_ops`` range requests (1,000 misses: 8 round trips). With ``timeout``,
        blocks until every absent key is created or the (shared) timeout passes, also
        while etcd is unreachable (then StoreTimeoutError's ``__cause__`` is the
        EtcdConnectionError, unless a default answers). A timeout of 0 is one look: it
        raises EtcdConnectionError when etcd cannot be read, as a consistent read does.
        Raises KeyNotFoundError for the first absent key when neither default nor timeout
        is given, InvalidTypeError for a lone str/bytes instead of a list. Thread-safe.
        ``consistent=True``: linearizable, as for :meth:`get` (one shared revision request
        for all the names).
        """
        return self._mget("mget", names, default, timeout, consistent)

    def _mget(self, op: str, names: Iterable[Name], default: Any, timeout: Timeout,
              consistent: bool = False) -> list[Any]:
        started = time.perf_counter()
        try:
            names = names_list(names)
            lookup = self._lookup
            results: list[Any] = [None] * len(names)
            pending: list[int] = []
            if consistent:
                return self._reads.mget(op, names, default, timeout, results,
                                        list(range(len(names))), True)
            for i, name in enumerate(names):
                entry = lookup(name)
                if entry is not None and entry[0].__class__ is bytes:
                    results[i] = entry[0]
                else:
                    pending.append(i)
            if not pending:
                self.metrics.hit[op].inc(len(names))
                return results
            return self._reads.mget(op, names, default, timeout, results, pending)
        finally:
            self._duration[op].observe(time.perf_counter() - started)

    def wait(self, names: Iterable[Name], timeout: Timeout = None, *,
             consistent: bool = False) -> None:
        """Block until every key in ``names`` exists.

        ``timeout`` defaults to the store's ``timeout`` (300 s). Raises
        :class:`~cachedstore.StoreTimeoutError` (a TimeoutError) when it passes, also when
        etcd is unreachable until then (its ``__cause__`` the EtcdConnectionError); a
        timeout of 0 is one look, which raises EtcdConnectionError when etcd cannot be read,
        as a consistent first look does. Waiters share the store's one watch: no extra etcd
        stream, no polling. InvalidTypeError for a lone str/bytes. Thread-safe.
        ``consistent=True``: the first look is linearizable (a key created before the call
        began is found without waiting for the watch).
        """
        names = names_list(names)
        self._mget("wait", names, MISSING, self._config.timeout if timeout is None else timeout,
                   consistent)

    def wait_until(self, ready: Callable[[], bool], *, names: Iterable[Name] = (),
                   prefixes: Iterable[Name] = (), queues: Iterable[Name] = (),
                   timeout: Timeout = None, clock: Clock | None = None) -> None:
        """Block until ``ready()`` returns true: asked at once, then again each time this
        store's watch applies (or the store itself writes) a change of one of ``names``, of
        a key whose name starts with one of ``prefixes``, or of an item of one of
        ``queues`` -- the one wait that every waiter past ``get``/``wait`` uses (queue pops,
        torch's ``wait`` on keys and queues). It polls nothing; in a store watching what it
        touched, while no open watch covers one of ``names`` or no open directory scope
        covers one of the prefixes, ``ready()`` is asked again every 0.25 s (asking may open
        it). ``timeout`` defaults to the store's; its passing raises StoreTimeoutError (a
        TimeoutError) without asking ``ready()`` again.
        ``ready`` runs on the calling thread and may read the store (or etcd); exceptions
        it raises propagate. Its reads of this store belong to the wait: each etcd round
        trip of theirs may take until the wait's deadline (``request_timeout`` at most),
        even a ``timeout=0`` look's, which alone gets 250 ms. ``clock`` times the wait
        (default: the store's). Thread-safe.
        """
        wait = seconds(self._config.timeout if timeout is None else timeout)
        assert wait is not None
        clock = clock or self._clock
        keys = self._keys
        canonical = [keys.canonical(n) for n in names_list(names)]
        under = [keys.canonical(p) for p in names_list(prefixes, "prefixes")]
        under += [item_prefix(keys.canonical(q)) for q in names_list(queues, "queues")]
        opener = self._opener
        self._reads.wait_until(
            ready, canonical, under, clock.monotonic() + wait, clock=clock,
            covered=lambda: all(opener.covers_directory(p) for p in under),
            message=lambda: f"timed out after {wait:g} s waiting for a change of "
                            f"{canonical + under!r}")

    def check(self, names: Iterable[Name], *, consistent: bool = False) -> bool:
        """True if every key in ``names`` exists right now (never blocks on absent keys).
        InvalidTypeError for a lone str/bytes. Thread-safe. ``consistent=True``:
        linearizable, as for :meth:`get`."""
        started = time.perf_counter()
        try:
            return self._reads.check(names, consistent)
        finally:
            self._duration["check"].observe(time.perf_counter() - started)

    # -- asyncio ---------------------------------------------------------------------------
    async def aget(self, name: Name, default: Any = MISSING, timeout: Timeout = None, *,
                   consistent: bool = False) -> Any:
        """asyncio :meth:`get`. A hit returns without leaving the event loop's thread; an
        etcd read runs on the store's executor (up to 32 threads, see ``aio.py``); a
        blocking wait holds no thread. ``timeout`` covers waiting for an executor thread
        too: a blocking aget outlasts it as a blocking get does (250 ms at most), or by
        500 ms at most when its last round trip had to wait for a thread; a round trip
        that found none by the deadline is unanswered, as in an outage. Raises
        StoreClosedError if the store is closed meanwhile. ``consistent=True``:
        linearizable, as for :meth:`get` (its revision request and catch-up run on the
        executor)."""
        if consistent:
            return await self._async.get("aget", name, default, timeout, consistent=True)
        # The hit path below mirrors get()'s line for line on purpose: sharing it through a
        # helper would add a Python call (~70 ns, a tenth of a hit) to every cached read.
        if self._metered:
            tick = self._tick_aget - 1
            if tick <= 0:  # sampled: timed, hit or miss
                return await self._aget_timed(name, default, timeout)
            self._tick_aget = tick
        cache = self._cache  # CoherentCache.lookup inlined, as in get()
        try:
            entry = self._entries[name]  # type: ignore[index]
        except (KeyError, TypeError):
            return await self._async.get("aget", name, default, timeout)
        if entry[1] >= cache.floor and not cache._lock.locked():  # noqa: SLF001
            value = entry[0]
            if value.__class__ is bytes:
                self._touched[name] = None  # type: ignore[index]  # found: a str
                if self._metered:
                    next(self._hits_aget)
                return value
        return await self._async.get("aget", name, default, timeout)

    async def _aget_timed(self, name: Name, default: Any, timeout: Timeout) -> Any:
        """:meth:`aget` with its latency observed (the sampled call)."""
        self._tick_aget = self._sample_every
        with self._timed("aget"):
            entry = self._lookup(name)
            if entry is not None and entry[0].__class__ is bytes:
                next(self._hits_aget)
                return entry[0]
            return await self._async.get("aget", name, default, timeout)

    async def amget(self, names: Iterable[Name], default: Any = MISSING,
                    timeout: Timeout = None, *, consistent: bool = False) -> list[Any]:
        """asyncio :meth:`mget`: all hits → no thread hop; misses read on the executor;
        ``timeout`` covers the whole call. ``consistent=True``: linearizable. Its latency
        is observed for one call in ``LATENCY_SAMPLE_EVERY``, hit or miss, as aget's."""
        if self._metered:
            tick = self._tick_amget - 1
            if tick <= 0:  # one call in LATENCY_SAMPLE_EVERY, hit or miss: timed
                return await self._amget_timed(names, default, timeout, consistent)
            self._tick_amget = tick
        names = names_list(names)
        if consistent:
            return list(await self._async.mget("amget", names, default, timeout, True))
        lookup = self._lookup
        results: list[Any] = []
        for name in names:
            entry = lookup(name)
            if entry is None or entry[0].__class__ is not bytes:
                break
            results.append(entry[0])
        else:
            self.metrics.hit["amget"].inc(len(names))
            return results
        return list(await self._async.mget("amget", names, default, timeout))

    async def _amget_timed(self, names: Iterable[Name], default: Any, timeout: Timeout,
                           consistent: bool) -> list[Any]:
        """:meth:`amget` with its latency observed (the sampled call)."""
        self._tick_amget = self._sample_every + 1  # the call below counts itself
        with self._timed("amget"):
            return await self.amget(names, default, timeout, consistent=consistent)

    @property
    def _async(self) -> AsyncFront:
        front = self._aio
        if front is None:
            raise StoreClosedError("the store is closed")
        return front

    # -- writes --------------------------------------------------------------------------------
    def _timed(self, op: str) -> _Timer:
        return _Timer(self._duration[op])

    def set(self, name: Name, value: Value) -> None:
        """Write ``value`` under ``name`` (one etcd put). Blocks for the round trip; the
        store's reads see the write as soon as this returns. Raises EtcdConnectionError —
        saying the outcome is unknown — if etcd was lost after the put may have reached it
        (it is retried, on the next endpoint, only while it provably was not sent).
        Thread-safe."""
        with self._timed("set"):
            self._writes.set(name, value)

    def set_if_changed(self, name: Name, value: Value) -> bool:
        """Write ``value`` under ``name`` unless it holds exactly that value already; return
        whether it wrote. One etcd Txn either way (one raft proposal), but an unchanged
        value makes no new revision and no watch event: when many processes publish the
        same value (torch's barrier: every rank that sees the count complete sets
        ``last_worker``), every watcher gets one event instead of one per writer. Same
        guarantees, errors and thread-safety as :meth:`set`."""
        with self._timed("set"):
            return self._writes.set_if_changed(name, value)

    def mset(self, items: Mapping[Name, Value] | Iterable[tuple[Name, Value]]) -> None:
        """Write several keys: one etcd Txn per ``max_txn_ops`` keys (fewer when the values
        are large, to stay within etcd's request limit), each Txn atomic. A name given twice
        keeps its last value. Every name and value is checked before anything is sent
        (InvalidTypeError, InvalidInputError). Like :meth:`set`, a Txn is not re-sent once
        it may have reached etcd: EtcdConnectionError then says the outcome is unknown (the
        Txns before it were applied). Blocks for the round trips. Thread-safe."""
        with self._timed("mset"):
            self._writes.mset(items)

    def delete(self, name: Name) -> bool:
        """Delete ``name``; True if it existed. Blocks for the round trip. Thread-safe."""
        with self._timed("delete"):
            return self._writes.delete(name)

    def add(self, name: Name, amount: int = 1) -> int:
        """Atomically add ``amount`` to the integer under ``name`` — 0 if absent — and
        return the new value; ``get`` returns it in decimal ASCII, like torch's Store.

        ``amount != 0``: one etcd Txn and one raft proposal, whatever the contention: no
        ``add`` can make another retry, and W concurrent ``add(name, 1)`` return 1..W, each
        once. The increments are stored past the watched range, so they reach no store's
        watch (how a plain etcd client sees a counter: ``cachedstore/counters.py``). A key
        holding a plain decimal someone ``set`` costs one compare-and-swap more, once.
        ``amount == 0`` only reads (a read-only Txn: no proposal, no event); an absent key
        stays absent. Raises NotAnIntegerError if the key holds something else,
        InvalidTypeError if ``amount`` is not an int, and EtcdConnectionError — saying the
        outcome is unknown — if etcd was lost after the request may have reached it.
        Blocks for one round trip. Thread-safe, and atomic across processes.
        """
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidTypeError(f"amount must be an int, not {type(amount).__name__}")
        amount = int(amount)  # an IntEnum or an int subclass: counted, returned as int
        with self._timed("add"):
            if amount == 0:
                return self._reads.counter(name)
            return self._writes.add(name, amount)

    def barrier(self, key: Name, world_size: int, timeout: Timeout = None) -> None:
        """Block until ``world_size`` callers (any stores, any processes) have called
        ``barrier`` with the same ``key``; the keys of torch's ``Store.barrier`` and
        torchelastic's barrier, so that every implementation of either interoperates.

        Each caller costs etcd one ``add(key + "/num_members", 1)`` (one Txn, one raft
        proposal, no retries), the one that counts ``world_size`` one put of
        ``key + "/last_member"``, whose single watch event releases every waiting store;
        the wait itself polls nothing. Like torch's, a barrier key serves once. ``timeout``
        defaults to the store's; raises StoreTimeoutError (a TimeoutError) when it passes,
        InvalidInputError for a ``world_size`` below 1. Thread-safe.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidInputError(f"world_size must be an int >= 1, got {world_size!r}")
        prefix = key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key
        if not isinstance(prefix, str):
            raise InvalidTypeError(f"barrier key must be str or bytes, not "
                                   f"{type(key).__name__}")
        last = prefix + "/last_member"
        if self.add(prefix + "/num_members", 1) == world_size:
            self.set(last, "<val_ignored>")
        self.wait([last], timeout)

    def append(self, name: Name, value: Value) -> bytes:
        """Atomically append ``value`` to the bytes stored under ``name`` (creating the key
        if absent) and return the new value: torch Store's ``append``.

        A compare-and-swap Txn on the key's ``mod_revision`` (a counter is folded back
        into a plain decimal first). Raises
        InvalidInputError if the result would exceed etcd's request limit, and
        EtcdConnectionError (outcome unknown) if etcd was lost after the request may have
        reached it. Thread-safe, and atomic across processes.
        """
        with self._timed("append"):
            return self._writes.append(name, value)

    def compare_set(self, name: Name, expected: Value, desired: Value) -> bytes:
        """torch Store's compare-and-set: if the key's value equals ``expected`` — or the key
        is absent and ``expected`` is empty — store ``desired`` and return it; otherwise
        return the current value (``expected`` itself when the key is absent), unchanged.

        One etcd Txn (two in the rare case of an existing empty value). Atomic across
        processes; never answered from the cache. Thread-safe.
        """
        with self._timed("compare_set"):
            return self._writes.compare_set(name, expected, desired)

    # -- key listing (cachedstore.queues: it knows which keys are queue items) ----------
    def list_keys(self) -> list[str]:
        """Every name under the prefix, queue items left out, in etcd's key order
        (linearizable). Thread-safe."""
        return self.queues.list_keys()

    def num_keys(self) -> int:
        """How many keys exist under the prefix, queue items not counted, consistent with
        :meth:`list_keys` (one Txn of count-only ranges). Thread-safe."""
        with self._timed("num_keys"):
            return self.queues.num_keys()

    # -- lifecycle -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            if self._fork_pid is not None:
                raise StoreForkedError(
                    f"this EtcdStore was created in process {self._fork_pid} and cannot be "
                    f"used in the forked child {os.getpid()} (it has no watch there, and "
                    f"gRPC does not survive a fork): create a new store in the child")
            raise StoreClosedError("the store is closed")

    def _forked(self) -> None:
        """In a forked child (single-threaded at this point): never serve what was
        inherited, never touch the parent's threads or channels."""
        if self._closed:
            return
        self._fork_pid = os.getppid()
        self._closed = True
        cache = self._cache
        cache._lock = threading.Lock()  # noqa: SLF001 -- a parent thread may have held it
        cache.floor = NOT_SERVING
        cache.closed = True
        if self._aio is not None:
            self._aio.abandon()

    def close(self) -> None:
        """Stop the watch thread, release every waiter (they raise StoreClosedError), fail
        the RPCs in flight and close the gRPC channels, then shut the executor. Idempotent;
        returns promptly even if etcd is unresponsive (in-flight calls are cut by closing
        the channels, then the watch thread is joined)."""
        forked = getattr(self, "_fork_pid", None) is not None
        self._closed = True
        _live.discard(self)
        if forked:
            return  # the parent's threads and channels are not ours to touch
        aio = getattr(self, "_aio", None)
        if aio is not None:
            aio.refuse()  # before the connection is cut: what that fails is "closed"
        cache = getattr(self, "_cache", None)
        if cache is not None:
            cache.close()
        opener = getattr(self, "_opener", None)
        if opener is not None:
            opener.close()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.stop(timeout=0)  # flag the stop first, so the cut below is no failure
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()  # RPCs in flight (a resync's reads included) fail fast now
        if watcher is not None:
            watcher.stop()
        if aio is not None:
            aio.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten store must not leave its thread running
        # Closed on a thread of its own, not in place: a store dropped without close() is
        # freed by the garbage collector (it is in reference cycles), on whatever thread
        # the collection starts, maybe its own watch thread holding its cache's lock,
        # which close() takes (and close() joins that thread).
        try:
            if not self._closed:
                threading.Thread(target=self.close,
                                 name=f"cachedstore-close-{getattr(self, '_id', '?')}",
                                 daemon=True).start()
        except Exception:  # (at interpreter shutdown no thread starts: its threads end)
            pass


class _Timer:
    """``with`` block observing its duration into a bound histogram child. A coroutine
    closed unfinished (GeneratorExit) is not observed: the garbage collector closes an
    abandoned one (an aget whose event loop is gone: its task and futures form a cycle) on
    whatever thread it runs, which may hold the histogram's lock (a scrape's snapshot
    allocates under it)."""

    __slots__ = ("_observe", "_started")

    def __init__(self, histogram: Any) -> None:
        self._observe = histogram.observe
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not GeneratorExit:
            self._observe(time.perf_counter() - self._started)
