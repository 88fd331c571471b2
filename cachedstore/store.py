"""The front end: :class:`EtcdStore`."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

from etcd3 import etcdrpc
from prometheus_client import CollectorRegistry

from . import etcdapi
from .cache import AsyncWaiter, CoherentCache, Entry, ThreadWaiter
from .config import StoreConfig, seconds
from .connection import UNSENT_ONLY, Connection, Credentials, parse_endpoint
from .errors import (
    CachedStoreError,
    EtcdConnectionError,
    EtcdError,
    InvalidInputError,
    InvalidTypeError,
    KeyNotFoundError,
    LeaseNotFoundError,
    NotAnIntegerError,
    StoreClosedError,
    StoreTimeoutError,
)
from .keys import REQUEST_OVERHEAD, KeySpace, to_value
from .metrics import make_metrics
from .watcher import Watcher, snapshot

__all__ = ["MISSING", "EtcdStore", "Versioned"]

T = TypeVar("T")
Name = str | bytes
Value = str | bytes
Timeout = float | timedelta | None


class Versioned(NamedTuple):
    """A key's value with etcd's metadata, as :meth:`EtcdStore.read` returns it."""

    value: bytes
    #: The revision of the key's last modification: the token of :meth:`EtcdStore.put_if`.
    mod_revision: int
    #: How many times the key was put since it was created (1 after the first put).
    version: int
    #: The lease the key is attached to, 0 for none.
    lease: int


class _Missing:
    """The type of :data:`MISSING`, the "no default given" marker."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
_store_ids = itertools.count(1)


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
        request_timeout, connect_timeout, stall_timeout, progress_interval, max_staleness,
        max_txn_ops, max_request_bytes, preload_limit: see :class:`~cachedstore.StoreConfig`.
        config: a complete :class:`~cachedstore.StoreConfig`; keywords override it.
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
        max_staleness: float | None = None,
        max_txn_ops: int | None = None,
        max_request_bytes: int | None = None,
        preload_limit: int | None = None,
        config: StoreConfig | None = None,
    ) -> None:
        self._closed = True  # until fully constructed: close() must work on a partial store
        self._watcher: Watcher | None = None
        self._executor: ThreadPoolExecutor | None = None
        cfg = (config or StoreConfig()).with_overrides(
            cache_size=cache_size, timeout=timeout, request_timeout=request_timeout,
            connect_timeout=connect_timeout, stall_timeout=stall_timeout,
            progress_interval=progress_interval, max_staleness=max_staleness,
            max_txn_ops=max_txn_ops, max_request_bytes=max_request_bytes,
            preload_limit=preload_limit)
        self._config = cfg
        self._keys = KeySpace(prefix, cfg.max_request_bytes)
        self.metrics = make_metrics(registry, metrics)
        self._cache = CoherentCache(cfg.cache_size, self.metrics)
        targets = [parse_endpoint(e) for e in endpoints] if endpoints else [(host, int(port))]
        self._conn = Connection(targets, Credentials(ca_cert, cert_key, cert_cert, user,
                                                     password), cfg, self.metrics)
        self._id = next(_store_ids)
        # The hot path, bound once: a hit is one lookup and one counter increment.
        self._lookup = self._cache.lookup
        self._hit_get = self.metrics.hit["get"].inc
        self._hit_aget = self.metrics.hit["aget"].inc
        # Latency of get/aget is observed for one call in `latency_sample_every` (hit or
        # miss alike, so the histogram is an unbiased sample); counts stay exact.
        self._sample_every = cfg.latency_sample_every
        self._tick_get = self._tick_aget = 1
        self._observe_get = self.metrics.duration["get"].observe
        self._observe_aget = self.metrics.duration["aget"].observe
        self._closed = False
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        cfg = self._config
        deadline = self._conn.deadline(cfg.connect_timeout)
        self._conn.authenticate(deadline)
        revision, entries = snapshot(self._conn, self._keys, self._preload_limit(), deadline)
        self._cache.reset(revision, entries)
        self._watcher = Watcher(self._conn, self._keys, self._cache, cfg, self.metrics,
                                name=f"cachedstore-watch-{self._id}")
        self._watcher.start(revision)
        if not self._watcher.ready.wait(max(0.0, deadline - time.monotonic())):
            cause = self._watcher.last_error
            if isinstance(cause, CachedStoreError):
                raise cause
            raise EtcdConnectionError(
                f"the watch on {self._conn.targets} could not be created within "
                f"connect_timeout={cfg.connect_timeout:g} s: {cause}") from None

    def _preload_limit(self) -> int:
        return min(self._config.preload_limit, self._config.cache_size)

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
        return self._watcher is not None and self._watcher.up

    @property
    def watch_revision(self) -> int:
        """The newest etcd revision whose events this store has applied."""
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
            "waiters": self._cache.n_waiters,
            "closed": self._closed,
        }

    # -- reads -------------------------------------------------------------------------
    def get(self, name: Name, default: Any = MISSING, timeout: Timeout = None) -> Any:
        """The value of ``name`` as bytes.

        Served from the cache when it holds the key and the watch is healthy; otherwise
        read from etcd (one range request) and cached. If the key is absent: with
        ``timeout``, block until it is created (woken by the store's watch, no polling) and
        return it, or when ``timeout`` passes return ``default`` if given, else raise
        :class:`~cachedstore.StoreTimeoutError`; without ``timeout``, return ``default``
        unchanged if given, else raise :class:`~cachedstore.KeyNotFoundError` (a KeyError).

        Thread-safe. Non-blocking unless ``timeout`` is given (apart from etcd round trips,
        each bounded by ``request_timeout``).
        """
        tick = self._tick_get - 1
        if tick > 0:  # not sampled for latency: the hot path
            self._tick_get = tick
            entry = self._lookup(name)
            if entry is not None:
                value = entry[0]
                if value is not None:
                    self._hit_get()
                    return value
            return self._get_slow("get", name, default, timeout)
        self._tick_get = self._sample_every
        started = time.perf_counter()
        try:
            entry = self._lookup(name)
            if entry is not None and entry[0] is not None:
                self._hit_get()
                return entry[0]
            return self._get_slow("get", name, default, timeout)
        finally:
            self._observe_get(time.perf_counter() - started)

    def _get_slow(self, op: str, name: Name, default: Any, timeout: Timeout) -> Any:
        """get past the hot path: bytes names, misses, absent keys, blocking."""
        canonical, wait, entry = self._begin_get(op, name, timeout)
        value = entry[0] if entry is not None else self._fetch([canonical]).get(canonical)
        if value is None and wait is not None:
            try:
                value = self._wait_for(canonical, time.monotonic() + wait, timeout)
            except StoreTimeoutError:
                if default is MISSING:
                    raise
        return value if value is not None else self._absent(name, default)

    def _begin_get(self, op: str, name: Name, timeout: Timeout
                   ) -> tuple[str, float | None, Entry | None]:
        """Validate a get's arguments and look it up: (canonical name, wait in seconds or
        None, the entry to serve or None to read etcd). Counts the hit or miss."""
        canonical = self._keys.canonical(name)
        wait = seconds(timeout)
        self._check_open()
        entry = self._cached(canonical, blocking=wait is not None)
        (self.metrics.hit if entry is not None else self.metrics.miss)[op].inc()
        return canonical, wait, entry

    @staticmethod
    def _absent(name: Name, default: Any) -> Any:
        if default is MISSING:
            raise KeyNotFoundError(name)
        return default

    def _cached(self, canonical: str, blocking: bool = False) -> Entry | None:
        """The entry to serve for a canonical name: served normally, or stale within
        ``max_staleness`` while the watch is down (counted). None: read etcd.

        ``blocking``: the caller will wait for the key if it is absent. Then a complete
        cache's "not here, so absent" is answer enough (the watch will deliver the key);
        a non-blocking read of a key the cache never held still asks etcd, so that a key
        written just before (in real time) is found even if the watch is a moment behind."""
        cache = self._cache
        entry = cache.lookup_or_absent(canonical) if blocking else cache.lookup(canonical)
        if entry is not None:
            return entry
        max_staleness = self._config.max_staleness
        watcher = self._watcher
        if max_staleness is None or watcher is None or watcher.up:
            return None
        if time.monotonic() - watcher.last_contact > max_staleness:
            return None
        entry = self._cache.peek(canonical)
        if entry is not None:
            self.metrics.stale_reads.inc()
        return entry

    def mget(self, names: Iterable[Name], default: Any = MISSING,
             timeout: Timeout = None) -> list[Any]:
        """The values of ``names``, in order, with :meth:`get`'s rules for each key.

        Hits come from the cache; all misses are read together, in Txns of up to
        ``max_txn_ops`` range requests (1,000 misses: 8 round trips). With ``timeout``,
        blocks until every absent key is created or the (shared) timeout passes. Raises
        KeyNotFoundError for the first absent key when neither default nor timeout is
        given. Thread-safe.
        """
        return self._mget("mget", names, default, timeout)

    def _mget(self, op: str, names: Iterable[Name], default: Any, timeout: Timeout
              ) -> list[Any]:
        started = time.perf_counter()
        names = list(names)
        lookup = self._lookup
        results: list[Any] = [None] * len(names)
        pending: list[int] = []
        for i, name in enumerate(names):
            entry = lookup(name)
            if entry is not None and entry[0] is not None:
                results[i] = entry[0]
            else:
                pending.append(i)
        if not pending:
            self.metrics.hit[op].inc(len(names))
            self.metrics.duration[op].observe(time.perf_counter() - started)
            return results
        try:
            wait = seconds(timeout)
            self._check_open()
            canonical = {i: self._keys.canonical(names[i]) for i in pending}
            values, hits = self._resolve(set(canonical.values()), blocking=wait is not None)
            self.metrics.hit[op].inc(len(names) - len(pending) + hits)
            self.metrics.miss[op].inc(len(pending) - hits)
            deadline = None if wait is None else time.monotonic() + wait
            for i in pending:
                name = canonical[i]
                value = values.get(name)
                if value is None and deadline is not None:
                    try:
                        value = values[name] = self._wait_for(name, deadline, timeout)
                    except StoreTimeoutError:
                        if default is MISSING:
                            raise
                if value is None:
                    if default is MISSING:
                        raise KeyNotFoundError(names[i])
                    value = default
                results[i] = value
            return results
        finally:
            self.metrics.duration[op].observe(time.perf_counter() - started)

    def _resolve(self, names: set[str], blocking: bool = False
                 ) -> tuple[dict[str, bytes | None], int]:
        """Values of canonical ``names``: served entries first, the rest read from etcd in
        batches. Returns (name → value or None, number served from the cache)."""
        values: dict[str, bytes | None] = {}
        misses = []
        for name in names:
            entry = self._cached(name, blocking)
            if entry is None:
                misses.append(name)
            else:
                values[name] = entry[0]
        if misses:
            values.update(self._fetch(misses))
        return values, len(names) - len(misses)

    def _fetch(self, names: Sequence[str]) -> dict[str, bytes | None]:
        """Read ``names`` from etcd (linearizable) in as few round trips as etcd allows and
        fill the cache through the revision gate. Returns name → value or None (absent)."""
        out: dict[str, bytes | None] = {}
        batch = self._config.max_txn_ops
        for start in range(0, len(names), batch):
            chunk = names[start:start + batch]
            token = self._cache.begin_fill(chunk)
            results: dict[str, tuple[bytes | None, int]] | None = None
            revision = 0
            try:
                results, revision = self._read(chunk)
            finally:
                dropped = self._cache.end_fill(chunk, token, results, revision)
            for name in chunk:
                value = results.get(name, (None, 0))[0] if results else None
                if dropped:
                    # The gate refused this read because the watch applied a newer write
                    # meanwhile: answer with that newer state rather than the older read.
                    newer = self._cache.peek(name)
                    if newer is not None and newer[1] > revision:
                        value = newer[0]
                out[name] = value
        return out

    def _read(self, names: Sequence[str]) -> tuple[dict[str, tuple[bytes | None, int]], int]:
        key = self._keys.key
        deadline = self._conn.deadline()
        if len(names) == 1:
            response = self._conn.call("range", etcdrpc.RangeRequest(key=key(names[0])),
                                       deadline=deadline)
            kvs = [response.kvs]
        else:
            ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key(n)))
                   for n in names]
            response = self._conn.call("txn", etcdrpc.TxnRequest(success=ops),
                                       deadline=deadline)
            kvs = [r.response_range.kvs for r in response.responses]
        results = {}
        for name, found in zip(names, kvs, strict=True):
            if found:
                results[name] = (found[0].value, found[0].mod_revision)
        return results, response.header.revision

    def _wait_for(self, name: str, deadline: float, timeout: Timeout) -> bytes:
        """Block until ``name`` exists (woken by the watch) and return its value."""
        waiter = ThreadWaiter()
        self._cache.add_waiter(name, waiter)
        try:
            while True:
                self._check_open()
                entry = self._cache.lookup_or_absent(name)
                value = self._fetch([name]).get(name) if entry is None else entry[0]
                if value is not None:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(
                        f"timed out after {_describe(timeout)} waiting for key {name!r}")
                waiter.event.wait(remaining)
                if waiter.value is not None:
                    return waiter.value
                waiter.event.clear()  # nudged (resync or close): check again
        finally:
            self._cache.remove_waiter(name, waiter)

    def wait(self, names: Iterable[Name], timeout: Timeout = None) -> None:
        """Block until every key in ``names`` exists.

        ``timeout`` defaults to the store's ``timeout`` (300 s). Raises
        :class:`~cachedstore.StoreTimeoutError` (a TimeoutError) when it passes. Waiters
        share the store's one watch: no extra etcd stream, no polling. Thread-safe.
        """
        wait = seconds(timeout)
        self._mget("wait", names, MISSING, self._config.timeout if wait is None else wait)

    def check(self, names: Iterable[Name]) -> bool:
        """True if every key in ``names`` exists right now (never blocks on absent keys)."""
        started = time.perf_counter()
        try:
            self._check_open()
            canonical = {self._keys.canonical(n) for n in names}
            values, hits = self._resolve(canonical)
            self.metrics.hit["check"].inc(hits)
            self.metrics.miss["check"].inc(len(canonical) - hits)
            return all(v is not None for v in values.values())
        finally:
            self.metrics.duration["check"].observe(time.perf_counter() - started)

    # -- asyncio ---------------------------------------------------------------------------
    async def aget(self, name: Name, default: Any = MISSING, timeout: Timeout = None) -> Any:
        """asyncio :meth:`get`. A hit returns without leaving the event loop's thread; an
        etcd read runs on the store's small executor; a blocking wait holds no thread."""
        # The hit path below mirrors get()'s line for line on purpose: sharing it through a
        # helper would add a Python call (~70 ns, a tenth of a hit) to every cached read.
        tick = self._tick_aget - 1
        if tick > 0:
            self._tick_aget = tick
            entry = self._lookup(name)
            if entry is not None:
                value = entry[0]
                if value is not None:
                    self._hit_aget()
                    return value
            return await self._aget_slow("aget", name, default, timeout)
        self._tick_aget = self._sample_every
        started = time.perf_counter()
        try:
            entry = self._lookup(name)
            if entry is not None and entry[0] is not None:
                self._hit_aget()
                return entry[0]
            return await self._aget_slow("aget", name, default, timeout)
        finally:
            self._observe_aget(time.perf_counter() - started)

    async def _aget_slow(self, op: str, name: Name, default: Any, timeout: Timeout) -> Any:
        canonical, wait, entry = self._begin_get(op, name, timeout)
        if entry is not None:
            value = entry[0]
        else:
            value = (await self._in_executor(self._fetch, [canonical])).get(canonical)
        if value is None and wait is not None:
            try:
                value = await self._await_for(canonical, time.monotonic() + wait, timeout)
            except StoreTimeoutError:
                if default is MISSING:
                    raise
        return value if value is not None else self._absent(name, default)

    async def amget(self, names: Iterable[Name], default: Any = MISSING,
                    timeout: Timeout = None) -> list[Any]:
        """asyncio :meth:`mget`: all hits → no thread hop; misses read on the executor."""
        names = list(names)
        lookup = self._lookup
        results: list[Any] = []
        for name in names:
            entry = lookup(name)
            if entry is None or entry[0] is None:
                break
            results.append(entry[0])
        else:
            self.metrics.hit["amget"].inc(len(names))
            return results
        started = time.perf_counter()
        try:
            values = await self._in_executor(self._mget, "amget", names, None, None)
        except KeyNotFoundError:
            values = None
        if values is not None and all(v is not None for v in values):
            return values
        # Some keys are absent: resolve each with aget's rules (waits hold no thread).
        try:
            return [await self._aget_slow("amget", n, default, timeout) if values is None
                    or values[i] is None else values[i] for i, n in enumerate(names)]
        finally:
            self.metrics.duration["amget"].observe(time.perf_counter() - started)

    async def _await_for(self, name: str, deadline: float, timeout: Timeout) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            waiter = AsyncWaiter(loop)
            self._cache.add_waiter(name, waiter)
            try:
                self._check_open()
                entry = self._cache.lookup_or_absent(name)
                if entry is None:
                    value = (await self._in_executor(self._fetch, [name])).get(name)
                else:
                    value = entry[0]
                if value is not None:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(
                        f"timed out after {_describe(timeout)} waiting for key {name!r}")
                try:
                    value = await asyncio.wait_for(waiter.future, remaining)
                except asyncio.TimeoutError:
                    raise StoreTimeoutError(
                        f"timed out after {_describe(timeout)} waiting for key {name!r}"
                    ) from None
                if value is not None:
                    return value
            finally:
                self._cache.remove_waiter(name, waiter)

    async def _in_executor(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            self._check_open()
            self._executor = ThreadPoolExecutor(
                max_workers=4, thread_name_prefix=f"cachedstore-aio-{self._id}")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- writes --------------------------------------------------------------------------------
    def _target(self, name: Name) -> tuple[str, bytes]:
        canonical = self._keys.canonical(name)
        return canonical, self._keys.key(canonical)

    def set(self, name: Name, value: Value) -> None:
        """Write ``value`` under ``name`` (one etcd put). Blocks for the round trip; the
        store's reads see the write as soon as this returns. Raises EtcdConnectionError —
        saying the outcome is unknown — if etcd was lost after the put may have reached it
        (it is retried, on the next endpoint, only while it provably was not sent).
        Thread-safe."""
        started = time.perf_counter()
        try:
            canonical, key = self._target(name)
            data = to_value(value)
            self._keys.check_size(key, data)
            self._check_open()
            # Not retried once it may have reached etcd: a second put of the same value
            # after someone else's write would make readers see it twice (X, Y, X).
            response = self._conn.call("put", etcdrpc.PutRequest(key=key, value=data),
                                       deadline=self._conn.deadline(), retry=UNSENT_ONLY)
            self._cache.apply_write(canonical, data, response.header.revision)
        finally:
            self.metrics.duration["set"].observe(time.perf_counter() - started)

    def mset(self, items: Mapping[Name, Value] | Iterable[tuple[Name, Value]]) -> None:
        """Write several keys: one etcd Txn per ``max_txn_ops`` keys (fewer when the values
        are large, to stay within etcd's request limit), each Txn atomic. A name given twice
        keeps its last value. Every name and value is checked before anything is sent
        (InvalidTypeError, InvalidInputError). Like :meth:`set`, a Txn is not re-sent once
        it may have reached etcd: EtcdConnectionError then says the outcome is unknown (the
        Txns before it were applied). Blocks for the round trips. Thread-safe."""
        started = time.perf_counter()
        try:
            pairs = items.items() if isinstance(items, Mapping) else items
            writes: dict[str, tuple[bytes, bytes]] = {}
            for name, value in pairs:
                canonical, key = self._target(name)
                data = to_value(value)
                self._keys.check_size(key, data)
                writes.pop(canonical, None)  # etcd refuses a key twice in one Txn
                writes[canonical] = (key, data)
            self._check_open()
            budget = self._config.max_request_bytes - REQUEST_OVERHEAD
            batch: list[str] = []
            size = 0
            for canonical, (key, data) in writes.items():
                if batch and (len(batch) == self._config.max_txn_ops
                              or size + len(key) + len(data) > budget):
                    self._put_batch(batch, writes)
                    batch, size = [], 0
                batch.append(canonical)
                size += len(key) + len(data)
            if batch:
                self._put_batch(batch, writes)
        finally:
            self.metrics.duration["mset"].observe(time.perf_counter() - started)

    def _put_batch(self, names: list[str], writes: dict[str, tuple[bytes, bytes]]) -> None:
        ops = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=writes[n][0],
                                                                value=writes[n][1]))
               for n in names]
        response = self._conn.call("txn", etcdrpc.TxnRequest(success=ops),
                                   deadline=self._conn.deadline(), retry=UNSENT_ONLY)
        for name in names:
            self._cache.apply_write(name, writes[name][1], response.header.revision)

    def delete(self, name: Name) -> bool:
        """Delete ``name``; True if it existed. Blocks for the round trip. Thread-safe."""
        started = time.perf_counter()
        try:
            canonical, key = self._target(name)
            self._check_open()
            response = self._conn.call("delete_range", etcdrpc.DeleteRangeRequest(key=key),
                                       deadline=self._conn.deadline(), retry=UNSENT_ONLY)
            self._cache.apply_write(canonical, None, response.header.revision)
            return response.deleted > 0
        finally:
            self.metrics.duration["delete"].observe(time.perf_counter() - started)

    def add(self, name: Name, amount: int = 1) -> int:
        """Atomically add ``amount`` to the integer stored (as decimal ASCII, like torch's
        Store) under ``name`` — 0 if absent — and return the new value.

        A compare-and-swap Txn on the key's ``mod_revision``: one round trip when the cache
        holds the current value, two under contention (the failed compare returns the
        current value in the same response). Never trusts a stale cache entry. Raises
        NotAnIntegerError if the stored value is not an integer, and EtcdConnectionError —
        saying the outcome is unknown — if etcd was lost after the request may have
        reached it. Thread-safe, and atomic across processes.
        """
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidTypeError(f"amount must be an int, not {type(amount).__name__}")

        def plus(current: bytes | None) -> bytes:
            base = 0 if current is None else _parse_int(current, name)
            return str(base + amount).encode()

        return int(self._read_modify_write("add", name, plus))

    def append(self, name: Name, value: Value) -> bytes:
        """Atomically append ``value`` to the bytes stored under ``name`` (creating the key
        if absent) and return the new value: torch Store's ``append``.

        A compare-and-swap Txn on the key's ``mod_revision``, like :meth:`add`: one round
        trip when the cache holds the current value, two under contention. Never trusts a
        stale cache entry. Raises InvalidInputError if the result would exceed etcd's
        request limit, and EtcdConnectionError (outcome unknown) if etcd was lost after the
        request may have reached it. Thread-safe, and atomic across processes.
        """
        data = to_value(value)
        return self._read_modify_write("append", name, lambda current: (current or b"") + data)

    def _read_modify_write(self, op: str, name: Name,
                           transform: Callable[[bytes | None], bytes]) -> bytes:
        """Store ``transform(current value or None)`` atomically: a CAS loop on the key's
        ``mod_revision`` (or its absence), starting from the cached value as a guess."""
        started = time.perf_counter()
        try:
            canonical, key = self._target(name)
            self._check_open()
            guess = self._cache.peek(canonical)
            current, mod_revision = (guess[0], guess[2]) if guess else (None, 0)
            deadline = self._conn.deadline()
            while True:
                new = transform(current)
                self._keys.check_size(key, new)
                compare = _absent(key) if current is None else _unmodified(key, mod_revision)
                succeeded, found, _ = self._cas(canonical, key, compare, new, deadline)
                if succeeded:
                    return new
                current, mod_revision = (found.value, found.mod_revision) if found else (None, 0)
        finally:
            self.metrics.duration[op].observe(time.perf_counter() - started)

    def compare_set(self, name: Name, expected: Value, desired: Value) -> bytes:
        """torch Store's compare-and-set: if the key's value equals ``expected`` — or the key
        is absent and ``expected`` is empty — store ``desired`` and return it; otherwise
        return the current value (``expected`` itself when the key is absent), unchanged.

        One etcd Txn (two in the rare case of an existing empty value). Atomic across
        processes; never answered from the cache. Thread-safe.
        """
        started = time.perf_counter()
        try:
            canonical, key = self._target(name)
            want = to_value(expected, "expected")
            data = to_value(desired, "desired")
            self._keys.check_size(key, data)
            self._check_open()
            deadline = self._conn.deadline()
            compare = etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                                      target=etcdrpc.Compare.VALUE, value=want
                                      ) if want else _absent(key)
            while True:
                succeeded, found, _ = self._cas(canonical, key, compare, data, deadline)
                if succeeded:
                    return data
                if found is None:
                    return want
                if found.value != want:
                    return bytes(found.value)
                # Present with an empty value and expected == "": swap on its mod_revision.
                compare = _unmodified(key, found.mod_revision)
        finally:
            self.metrics.duration["compare_set"].observe(time.perf_counter() - started)

    def _cas(self, canonical: str, key: bytes, compare: Any, data: bytes, deadline: float,
             lease: int = 0, prev_kv: bool = False) -> tuple[bool, Any, int]:
        """One Txn: if ``compare`` holds put ``data``, else read the key. Returns (succeeded,
        the key's kv on failure or None if absent). Either way the cache learns the outcome:
        the put as a local write, the read as a fill through the revision gate (a caller
        may return what it read, so a later get must not return anything older). The third
        item is the revision of the response; with ``prev_kv`` a success returns the kv it
        replaced (None if it created the key) as the second."""
        request = etcdapi.txn(
            [compare], [etcdapi.op_put(etcdapi.put(key, data, lease=lease, prev_kv=prev_kv))],
            [etcdapi.op_range(etcdapi.range_key(key))])
        token = self._cache.begin_fill([canonical])
        seen: dict[str, tuple[bytes | None, int]] | None = None
        revision = 0
        try:
            response = self._conn.call("txn", request, deadline=deadline, retry=UNSENT_ONLY)
            revision = response.header.revision
            if response.succeeded:
                put = response.responses[0].response_put
                found = put.prev_kv if prev_kv and put.HasField("prev_kv") else None
            else:
                kvs = response.responses[0].response_range.kvs
                found = kvs[0] if kvs else None
                seen = {canonical: (found.value, found.mod_revision)} if found else {}
        finally:
            self._cache.end_fill([canonical], token, seen, revision)
        if response.succeeded:
            self._cache.apply_write(canonical, data, revision)
        return response.succeeded, found, revision

    # -- versioned reads, conditional writes and leases (the rendezvous backend's API) ----
    def read(self, name: Name) -> Versioned | None:
        """The key's current value and metadata, read from etcd (linearizable, never from
        the cache), or None if absent. The result also fills the cache through the revision
        gate. One range request; blocks for it. Thread-safe."""
        canonical, key = self._target(name)
        self._check_open()
        token = self._cache.begin_fill([canonical])
        seen: dict[str, tuple[bytes | None, int]] | None = None
        revision = 0
        try:
            response = self._conn.call("range", etcdapi.range_key(key),
                                       deadline=self._conn.deadline())
            revision = response.header.revision
            kv = response.kvs[0] if response.kvs else None
            seen = {canonical: (kv.value, kv.mod_revision)} if kv else {}
        finally:
            self._cache.end_fill([canonical], token, seen, revision)
        if kv is None:
            return None
        return Versioned(bytes(kv.value), kv.mod_revision, kv.version, kv.lease)

    def put_if(self, name: Name, value: Value, *, mod_revision: int, lease: int = 0
               ) -> tuple[bool, Versioned | None]:
        """Compare-and-swap on the key's ``mod_revision``: write ``value`` (attached to
        ``lease`` if non-zero) only if the key was last modified at ``mod_revision``, or,
        with ``mod_revision=0``, only if it is absent.

        Returns ``(True, the new Versioned)`` on success, else ``(False, the current
        Versioned or None if absent)``. One Txn; not re-sent once it may have reached etcd
        (EtcdConnectionError then says the outcome is unknown). LeaseNotFoundError if the
        lease expired. Blocks for the round trip. Thread-safe, atomic across processes."""
        canonical, key = self._target(name)
        data = to_value(value)
        self._keys.check_size(key, data)
        if isinstance(mod_revision, bool) or not isinstance(mod_revision, int) \
                or mod_revision < 0:
            raise InvalidTypeError(f"mod_revision must be an int >= 0, got {mod_revision!r}")
        self._check_open()
        compare = etcdapi.unmodified(key, mod_revision) if mod_revision \
            else etcdapi.absent(key)
        succeeded, found, revision = self._cas(canonical, key, compare, data,
                                               self._conn.deadline(), lease=lease, prev_kv=True)
        if succeeded:
            return True, Versioned(data, revision, found.version + 1 if found else 1, lease)
        if found is None:
            return False, None
        return False, Versioned(bytes(found.value), found.mod_revision, found.version,
                                found.lease)

    def grant_lease(self, ttl: float) -> int:
        """A new etcd lease of ``ttl`` seconds (rounded up to whole seconds, at least 1);
        returns its id. Keys written with it vanish when it expires or is revoked. One
        request; blocks for it. Thread-safe."""
        ttl_s = seconds(ttl, "ttl")
        if ttl_s is None or not 0 < ttl_s < 2**62 or ttl_s != ttl_s:
            raise InvalidInputError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
        self._check_open()
        response = self._conn.call("lease_grant", etcdapi.lease_grant(math.ceil(ttl_s)),
                                   deadline=self._conn.deadline())
        if response.error:
            raise EtcdError(f"etcd lease grant: {response.error}")
        return int(response.ID)

    def revoke_lease(self, lease: int) -> None:
        """Revoke ``lease``: every key attached to it is deleted. A lease that no longer
        exists is not an error. One request; blocks for it. Thread-safe."""
        self._check_open()
        try:
            self._conn.call("lease_revoke", etcdapi.lease_revoke(lease),
                            deadline=self._conn.deadline())
        except LeaseNotFoundError:
            pass

    # -- queues and key listing (implemented in cachedstore.queues) ------------------------
    def queue_push(self, name: Name, value: Value) -> None:
        """Append ``value`` to the FIFO queue ``name`` (see :mod:`cachedstore.queues`)."""
        from . import queues

        queues.push(self, name, value)

    def queue_pop(self, name: Name, block: bool = True, timeout: Timeout = None) -> bytes:
        """Remove and return the oldest item of queue ``name`` (see :mod:`cachedstore.queues`)."""
        from . import queues

        return queues.pop(self, name, block, timeout)

    def queue_len(self, name: Name) -> int:
        """How many items queue ``name`` holds (see :mod:`cachedstore.queues`)."""
        from . import queues

        return queues.length(self, name)

    def list_keys(self) -> list[str]:
        """Every name under the prefix (see :mod:`cachedstore.queues`)."""
        from . import queues

        return queues.list_keys(self)

    def num_keys(self) -> int:
        """How many keys exist under the prefix (one count-only etcd range). Thread-safe."""
        started = time.perf_counter()
        try:
            self._check_open()
            request = etcdrpc.RangeRequest(key=self._keys.range_start,
                                           range_end=self._keys.range_end, count_only=True)
            return int(self._conn.call("range", request, deadline=self._conn.deadline()).count)
        finally:
            self.metrics.duration["num_keys"].observe(time.perf_counter() - started)

    # -- lifecycle -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def close(self) -> None:
        """Stop the watch thread, release every waiter (they raise StoreClosedError), shut
        the executor and close the gRPC channels. Idempotent; blocks for at most a few
        seconds while the watch thread ends."""
        self._closed = True
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.stop()
        cache = getattr(self, "_cache", None)
        if cache is not None:
            cache.close()
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()  # RPCs in flight on the executor fail fast now
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten store must not leave its thread running
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


def _absent(key: bytes) -> Any:
    """A Txn compare: the key does not exist."""
    return etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                           target=etcdrpc.Compare.CREATE, create_revision=0)


def _unmodified(key: bytes, mod_revision: int) -> Any:
    """A Txn compare: the key was last modified at ``mod_revision``."""
    return etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                           target=etcdrpc.Compare.MOD, mod_revision=mod_revision)


def _parse_int(value: bytes, name: object) -> int:
    try:
        return int(value)
    except ValueError:
        raise NotAnIntegerError(
            f"add() on key {name!r}: its value {value[:40]!r} is not a decimal integer"
        ) from None


def _describe(timeout: Timeout) -> str:
    if isinstance(timeout, timedelta):
        return f"{timeout.total_seconds():g} s"
    return f"{timeout:g} s" if isinstance(timeout, (int, float)) else str(timeout)
