"""The versioned read, conditional write and lease API (what the rendezvous backend uses)."""

from __future__ import annotations

import pytest

from cachedstore import EtcdStore, InvalidInputError, LeaseNotFoundError, Versioned


@pytest.fixture
def store(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as s:
        yield s


def test_read_returns_value_and_metadata(store):
    assert store.read("k") is None
    store.set("k", "v1")
    first = store.read("k")
    assert isinstance(first, Versioned)
    assert first.value == b"v1" and first.version == 1 and first.lease == 0
    store.set("k", "v2")
    second = store.read("k")
    assert second.version == 2 and second.mod_revision > first.mod_revision


def test_put_if_absent_then_on_mod_revision(store):
    ok, created = store.put_if("k", "a", mod_revision=0)
    assert ok and created.value == b"a" and created.version == 1
    assert store.read("k").mod_revision == created.mod_revision
    lost, current = store.put_if("k", "b", mod_revision=0)
    assert not lost and current == store.read("k")
    ok, swapped = store.put_if("k", "c", mod_revision=created.mod_revision)
    assert ok and swapped.version == 2 and store.get("k") == b"c"
    stale, current = store.put_if("k", "d", mod_revision=created.mod_revision)
    assert not stale and current.value == b"c"
    assert store.get("k") == b"c"


def test_put_if_on_absent_key_with_a_token_fails_and_says_absent(store):
    assert store.put_if("gone", "x", mod_revision=12345) == (False, None)


def test_lease_attaches_and_revoke_deletes(store):
    lease = store.grant_lease(30)
    ok, kv = store.put_if("leased", "x", mod_revision=0, lease=lease)
    assert ok and store.read("leased").lease == lease
    store.revoke_lease(lease)
    assert store.read("leased") is None
    store.revoke_lease(lease)  # revoking twice is not an error
    with pytest.raises(LeaseNotFoundError):
        store.put_if("leased", "y", mod_revision=0, lease=lease)
    assert store.read("leased") is None


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan")])
def test_grant_lease_refuses_bad_ttl(store, ttl):
    with pytest.raises(InvalidInputError):
        store.grant_lease(ttl)
