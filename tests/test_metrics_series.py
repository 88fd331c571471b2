"""How many series a process exports, counted from the registry's own text exposition.

At 8 ranks x 1,000 nodes every series a store exports is 8,000 series for one job: an idle
process must stay within IDLE_BUDGET and one that used every operation within USED_BUDGET.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from cachedstore import EtcdStore
from cachedstore.errors import InvalidInputError
from cachedstore.metrics import (
    ALL_OPS,
    COARSE_BUCKETS,
    FULL_BUCKETS,
    READ_OPS,
    make_metrics,
)
from cachedstore.server import LocalEtcd

IDLE_BUDGET = 60
USED_BUDGET = 150


def series(registry: CollectorRegistry) -> list[str]:
    """Every sample line (one series each) of the registry's text exposition."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


@pytest.fixture
def store(etcd: LocalEtcd, prefix: str) -> Iterator[EtcdStore]:
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                   registry=CollectorRegistry()) as s:
        yield s


def use_every_operation(store: EtcdStore) -> None:
    store.set("a", "1")
    store.mset({"b": "2", "c": "3"})
    store.get("a")
    store.get("missing", default=None)
    store.mget(["a", "b"])
    store.check(["a"])
    store.wait(["a"], timeout=5)
    store.add("n", 1)
    store.append("s", "x")
    store.compare_set("a", "1", "2")
    store.delete("c")
    store.num_keys()

    async def both() -> None:
        await store.aget("a")
        await store.amget(["a", "b"])

    asyncio.run(both())


def test_idle_and_busy_process_stay_within_budget(store: EtcdStore) -> None:
    registry = store.registry
    assert registry is not None
    idle = series(registry)
    assert len(idle) <= IDLE_BUDGET, "\n".join(idle)
    use_every_operation(store)
    used = series(registry)
    assert len(used) <= USED_BUDGET, "\n".join(used)
    # the budget was met with every operation present, not by dropping them
    ops = {line.split('op="')[1].split('"')[0] for line in used if 'op="' in line}
    assert ops == set(ALL_OPS)
    assert len(used) > len(idle)
    assert not [line for line in used if "_created" in line]


def test_children_are_created_on_first_use_and_then_kept() -> None:
    registry = CollectorRegistry()
    metrics = make_metrics(registry)
    assert not any('op="get"' in line for line in series(registry))
    child = metrics.hit["get"]
    assert metrics.hit["get"] is child  # bound once: the same object on every lookup
    child.inc()
    assert registry.get_sample_value("cachedstore_cache_requests_total",
                                     {"op": "get", "result": "hit"}) == 1
    assert not any('op="mget"' in line for line in series(registry))
    with pytest.raises(KeyError):
        metrics.hit["set"]  # not a read operation: no series for it
    with pytest.raises(KeyError):
        metrics.duration["no-such-op"]
    assert set(READ_OPS) <= set(ALL_OPS)


def test_created_series_dropped_only_for_cachedstore() -> None:
    registry = CollectorRegistry()
    theirs = Counter("user_things_total", "A user's own counter.", registry=registry)
    theirs.inc()
    metrics = make_metrics(registry)
    metrics.evictions.inc()
    metrics.duration["set"].observe(0.001)
    lines = series(registry)
    assert "user_things_created" in "\n".join(lines)  # the user's registry is untouched
    assert not [line for line in lines if line.startswith("cachedstore_")
                and "_created" in line.split("{")[0]]


def test_coarse_default_and_full_layout_as_a_setting() -> None:
    def buckets_of(registry: CollectorRegistry) -> int:
        return sum(1 for line in series(registry)
                   if line.startswith("cachedstore_request_duration_seconds_bucket"))

    coarse, full = CollectorRegistry(), CollectorRegistry()
    make_metrics(coarse).duration["get"].observe(1e-6)
    make_metrics(full, buckets="full").duration["get"].observe(1e-6)
    assert buckets_of(coarse) == len(COARSE_BUCKETS) + 1  # + the +Inf bucket
    assert buckets_of(full) == len(FULL_BUCKETS) + 1
    # a second store on the same registry inherits its layout, or must ask for the same
    assert make_metrics(full).buckets == FULL_BUCKETS
    with pytest.raises(InvalidInputError, match="already holds"):
        make_metrics(full, buckets="coarse")
    for bad in ("fine", [], [0.1, 0.01], [0.0, 1.0], [float("inf")], ["x"]):
        with pytest.raises(InvalidInputError):
            make_metrics(CollectorRegistry(), buckets=bad)  # type: ignore[arg-type]
    assert make_metrics(CollectorRegistry(), buckets=(0.5, 2.0)).buckets == (0.5, 2.0)


def test_store_binds_the_hit_child_once(store: EtcdStore) -> None:
    """The store's hit path increments the very child the registry exports."""
    store.set("k", "v")
    store.get("k")
    registry = store.registry
    assert registry is not None
    before = registry.get_sample_value("cachedstore_cache_requests_total",
                                       {"op": "get", "result": "hit"})
    assert before is not None
    for _ in range(10):
        store.get("k")
    after = registry.get_sample_value("cachedstore_cache_requests_total",
                                      {"op": "get", "result": "hit"})
    assert after == before + 10
