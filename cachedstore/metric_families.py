"""cachedstore's metric families and their values: what a registry holds and exports.

:mod:`cachedstore.metrics` hands a store its children (one per family and label values);
this module makes them and exports them.

* **In one process** (prometheus-client's default values) the children are this module's
  own (:class:`LocalFamilies`): a counter or gauge is a float and a lock (:class:`Value`),
  a histogram its bucket counts and sum under one lock (:class:`HistogramValue`), and the
  registry holds one collector that reads them at each collection. Making a child costs one
  small object; prometheus-client's ``labels()`` builds a metric object, validates its
  labels and makes a locked value per bucket, which was about a third of a fresh store's
  first ``set`` or ``wait`` (``benchmarks/fanout/notes.md``, "a fifth cut"). An update is
  one Python call (prometheus-client's take two or three). The exposition is the one
  prometheus-client would write for the same updates, less the ``_created`` series
  (``tests/test_metric_families.py`` compares them).
* **In prometheus-client's multiprocess mode** (``PROMETHEUS_MULTIPROC_DIR`` set before it
  was imported) every update must reach the process's files, which the scraping process
  reads: the children are prometheus-client's own, made with ``labels()``
  (:class:`SharedFamilies`), and exported without ``_created`` (:class:`PrometheusCollector`).

Children are kept for the registry's life and shared by the stores on it, so counts only
grow. Everything here is thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .errors import InvalidInputError

__all__ = [
    "SPECS",
    "FamilySpec",
    "Families",
    "HistogramValue",
    "HitCounter",
    "LocalFamilies",
    "SharedFamilies",
    "Value",
    "families",
]


class FamilySpec(NamedTuple):
    """One metric family: the attribute naming it, its name, kind, help and label names."""

    attr: str
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    doc: str
    labels: tuple[str, ...] = ()
    multiprocess_mode: str = "all"  # gauges only: how processes' values are combined


#: Every family, in the order of the exposition.
SPECS: tuple[FamilySpec, ...] = (
    FamilySpec("cache_requests", "cachedstore_cache_requests_total", "counter",
          "Keys requested from the cache, by operation and result (mget counts each key).",
          ("op", "result")),
    FamilySpec("request_duration", "cachedstore_request_duration_seconds", "histogram",
          "Duration of store operations as the caller sees them.", ("op",)),
    FamilySpec("etcd_requests", "cachedstore_etcd_requests_total", "counter",
          "RPCs sent to etcd, by method and gRPC status code (ok on success).",
          ("method", "code")),
    FamilySpec("etcd_duration", "cachedstore_etcd_request_duration_seconds", "histogram",
          "Duration of unary RPCs sent to etcd (all methods)."),
    FamilySpec("cache_entries", "cachedstore_cache_entries", "gauge",
          "Entries held in the cache (values and absent-key markers).",
          multiprocess_mode="livesum"),
    FamilySpec("cache_evictions", "cachedstore_cache_evictions_total", "counter",
          "Entries evicted to keep the cache within its size."),
    FamilySpec("watch_events", "cachedstore_watch_events_total", "counter",
          "Events received on the watch stream, by type.", ("type",)),
    FamilySpec("watch_restarts", "cachedstore_watch_restarts_total", "counter",
          "Times the watch stream had to be restarted, by reason.", ("reason",)),
    FamilySpec("watch_up", "cachedstore_watch_up", "gauge",
          "1 while the watch is healthy and the cache may be served (summed over stores).",
          multiprocess_mode="livesum"),
    FamilySpec("watch_revision", "cachedstore_watch_revision", "gauge",
          "Newest etcd revision the watch has confirmed.", multiprocess_mode="livemax"),
    FamilySpec("watch_scopes", "cachedstore_watch_scopes", "gauge",
          "Watches on the store's stream: the scopes it touched (watch_scope=touched), "
          "else 1 (summed over stores).", multiprocess_mode="livesum"),
    FamilySpec("quiet_refreshes", "cachedstore_watch_quiet_refreshes_total", "counter",
          "Scopes read afresh after a reconnect because their range had no event to "
          "replay (etcd's revision moved elsewhere meanwhile)."),
    FamilySpec("watch_liveness", "cachedstore_watch_liveness_requests_total", "counter",
          "What quiet watch streams sent to learn that etcd is still there: HTTP/2 PINGs "
          "(answered by etcd's transport, no etcd request) or progress requests.", ("kind",)),
    FamilySpec("waiters", "cachedstore_waiters", "gauge",
          "Blocked gets and waits right now.", multiprocess_mode="livesum"),
    FamilySpec("fills_dropped", "cachedstore_fills_dropped_total", "counter",
          "Read-through results refused by the revision gate (a newer write was known)."),
    FamilySpec("stale_reads", "cachedstore_stale_reads_total", "counter",
          "Reads served from the cache while the watch was down (max_staleness mode)."),
)


class Value:
    """A counter's or gauge's value in this process: a float and a lock.

    ``inc``/``dec``/``set`` are one Python call each (prometheus-client's children go
    through two or three); a counter is only ever given non-negative amounts here (the
    callers are this package's own modules).
    """

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        with self._lock:
            self.value += amount

    def dec(self, amount: float = 1) -> None:
        with self._lock:
            self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)  # one store of a reference: atomic

    def get(self) -> float:
        return self.value


class HistogramValue:
    """A histogram's buckets and sum in this process: one lock for both.

    ``observe`` finds the bucket by bisection (the first bound ``>= amount``, as
    prometheus-client's ``le`` buckets count it) and counts it with the sum under the lock, so
    a collection never sees one without the other.
    """

    __slots__ = ("_bounds", "_counts", "_lock", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: +Inf
        self._lock = threading.Lock()
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        i = bisect_left(self._bounds, amount)
        with self._lock:
            self._counts[i] += 1
            self._sum += amount

    def snapshot(self) -> tuple[list[int], float]:
        """The cumulative bucket counts (``+Inf`` last) and the sum, as of one instant."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        return list(itertools.accumulate(counts)), total


class LocalFamilies(Collector):
    """The families of one registry in a single process: children are :class:`Value` and
    :class:`HistogramValue`, exported by this collector as they are at each collection.

    A child costs one small object when first used (prometheus-client's ``labels()`` builds
    a metric object, validates its labels and, for a histogram, a locked value per bucket:
    about a third of a fresh store's first ``set`` or ``wait``). Children are kept for the
    registry's life, shared by the stores on it, so that counts only grow. No ``_created``
    series.
    """

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self._le = tuple(floatToGoString(b) for b in buckets) + ("+Inf",)
        self._lock = threading.Lock()
        self._children: dict[str, dict[tuple[str, ...], Value | HistogramValue]] = {
            spec.attr: {} for spec in SPECS}
        for spec in SPECS:  # an unlabelled family exports its one series from the start
            if not spec.labels:
                self.child(spec.attr)
        self.hits: dict[str, HitCounter] = {}

    def child(self, attr: str, *labels: str) -> Any:
        """The child of family ``attr`` for ``labels`` (created on first use, then kept)."""
        children = self._children[attr]
        found = children.get(labels)
        if found is None:
            with self._lock:
                found = children.get(labels)
                if found is None:
                    kind = _KINDS[attr]
                    found = children[labels] = (
                        HistogramValue(self.buckets) if kind == "histogram" else Value())
        return found

    def hit_counter(self, op: str) -> HitCounter:
        """The hit counter of ``op`` (created with its series on first use, then kept)."""
        counter = self.hits.get(op)
        if counter is None:
            with self._lock:
                counter = self.hits.get(op)
                if counter is None:
                    counter = HitCounter(None)
                    self._children["cache_requests"][(op, "hit")] = counter.child
                    self.hits[op] = counter
        return counter

    def describe(self) -> Iterable[Metric]:
        for spec in SPECS:
            yield _family(spec)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            for counter in self.hits.values():
                counter.flush()
            listed = {attr: list(children.items()) for attr, children in self._children.items()}
        for spec in SPECS:
            family = _family(spec)
            for labels, child in listed[spec.attr]:
                if isinstance(child, HistogramValue):
                    counts, total = child.snapshot()
                    family.add_metric(list(labels), list(zip(self._le, counts, strict=True)),
                                      total)
                else:
                    family.add_metric(list(labels), child.value)
            yield family


#: family attribute -> its kind.
_KINDS = {spec.attr: spec.kind for spec in SPECS}


#: kind -> the metric family a collector fills, and prometheus-client's metric class.
_FAMILY_OF = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
              "histogram": HistogramMetricFamily}
_METRIC_OF = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def _family(spec: FamilySpec) -> Any:
    """An empty metric family of ``spec``, for a collector to fill."""
    return _FAMILY_OF[spec.kind](spec.name, spec.doc, labels=spec.labels)


class PrometheusCollector(Collector):
    """prometheus-client's families in one registry (multiprocess mode), exported without
    their ``_created`` samples."""

    def __init__(self, families: Sequence[Counter | Gauge | Histogram]) -> None:
        self._families = tuple(families)

    def describe(self) -> Iterable[Metric]:
        for family in self._families:
            yield from family.describe()

    def collect(self) -> Iterable[Metric]:
        for family in self._families:
            for metric in family.collect():
                samples = [s for s in metric.samples if not s.name.endswith("_created")]
                if len(samples) != len(metric.samples):
                    copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    copy.samples = samples
                    metric = copy
                yield metric


class SharedFamilies:
    """The families of one registry in prometheus-client's multiprocess mode.

    There every value must be prometheus-client's own (it writes each update to the
    process's files, which the scraping process reads), so the children are made with
    ``labels()``, and the families are registered through :class:`PrometheusCollector`.
    A hit counter's ticks increment its child as they happen: nothing waits for a flush.
    """

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._families: dict[str, Counter | Gauge | Histogram] = {}
        for spec in SPECS:
            kw: dict[str, Any] = {"registry": None}
            if spec.kind == "gauge":
                kw["multiprocess_mode"] = spec.multiprocess_mode
            elif spec.kind == "histogram":
                kw["buckets"] = buckets
            self._families[spec.attr] = _METRIC_OF[spec.kind](spec.name, spec.doc,
                                                               spec.labels, **kw)
        self.hits: dict[str, HitCounter] = {}
        registry.register(PrometheusCollector(list(self._families.values())))

    def child(self, attr: str, *labels: str) -> Any:
        family = self._families[attr]
        return family.labels(*labels) if labels else family

    def hit_counter(self, op: str) -> HitCounter:
        with self._lock:
            counter = self.hits.get(op)
            if counter is None:
                counter = self.hits[op] = HitCounter(self.child("cache_requests", op, "hit"))
            return counter


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
    """The cache hits of one operation on one registry: a counter whose increments by one
    cost one C call and no lock.

    ``next(counter.tick)`` counts one hit; ``counter.inc(n)`` counts ``n`` (the child's
    lock is taken for ``n != 1``: those are the batched and the slower paths). ``tick`` is an
    :func:`itertools.count`: its ``next`` runs in C without releasing the GIL, so
    concurrent hits are never lost. :meth:`flush` (the families' collector calls it, under
    their lock, before every collection) reads the count with one more ``next`` of its own,
    which it remembers and subtracts, and adds what is new to the child. In
    prometheus-client's multiprocess mode (``child`` given) ``tick`` increments that child
    directly; else the counter has its own child, a :class:`Value`.
    """

    __slots__ = ("_flushed", "_own_ticks", "child", "tick")

    def __init__(self, child: Any) -> None:
        self.tick: Iterator[Any]
        if child is None:  # in-process values: count, flush later
            self.child: Any = Value()
            self.tick = itertools.count()
        else:  # multiprocess mode: samples go to the shared files as they happen
            self.child = child
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


Families = LocalFamilies | SharedFamilies

_families_lock = threading.Lock()
_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, Families] = (
    weakref.WeakKeyDictionary()
)


def families(registry: CollectorRegistry, buckets: tuple[float, ...] | None,
             default: tuple[float, ...]) -> Families:
    """The families of ``registry``, created with ``buckets`` (``default`` when None) if new.

    Raises InvalidInputError when they exist with another layout than ``buckets``.
    """
    with _families_lock:
        families = _families_by_registry.get(registry)
        if families is None:
            layout = default if buckets is None else buckets
            if values.ValueClass is values.MutexValue:  # one process: our own values
                families = LocalFamilies(layout)
                registry.register(families)
            else:
                families = SharedFamilies(registry, layout)
            _families_by_registry[registry] = families
        elif buckets is not None and buckets != families.buckets:
            raise InvalidInputError(
                f"this registry already holds cachedstore's metrics with buckets "
                f"{list(families.buckets)}; a store on it cannot use {list(buckets)}")
        return families
