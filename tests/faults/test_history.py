"""etcd's history going back (rule 10 of cachedstore/cache.py), on a real etcd.

An etcd restored from a backup without ``--bump-revision`` comes back with the same cluster
id, at an older revision: what was written after the backup is gone, and the revisions
it had are handed out again to new writes. etcd#14370 (a lone 3.5.1-3.5.4 member losing
acknowledged writes to a crash) and etcd#13766 (members diverging after a crash, 3.5.0-3.5.2)
look the same to a client. A store that kept its cache would serve the lost values for
good: its watch resumes after the lost revisions and never hears of the keys' new states.

Here the restore is made on purpose (``etcdutl snapshot restore`` into the member's data
dir), so the history goes back every time, at a known revision.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachedstore import EtcdStore
from cachedstore.clock import SYSTEM_CLOCK
from cachedstore.server import LocalEtcd
from tests.util import held_opening, restore_backup, save_backup

from . import sample, wait_until

pytestmark = pytest.mark.timeout(90)


def _store(server: LocalEtcd, prefix: str, **kwargs: object) -> EtcdStore:
    return EtcdStore(endpoints=[server.endpoint], prefix=prefix, request_timeout=2.0,
                     connect_timeout=10.0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("watch_scope", ["prefix", "touched"])
def test_a_store_that_only_reads_its_cache_sees_the_history_go_back(
        etcd_factory: Callable[..., LocalEtcd], prefix: str, tmp_path: Path,
        watch_scope: str) -> None:
    """A store that sends etcd nothing after the restore (its reads are hits) finds out
    when its watch is created again on a member behind what it applied: one linearizable
    read shows etcd's history went back, and the cache starts over. Without that check
    the store keeps serving the lost values (its watch resumes after them)."""
    server = etcd_factory()
    with _store(server, prefix) as writer, \
            _store(server, prefix, watch_scope=watch_scope) as reader:
        writer.set("a", "backed up")
        assert reader.get("a", consistent=True) == b"backed up"
        backed_up = save_backup(server, tmp_path / "backup.db")
        for i in range(5):  # lost: revisions the restored etcd will hand out again
            writer.set("a", f"lost {i}")
        writer.set("b", "lost")
        assert reader.get("a", consistent=True) == b"lost 4"
        assert reader.get("b", consistent=True) == b"lost"
        applied = reader.watch_revision
        assert applied >= backed_up + 6
        watcher = reader._watcher  # noqa: SLF001
        set_up, removed_set_up = watcher._set_up, []  # noqa: SLF001

        def recorded(revision: int, scope: Any) -> None:
            if scope is not None and scope.removed:
                removed_set_up.append(scope)
            set_up(revision, scope)

        watcher._set_up = recorded  # type: ignore[method-assign]  # noqa: SLF001

        restore_backup(server, tmp_path / "backup.db", tmp_path)
        # No read until the watch is back (created again, serving): only it can find out.
        wait_until(lambda: reader._watcher.restarts and reader.watch_healthy,  # noqa: SLF001
                   30, "the reader's watch created again")
        assert reader.get("a") == b"backed up"  # not "lost 4"
        assert reader.get("b", default=None) is None
        assert reader.watch_revision == backed_up
        assert reader._cache.rewinds == 1  # noqa: SLF001
        assert sample(reader, "cachedstore_watch_restarts_total", {"reason": "rewound"}) == 1
        # The create that showed it (its check's range answered first, by the
        # connection) did not set the watch up on a scope the rewind removed.
        assert removed_set_up == []
        # The new history is followed: a write of another store is seen by the watch.
        writer.set("a", "after the restore")
        wait_until(lambda: reader.get("a") == b"after the restore", 10,
                   "the reader following the new history")


class _BackoffHolder:
    """The system's clock, but while ``hold`` is set the watch thread's back-off wait (on
    ``stopping``, the watcher's) blocks until ``release``: the watch stays between streams
    for as long as a test needs."""

    def __init__(self) -> None:
        self.stopping: threading.Event | None = None
        self.hold, self.held, self.release = (threading.Event(), threading.Event(),
                                              threading.Event())

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic()

    def sleep(self, seconds: float) -> None:
        SYSTEM_CLOCK.sleep(seconds)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event is self.stopping and self.hold.is_set():
            self.held.set()
            self.release.wait(60)
            return event.is_set()
        return SYSTEM_CLOCK.wait(event, timeout)


@contextlib.contextmanager
def _backed_up_store(server: LocalEtcd, prefix: str, tmp_path: Path, lost: int
                     ) -> Iterator[tuple[EtcdStore, _BackoffHolder]]:
    """A store whose watch thread the clock it is given can hold between streams: it
    wrote "a", a backup was saved to ``tmp_path/backup.db``, then it wrote "a" ``lost``
    times more (revisions a restore of the backup hands out again)."""
    clock = _BackoffHolder()
    with _store(server, prefix, clock=clock) as store:
        clock.stopping = store._watcher._stopping  # noqa: SLF001
        store.set("a", "backed up")
        save_backup(server, tmp_path / "backup.db")
        for i in range(lost):
            store.set("a", f"lost {i}")
        yield store, clock


def test_a_write_answered_at_an_older_revision_starts_the_cache_over(
        etcd_factory: Callable[..., LocalEtcd], prefix: str, tmp_path: Path) -> None:
    """The store's own write is answered at a revision older than the one it knew when it
    sent it: the cache starts over, and the write is not recorded at a number of the
    lost history (it is read again from etcd). The watch thread is held between streams
    (the restore broke its stream) until the write found the rewind: the restart reason
    ``rewound`` is still counted, once (it was lost when no stream was live to cancel)."""
    server = etcd_factory()
    with _backed_up_store(server, prefix, tmp_path, lost=5) as (store, clock):
        store.set("b", "lost")
        clock.hold.set()
        restore_backup(server, tmp_path / "backup.db", tmp_path)
        assert clock.held.wait(30), "the watch never began its back-off"
        store.set("c", "written after the restore")  # the first request after it
        assert store._cache.rewinds == 1  # noqa: SLF001
        clock.hold.clear()
        clock.release.set()
        wait_until(lambda: store.watch_healthy, 30, "the watch up")
        assert store._cache.rewinds == 1  # noqa: SLF001
        assert sample(store, "cachedstore_watch_restarts_total", {"reason": "rewound"}) == 1
        assert store.get("c") == b"written after the restore"
        assert store.get("a") == b"backed up"
        assert store.get("b", default=None) is None


def test_an_opening_that_finds_the_rewind_reads_no_further_chunk(
        etcd_factory: Callable[..., LocalEtcd], prefix: str) -> None:
    """A store watching what it touched opens one ``mget``'s scopes in chunks of
    ``max_txn_ops``; the first chunk's read finds etcd's history went back (made here by
    the core knowing a revision etcd never had). The scopes are gone and a root covers
    every name: no further chunk is read, and no scope is counted as open (the gauge
    stayed at 2 scopes that did not exist, and a read was sent for them)."""
    server = etcd_factory()
    with _store(server, prefix, watch_scope="touched", max_txn_ops=2) as store:
        names = ["a/x", "b/x", "c/x", "d/x"]
        for name in names:
            store.set(name, name)
        reads: list[list[str]] = []
        store._opener.after_read = reads.append  # noqa: SLF001
        cache = store._cache  # noqa: SLF001
        with cache._lock:  # noqa: SLF001
            cache._known = 10**9  # noqa: SLF001
        assert store.mget(names) == [name.encode() for name in names]
        assert cache.rewinds == 1 and not cache.scoped
        wait_until(lambda: store.watch_healthy, 30, "the watch up on the new root")
        assert len(reads) == 1, reads
        assert not store._opener._open  # noqa: SLF001
        assert sample(store, "cachedstore_watch_scopes") == 1


def _knows_a_lost_revision(store: EtcdStore) -> None:
    """Make the store's core know a revision etcd never had: to the store, etcd's next
    answer is one of a history that went back (as after a restore)."""
    cache = store._cache  # noqa: SLF001
    with cache._lock:  # noqa: SLF001
        cache._known = 10**9  # noqa: SLF001


def _push(store: EtcdStore) -> None:
    store.queues.push("q", "item")


def _pop(store: EtcdStore) -> None:
    assert store.queues.pop("q", block=False) == b"first"


def _failed_guard(store: EtcdStore) -> None:
    ok, _ = store.versioned.put_many_if({"g": 0}, {"c": "3"})  # "g" exists: refused
    assert not ok


def _failed_put_if(store: EtcdStore) -> None:
    from cachedstore import etcdapi

    key = store._keys.key("g")  # noqa: SLF001
    request = etcdapi.txn([etcdapi.absent(key)], [etcdapi.op_put(etcdapi.put(key, b"x"))])
    writes = store._writes  # noqa: SLF001
    assert not writes._put_if("g", request, b"x", writes._conn.deadline()).succeeded  # noqa: SLF001


def _consistent_read(store: EtcdStore) -> None:
    assert store.get("g", consistent=True) == b"guard"


def _queue_length(store: EtcdStore) -> None:
    assert store.queues.length("q") == 1


def _key_count(store: EtcdStore) -> None:
    assert store.num_keys() == 1


@pytest.mark.parametrize("request_", [_push, _pop, _failed_guard, _failed_put_if,
                                      _consistent_read, _queue_length, _key_count],
                         ids=["push", "pop", "failed guard", "failed put_if",
                              "consistent revision", "queue length", "key count"])
def test_every_answer_is_checked(etcd_factory: Callable[..., LocalEtcd], prefix: str,
                                 request_: Callable[[EtcdStore], None]) -> None:
    """Every key-value answer carries etcd's revision, and each is checked against what
    the store knew when it was sent (the connection does it for every range, Txn, put
    and delete): queue pushes, pops and counts, writes whose guard failed, the revision
    request of a consistent read. (Behind grpc-proxy the store's stream may never break:
    its own requests are then how it finds out.)"""
    server = etcd_factory()
    with _store(server, prefix) as store:
        store.set("g", "guard")
        store.queues.push("q", "first")
        cache = store._cache  # noqa: SLF001
        found_on: list[int] = []
        on_rewind = cache.on_rewind
        assert on_rewind is not None

        def recorded(*args: Any) -> None:
            found_on.append(threading.get_ident())
            on_rewind(*args)

        cache.on_rewind = recorded
        _knows_a_lost_revision(store)
        request_(store)
        assert cache.rewinds == 1
        assert found_on == [threading.get_ident()]  # by the request's answer
        wait_until(lambda: store.watch_healthy, 30, "the watch up on the new root")
        assert store.get("g") == b"guard"


class _RestoreAfterAnswer:
    """A store's connection whose first Txn answer is held back while etcd is restored
    from ``backup`` and the store finds out (by one range: the connection checks it);
    the answer, of the lost history, then reaches its caller."""

    def __init__(self, store: EtcdStore, server: LocalEtcd, backup: Path, scratch: Path,
                 clock: _BackoffHolder) -> None:
        self._real = store._writes._conn  # noqa: SLF001
        self._store, self._server, self._backup, self._scratch = store, server, backup, scratch
        self._clock = clock
        self.done = False

    def call(self, method: str, request: object, **kwargs: object) -> object:
        response = self._real.call(method, request, **kwargs)
        if method == "txn" and not self.done:
            self.done = True
            self._clock.hold.set()  # the watch thread stays between streams meanwhile
            restore_backup(self._server, self._backup, self._scratch)
            assert self._clock.held.wait(30), "the watch never began its back-off"
            self._store.num_keys()  # answered below what the store knew: a rewind
            assert self._store._cache.rewinds == 1  # noqa: SLF001
        return response

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_a_push_answered_before_the_rewind_is_not_installed_after_it(
        etcd_factory: Callable[..., LocalEtcd], prefix: str, tmp_path: Path) -> None:
    """A push etcd answered at a revision of the history it then lost reaches the cache
    after the store found the rewind: the item is not installed (its ticket predates the
    rewind). Recorded without a ticket, it waited in the new root's pending results and
    was installed over the root's snapshot (older than the lost revision): the cache held
    a queue item the restored etcd does not have."""
    server = etcd_factory()
    with _backed_up_store(server, prefix, tmp_path, lost=3) as (store, clock):
        store._writes._conn = _RestoreAfterAnswer(  # noqa: SLF001
            store, server, tmp_path / "backup.db", tmp_path, clock)
        store.queues.push("q", "lost item")
        clock.hold.clear()
        clock.release.set()
        wait_until(lambda: store.watch_healthy, 30, "the watch up on the new root")
        cache = store._cache  # noqa: SLF001
        assert [name for name in cache._lru if "q" in name] == []  # noqa: SLF001
        assert store.get("a") == b"backed up"
        assert store.queues.length("q") == 0


def test_a_rewind_found_during_another_threads_opening_does_not_wait_for_it(
        etcd_factory: Callable[..., LocalEtcd], prefix: str) -> None:
    """One thread's opening read is answered and held before its scopes open; another
    thread's request finds etcd's history went back meanwhile. That request returns at
    once (it waited for the opening, up to a request timeout: any request may find a
    rewind now, a blocking read's too); the opening then finds its scopes gone and
    counts none."""
    server = etcd_factory()
    with _store(server, prefix, watch_scope="touched") as store:
        store.set("a/x", "x")
        with held_opening(store, "a/x"):
            _knows_a_lost_revision(store)
            counted = threading.Event()
            finder = threading.Thread(target=lambda: (store.num_keys(), counted.set()),
                                      name="finder")
            finder.start()
            assert counted.wait(5), "the request that found the rewind waited"
        assert store._cache.rewinds == 1  # noqa: SLF001
        wait_until(lambda: store.watch_healthy, 30, "the watch up on the new root")
        assert not store._opener._open  # noqa: SLF001
        assert sample(store, "cachedstore_watch_scopes") == 1
        assert store.get("a/x") == b"x"


def test_a_fall_back_after_a_rewind_keeps_its_root_and_stays_quiet(
        etcd_factory: Callable[..., LocalEtcd], prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """An opening that decided to fall back to the whole prefix (too many scopes) while
    another thread's request found a rewind: the rewind's root already covers every
    name, so the fall-back neither warns of max_watches nor restarts the stream again."""
    server = etcd_factory()
    with _store(server, prefix, watch_scope="touched") as store:
        store.set("a/x", "x")
        _knows_a_lost_revision(store)
        store.num_keys()
        assert store._cache.rewinds == 1  # noqa: SLF001
        fell_back: list[object] = []
        opener = store._opener  # noqa: SLF001
        opener.fall_back = fell_back.append
        caplog.clear()
        with opener._lock:  # noqa: SLF001 -- as ensure() holds it when it collapses
            opener._collapse()  # noqa: SLF001
        assert fell_back == []
        assert not [r for r in caplog.records if "max_watches" in r.getMessage()]
        assert sample(store, "cachedstore_watch_scopes") == 1
