"""``store.versioned.read_many`` and ``put_many_if`` (``cachedstore/guarded.py``) on a
real etcd: one revision for every key read, writes only when the guard holds, and the
writes recorded through the coherence gate (read-your-writes with the watch held)."""

from __future__ import annotations

import pytest
from test_coherence import held_watch_apply, open_store
from util import raw_client

from cachedstore import InvalidInputError, InvalidTypeError, LeaseNotFoundError, Snapshot
from cachedstore.counters import MARK

pytestmark = pytest.mark.timeout(60)


def test_read_many_reads_names_and_prefixes_at_one_revision(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.set("a", "1")
        store.mset({"dir/x": "2", "dir/y": "3", "dirt": "no"})
        snap = store.versioned.read_many(["a", "missing"], ["dir/"])
        assert isinstance(snap, Snapshot)
        assert list(snap.found) == ["a", "dir/x", "dir/y"]  # etcd's key order
        assert snap.found["dir/y"].value == b"3"
        assert snap.revision == raw.get(prefix + "a")[1].response_header.revision
        assert snap.found["a"].mod_revision < snap.found["dir/x"].mod_revision
        store.add("n", 5)  # a counter reads as its decimal, as read() gives it
        store.add("n", 2)
        assert store.versioned.read_many(["n"]).found["n"].value == b"7"


def test_read_many_refuses_what_etcd_would(etcd, prefix):
    with open_store(etcd, prefix, max_txn_ops=4) as store:
        with pytest.raises(InvalidInputError, match="at least one"):
            store.versioned.read_many()
        with pytest.raises(InvalidInputError, match="at most 4"):
            store.versioned.read_many([f"k{i}" for i in range(5)])
        with pytest.raises(InvalidInputError, match="reserved"):
            store.versioned.read_many([b"\xff\xffx"])
        with pytest.raises(InvalidInputError, match="empty"):
            store.versioned.read_many([], [""])


def test_put_many_if_writes_only_when_every_guard_holds(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.mset({"guard": "g", "old": "o"})
        guard = store.versioned.read("guard").mod_revision
        ok, snap = store.versioned.put_many_if({"guard": guard, "absent": 0}, {"a": "1", "b": "2"},
                                     ["old"], names=["guard"], prefixes=["a", "b", "o"])
        assert ok
        assert {n: v.value for n, v in snap.found.items()} == {"a": b"1", "b": b"2",
                                                                "guard": b"g"}
        assert snap.found["a"].mod_revision == snap.revision  # read after the writes
        assert raw.get(prefix + "old")[0] is None
        # A guard that no longer holds: nothing written, the snapshot read instead.
        ok, snap = store.versioned.put_many_if({"guard": guard, "a": 0}, {"c": "3"}, names=["c", "a"])
        assert not ok and list(snap.found) == ["a"]
        assert raw.get(prefix + "c")[0] is None
        store.set("guard", "moved")
        ok, _ = store.versioned.put_many_if({"guard": guard}, {"c": "3"})
        assert not ok and raw.get(prefix + "c")[0] is None


def test_put_many_if_is_seen_at_once_by_the_same_store(etcd, prefix):
    """Read-your-writes: the writes reach the cache through the gate, not only through
    the watch (held here)."""
    with open_store(etcd, prefix) as store:
        store.set("k", "old")
        assert store.get("k") == b"old"
        with held_watch_apply(store) as (_gate, held, _):
            store.set("other", "x")  # the watch is held before applying this
            assert held.wait(10)
            ok, _ = store.versioned.put_many_if({}, {"k": "new"}, ["other"])
            assert ok
            assert store.get("k") == b"new"
            assert store.get("other", default=None) is None


def test_put_many_if_attaches_the_lease(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        lease = store.leases.grant(30)
        assert store.versioned.put_many_if({}, {"leased": "v"}, lease=lease)[0]
        assert raw.get(prefix + "leased")[1].lease_id == lease
        store.leases.revoke(lease)
        assert raw.get(prefix + "leased")[0] is None
        with pytest.raises(LeaseNotFoundError):
            store.versioned.put_many_if({}, {"leased": "v"}, lease=lease)


@pytest.mark.parametrize("call, error, match", [
    (lambda s: s.versioned.put_many_if({}, {"a": "1"}, ["a"]), InvalidInputError, "both"),
    (lambda s: s.versioned.put_many_if({}, {"a": "1", b"a": "2"}), InvalidInputError, "twice"),
    (lambda s: s.versioned.put_many_if({"a": -1}, {}), InvalidTypeError, "mod_revision"),
    (lambda s: s.versioned.put_many_if({"a": True}, {}), InvalidTypeError, "mod_revision"),
    (lambda s: s.versioned.put_many_if({}, {"a": "1"}, lease=-2), InvalidTypeError, "lease"),
    (lambda s: s.versioned.put_many_if({}, {"a": MARK + b"1"}), InvalidInputError, "reserved"),
    (lambda s: s.versioned.put_many_if({f"g{i}": 0 for i in range(5)}, {}), InvalidInputError,
     "compares"),
    (lambda s: s.versioned.put_many_if({}, {"a": "1", "b": "2"}, names=["c", "d", "e"]),
     InvalidInputError, "at most 4"),
    (lambda s: s.versioned.put_many_if({}, {"a": "x" * 3000}), InvalidInputError, "bytes"),
])
def test_put_many_if_refuses_bad_input_and_writes_nothing(etcd, prefix, call, error, match):
    with open_store(etcd, prefix, max_txn_ops=4, max_request_bytes=2048) as store:
        with pytest.raises(error, match=match):
            call(store)
        assert store.list_keys() == []


def test_put_many_if_unchanged_since_guards_prefixes_and_name_ranges(etcd, prefix):
    """A name stands for its prefix; a pair for the names from first to last, both
    included and nothing past last (etcd's range end is last + NUL)."""
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.mset({"d/a": "1", "d/b": "2", "d/c": "3", "e": "4"})
        since = store.versioned.read_many(["e"]).revision
        store.set("d/bb", "past the range")  # after ``since``, outside ("d/a", "d/b")
        store.set("d/c", "moved")  # after ``since``, outside too
        ok, _ = store.versioned.put_many_if({}, {"w1": "x"}, unchanged_since={("d/a", "d/b"): since})
        assert ok
        store.set("d/b", "moved")  # the range's last name
        ok, _ = store.versioned.put_many_if({}, {"w2": "x"}, unchanged_since={("d/a", "d/b"): since})
        assert not ok and raw.get(prefix + "w2")[0] is None
        ok, _ = store.versioned.put_many_if({}, {"w3": "x"}, unchanged_since={"d/": since})
        assert not ok and raw.get(prefix + "w3")[0] is None
        ok, _ = store.versioned.put_many_if({}, {"w4": "x"}, unchanged_since={"e": since,
                                                                   ("d/x", "d/z"): since})
        assert ok  # nothing under "e" nor from "d/x" to "d/z" changed
        now = store.versioned.read_many(["e"]).revision
        assert store.versioned.put_many_if({}, {"w5": "x"}, unchanged_since={"d/": now})[0]


@pytest.mark.parametrize("scope, error, match", [
    (("d/b", "d/a"), InvalidInputError, "first name sorts after its last"),
    (("d/a", "d/b", "d/c"), InvalidTypeError, "pair"),
    ("", InvalidInputError, "empty"),
])
def test_put_many_if_refuses_a_bad_unchanged_since_scope(etcd, prefix, scope, error, match):
    with open_store(etcd, prefix) as store:
        with pytest.raises(error, match=match):
            store.versioned.put_many_if({}, {"a": "1"}, unchanged_since={scope: 1})
        with pytest.raises(InvalidTypeError, match="revision"):
            store.versioned.put_many_if({}, {"a": "1"}, unchanged_since={"d/": -1})
        assert store.list_keys() == []
