"""Access revoked while a store runs (issue 14, item 6).

etcd checks a watch's permission once, when it is created: after ``user delete`` or a
revoked role the open watch keeps delivering. The store re-checks its access every
``auth_check_interval`` and, once denied, stops serving: a cached ``get`` then raises
the permission error instead of returning the value.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cachedstore import AuthenticationError, EtcdPermissionError, EtcdStore, StoreConfig
from cachedstore.server import LocalEtcd

from . import restarts, served_from_cache, wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(60)

ROOT_PASSWORD = "r00t-Pw-revoke"
USER_PASSWORD = "b0b-Pw-revoke"
PREFIX = "/jobR/"
#: The interval used here; the documented bound is ``auth_check_interval`` plus one
#: request (measured: 1.0-1.1 s with a 1 s interval on loopback).
INTERVAL = 1.0
BOUND = INTERVAL + 2.0


@pytest.fixture
def server(etcd_factory: Callable[..., LocalEtcd]) -> LocalEtcd:
    """etcd with auth on: user ``bob`` whose only role, ``jobR``, covers ``/jobR/``."""
    server = etcd_factory()
    server.etcdctl("role", "add", "jobR")
    server.etcdctl("role", "grant-permission", "jobR", "--prefix=true", "readwrite", PREFIX)
    server.etcdctl("user", "add", "bob", "--interactive=false", input=USER_PASSWORD + "\n")
    server.etcdctl("user", "grant-role", "bob", "jobR")
    server.enable_auth(ROOT_PASSWORD)
    return server


@pytest.mark.parametrize("max_staleness", [None, 60.0], ids=["strict", "max_staleness"])
@pytest.mark.parametrize("revoke", ["revoke-permission", "delete-user"])
def test_revoked_access_stops_serving(server: LocalEtcd, revoke: str,
                                      max_staleness: float | None) -> None:
    """Also with bounded staleness opted in: a revoked user is not served what the cache
    holds for another ``max_staleness`` seconds."""
    config = StoreConfig(auth_check_interval=INTERVAL, max_staleness=max_staleness)
    with EtcdStore(endpoints=[server.endpoint], prefix=PREFIX, user="bob",
                   password=USER_PASSWORD, config=config, request_timeout=2.0) as store:
        store.set("k", "v")
        wait_until(lambda: served_from_cache(store, "k", b"v"), 5, "k served from the cache")

        if revoke == "revoke-permission":
            server.etcdctl("role", "revoke-permission", "jobR", "--prefix=true", PREFIX,
                           user="root", password=ROOT_PASSWORD)
            expected: type[Exception] = EtcdPermissionError
        else:
            server.etcdctl("user", "delete", "bob", user="root", password=ROOT_PASSWORD)
            expected = AuthenticationError
        took = wait_until(lambda: not store.watch_healthy, BOUND,
                          "the store to stop serving after the revocation")
        print(f"{revoke}: stopped serving after {took:.2f} s")
        assert store.stats()["watch_up"] is False
        with pytest.raises(expected):
            store.get("k")  # was cached: etcd is asked, and says no
        # The watch thread counts the restart once the stream it cancelled has ended,
        # which may be after the access check stopped serving and the get above returned.
        wait_until(lambda: restarts(store, "auth") >= 1, 5, "the restart to be counted")
        # It stays that way: re-creating the watch on the revoked credentials fails too.
        wait_until(lambda: restarts(store, "auth") >= 2, 10, "the watch to retry")
        assert not store.watch_healthy
        with pytest.raises(expected):
            store.get("k")


def test_access_checks_do_not_delay_stall_detection(server: LocalEtcd) -> None:
    """The access check runs on the watchdog's thread; against a silent partition it must
    give up before the next progress tick instead of holding the watchdog for a whole
    ``request_timeout``. The stall bound is the one without credentials."""
    stall_timeout, progress_interval = 1.5, 0.5
    bound = stall_timeout + 2 * progress_interval
    config = StoreConfig(auth_check_interval=0.2)
    with FaultProxy(server.endpoint, max_lifetime=50) as proxy, EtcdStore(
            endpoints=[proxy.endpoint], prefix=PREFIX, user="bob", password=USER_PASSWORD,
            config=config, request_timeout=10.0, stall_timeout=stall_timeout,
            progress_interval=progress_interval) as store:
        store.set("k", "v")
        wait_until(lambda: served_from_cache(store, "k", b"v"), 5, "k served from the cache")
        proxy.stall()
        detected = wait_until(lambda: not store.watch_healthy, bound + 10,
                              "the stall to be detected")
        print(f"stall detected after {detected:.2f} s with access checks every 0.2 s")
        assert detected <= bound + 1.0  # the same slack as test_outages.py
        wait_until(lambda: restarts(store, "stalled") >= 1, 5, "a restart for the stall")
