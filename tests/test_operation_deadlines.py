"""A look made for a longer operation has that operation's time for its etcd round trips.

A read that does not wait (``timeout=0``) gives its round trip ``MIN_ROUND_TRIP`` (250 ms),
so that a blocking read outlasts its own timeout by that much at most. But an operation
that waits by looking again and again -- ``wait_until``'s ``ready()``, torch's ``get``,
``multi_get`` and ``wait`` -- made each of its looks that way too: under a slow etcd
(fan-out W = 1,024 on 2 cores: round trips past 250 ms) every look failed, was retried on
a new connection while etcd still served the first, and each retry loaded etcd further
(669-912 connections opened per worker process of 256 ranks instead of 256). Here the
deadline each round trip is given is read off the requests themselves, as the connection
receives them: no timing, no sleeps.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from faults.proxy import FaultProxy
from torch.distributed import DistStoreError
from util import raw_client

from cachedstore import EtcdStore, StoreTimeoutError
from cachedstore.clock import FakeClock
from cachedstore.reads import MIN_ROUND_TRIP
from cachedstore.torch import TorchEtcdStore

pytestmark = pytest.mark.timeout(60)

#: Comfortably below a round trip given the request timeout (10 s), far above 250 ms.
LONG = 5.0


def _record_deadlines(store: EtcdStore) -> list[tuple[str, float, float]]:
    """Every etcd request the store's reads send from now on, as (method, seconds its
    deadline leaves when the connection receives it, the deadline itself)."""
    reads = store._reads
    conn, clock = reads._conn, reads._clock
    seen: list[tuple[str, float, float]] = []
    call = conn.call

    def recording(method: str, request: Any, *, deadline: float, **kwargs: Any) -> Any:
        seen.append((method, deadline - clock.monotonic(), deadline))
        return call(method, request, deadline=deadline, **kwargs)

    conn.call = recording  # type: ignore[method-assign]
    return seen


def _reads_of(seen: list[tuple[str, float, float]]) -> list[float]:
    return [left for method, left, _ in seen if method in ("range", "txn")]


@pytest.mark.parametrize("options", [{"watch_scope": "touched"},
                                     {"watch_scope": "prefix", "preload_limit": 0}])
def test_looks_inside_wait_until_get_its_deadline_and_a_bare_look_keeps_250_ms(
        etcd, prefix, options):
    """A zero-timeout ``get`` of a key the cache cannot answer reads etcd either way: by
    itself, its round trip gets 250 ms (the promise that a blocking read outlasts its
    timeout by that much at most); asked by ``wait_until``'s ``ready()``, it gets what
    remains of the wait, capped by ``request_timeout``."""
    client = raw_client(etcd)
    client.put(f"{prefix}alone", b"1")
    client.put(f"{prefix}inside", b"2")
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **options) as store:
        seen = _record_deadlines(store)
        assert store.get("alone", None, timeout=0) == b"1"
        alone = _reads_of(seen)
        assert alone and max(alone) <= MIN_ROUND_TRIP, seen
        seen.clear()
        store.wait_until(lambda: store.get("inside", None, timeout=0) == b"2",
                         names=["inside"], timeout=30)
        inside = _reads_of(seen)
        assert inside and min(inside) > LONG, seen
        assert max(inside) <= store.config.request_timeout, seen
    client.close()


def test_another_stores_look_inside_a_wait_keeps_its_own_rule(etcd, prefix):
    """The operation is the waiting store's: a look at another store made inside its
    ``ready()`` is that store's own bare look (250 ms)."""
    client = raw_client(etcd)
    client.put(f"{prefix}other", b"1")
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_scope="touched") as a, \
            EtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                      watch_scope="touched") as b:
        seen = _record_deadlines(b)
        a.wait_until(lambda: b.get("other", None, timeout=0) == b"1", timeout=30)
        looks = _reads_of(seen)
        assert looks and max(looks) <= MIN_ROUND_TRIP, seen
    client.close()


def test_torch_blocking_reads_give_their_looks_the_store_timeout(etcd, prefix):
    """torch's ``multi_get`` and ``wait`` of keys another client wrote (not cached: a store
    watching what it touched opens their scopes with a read): every round trip of theirs
    gets the request timeout (the store timeout, 30 s, is longer), none 250 ms."""
    client = raw_client(etcd)
    names = [f"group/{i}" for i in range(3)]
    for name in names:
        client.put(f"{prefix}{name}", name.encode())
    client.put(f"{prefix}flag", b"1")
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                        timeout=timedelta(seconds=30)) as store:
        seen = _record_deadlines(store._etcd)
        assert store.multi_get(names) == [n.encode() for n in names]
        store.wait(["flag"])
        looks = _reads_of(seen)
        assert looks and min(looks) > LONG, seen
    client.close()


def test_torch_get_gives_its_first_look_the_store_timeout(etcd, prefix):
    """torch's ``get`` of a key another client wrote (not cached): its first look reads
    etcd, and that round trip gets the request timeout (the store timeout, 30 s, is
    longer), not 250 ms. A key the cache holds is answered without a request."""
    client = raw_client(etcd)
    client.put(f"{prefix}nccl-id", b"id")
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                        timeout=timedelta(seconds=30)) as store:
        seen = _record_deadlines(store._etcd)
        assert store.get("nccl-id") == b"id"
        looks = _reads_of(seen)
        assert looks and min(looks) > LONG, seen
        seen.clear()
        assert store.get("nccl-id") == b"id"
        assert not seen
    client.close()


def test_torch_get_under_a_silent_etcd_ends_at_its_store_timeout(etcd, prefix):
    """The first look's time counts against the ``get``: with every byte held (a link
    that neither answers nor fails), the look may take the whole store timeout (1 s), and
    the wait that follows gets only what is left of it, not a fresh second. Read off the
    requests' deadlines, as the connection receives them."""
    with FaultProxy(etcd.endpoint) as proxy, \
            TorchEtcdStore(endpoints=[proxy.endpoint], prefix=prefix,
                           timeout=timedelta(seconds=1)) as store:
        store.set("warm", "1")  # a pooled connection: the look is sent, and held
        seen = _record_deadlines(store._etcd)
        proxy.stall()
        started = store._etcd._reads._clock.monotonic()
        with pytest.raises(DistStoreError, match="wait timeout"):
            store.get("never-written")
        proxy.heal()
    deadlines = [deadline for _, _, deadline in seen]
    assert deadlines, "the first look sent nothing"
    assert deadlines[0] > started + 0.9  # the look had the store timeout, not 250 ms
    assert max(deadlines) <= started + 1.0 + MIN_ROUND_TRIP + 0.2, \
        [d - started for d in deadlines]


def test_torch_wait_counts_its_first_reads_against_its_timeout(etcd, prefix):
    """torch's ``wait`` reads before it waits (the keys' and queues' scopes, a look): that
    time is the wait's too. Here the reads take 4 of the wait's 5 s (a fake clock moved
    while they run); the watch wait that follows is given the 1 s left, not 5 s again."""
    clock = FakeClock()
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                        timeout=timedelta(seconds=30), clock=clock) as store:
        etcd_store = store._etcd
        queues, open_directory = etcd_store.queues, etcd_store.queues.open_directory
        given: list[float] = []

        def slow_open(*args: Any, **kwargs: Any) -> Any:
            clock.advance(4.0)  # etcd took 4 s to answer
            return open_directory(*args, **kwargs)

        def recording_wait_until(ready: Any, *, timeout: float, **kwargs: Any) -> None:
            given.append(timeout)
            raise StoreTimeoutError("recorded")

        queues.open_directory = slow_open
        etcd_store.wait_until = recording_wait_until
        with pytest.raises(DistStoreError, match="wait timeout"):
            store.wait(["absent"], timedelta(seconds=5))
    assert given == [pytest.approx(1.0)]


def test_torch_check_of_several_keys_gives_each_look_the_request_timeout(etcd, prefix,
                                                                         monkeypatch):
    """torch's ``check`` of several keys, one absent, looks at each key again (a key or a
    non-empty queue): those looks read etcd as ``check``'s own read does, with the request
    timeout, not a bare look's 250 ms. The cache is made unable to answer them (as while
    its watch is down), so that every look reads etcd."""
    client = raw_client(etcd)
    client.put(f"{prefix}present", b"1")
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                        timeout=timedelta(seconds=30)) as store:
        monkeypatch.setattr(store._etcd._cache, "lookup_or_absent", lambda name: None)
        seen = _record_deadlines(store._etcd)
        assert store.check(["present", "absent"]) is False
        looks = _reads_of(seen)
        assert len(looks) >= 3 and min(looks) > LONG, seen
    client.close()


@pytest.mark.parametrize("options", [{"watch_scope": "touched"}, {"watch_scope": "prefix"}])
def test_queue_reads_inside_a_wait_end_with_the_wait(etcd, prefix, options):
    """The reads a wait's ``ready()`` makes through the queues (the directory's opening
    read, a count) end with the wait (or 250 ms from when they start, whichever is later),
    not a request timeout later; outside a wait they keep the request timeout."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **options) as store:
        seen = _record_deadlines(store)
        assert not store.queues.is_nonempty("outside")
        outside = _reads_of(seen)
        assert outside and min(outside) > LONG, seen
    # (A store that found every queue empty answers from then on without a read: another.)
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **options) as store:
        seen = _record_deadlines(store)
        with pytest.raises(StoreTimeoutError):
            store.wait_until(lambda: store.queues.is_nonempty("inside"), timeout=1.0)
        inside = _reads_of(seen)
        assert inside and max(inside) <= 1.0, seen


def test_a_blocking_mget_hands_its_first_reads_outage_to_the_first_wait_only(
        etcd, prefix, monkeypatch):
    """A blocking ``mget`` whose first read of its keys met an outage waits for each key.
    The outage was the first wait's news: once that wait has read etcd again (here it
    answered, late), the next key's wait reads etcd too instead of giving up at its
    deadline as if etcd were still unreachable. Time is a fake clock's; etcd's answers
    are staged on the store's read (the keys are not cached: ``preload_limit=0``)."""
    from cachedstore import EtcdConnectionError

    clock = FakeClock()
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, preload_limit=0,
                   clock=clock) as store:
        answers = iter([EtcdConnectionError("etcd range: etcd unreachable (staged)"),
                        {"a": b"1"}, {"b": b"2"}])

        def staged(names, deadline=None):
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            clock.advance(10.0)  # each answer comes late: past the mget's 5 s
            return answer

        monkeypatch.setattr(store._reads, "fetch", staged)
        assert store.mget(["a", "b"], timeout=5.0) == [b"1", b"2"]


def test_a_blocking_mget_in_an_outage_reads_no_key_past_its_deadline(etcd, prefix,
                                                                     monkeypatch):
    """With a default, a blocking ``mget`` that met an outage answers each key it could not
    read with the default at its deadline. The first key's wait still found etcd
    unreachable at the deadline: the next key is not read past it (each such read would
    add 250 ms to the call), so two reads in all. Time is a fake clock's; etcd's answers
    are staged on the store's read."""
    from cachedstore import EtcdConnectionError

    clock = FakeClock()
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, preload_limit=0,
                   clock=clock) as store:
        reads: list[list[str]] = []

        def unreachable(names, deadline=None):
            reads.append(list(names))
            if len(reads) == 2:
                clock.advance(10.0)  # the first key's retry fails at the deadline
            raise EtcdConnectionError("etcd range: etcd unreachable (staged)")

        monkeypatch.setattr(store._reads, "fetch", unreachable)
        assert store.mget(["a", "b"], None, timeout=5.0) == [None, None]
        assert reads == [["a", "b"], ["a"]]
