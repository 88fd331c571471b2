"""cachedstore.queues on real etcd: FIFO, namespaces, blocking on the watch, exactly-once
pops across processes, lost races, and the emptiness the store remembers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from util import eventually, raw_client, rpc_count

from cachedstore import EtcdStore, StoreClosedError, StoreTimeoutError, queues
from cachedstore.clock import FakeClock

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def store(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as s:
        yield s


def _another(etcd, prefix) -> EtcdStore:
    return EtcdStore(endpoints=[etcd.endpoint], prefix=prefix)


def test_fifo_length_and_the_store_methods(store):
    assert store.queues.length("q") == 0
    for v in ("1", b"2", "3"):
        store.queues.push("q", v)
    assert store.queues.length("q") == 3
    assert [store.queues.pop("q") for _ in range(3)] == [b"1", b"2", b"3"]
    assert store.queues.length("q") == 0
    with pytest.raises(queues.QueueEmptyError, match="queue is empty") as info:
        store.queues.pop("q", block=False)
    assert isinstance(info.value, KeyError)
    store.queues.push("q", "x")
    assert store.queues.pop("q", block=False) == b"x"


def test_queues_and_keys_are_separate_namespaces(store, etcd, prefix):
    store.set("a", "key")
    store.set("z", "key")
    store.queues.push("a", "item")
    store.queues.push("a/b", "nested")  # a queue whose name extends another's
    assert store.get("a") == b"key"
    assert store.num_keys() >= 2  # EtcdStore.num_keys: the lead's (counts every key)
    assert store.queues.num_keys() == 2  # torch's count: keys only, like HashStore
    assert store.list_keys() == ["a", "z"]
    assert store.queues.length("a") == 1 and store.queues.length("a/b") == 1
    assert store.queues.pop("a") == b"item" and store.queues.length("a/b") == 1
    # The items' etcd keys: under the prefix, behind a NUL, the name percent-encoded.
    keys = [m.key for _, m in raw_client(etcd).get_prefix(prefix)]
    item = [k for k in keys if k.startswith(prefix.encode() + b"\x00queue/")]
    assert len(item) == 1 and item[0].startswith(prefix.encode() + b"\x00queue/a%2Fb/")


def test_names_in_the_queue_directory_are_refused_and_lose_nothing(store):
    """An item's name is not a key name: a key written there would pass for a queue item
    (torch's check and wait would see a queue that nobody pushed to)."""
    from cachedstore import InvalidInputError

    store.queues.push("q", "item")
    with pytest.raises(InvalidInputError, match="reserved for queue items"):
        store.set("\x00queue/q/0000000000000000", "forged")
    with pytest.raises(InvalidInputError, match="reserved for queue items"):
        store.set(b"\x00queue/other/1", "forged")
    store.set("\x00elsewhere", "a NUL alone is an ordinary name")
    assert store.get("\x00elsewhere") == b"a NUL alone is an ordinary name"
    assert store.queues.length("q") == 1 and store.queues.pop("q") == b"item"
    assert store.queues.length("other") == 0


def test_list_keys_pages_and_names_under_a_scope(store, monkeypatch):
    monkeypatch.setattr(queues, "_PAGE", 2)
    names = [f"k{i}" for i in range(5)] + ["s/x", "s/y"]
    for n in names:
        store.set(n, "v")
    store.queues.push("s/q", "item")
    assert store.queues.list_keys() == sorted(names)
    assert store.queues.list_keys(under="s/") == ["x", "y"]
    assert store.queues.num_keys(under="s/") == 2


def test_a_blocked_pop_is_woken_by_the_watch_not_by_polling(store, etcd, prefix):
    clock = FakeClock()  # never advanced: only the watch event can end this wait
    got: list[bytes] = []
    popper = threading.Thread(target=lambda: got.append(store.queues.pop("q", True, 60,
                                                                    clock=clock)),
                              name="test-blocked-pop")
    popper.start()
    clock.wait_for_waiters(1)
    ranges, txns = rpc_count(store.registry, "range"), rpc_count(store.registry, "txn")
    other = _another(etcd, prefix)
    try:
        other.queues.push("q", "hello")
        popper.join(10)
        assert got == [b"hello"]
        # Woken once: one range for the new item, one guarded delete. No poll.
        assert rpc_count(store.registry, "range") - ranges == 1
        assert rpc_count(store.registry, "txn") - txns == 1
    finally:
        other.close()
        popper.join(10)


def test_pop_times_out_on_the_clock_and_close_releases_a_popper(store):
    clock = FakeClock()
    errors: list[BaseException] = []

    def pop() -> None:
        try:
            store.queues.pop("empty", True, 5, clock=clock)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            errors.append(exc)

    t = threading.Thread(target=pop, name="test-pop-timeout")
    t.start()
    clock.wait_for_waiters(1)
    clock.advance(5)
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], StoreTimeoutError)
    t = threading.Thread(target=pop, name="test-pop-close")
    t.start()
    clock.wait_for_waiters(1)
    store.close()
    t.join(10)
    assert len(errors) == 2 and isinstance(errors[1], StoreClosedError)


def test_a_lost_race_costs_one_txn_that_already_names_the_next_item(store, etcd, prefix):
    rival = _another(etcd, prefix)
    try:
        store.queues.push("q", "first")
        store.queues.push("q", "second")
        real_call = store._conn.call
        raced = []

        def call(method, request, **kwargs):
            response = real_call(method, request, **kwargs)
            if method == "range" and not raced:  # A has read the head; B takes it now
                raced.append(rival.queues.pop("q"))
            return response

        store._conn.call = call
        ranges, txns = rpc_count(store.registry, "range"), rpc_count(store.registry, "txn")
        assert store.queues.pop("q", block=False) == b"second"
        assert raced == [b"first"]
        assert rpc_count(store.registry, "range") - ranges == 1  # no re-read after losing
        assert rpc_count(store.registry, "txn") - txns == 2  # the lost delete, the won one
    finally:
        rival.close()


def test_one_push_wakes_one_popper_per_store(store, etcd, prefix):
    results: list[bytes] = []
    lock = threading.Lock()

    def pop() -> None:
        value = store.queues.pop("q", timeout=60)
        with lock:
            results.append(value)

    # Counted from before the poppers start: the first popper's first look (it holds the
    # queue's gate; the others wait for it, asking nothing) may be in flight after it
    # registered as a waiter.
    ranges, txns = rpc_count(store.registry, "range"), rpc_count(store.registry, "txn")
    threads = [threading.Thread(target=pop, name=f"test-popper-{i}") for i in range(4)]
    for t in threads:
        t.start()
    eventually(lambda: store.stats()["waiters"] >= 1, what="a popper parked")
    pusher = _another(etcd, prefix)
    try:
        pusher.queues.push("q", "only")
        eventually(lambda: len(results) == 1, what="one pop")
        # The first popper's look while the queue was empty, its range and delete once
        # woken; the next in line looks once (a range) and parks. Without the in-process
        # gate all four would range and try the delete.
        assert rpc_count(store.registry, "txn") - txns == 1
        assert rpc_count(store.registry, "range") - ranges <= 3
        for i in range(3):
            pusher.queues.push("q", f"more{i}")
        for t in threads:
            t.join(30)
        assert sorted(results) == [b"more0", b"more1", b"more2", b"only"]
    finally:
        pusher.close()


_POPPER = textwrap.dedent("""
    import json, sys
    from cachedstore import EtcdStore
    endpoint, prefix = sys.argv[1], sys.argv[2]
    got = []
    with EtcdStore(endpoints=[endpoint], prefix=prefix) as store:
        print("READY", flush=True)
        while True:
            value = store.queues.pop("jobs", timeout=60).decode()
            if value == "STOP":
                break
            got.append(int(value))
    print(json.dumps(got), flush=True)
""")


def test_every_item_is_popped_exactly_once_by_concurrent_processes(store, etcd, prefix):
    procs = [subprocess.Popen([sys.executable, "-c", _POPPER, etcd.endpoint, prefix],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "READY"
        n = 60
        for i in range(n):
            store.queues.push("jobs", str(i))
        for _ in procs:
            store.queues.push("jobs", "STOP")
        popped = []
        for p in procs:
            out, _ = p.communicate(timeout=60)
            mine = json.loads(out.strip().splitlines()[-1])
            assert mine == sorted(mine)  # each popper sees FIFO order
            popped.extend(mine)
        assert sorted(popped) == list(range(n))  # each item exactly once
        assert store.queues.length("jobs") == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_emptiness_is_remembered_until_an_item_is_put(store, etcd, prefix):
    txns = rpc_count(store.registry, "txn")
    assert not store.queues.is_nonempty("q")
    assert rpc_count(store.registry, "txn") - txns == 1  # both counts in one Txn
    # The knowledge is a waiter nobody blocks on: the watch may go on pacing (torch's
    # check/wait of a missing key lands here, and that knowledge stays for good).
    assert store._cache.n_waiters == 2 and not store._cache.awaited()
    assert not store.queues.is_nonempty("q") and not store.queues.is_nonempty("other")
    assert rpc_count(store.registry, "txn") - txns == 1  # remembered: no request
    other = _another(etcd, prefix)
    try:
        other.queues.push("q", "x")  # seen through this store's watch
        eventually(lambda: store.queues.is_nonempty("q"), what="push seen")
        assert not store.queues.is_nonempty("other")  # that queue is still empty
        store.queues.pop("q")
        assert not store.queues.is_nonempty("q")
    finally:
        other.close()


def test_wait_until_asks_again_on_each_change_of_its_names_prefixes_and_queues(etcd, prefix):
    """``EtcdStore.wait_until``: the predicate is asked at once, then after each change the
    watch applies to one of the names, a key under a prefix, or an item of a queue -- a
    change elsewhere wakes nothing -- and the timeout raises StoreTimeoutError."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store, \
            EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as other:
        asked: list[int] = []
        goal = threading.Event()

        def ready() -> bool:
            asked.append(len(asked))
            return goal.is_set()

        def writes() -> None:
            eventually(lambda: len(asked) == 1, what="the first ask")
            other.set("unrelated", "x")  # wakes nothing
            other.set("name", "1")
            eventually(lambda: len(asked) == 2, what="asked after the name's put")
            other.set("dir/a", "1")
            eventually(lambda: len(asked) == 3, what="asked after a put under the prefix")
            goal.set()
            other.queues.push("q", "item")

        writer = threading.Thread(target=writes)
        writer.start()
        store.wait_until(ready, names=["name"], prefixes=["dir/"], queues=["q"], timeout=60)
        writer.join(10)
        assert len(asked) == 4  # at once, name, dir/a, the queue's item
        with pytest.raises(StoreTimeoutError, match="waiting for a change of"):
            store.wait_until(lambda: False, names=["never"], timeout=0.2)
