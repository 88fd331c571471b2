"""Deterministic regression tests for histories the consistency checker rejected.

Each test reproduces one checker finding with a hook instead of luck: the watch thread is
held inside ``apply_events`` (a real etcd write is on its way, the store has not applied it
yet) while the foreground does the operations of the offending history.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import closing

import etcd3
import pytest

from cachedstore import EtcdStore
from cachedstore.server import LocalEtcd

from . import split, wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store(etcd: LocalEtcd, prefix: str) -> Iterator[EtcdStore]:
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as s:
        yield s


def _hold_watch(store: EtcdStore) -> tuple[threading.Event, threading.Event]:
    """Make the watch thread block before applying its next events. Returns (held: set
    once it is blocked, release: set it to let it go)."""
    held, release = threading.Event(), threading.Event()
    apply = store._cache.apply_events

    def blocked(events, revision, scope=None):  # type: ignore[no-untyped-def]
        held.set()
        release.wait(10)
        apply(events, revision, scope)

    store._cache.apply_events = blocked  # type: ignore[method-assign]
    return held, release


def test_compare_set_failure_then_get_is_monotonic(etcd: LocalEtcd, store: EtcdStore,
                                                   prefix: str) -> None:
    """Checker seed 1: ``compare_set`` failed and returned etcd's current value v2, then a
    ``get`` of the same key returned the older cached v1 (the watch had not delivered v2
    yet): a monotonic-reads violation. The failed compare's read now fills the cache."""
    store.set("k", "v1")
    assert store.get("k") == b"v1"
    held, release = _hold_watch(store)
    try:
        with closing(etcd3.client(*split(etcd.endpoint))) as other:
            other.put(prefix + "k", "v2")
        wait_until(held.is_set, 5, "the watch to hold the v2 event")
        assert store.compare_set("k", "not-the-value", "x") == b"v2"
        assert store.get("k") == b"v2"  # not the cached v1: never back in time
    finally:
        release.set()
    wait_until(lambda: store.watch_revision > 0 and store.get("k") == b"v2", 5, "v2 applied")
    assert store.compare_set("k", "v2", "v3") == b"v3" and store.get("k") == b"v3"
