"""The watch thread against failures of the unary calls it makes itself (issue 10, item 5):
a CANCELLED status on the resync read is a transport failure, not ``close()``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import etcd3
import grpc
import pytest

from cachedstore import EtcdStore
from cachedstore import connection as connection_module
from cachedstore.server import LocalEtcd
from tests.util import FakeRpcError

from . import follows_by_watch, restarts, split, wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(60)


#: What grpc raises when the server or a proxy resets the HTTP/2 stream (RST_STREAM
#: CANCEL): status CANCELLED, as if the call had been cancelled locally.
_CANCELLED = (grpc.StatusCode.CANCELLED, "Received RST_STREAM with error code 8")


@pytest.fixture
def server(etcd_factory: Callable[..., LocalEtcd]) -> LocalEtcd:
    return etcd_factory()


@pytest.fixture
def proxy(server: LocalEtcd) -> Iterator[FaultProxy]:
    with FaultProxy(server.endpoint, max_lifetime=50) as p:
        yield p


def test_cancelled_resync_read_does_not_end_the_watch_thread(
        server: LocalEtcd, proxy: FaultProxy, prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first unary Range of a resync (after a compaction) gets CANCELLED, once, as a
    proxy's RST_STREAM produces it. The watch thread must count it as a failure, retry
    the resync and follow etcd again; with CANCELLED taken for ``close()`` it would end."""
    real_rpc = connection_module._rpc
    armed = threading.Event()
    fired = threading.Event()

    def rpc(ep: Any, method: str) -> Callable[..., Any]:
        call = real_rpc(ep, method)
        if method != "range" or not armed.is_set() \
                or not threading.current_thread().name.startswith("cachedstore-watch-"):
            return call

        def cancelled(*args: Any, **kwargs: Any) -> Any:
            armed.clear()
            fired.set()
            raise FakeRpcError(*_CANCELLED)

        return cancelled

    monkeypatch.setattr(connection_module, "_rpc", rpc)
    host, port = split(server.endpoint)
    with EtcdStore(endpoints=[proxy.endpoint], prefix=prefix, request_timeout=1.0,
                   connect_timeout=5.0) as store, \
            closing(etcd3.client(host, port, timeout=5)) as writer:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        watch_thread = next(t for t in threading.enumerate()
                            if t.name.startswith("cachedstore-watch-"))
        proxy.reset(refuse=True)
        wait_until(lambda: not store.watch_healthy, 5, "the watch to notice the reset")
        writer.put(prefix + "k", "v2")
        writer.put(prefix + "other", "x")  # compact past the resume revision, not to it
        assert server.compact() > store.watch_revision + 1
        armed.set()  # the resync's first read is cancelled
        proxy.heal()
        wait_until(fired.is_set, 15, "the resync read to be cancelled")
        wait_until(lambda: store.watch_healthy, 15, "the watch to resync after the cancel")
        assert watch_thread.is_alive()
        assert restarts(store, "compacted") >= 1
        assert restarts(store, "disconnect") >= 1  # the cancelled resync, counted
        assert store.get("k") == b"v2"
        follows_by_watch(store, lambda v: writer.put(prefix + "k", v), "k", b"v2", "v3")
