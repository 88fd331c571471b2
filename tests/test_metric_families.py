"""cachedstore's own metric values against prometheus-client's, update for update.

In one process a store's children are :mod:`cachedstore.metric_families`' values, read by
its collector at scrape time. What a scrape reads must be what prometheus-client's own
children would have exported for the same updates (less the ``_created`` series): the
families, label sets, ``le`` strings, counts and sums. A hypothesis-driven differential test
applies one random sequence of updates to both and compares the parsed expositions; the
threaded tests check that concurrent updates are never lost and that a histogram's sum and
count are read at one instant.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachedstore.metric_families import (
    SPECS,
    HistogramValue,
    LocalFamilies,
    Value,
    families,
)
from cachedstore.metrics import COARSE_BUCKETS, FULL_BUCKETS, METRIC_NAMES, make_metrics

LABEL_VALUES = ("get", "set", "ok", "put", "ping", "disconnect")


def _reference(registry: CollectorRegistry, buckets: tuple[float, ...]) -> dict[str, Any]:
    """prometheus-client's own families for every spec, on ``registry``."""
    made: dict[str, Any] = {}
    for spec in SPECS:
        if spec.kind == "counter":
            made[spec.attr] = Counter(spec.name, spec.doc, spec.labels, registry=registry)
        elif spec.kind == "gauge":
            made[spec.attr] = Gauge(spec.name, spec.doc, spec.labels, registry=registry)
        else:
            made[spec.attr] = Histogram(spec.name, spec.doc, spec.labels, buckets=buckets,
                                        registry=registry)
    return made


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's text exposition but ``_created``, by name and labels."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def _families_listed(registry: CollectorRegistry) -> list[tuple[str, str, str]]:
    text = generate_latest(registry).decode()
    return [(f.name, f.type, f.documentation) for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")]  # the parser's reading of bare _created lines


def _amount(bounds: tuple[float, ...]) -> st.SearchStrategy[float]:
    """Durations, bounds themselves included (an observation equal to a bound counts in it)."""
    return st.one_of(st.sampled_from(bounds), st.floats(0, 20, allow_nan=False),
                     st.sampled_from((0.0, 1e-9, 1e3)))


UPDATE = st.tuples(st.sampled_from(SPECS), st.lists(st.sampled_from(LABEL_VALUES), min_size=2,
                                                    max_size=2),
                   st.sampled_from(("inc", "dec", "set", "observe")), st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from((COARSE_BUCKETS, FULL_BUCKETS, (0.5, 2.0))),
       updates=st.lists(UPDATE, max_size=40), data=st.data())
def test_exposition_matches_prometheus_clients_for_the_same_updates(
        layout: tuple[float, ...], updates: list[Any], data: st.DataObject) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    local = families(ours, layout, COARSE_BUCKETS)
    assert isinstance(local, LocalFamilies)
    reference = _reference(theirs, layout)
    for spec, labels, op, small in updates:
        labels = labels[:len(spec.labels)]
        child = local.child(spec.attr, *labels)
        ref = reference[spec.attr].labels(*labels) if labels else reference[spec.attr]
        if spec.kind == "histogram":
            amount = data.draw(_amount(layout))
            child.observe(amount)
            ref.observe(amount)
        elif spec.kind == "counter" or op == "inc":
            child.inc(small)
            ref.inc(small)
        elif op == "dec":
            child.dec(small)
            ref.dec(small)
        else:
            child.set(small / 2)
            ref.set(small / 2)
    assert _samples(ours) == _samples(theirs)
    assert _families_listed(ours) == _families_listed(theirs)


def test_a_fresh_registry_exports_the_unlabelled_series_at_zero_and_no_labelled_ones() -> None:
    registry = CollectorRegistry()
    families(registry, None, COARSE_BUCKETS)
    reference = CollectorRegistry()
    _reference(reference, COARSE_BUCKETS)
    assert _samples(registry) == _samples(reference)
    assert [name for name, _, _ in _families_listed(registry)] == [
        name.removesuffix("_total") for name in METRIC_NAMES]


def test_the_families_of_a_registry_are_made_once_and_shared() -> None:
    registry = CollectorRegistry()
    a, b = make_metrics(registry), make_metrics(registry)
    a.duration["set"].observe(0.002)
    b.duration["set"].observe(0.002)
    assert a.duration["set"] is b.duration["set"]
    assert registry.get_sample_value("cachedstore_request_duration_seconds_count",
                                     {"op": "set"}) == 2
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("cachedstore_cache_evictions", "a user's clash", registry=registry)


class _Intruding(float):
    """A float that, added as the right operand, runs another thread's update in the middle
    of the read-modify-write it is part of: it starts ``intruder`` and gives it PATIENCE
    seconds before the addition completes. Under the value's lock the intruder waits for
    the lock and the update stays whole; without it, the intruder's update lands between
    the read and the write and is lost. (A machine that stalls PATIENCE seconds only lets
    the mutant pass: correct code never fails.)"""

    PATIENCE = 0.5

    def __new__(cls, value: float, intruder: Any) -> _Intruding:
        made = super().__new__(cls, value)
        made.intruder = intruder
        made.threads = []
        return made

    intruder: Any
    threads: list[threading.Thread]

    def _let_in(self) -> None:
        thread = threading.Thread(target=self.intruder, name="test-metrics-intruder")
        self.threads.append(thread)
        thread.start()
        thread.join(self.PATIENCE)

    def __radd__(self, other: float) -> float:
        self._let_in()
        return float(other) + float(self)

    def __rsub__(self, other: float) -> float:
        self._let_in()
        return float(other) - float(self)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(30)
            assert not thread.is_alive()


def test_an_increment_is_not_lost_to_one_made_in_the_middle_of_another() -> None:
    value = Value()
    amount = _Intruding(1.0, lambda: value.inc(10))
    value.inc(amount)
    amount.join()
    assert value.get() == 11
    amount = _Intruding(1.0, lambda: value.dec(5))
    value.dec(amount)
    amount.join()
    assert value.get() == 5


def test_an_observation_is_not_lost_to_one_made_in_the_middle_of_another() -> None:
    histogram = HistogramValue(COARSE_BUCKETS)
    amount = _Intruding(0.5, lambda: histogram.observe(2.0))
    histogram.observe(amount)
    amount.join()
    counts, total = histogram.snapshot()
    assert counts[-1] == 2
    assert total == 2.5


def test_a_snapshot_never_reads_a_count_without_its_sum() -> None:
    """The intruder snapshots while an observation has counted its bucket but not yet
    added to the sum: under the lock it waits for both, else it reads them apart."""
    histogram = HistogramValue(COARSE_BUCKETS)
    seen: list[tuple[list[int], float]] = []
    amount = _Intruding(0.5, lambda: seen.append(histogram.snapshot()))
    histogram.observe(amount)
    amount.join()
    assert seen == [([0, 0, 0, 0, 0, 1], 0.5)]


def test_a_collection_reads_what_a_concurrent_update_left_whole() -> None:
    """The same through a registry: collections made in the middle of an observation wait
    for it, and export its count and its sum together."""
    registry = CollectorRegistry()
    child = make_metrics(registry).duration["get"]
    got: list[float | None] = []
    amount = _Intruding(0.5, lambda: got.extend([
        registry.get_sample_value("cachedstore_request_duration_seconds_count", {"op": "get"}),
        registry.get_sample_value("cachedstore_request_duration_seconds_sum", {"op": "get"})]))
    child.observe(amount)
    amount.join()
    assert got == [1.0, 0.5]  # read once the observation was whole
