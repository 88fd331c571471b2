"""``store.versioned``: versioned reads and conditional writes (what the rendezvous backend
uses)."""

from __future__ import annotations

import pytest

from cachedstore import EtcdStore, Versioned


@pytest.fixture
def store(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as s:
        yield s


def test_read_returns_value_and_metadata(store):
    assert store.versioned.read("k") is None
    store.set("k", "v1")
    first = store.versioned.read("k")
    assert isinstance(first, Versioned)
    assert first.value == b"v1" and first.version == 1 and first.lease == 0
    store.set("k", "v2")
    second = store.versioned.read("k")
    assert second.version == 2 and second.mod_revision > first.mod_revision


def test_put_if_absent_then_on_mod_revision(store):
    ok, created = store.versioned.put_if("k", "a", mod_revision=0)
    assert ok and created.value == b"a" and created.version == 1
    assert store.versioned.read("k").mod_revision == created.mod_revision
    lost, current = store.versioned.put_if("k", "b", mod_revision=0)
    assert not lost and current == store.versioned.read("k")
    ok, swapped = store.versioned.put_if("k", "c", mod_revision=created.mod_revision)
    assert ok and swapped.version == 2 and store.get("k") == b"c"
    stale, current = store.versioned.put_if("k", "d", mod_revision=created.mod_revision)
    assert not stale and current.value == b"c"
    assert store.get("k") == b"c"


def test_put_if_on_absent_key_with_a_token_fails_and_says_absent(store):
    assert store.versioned.put_if("gone", "x", mod_revision=12345) == (False, None)
