"""Watching only what a store touched (``watch_scope="touched"``: ``scoping.py``, and ``opener.py``, which opens the scopes),
against a
real etcd: what reaches a store (counted by etcd's ``/metrics``), the coherence of the
scopes it opens, a write racing a scope's opening (forced by a hook, not a sleep), nested
scopes, and the fall-back to the whole prefix.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from benchmarks.fanout.etcd_metrics import sample as etcd_sample
from cachedstore import EtcdConnectionError, EtcdStore, InvalidInputError, StoreConfig
from cachedstore.server import LocalEtcd
from cachedstore.torch import TorchEtcdStore
from tests.util import eventually, held_opening, raw_client, rpc_count

pytestmark = pytest.mark.timeout(120)


def _store(server: LocalEtcd, prefix: str, **kwargs: Any) -> EtcdStore:
    kwargs.setdefault("watch_scope", "touched")
    return EtcdStore(endpoints=[server.endpoint], prefix=prefix, **kwargs)


def _group_exchange(server: LocalEtcd, prefix: str, scope: str, world: int, groups: int
                    ) -> tuple[int, int]:
    """``world`` stores in ``groups`` groups: each sets its key in its group's directory
    and blocks in ``mget`` of its group's keys (gloo's all-gather). Returns (watch
    messages etcd sent, deliveries the ranks needed: each rank needs its group's puts)."""
    stores = [_store(server, prefix, watch_scope=scope) for _ in range(world)]
    size = world // groups
    try:
        before = etcd_sample(server.metrics_url)
        start = threading.Barrier(world)
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            group = r // size
            names = [f"group{group}/cpu/{i}" for i in range(size)]
            try:
                start.wait()
                stores[r].set(names[r % size], f"addr-{r}")
                values = stores[r].mget(names, timeout=30)
                assert values == [f"addr-{group * size + i}".encode() for i in range(size)]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        counts = etcd_sample(server.metrics_url).minus(before)
    finally:
        for s in stores:
            s.close()
    return counts.watch_msgs_sent, world * size


def test_a_store_receives_its_groups_writes_not_the_jobs(own_etcd: LocalEtcd) -> None:
    """16 stores in 4 groups of 4 exchange addresses. Watching the prefix, etcd sends
    every put to every store (16 × 16 = 256 messages for 64 needed); watching what was
    touched, each store gets its own group's puts: at most twice what is needed."""
    touched, needed = _group_exchange(own_etcd, "/scoped/t/", "touched", 16, 4)
    whole, _ = _group_exchange(own_etcd, "/scoped/p/", "prefix", 16, 4)
    assert needed == 64
    assert touched <= 2 * needed, (touched, needed)
    assert whole >= 16 * 16, whole  # every put reached every store


def test_touched_scopes_are_coherent(own_etcd: LocalEtcd) -> None:
    """A scope opened by a read follows other clients' writes through the watch; a name
    no scope covers is read from etcd each time, so it is never stale either."""
    prefix = "/scoped/coherent/"
    writer = raw_client(own_etcd)
    writer.put(prefix + "d/x", "1")
    writer.put(prefix + "e/y", "1")
    with _store(own_etcd, prefix) as store:
        assert store.get("d/x") == b"1"
        writer.put(prefix + "d/x", "2")
        eventually(lambda: store._cache.peek("d/x")[0] == b"2", what="the watch of d/x")
        before = rpc_count(store.metrics.registry, "range")
        assert store.get("d/x") == b"2"
        assert rpc_count(store.metrics.registry, "range") == before  # served locally
        writer.put(prefix + "e/y", "2")  # not touched: not watched, read from etcd
        assert store._cache.peek("e/y") is None
        assert store.get("e/y") == b"2"
        # A blocking read of a key not yet written, in a new scope, is woken by its watch.
        threading.Timer(0.2, lambda: writer.put(prefix + "f/late", "here")).start()
        assert store.get("f/late", timeout=10) == b"here"
        assert store.stats()["watch_scope"] == "touched"


def test_opening_a_key_scope_does_not_scan_the_cache(own_etcd: LocalEtcd) -> None:
    """A key scope covers one name, so its opening (a reset of that scope) looks up that
    name only: scanning every cached entry made each new key touched cost O(cache size)
    under the cache's lock (10,000 entries: 7.3 ms a scope, against 0.35 ms)."""
    prefix = "/scoped/no-scan/"
    writer = raw_client(own_etcd)
    names = [f"big/k{i}" for i in range(400)]
    for name in names:
        writer.put(prefix + name, "v")
    writer.put(prefix + "lone", "1")
    with _store(own_etcd, prefix, cache_size=1000) as store:
        store.mget(names)  # one directory scope, 400 entries cached
        assert len(store._cache._lru.data) >= 400
        cache = store._cache
        looked: list[str] = []
        scope_of = cache._scope_of

        def counted(name: str) -> Any:
            looked.append(name)
            return scope_of(name)

        cache._scope_of = counted  # type: ignore[method-assign]
        assert store.get("lone") == b"1"  # opens the key scope of "lone"
        assert store.stats()["watch_scope"] == "touched"
        assert len(looked) < 40, f"{len(looked)} names looked up to open one key scope"


def test_a_write_that_ends_while_its_scope_opens_is_not_lost(own_etcd: LocalEtcd) -> None:
    """The opening thread has read the scope's snapshot (v1) but not installed it when
    this store's own write of v2 returns. Opening must keep the write (read-your-writes):
    installing the older snapshot over it would serve v1 until the next event."""
    prefix = "/scoped/race/"
    raw_client(own_etcd).put(prefix + "k", "v1")
    with _store(own_etcd, prefix) as store:
        read, release = threading.Event(), threading.Event()

        def hold(keys: list[str]) -> None:
            read.set()
            assert release.wait(10)

        store._opener.after_read = hold
        opener = threading.Thread(target=store.get, args=("k",))
        opener.start()
        assert read.wait(10)
        store._opener.after_read = None
        store.set("k", "v2")  # ends while the scope is opening
        release.set()
        opener.join(10)
        assert store.get("k") == b"v2"
        entry = store._cache.peek("k")
        assert entry is not None and entry[0] == b"v2"


def test_nested_scopes_follow_etcd(own_etcd: LocalEtcd) -> None:
    """A name read alone gets its own key scope; reading 8 names of its directory then
    watches the directory whole, whose watch also carries the first name's events. Each
    name follows etcd through the one scope that covers it, with no read."""
    prefix = "/scoped/nested/"
    writer = raw_client(own_etcd)
    with _store(own_etcd, prefix) as store:
        assert store.get("g/0", None) is None
        names = [f"g/{i}" for i in range(1, 9)]
        assert store.mget(names, default=None) == [None] * 8
        assert sorted(s.key for s in store._cache._scopes.values()) == ["dg/", "kg/0"]
        for i in range(9):
            writer.put(prefix + f"g/{i}", f"v{i}")
        for i in range(9):
            eventually(lambda i=i: (store._cache.peek(f"g/{i}") or (None,))[0]
                       == f"v{i}".encode(), what=f"g/{i} by its watch")
        before = rpc_count(store.metrics.registry, "range")
        assert store.mget([f"g/{i}" for i in range(9)]) == [f"v{i}".encode()
                                                            for i in range(9)]
        assert rpc_count(store.metrics.registry, "range") == before


def test_too_many_scopes_fall_back_to_the_whole_prefix(own_etcd: LocalEtcd) -> None:
    """Past ``max_watches`` the store watches its whole prefix, once and for good, and
    stays coherent: another client's write reaches it through the watch, and a blocking
    read is woken."""
    prefix = "/scoped/fallback/"
    writer = raw_client(own_etcd)
    writer.put(prefix + "a", "1")
    with _store(own_etcd, prefix, max_watches=3) as store:
        assert store.mget(["a", "b", "c"], default=None) == [b"1", None, None]
        assert store.stats()["watch_scopes"] == 3
        assert store.get("d", None) is None  # the fourth scope
        assert store.stats()["watch_scope"] == "prefix"
        eventually(lambda: store.watch_healthy, what="the whole-prefix watch")
        writer.put(prefix + "zz/untouched", "u")
        eventually(lambda: store._cache.peek("zz/untouched") is not None,
                   what="an untouched key to arrive by the whole-prefix watch")
        threading.Timer(0.2, lambda: writer.put(prefix + "late", "x")).start()
        assert store.get("late", timeout=10) == b"x"


def test_torch_store_watches_what_it_touched(own_etcd: LocalEtcd) -> None:
    """TorchEtcdStore watches what it touched unless told otherwise."""
    endpoint = own_etcd.endpoint
    host, port = endpoint.rsplit(":", 1)
    store = TorchEtcdStore(host, int(port), prefix="/scoped/torch/")
    try:
        assert store._etcd.stats()["watch_scope"] == "touched"
        store.set("a", "1")
        assert store.get("a") == b"1"
    finally:
        store.close()
    store = TorchEtcdStore(host, int(port), prefix="/scoped/torch/", watch_scope="prefix")
    try:
        assert store._etcd.stats()["watch_scope"] == "prefix"
    finally:
        store.close()


def test_a_bad_watch_scope_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="watch_scope"):
        StoreConfig(watch_scope="some")
    with pytest.raises(InvalidInputError, match="max_watches"):
        StoreConfig().with_overrides(max_watches=0)


@pytest.mark.parametrize("scope", ["touched", "prefix"])
def test_a_quiet_scope_is_served_again_after_a_reconnect(own_etcd: LocalEtcd,
                                                         scope: str) -> None:
    """While the stream is down, etcd's revision moves only through keys this store does
    not watch (another prefix). Its scopes then have nothing to replay, so no event ends
    their catch-up: the watch reads them afresh on a progress response, and the cache is
    served again (without it, every read went to etcd until those keys changed)."""
    prefix = f"/scoped/quiet-{scope}/"
    writer = raw_client(own_etcd)
    writer.put(prefix + "k", "v")
    with _store(own_etcd, prefix, watch_scope=scope, progress_interval=0.2) as store:
        assert store.get("k") == b"v"
        eventually(lambda: store._cache.lookup("k") is not None, what="k cached")
        restarts = store._watcher.restarts
        store._watcher._call.cancel()  # the stream ends; it is created again at once
        writer.put("/scoped/elsewhere", "moves the revision")
        eventually(lambda: store._watcher.restarts > restarts, what="the restart")
        eventually(lambda: store._cache.lookup("k") is not None, timeout=10,
                   what="k served from the cache again")
        assert store.registry is not None
        assert (store.registry.get_sample_value(
            "cachedstore_watch_quiet_refreshes_total") or 0) >= 1
        writer.put(prefix + "k", "v2")  # and the watch still follows k
        eventually(lambda: store.get("k") == b"v2", what="the watch to deliver v2")


def test_a_given_config_keeps_its_watch_scope(own_etcd: LocalEtcd) -> None:
    """TorchEtcdStore's default is the config's default: a config given keeps its own."""
    host, port = own_etcd.endpoint.rsplit(":", 1)
    store = TorchEtcdStore(host, int(port), prefix="/scoped/torch-config/",
                           config=StoreConfig(watch_scope="prefix"))
    try:
        assert store._etcd.stats()["watch_scope"] == "prefix"
    finally:
        store.close()


def test_creates_are_matched_to_their_answers_by_watch_id() -> None:
    """etcd and grpc-proxy number a stream's watches in the order of the creates, but the
    proxy answers a create joining a watch it already has at once, ahead of an earlier
    one still waiting for etcd: the answers are matched by id, not by order."""
    from cachedstore.scoping import Scope
    from cachedstore.watchstream import WatchStream

    first, second, third = (Scope(f"k{n}", n.encode(), n.encode() + b"\0")
                            for n in ("a", "b", "c"))
    stream = WatchStream([first, second])
    for scope in (first, second, third):
        stream.sent(scope)
    assert stream.created(1) is second  # the proxy's early answer
    assert stream.created(0) is first
    assert stream.created(2) is third
    assert stream.by_id == {0: first, 1: second, 2: third}
    assert stream.created(7) is None  # not a create of ours


def test_a_store_watching_what_it_touched_connects_with_one_message(
        own_etcd: LocalEtcd) -> None:
    """Connecting costs etcd one stream and one watch create: the member is checked by the
    create's answer, not by a Status call first (etcd's own counts)."""
    before = etcd_sample(own_etcd.metrics_url)
    store = _store(own_etcd, "/scoped/connect/")
    try:
        counts = etcd_sample(own_etcd.metrics_url).minus(before)
        assert counts.requests == {}, counts.requests
        assert counts.watch_streams == 1 and counts.watch_msgs_received == 1
        assert store.get("x", default=None, timeout=0) is None  # it works
    finally:
        store.close()


def test_a_read_does_not_wait_past_its_deadline_for_another_scopes_opening(
        own_etcd: LocalEtcd) -> None:
    """One thread's scope opening is held between etcd's answer and the cache update (a
    slow round trip). A blocking read of another name, with a budget of 0.5 s, must not
    queue behind it: it reads etcd itself (uncached) and answers while the first opening
    is still held, not once it ends, and not with "etcd unreachable"."""
    prefix = "/scoped/opening-lock/"
    raw_client(own_etcd).put(prefix + "b", "vb")
    with _store(own_etcd, prefix) as store:
        read, release = threading.Event(), threading.Event()
        held_to_the_end: list[bool] = []

        def hold(keys: list[str]) -> None:
            if keys == ["ka"]:
                read.set()
                held_to_the_end.append(not release.wait(20))

        store._opener.after_read = hold
        opener = threading.Thread(target=store.get, args=("a",), kwargs={"timeout": 30})
        opener.start()
        try:
            assert read.wait(10)
            assert store.get("b", timeout=0.5) == b"vb"
            assert not held_to_the_end, "the read waited for the other opening to end"
            assert store._cache.scope_of("b") is None  # read through, not opened
        finally:
            release.set()
            store.set("a", "va")
            opener.join(30)
        assert store.get("b", timeout=1) == b"vb"
        assert store._cache.scope_of("b") is not None  # opened by the next read


def test_a_wait_sees_a_push_of_its_own_store_that_lands_while_the_queues_open(
        own_etcd: LocalEtcd) -> None:
    """torch's ``wait`` on a queue name opens the name's scope and the queues' directory
    with one read. This store's own push lands after that read and before the scopes'
    watches exist (forced with the hook): its item enters the cache with no event, and the
    event that follows changes nothing, so wakes no one. The read's "empty, nothing applied
    since" must not be trusted then: the wait ends at once, not at its timeout."""
    host, port = own_etcd.endpoint.rsplit(":", 1)
    store = TorchEtcdStore(host, int(port), prefix="/scoped/own-push/")
    pushed: list[bool] = []

    def push_now(keys: list[str]) -> None:
        if not pushed:
            pusher = threading.Thread(target=store.queue_push, args=("jobs", "x"))
            pusher.start()
            pusher.join(10)
            pushed.append(True)

    store._etcd._opener.after_read = push_now
    try:
        store.wait(["jobs"], timedelta(seconds=5))
        assert pushed == [True]
        assert store.queue_pop("jobs") == b"x"
    finally:
        store.close()


def test_a_wait_whose_scope_gave_way_to_another_opening_is_still_woken(
        own_etcd: LocalEtcd) -> None:
    """Another reader's opening holds the opener (forced with the hook) longer than this
    blocking read's round trip may wait for it, so the read goes to etcd uncached and its
    name has no watch; then that opening fails (so no scope creation nudges anyone). The
    wait must not sleep until its deadline (no event can wake it): it looks again, opens
    the scope, and sees the key set meanwhile."""
    prefix = "/scoped/gave-way/"
    with _store(own_etcd, prefix, request_timeout=0.5) as store:
        read, release = threading.Event(), threading.Event()

        def hold(keys: list[str]) -> None:
            if keys == ["ka"]:
                read.set()
                assert release.wait(20)
                raise EtcdConnectionError("the opening read failed (simulated)")

        def get_a() -> None:
            with pytest.raises(EtcdConnectionError):
                store.get("a", default=None)

        fell_through = threading.Event()  # b was read uncached: its opening gave way
        store._opener.after_read = hold
        store._reads.after_read = lambda chunk: fell_through.set() if "b" in chunk else None
        opener = threading.Thread(target=get_a)
        opener.start()
        got: list[object] = []
        try:
            assert read.wait(10)
            waiter = threading.Thread(
                target=lambda: got.append(store.get("b", timeout=10)))
            waiter.start()
            assert fell_through.wait(10)
            assert store._cache.scope_of("b") is None  # no watch covers it
        finally:
            release.set()
            opener.join(30)
        raw_client(own_etcd).put(prefix + "b", "vb")
        waiter.join(8)  # well inside the wait's own 10 s
        assert got == [b"vb"]


def test_an_opening_that_ends_after_close_leaves_no_scope_counted(own_etcd: LocalEtcd
                                                                   ) -> None:
    """``close()`` does not wait for an opening in progress (a rewind found by any
    request must not either): an opening whose read was answered before the store closed
    and that ends after it counts nothing, so ``cachedstore_watch_scopes`` stays at 0."""
    store = _store(own_etcd, "/scoped/close-opening/", watch_scope="touched")
    store.set("a/x", "x")
    with held_opening(store, "a/x") as opening:
        store.close()
    assert not opening.is_alive()
    assert store.registry.get_sample_value("cachedstore_watch_scopes", {}) == 0
