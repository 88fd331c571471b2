"""``store.leases`` (``cachedstore/leases.py``) on a real etcd: grant, time to live, revoke,
and the keys a lease carries."""

from __future__ import annotations

import pytest

from cachedstore import EtcdStore, InvalidInputError, InvalidTypeError, LeaseNotFoundError
from cachedstore.leases import Leases


@pytest.fixture
def store(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as s:
        yield s


def test_lease_attaches_and_revoke_deletes(store):
    assert isinstance(store.leases, Leases)
    lease = store.leases.grant(30)
    ok, kv = store.versioned.put_if("leased", "x", mod_revision=0, lease=lease)
    assert ok and store.versioned.read("leased").lease == lease
    store.leases.revoke(lease)
    assert store.versioned.read("leased") is None
    store.leases.revoke(lease)  # revoking twice is not an error
    with pytest.raises(LeaseNotFoundError):
        store.versioned.put_if("leased", "y", mod_revision=0, lease=lease)
    assert store.versioned.read("leased") is None


@pytest.mark.parametrize(("ttl", "error"), [(0, InvalidInputError), (-1, InvalidInputError),
                                           (float("inf"), InvalidInputError),
                                           (float("nan"), InvalidInputError),
                                           ("30", InvalidTypeError)])
def test_grant_refuses_a_bad_ttl(store, ttl, error):
    with pytest.raises(error, match="ttl"):
        store.leases.grant(ttl)


def test_lease_time_to_live_says_what_is_left_and_refuses_what_is_not_a_lease(store):
    lease = store.leases.grant(30)
    left, granted = store.leases.time_to_live(lease)
    assert granted == 30 and 0 < left <= 30
    store.leases.revoke(lease)
    assert store.leases.time_to_live(lease) is None  # revoked
    assert store.leases.time_to_live(2**63 - 1) is None  # never granted
    for bad in (0, -1, True, 2**63, "1", 1.0):
        with pytest.raises(InvalidTypeError, match="lease"):
            store.leases.time_to_live(bad)
