"""Review of the refactor of issue 25 (steps/reads/aio, Queues, wait_until, torch's waits):
behaviour the refactor changed. Each test fails on the refactored code and passes on
9377ab8's (or states what 9377ab8 did)."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from util import held_watch, rpc_count, sample

from cachedstore import EtcdStore
from cachedstore.clock import FakeClock

pytestmark = pytest.mark.timeout(60)


def _counts(store: EtcdStore, op: str) -> tuple[float, float]:
    return (sample(store.registry, "cachedstore_cache_requests_total", op=op, result="hit"),
            sample(store.registry, "cachedstore_cache_requests_total", op=op, result="miss"))


# -- metrics: amget with a name given twice ------------------------------------------------
def test_amget_counts_a_duplicated_cached_name_as_a_hit_not_a_miss(etcd, prefix):
    """``amget(["a", "a", "b"])`` answered wholly from the cache (``b`` known absent) makes no
    etcd request, so it must count no miss. Since ``AsyncFront.mget`` became
    ``mget_steps`` with every index pending, the misses are ``len(pending) - hits`` where
    ``hits`` counts *distinct* names: the second ``a`` is counted as a miss. (9377ab8's
    amget counted per distinct name: 2 hits, 0 misses; ``mget`` counts per name: 3 hits.)"""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        store.set("a", "1")
        assert store.get("b", None) is None  # "b absent" is now cached
        assert store.mget(["a", "a", "b"], default=None) == [b"1", b"1", None]
        assert _counts(store, "mget") == (3.0, 0.0)  # the sync front: per name, all hits
        ranges, txns = rpc_count(store.registry, "range"), rpc_count(store.registry, "txn")
        assert asyncio.run(store.amget(["a", "a", "b"], default=None)) == [b"1", b"1", None]
        assert (rpc_count(store.registry, "range"), rpc_count(store.registry, "txn")) == \
            (ranges, txns)  # no etcd read at all
        hits, misses = _counts(store, "amget")
        assert misses == 0, f"amget counted {misses:g} miss(es) for a call etcd never saw " \
                            f"(hits {hits:g})"


def test_consistent_amget_of_a_duplicated_name_counts_no_phantom_miss(etcd, prefix):
    """The same through the consistent path (every name pending in both fronts): a name
    given twice and served by the cache after the revision check counts one miss too
    many. (9377ab8's amget: 1 hit, 0 misses.)"""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        store.set("a", "1")
        assert asyncio.run(store.amget(["a", "a"], consistent=True)) == [b"1", b"1"]
        hits, misses = _counts(store, "amget")
        # "a" was served from the cache after the revision check: whatever the unit
        # (per name or per distinct name), no miss.
        assert misses == 0, f"hits {hits:g}, misses {misses:g}"


# -- torch: a blocking get whose deadline passes during its mget ----------------------------
def test_torch_get_whose_deadline_passes_during_the_mget_raises_torchs_timeout(etcd, prefix):
    """``TorchEtcdStore._get_blocking`` waits ``deadline - now`` after its mget; once the
    mget outlasted the deadline, that is negative. 9377ab8 made it a deadline in the past
    and raised StoreTimeoutError (torch's "wait timeout"); passed as it is as ``timeout=``
    to ``EtcdStore.wait_until``, whose ``seconds()`` refuses a negative timeout with
    InvalidInputError, torch would report a plain DistStoreError that is not a timeout
    ("timeout must be at least 0 seconds"). ``multi_get`` takes that path (``get`` of an
    absent key waits without the mget)."""
    import torch

    from cachedstore.torch import TorchEtcdStore

    clock = FakeClock()
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix, clock=clock,
                        timeout=timedelta(seconds=5)) as tstore:
        etcd_store = tstore._etcd  # noqa: SLF001
        original = etcd_store.mget

        def slow_mget(*args, **kwargs):  # the mget outlasts the wait's deadline
            try:
                return original(*args, **kwargs)
            finally:
                clock.advance(10)

        etcd_store.mget = slow_mget
        with pytest.raises(torch.distributed.DistStoreError) as caught:
            tstore.multi_get(["absent"])
        assert "wait timeout" in str(caught.value), str(caught.value)


# -- queue pop: the end of the wait -----------------------------------------------------------
def test_a_pop_whose_wait_ends_at_its_deadline_takes_an_item_etcd_holds(etcd, prefix):
    """9377ab8's blocking pop asked etcd once more after a wait that reached its deadline
    (``take`` before ``remaining <= 0``): an item pushed while this store's watch lagged
    was popped. Through ``ReadThrough.wait_until`` ("a wait that ends at the deadline
    raises without asking again") it now times out although etcd has held the item for
    the whole wait. Low severity (a lagging watch), but a change of pop's semantics."""
    clock = FakeClock()
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store, \
            EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as other:
        got: list[object] = []

        def pop() -> None:
            try:
                got.append(store.queues.pop("q", True, 5, clock=clock))
            except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
                got.append(exc)

        popper = threading.Thread(target=pop, name="test-review-pop")
        with held_watch(store):  # the watch is behind: the push reaches etcd only
            popper.start()
            clock.wait_for_waiters(1)
            other.queues.push("q", "item")
            assert other.queues.length("q") == 1
            clock.advance(5)  # the deadline
            popper.join(10)
        assert not popper.is_alive()
        assert got == [b"item"], got
