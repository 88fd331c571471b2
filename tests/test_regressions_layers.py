"""Regression tests for the layers that feed the coherence core (issue 24), each against a
real etcd, each interleaving forced through the store's own hooks (``after_read`` of the
scope opener, a held watch) or etcd's own limits: never a sleep.

1. a directory scope's snapshot must not overwrite what a key scope inside it applied;
2. the parts of two counters never coincide, whatever their names;
3. an ``add`` never raises for an upkeep step after etcd applied it;
4. a queue's remembered emptiness is not trusted while the watch replays an outage;
5. a blocking ``get`` and ``aget`` answer a deleted counter alike.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cachedstore import EtcdStore
from cachedstore.counters import Parts
from cachedstore.keys import KeySpace
from cachedstore.server import LocalEtcd
from tests.util import eventually, raw_client

pytestmark = pytest.mark.timeout(120)


def _store(server: LocalEtcd, prefix: str, **kwargs: Any) -> EtcdStore:
    return EtcdStore(endpoints=[server.endpoint], prefix=prefix, **kwargs)


# -- 1. a directory scope's snapshot and the key scopes inside it ----------------------------
def test_directory_snapshot_keeps_what_a_key_scope_applied(own_etcd: LocalEtcd) -> None:
    """``d/z`` has its own key scope. While the directory scope ``d/`` opens (its snapshot
    read at R, not yet installed), another client puts ``d/z`` (P > R), the key scope
    applies it, and four more puts evict it from a cache of 3 (no mark: it was not ahead
    of its own scope). Installing the snapshot's state of ``d/z`` (as of R) would serve
    the old value for good; the key scope's state must stay."""
    prefix = "/layers/dirsnap/"
    writer = raw_client(own_etcd)
    writer.put(prefix + "d/z", "old")
    with _store(own_etcd, prefix, watch_scope="touched", cache_size=3) as store:
        assert store.get("d/z") == b"old"
        for i in range(6):  # 7 key scopes in d/: the 8th name read opens the directory
            assert store.get(f"d/k{i}", default=None) is None
        assert store._cache.scope_of("d/k6") is None
        held = threading.Event()

        def between_read_and_open(scope_keys: list[str]) -> None:
            if "dd/" not in scope_keys or held.is_set():
                return
            held.set()
            newer = writer.put(prefix + "d/z", "new").header.revision
            eventually(lambda: store._cache.scope_of("d/z").applied >= newer,
                       what="d/z's key scope applied the put")
            for i in range(4):  # events of covered names install entries and evict d/z
                writer.put(prefix + f"d/k{i}", f"v{i}")
            eventually(lambda: "d/z" not in store._cache._lru, what="d/z evicted")
            assert "d/z" not in store._cache.marks()

        store._opener.after_read = between_read_and_open
        assert store.get("d/k6", default=None) is None  # opens the directory scope
        store._opener.after_read = None
        assert held.is_set()
        assert sorted(s.key for s in store._cache._scopes.values())[0] == "dd/"
        assert store.get("d/z") == b"new"
        assert store._cache.peek("d/z")[0] == b"new"


# -- 2. counters' parts: one set per name ------------------------------------------------------
def test_a_short_name_cannot_spell_a_long_names_parts(etcd: LocalEtcd, prefix: str) -> None:
    """A name over 200 bytes names its parts by a digest; the short name that spells that
    digest's directory used to share the parts, so its creation cleared the long
    counter's increments (an acknowledged add lost)."""
    import hashlib

    long_name = "L" * 300
    digest = hashlib.blake2b(long_name.encode(), digest_size=20).hexdigest()
    keys = KeySpace(prefix, 1_572_864)
    for spelling in ("~" + digest, "%%" + digest, "%25%25" + digest):
        assert Parts(keys, spelling).start != Parts(keys, long_name).start
    with _store(etcd, prefix) as store:
        assert store.add(long_name, 2) == 2  # creates it
        assert store.add(long_name, 2) == 4  # a delta part
        assert store.add("~" + digest, 2) == 2  # creates the short one (clears its parts)
        assert store.add("%%" + digest, 2) == 2
        assert store.add(long_name, 0) == 4
        assert store.get(long_name) == b"4"


def test_part_names_are_injective_over_hostile_names() -> None:
    """Distinct names, including ones built to spell escapes, digests and separators,
    never share a parts directory, and none is a prefix of another's."""
    keys = KeySpace("/p/", 1_572_864)
    names = ["a", "a/", "a/b", "a%2Fb", "~", "%%", "%", "%25", "x" * 200, "x" * 201,
             "x" * 201 + "y", "\udcff", "ones", "delta/", "a/ones", "é", "%C3%A9"]
    starts = [Parts(keys, n).start for n in names]
    assert len(set(starts)) == len(names)
    for i, a in enumerate(starts):
        for j, b in enumerate(starts):
            assert i == j or not b.startswith(a)


# -- 3. an add never raises after etcd applied it -------------------------------------------------
def test_folds_fit_etcds_max_txn_ops_and_adds_never_raise_after_commit(
        etcd_factory: Any) -> None:
    """etcd started with ``--max-txn-ops 16`` and the store configured to match: past 64
    deltas the fold used to carry ~122 operations, etcd refused it after the add had
    committed, and the add raised (a retrying caller double-counts). Now every add
    returns, and the counter holds exactly the sum of the adds."""
    server = etcd_factory(extra_args=["--max-txn-ops", "16"])
    with _store(server, "/layers/fold/", max_txn_ops=16) as store:
        total = 0
        for _ in range(70):
            total += 2
            assert store.add("c", 2) == total
        assert store.add("c", 0) == total == 140
        assert store.get("c") == b"140"
        deltas = raw_client(server).get_prefix(b"/layers/fold/\xff\xffcounter/c/delta/")
        assert len(list(deltas)) < 64  # folded, 14 at a time


def test_a_fold_etcd_refuses_does_not_fail_the_add(etcd_factory: Any) -> None:
    """A store told etcd takes more operations per Txn than it does: every fold is
    refused. The adds still return their values (the fold is upkeep) and count once."""
    server = etcd_factory(extra_args=["--max-txn-ops", "16"])
    with _store(server, "/layers/refused/", max_txn_ops=128) as store:
        for i in range(1, 71):
            assert store.add("c", 2) == 2 * i
        assert store.get("c") == b"140"


# -- 4. a queue's remembered emptiness during a replay ---------------------------------------------
def test_queue_emptiness_is_not_trusted_while_the_watch_replays(etcd: LocalEtcd,
                                                               prefix: str) -> None:
    """The store remembers queue ``q`` empty. Its stream breaks and is held down while
    another client pushes an item, then writes ``k``. The stream comes back and its replay
    of both is held before it is applied: the store reads ``k``'s new value (from etcd),
    so it must not say ``q`` is empty."""
    from cachedstore import queues

    writer = raw_client(etcd)
    with _store(etcd, prefix) as store:
        watcher = store._watcher
        assert watcher is not None
        assert not store.queues.is_nonempty("q")  # counted, and remembered
        held_down, release_stream = threading.Event(), threading.Event()
        original_stream_once = watcher._stream_once

        def stream_once() -> str:  # the stream after the break waits until released
            held_down.set()
            assert release_stream.wait(30)
            return original_stream_once()

        watcher._stream_once = stream_once  # type: ignore[method-assign]
        original_apply = store._cache.apply_events
        replay_held, release_replay = threading.Event(), threading.Event()

        def apply_events(events: Any, revision: int, scope: Any = None) -> None:
            if release_stream.is_set():
                replay_held.set()
                assert release_replay.wait(30)
            original_apply(events, revision, scope)

        store._cache.apply_events = apply_events  # type: ignore[method-assign]
        try:
            watcher._call.cancel()
            assert held_down.wait(10)
            assert not store.watch_healthy
            item = prefix + queues.item_prefix("q") + "0123456789abcdef"  # as a push
            writer.put(item.encode("utf-8", "surrogateescape"), "item")
            written = writer.put(prefix + "k", "after-the-push").header.revision
            release_stream.set()
            assert replay_held.wait(10)
            assert store.watch_healthy and store._cache.floor >= written
            assert store.get("k") == b"after-the-push"
            assert store.queues.is_nonempty("q")  # torch's check and wait ask this
        finally:
            release_stream.set()
            release_replay.set()
            store._cache.apply_events = original_apply  # type: ignore[method-assign]
        eventually(lambda: store._cache.floor == 0, what="the replay applied")
        assert store.queues.is_nonempty("q")


# -- 5. blocking get and aget agree on a counter deleted under them -----------------------------
@pytest.mark.parametrize("front", ["get", "aget", "mget", "amget"])
def test_a_counter_deleted_before_its_value_is_read_is_waited_for_again(
        etcd: LocalEtcd, prefix: str, front: str) -> None:
    """A blocking read finds counter ``c``'s marker; before the counter's value is read,
    another client deletes it. Every blocking front waits for the key to exist again (one
    behaviour, docs/guarantees.md): the write that recreates it ends the wait."""
    writer = raw_client(etcd)
    with _store(etcd, prefix) as store:
        assert store.add("c", 5) == 5
        reads = store._reads
        original = reads.read_counters
        deleted = threading.Event()

        def read_counters(names: Any) -> Any:
            if not deleted.is_set():
                deleted.set()
                writer.delete(prefix + "c")
            return original(names)

        reads.read_counters = read_counters  # type: ignore[method-assign]

        def recreate() -> None:
            assert deleted.wait(10)
            eventually(lambda: store._cache.n_waiters > 0, what="the read waits again")
            writer.put(prefix + "c", "7")

        helper = threading.Thread(target=recreate)
        helper.start()
        try:
            if front == "get":
                got = store.get("c", timeout=20)
            elif front == "mget":
                got = store.mget(["c"], timeout=20)[0]
            elif front == "aget":
                got = asyncio.run(store.aget("c", timeout=20))
            else:
                got = asyncio.run(store.amget(["c"], timeout=20))[0]
        finally:
            helper.join(20)
        assert got == b"7"


# -- found by the simulation -------------------------------------------------------------------
def test_a_scopes_opening_never_caches_a_snapshot_name_as_absent(etcd: LocalEtcd,
                                                                  prefix: str) -> None:
    """Found by the whole-store simulation: an ``mget`` of 8 names in ``d/`` opens the
    directory scope; its snapshot holds ``d/k6`` (and ``d/z``), and every asked name the
    snapshot lacks is cached as absent. In a cache of 2, installing those evicted
    ``d/k6`` (no mark: not ahead of the watch) and then "``d/k6`` absent" was installed
    with the rest: the mget answered None for a key etcd held."""
    writer = raw_client(etcd)
    writer.put(prefix + "d/k6", "here")
    writer.put(prefix + "d/z", "there")
    with _store(etcd, prefix, watch_scope="touched", cache_size=2) as store:
        # The read-through under mget, with the names in a fixed order (mget's own order
        # follows a set's): d/k6 last, so its "absent" comes after 7 others evicted it.
        names = [f"d/k{i}" for i in (0, 1, 2, 3, 4, 5, 7, 6)]
        got = store._reads.fetch(names)
        assert got["d/k6"] == b"here"
        assert [got[n] for n in names if n != "d/k6"] == [None] * 7
        assert store.get("d/k6") == b"here"
        assert store.mget([f"d/k{i}" for i in range(8)], default=None) == \
            [None] * 6 + [b"here", None]
