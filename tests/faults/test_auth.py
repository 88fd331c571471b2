"""etcd simple auth tokens that expire (``--auth-token-ttl``): reads, writes and the watch
re-authenticate by themselves."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from cachedstore import EtcdStore, StoreConfig
from cachedstore.server import LocalEtcd

from . import follows_by_watch, restarts, sample, wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(90)

TTL = 2
ROOT_PASSWORD = "r00t-Pw-4-expiry"


def _authentications(store: EtcdStore) -> float:
    return sample(store, "cachedstore_etcd_requests_total",
                  {"method": "authenticate", "code": "ok"})


def _let_token_expire() -> None:
    # A simple token dies TTL seconds after its last use; etcd sweeps expired tokens once
    # a second. This wait is the token's lifetime, not a race; every step below also checks
    # through the metrics that a re-authentication really happened.
    time.sleep(TTL + 1.5)


def test_expired_tokens_are_renewed(etcd_factory: Callable[..., LocalEtcd], prefix: str
                                    ) -> None:
    server = etcd_factory(auth_token_ttl=TTL)
    server.enable_auth(ROOT_PASSWORD)

    def put(value: str) -> None:
        server.etcdctl("put", prefix + "k", value, user="root", password=ROOT_PASSWORD)

    with FaultProxy(server.endpoint, max_lifetime=80) as proxy, EtcdStore(
            endpoints=[proxy.endpoint], prefix=prefix, user="root", password=ROOT_PASSWORD,
            request_timeout=3.0,
            # The periodic access check would renew the token before step 3 needs it
            # expired; it is tested in test_revocation.py.
            config=StoreConfig(auth_check_interval=None)) as store:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        assert _authentications(store) == 1

        # 1. Reads and writes after expiry: one transparent re-authentication.
        _let_token_expire()
        assert store.get("uncached", None) is None
        assert _authentications(store) == 2
        _let_token_expire()
        store.set("k", "v2")
        assert _authentications(store) == 3
        assert store.get("k") == b"v2"

        # 2. The established watch keeps delivering after its token expired.
        _let_token_expire()
        follows_by_watch(store, put, "k", b"v2", "v3")

        # 3. A watch re-created with an expired token re-authenticates and resumes (the
        # token is still expired: step 2 used only cache hits, and etcdctl its own token).
        before = _authentications(store)
        proxy.reset()
        wait_until(lambda: restarts(store, "auth") >= 1, 10,
                   "the watch to be refused with its expired token")
        wait_until(lambda: store.watch_healthy, 10, "the watch to re-authenticate")
        assert _authentications(store) > before
        follows_by_watch(store, put, "k", b"v3", "v4")
        store.set("k", "v5")
        assert store.get("k") == b"v5"
