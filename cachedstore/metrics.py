"""Prometheus metrics of a store, sized for fleets of thousands of processes.

Every metric family is declared once per :class:`~prometheus_client.CollectorRegistry`
(stores that share a registry share the families, and their counts add up).

Series budget. A process that merely opened a store exports about 50 series and one that
has used every operation about 140 (``tests/test_metrics_series.py`` counts them):

* **Label children are created lazily**, the first time an operation, RPC method or restart
  reason is used, and then kept: ``metrics.hit["get"]`` is a plain dict lookup after the
  first one.
* **Cache hits are counted without a lock.** A hit is the hot path (a few hundred ns), and
  prometheus-client's ``Counter.inc()`` takes its value's lock (about as long as the rest of
  the hit). ``metrics.hit[op]`` is a :class:`HitCounter`: the store binds its ``tick``, an
  :func:`itertools.count`, once at construction and counts a hit with ``next(tick)`` (one C
  call, atomic under the GIL: exact counts, no lock). The collector of the registry's
  families adds the hits counted since the last collection to the exported child
  (``cachedstore_cache_requests_total{result="hit"}``) before every collection (a scrape,
  ``get_sample_value``), so what a scrape reads is exact as of the scrape. In
  prometheus-client's multiprocess mode, where samples are written to files as they happen
  and the worker that counts is not the process that scrapes, ``next(tick)`` increments the
  child directly (the lock is paid there).
* **Coarse buckets by default** (:data:`COARSE_BUCKETS`, five decades from 10 µs to 100 ms
  plus ``+Inf``); the fine layout (:data:`FULL_BUCKETS`, 22 bounds from 1 µs to 10 s) is a
  setting: ``make_metrics(registry, buckets="full")``. The layout is fixed per registry by
  the first store that uses it; asking for another one on the same registry is an error.
* **No ``_created`` series.** prometheus-client's own switch for that
  (``disable_created_metrics()`` / ``PROMETHEUS_DISABLE_CREATED_SERIES``) is process-wide and
  would also change the user's metrics in the same registry, so it is left alone: instead the
  families are registered through one collector (:class:`_StoreCollector`) that drops the
  ``_created`` samples of cachedstore's families only. Other metrics in a shared registry
  (including the global ``REGISTRY``) keep theirs.
* etcd RPCs are counted by method and code, their durations in one histogram without labels.

Gauges that several stores (or, in prometheus-client's multiprocess mode, several processes)
contribute to are kept with ``inc``/``dec`` and aggregated with a ``multiprocess_mode`` that
adds them up (``livesum``); ``cachedstore_watch_up`` then counts healthy watches and
``cachedstore_watch_revision`` shows the newest revision (``livemax``).

Label values are bounded: the operation and method names below, gRPC code names and the
restart reasons. An unknown operation name is a ``KeyError``, never a new series. Key names
and values never appear in labels. Everything here is thread-safe (prometheus-client is).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .errors import InvalidInputError

__all__ = [
    "COARSE_BUCKETS",
    "FULL_BUCKETS",
    "METRIC_NAMES",
    "HitCounter",
    "NullMetrics",
    "StoreMetrics",
    "make_metrics",
    "resolve_buckets",
]

#: The default latency buckets, in seconds: one per decade from 10 µs (a cache hit is
#: below) to 100 ms (a blocking wait is usually above).
COARSE_BUCKETS: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 0.01, 0.1)
#: The fine layout (``buckets="full"``), from 1 µs (a cache hit) to 10 s (a long wait).
FULL_BUCKETS: tuple[float, ...] = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: The named layouts ``buckets=`` accepts.
BUCKET_LAYOUTS: dict[str, tuple[float, ...]] = {"coarse": COARSE_BUCKETS, "full": FULL_BUCKETS}

#: Read operations, whose requests are counted as cache hits or misses.
READ_OPS = ("get", "mget", "aget", "amget", "check", "wait")
#: Every operation whose duration is observed.
ALL_OPS = READ_OPS + ("set", "mset", "add", "compare_set", "append", "delete", "num_keys")
#: Why the watch stream had to be restarted.
RESTART_REASONS = (
    "disconnect", "compacted", "canceled", "stalled", "auth", "ended", "error", "rescoped",
)

#: The names of every metric family cachedstore exports (without the _bucket/_sum suffixes).
METRIC_NAMES = (
    "cachedstore_cache_requests_total",
    "cachedstore_request_duration_seconds",
    "cachedstore_etcd_requests_total",
    "cachedstore_etcd_request_duration_seconds",
    "cachedstore_cache_entries",
    "cachedstore_cache_evictions_total",
    "cachedstore_watch_events_total",
    "cachedstore_watch_restarts_total",
    "cachedstore_watch_up",
    "cachedstore_watch_revision",
    "cachedstore_watch_scopes",
    "cachedstore_watch_quiet_refreshes_total",
    "cachedstore_watch_liveness_requests_total",
    "cachedstore_waiters",
    "cachedstore_fills_dropped_total",
    "cachedstore_stale_reads_total",
)


def resolve_buckets(buckets: str | Sequence[float]) -> tuple[float, ...]:
    """A bucket layout: ``"coarse"``, ``"full"`` or increasing positive finite bounds.

    Raises:
        InvalidInputError: an unknown name, or bounds that are empty, not increasing,
            not positive or not finite (``+Inf`` is always added by prometheus-client).
    """
    if isinstance(buckets, str):
        try:
            return BUCKET_LAYOUTS[buckets]
        except KeyError:
            raise InvalidInputError(
                f"buckets must be one of {', '.join(BUCKET_LAYOUTS)} or a sequence of "
                f"bounds in seconds, got {buckets!r}") from None
    try:
        bounds = tuple(float(b) for b in buckets)
    except (TypeError, ValueError):
        raise InvalidInputError(f"buckets must be numbers of seconds, got {buckets!r}") from None
    if not bounds or any(not 0 < b < float("inf") for b in bounds) or any(
            a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise InvalidInputError(
            f"buckets must be increasing, positive and finite, got {list(bounds)}")
    return bounds


class _StoreCollector(Collector):
    """cachedstore's families in one registry, exported without their ``_created`` samples.

    The families themselves are created unregistered (``registry=None``) and collected
    through this object, which is what the registry holds.
    """

    def __init__(self, families: Sequence[Counter | Gauge | Histogram],
                 before: Callable[[], None] = lambda: None) -> None:
        self._families = tuple(families)
        self._before = before

    def describe(self) -> Iterable[Metric]:
        for family in self._families:
            yield from family.describe()

    def collect(self) -> Iterable[Metric]:
        self._before()  # the hits counted since the last collection reach their children
        for family in self._families:
            for metric in family.collect():
                samples = [s for s in metric.samples if not s.name.endswith("_created")]
                if len(samples) != len(metric.samples):
                    copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    copy.samples = samples
                    metric = copy
                yield metric


class _Families:
    """The metric families of one registry (created once, registered as one collector)."""

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        kw: dict[str, Any] = {"registry": None}
        self.cache_requests = Counter(
            "cachedstore_cache_requests_total",
            "Keys requested from the cache, by operation and result (mget counts each key).",
            ["op", "result"], **kw)
        self.request_duration = Histogram(
            "cachedstore_request_duration_seconds",
            "Duration of store operations as the caller sees them.",
            ["op"], buckets=buckets, **kw)
        self.etcd_requests = Counter(
            "cachedstore_etcd_requests_total",
            "RPCs sent to etcd, by method and gRPC status code (ok on success).",
            ["method", "code"], **kw)
        self.etcd_duration = Histogram(
            "cachedstore_etcd_request_duration_seconds",
            "Duration of unary RPCs sent to etcd (all methods).",
            buckets=buckets, **kw)
        self.cache_entries = Gauge(
            "cachedstore_cache_entries",
            "Entries held in the cache (values and absent-key markers).",
            multiprocess_mode="livesum", **kw)
        self.cache_evictions = Counter(
            "cachedstore_cache_evictions_total",
            "Entries evicted to keep the cache within its size.", **kw)
        self.watch_events = Counter(
            "cachedstore_watch_events_total",
            "Events received on the watch stream, by type.",
            ["type"], **kw)
        self.watch_restarts = Counter(
            "cachedstore_watch_restarts_total",
            "Times the watch stream had to be restarted, by reason.",
            ["reason"], **kw)
        self.watch_up = Gauge(
            "cachedstore_watch_up",
            "1 while the watch is healthy and the cache may be served (summed over stores).",
            multiprocess_mode="livesum", **kw)
        self.watch_revision = Gauge(
            "cachedstore_watch_revision",
            "Newest etcd revision the watch has confirmed.",
            multiprocess_mode="livemax", **kw)
        self.watch_scopes = Gauge(
            "cachedstore_watch_scopes",
            "Watches on the store's stream: the scopes it touched (watch_scope=touched), "
            "else 1 (summed over stores).",
            multiprocess_mode="livesum", **kw)
        self.quiet_refreshes = Counter(
            "cachedstore_watch_quiet_refreshes_total",
            "Scopes read afresh after a reconnect because their range had no event to "
            "replay (etcd's revision moved elsewhere meanwhile).", **kw)
        self.watch_liveness = Counter(
            "cachedstore_watch_liveness_requests_total",
            "What quiet watch streams sent to learn that etcd is still there: HTTP/2 PINGs "
            "(answered by etcd's transport, no etcd request) or progress requests.",
            ["kind"], **kw)
        self.waiters = Gauge(
            "cachedstore_waiters",
            "Blocked gets and waits right now.",
            multiprocess_mode="livesum", **kw)
        self.fills_dropped = Counter(
            "cachedstore_fills_dropped_total",
            "Read-through results refused by the revision gate (a newer write was known).",
            **kw)
        self.stale_reads = Counter(
            "cachedstore_stale_reads_total",
            "Reads served from the cache while the watch was down (max_staleness mode).",
            **kw)
        #: op -> the hits of that operation on this registry (shared by its stores).
        self.hits: dict[str, HitCounter] = {}
        self._hits_lock = threading.Lock()
        registry.register(_StoreCollector([
            self.cache_requests, self.request_duration, self.etcd_requests,
            self.etcd_duration, self.cache_entries, self.cache_evictions, self.watch_events,
            self.watch_restarts, self.watch_up, self.watch_revision, self.watch_scopes,
            self.quiet_refreshes, self.watch_liveness, self.waiters,
            self.fills_dropped, self.stale_reads], before=self.flush_hits))

    def hit_counter(self, op: str) -> HitCounter:
        """The hit counter of ``op`` (created with its series on first use, then kept)."""
        with self._hits_lock:
            counter = self.hits.get(op)
            if counter is None:
                counter = self.hits[op] = HitCounter(self.cache_requests.labels(op, "hit"))
            return counter

    def flush_hits(self) -> None:
        """Add every hit counted since the last flush to its exported child."""
        with self._hits_lock:
            for counter in self.hits.values():
                counter.flush()


class _Calls:
    """An iterator whose ``next`` calls ``fn`` (a counter child's ``inc``)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn

    def __iter__(self) -> _Calls:
        return self

    def __next__(self) -> None:
        self._fn()


class HitCounter:
    """The cache hits of one operation on one registry: a counter child whose increments
    by one cost one C call and no lock.

    ``next(counter.tick)`` counts one hit; ``counter.inc(n)`` counts ``n`` (the child's
    lock is taken for ``n != 1``: those are the batched and the slower paths). ``tick`` is an
    :func:`itertools.count`: its ``next`` runs in C without releasing the GIL, so
    concurrent hits are never lost. :meth:`flush` (the families' collector calls it, under
    their lock, before every collection) reads the count with one more ``next`` of its own,
    which it remembers and subtracts, and adds what is new to the child. In
    prometheus-client's multiprocess mode ``tick`` increments the child directly.
    """

    __slots__ = ("_flushed", "_own_ticks", "child", "tick")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.tick: Iterator[Any]
        if values.ValueClass is values.MutexValue:  # in-process values: count, flush later
            self.tick = itertools.count()
        else:  # multiprocess mode: samples go to the shared files as they happen
            self.tick = _Calls(child.inc)
        self._own_ticks = 0  # the values of ``tick`` that flush itself consumed
        self._flushed = 0  # hits already added to the child

    def inc(self, amount: float = 1) -> None:
        if amount == 1:
            next(self.tick)
        else:
            self.child.inc(amount)

    def flush(self) -> None:
        """Add the hits counted since the last flush to the child (callers serialize)."""
        tick = self.tick
        if not isinstance(tick, itertools.count):
            return
        hits = next(tick) - self._own_ticks  # every next() before this one, ours excluded
        self._own_ticks += 1
        if hits > self._flushed:
            self.child.inc(hits - self._flushed)
            self._flushed = hits


_families_lock = threading.Lock()
_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = (
    weakref.WeakKeyDictionary()
)


def _families(registry: CollectorRegistry, buckets: tuple[float, ...] | None) -> _Families:
    """The families of ``registry``, created with ``buckets`` (coarse when None) if new.

    Raises InvalidInputError when they exist with another layout than ``buckets``.
    """
    with _families_lock:
        families = _families_by_registry.get(registry)
        if families is None:
            families = _families_by_registry[registry] = _Families(
                registry, COARSE_BUCKETS if buckets is None else buckets)
        elif buckets is not None and buckets != families.buckets:
            raise InvalidInputError(
                f"this registry already holds cachedstore's metrics with buckets "
                f"{list(families.buckets)}; a store on it cannot use {list(buckets)}")
        return families


class _LazyChildren(dict[str, Any]):
    """``{name: label child}``, each child created on first lookup and then kept.

    Only names in ``allowed`` exist (anything else is a KeyError, not a new series). After
    the first lookup of a name, looking it up is a plain dict lookup. Thread-safe: two
    threads missing the same name at once get the same child (``labels()`` is idempotent).
    """

    def __init__(self, allowed: Iterable[str], make: Callable[[str], Any]) -> None:
        super().__init__()
        self._allowed = frozenset(allowed)
        self._make = make

    def __missing__(self, name: str) -> Any:
        if name not in self._allowed:
            raise KeyError(name)
        child = self[name] = self._make(name)
        return child


class StoreMetrics:
    """The label children one store updates, created on first use and then bound.

    Thread-safe (prometheus-client is). ``hit``, ``miss`` and ``duration`` map an operation
    name of :data:`READ_OPS` / :data:`ALL_OPS` to its child (``hit``: a :class:`HitCounter`);
    on a hot path bind ``metrics.hit_tick(op)`` once and count a hit with ``next()`` of it.

    Raises:
        InvalidInputError: ``buckets`` is not a layout (see :func:`resolve_buckets`), or the
            registry already holds cachedstore's families with another layout.
    """

    def __init__(self, registry: CollectorRegistry,
                 buckets: str | Sequence[float] | None = None) -> None:
        self.registry = registry
        f = self._f = _families(registry, None if buckets is None else resolve_buckets(buckets))
        self.hit = _LazyChildren(READ_OPS, f.hit_counter)
        self.miss = _LazyChildren(READ_OPS, lambda op: f.cache_requests.labels(op, "miss"))
        self.duration = _LazyChildren(ALL_OPS, lambda op: f.request_duration.labels(op))
        self.restarts = _LazyChildren(RESTART_REASONS, lambda r: f.watch_restarts.labels(r))
        self.entries = f.cache_entries
        self.evictions = f.cache_evictions
        self.events_put = f.watch_events.labels("put")
        self.events_delete = f.watch_events.labels("delete")
        self.watch_up = f.watch_up
        self.watch_revision = f.watch_revision
        self.watch_scopes = f.watch_scopes
        self.quiet_refreshes = f.quiet_refreshes
        self.watch_pings = f.watch_liveness.labels("ping")
        self.progress_requests = f.watch_liveness.labels("progress")
        self.waiters = f.waiters
        self.fills_dropped = f.fills_dropped
        self.stale_reads = f.stale_reads
        self._rpc_counts: dict[tuple[str, str], Any] = {}
        self._rpc_duration = f.etcd_duration

    @property
    def buckets(self) -> tuple[float, ...]:
        """The latency bucket bounds of this registry's histograms (without ``+Inf``)."""
        return self._f.buckets

    def hit_tick(self, op: str) -> Iterator[Any]:
        """An iterator whose ``next()`` counts one hit of ``op`` (no lock; see
        :class:`HitCounter`)."""
        counter: HitCounter = self.hit[op]
        return counter.tick

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """Record one etcd RPC (not on the hot path: a dict lookup per RPC is fine)."""
        child = self._rpc_counts.get((method, code))
        if child is None:
            child = self._rpc_counts[(method, code)] = self._f.etcd_requests.labels(method, code)
        child.inc()
        self._rpc_duration.observe(seconds)

    def restart(self, reason: str) -> None:
        """Count one watch restart; an unknown ``reason`` is counted as ``error``."""
        self.restarts[reason if reason in RESTART_REASONS else "error"].inc()


class _Null:
    """Stands in for a counter, gauge or histogram child when metrics are off."""

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class NullMetrics:
    """The same surface as :class:`StoreMetrics`, doing nothing (``EtcdStore(metrics=False)``)."""

    registry = None
    buckets: tuple[float, ...] = ()

    def __init__(self) -> None:
        null = _Null()
        self.hit = dict.fromkeys(READ_OPS, null)
        self.miss = dict.fromkeys(READ_OPS, null)
        self.duration = dict.fromkeys(ALL_OPS, null)
        self.entries = self.evictions = self.events_put = self.events_delete = null
        self.watch_up = self.watch_revision = self.watch_scopes = self.waiters = null
        self.quiet_refreshes = self.watch_pings = self.progress_requests = null
        self.fills_dropped = self.stale_reads = null
        self.restarts = dict.fromkeys(RESTART_REASONS, null)

    def rpc(self, method: str, code: str, seconds: float) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass

    @staticmethod
    def hit_tick(op: str) -> Iterator[Any]:
        """An iterator whose ``next()`` does nothing (and allocates nothing)."""
        if op not in READ_OPS:
            raise KeyError(op)
        return itertools.repeat(None)


def make_metrics(registry: CollectorRegistry | None, enabled: bool = True, *,
                 buckets: str | Sequence[float] | None = None) -> StoreMetrics | NullMetrics:
    """The metrics of one store: on ``registry``, or on a new private registry when None.

    ``buckets``: ``"coarse"`` (the default, :data:`COARSE_BUCKETS`), ``"full"``
    (:data:`FULL_BUCKETS`) or explicit bounds in seconds. None means "whatever the registry
    already uses, coarse if it has none yet". Raises InvalidInputError as
    :class:`StoreMetrics` does.
    """
    if not enabled:
        if buckets is not None:
            resolve_buckets(buckets)  # bad input is reported even with metrics off
        return NullMetrics()
    return StoreMetrics(registry if registry is not None else CollectorRegistry(), buckets)
