"""etcd before 3.5.5 panics and exits when a read-only Txn is cancelled while it executes
(etcd-io/etcd#14110, "unexpected error during txn: context canceled"); the tests' etcd is
3.5.1. A store's blocking reads near their deadline (torch's ``check``, a wait's probe)
give a read-only Txn less than ``request_timeout``: under load the answer is late, and
cancelling the call took the member down (the W = 1,024 fan-out benchmark, twice). The
connection layer waits that long for the answer and leaves the call to finish instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from etcd3 import etcdrpc

from cachedstore import EtcdConnectionError, StoreConfig, etcdapi
from cachedstore.connection import Connection, Credentials
from cachedstore.metrics import NullMetrics
from cachedstore.server import LocalEtcd

from . import split, wait_until

pytestmark = pytest.mark.timeout(120)

_KEYS = 25_600


def _slow_read(prefix: bytes) -> etcdrpc.TxnRequest:
    """A read-only Txn that takes etcd ~100 ms: four keys-only ranges over 25,600 keys
    (etcd checks for cancellation at each key it reads)."""
    whole = etcdrpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0", keys_only=True)
    return etcdrpc.TxnRequest(success=[etcdrpc.RequestOp(request_range=whole)] * 4)


def _fill(server: LocalEtcd, prefix: bytes) -> None:
    with grpc.insecure_channel(server.endpoint) as channel:
        kv = etcdrpc.KVStub(channel)
        for batch in range(_KEYS // 128):
            kv.Txn(etcdrpc.TxnRequest(success=[
                etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                    key=prefix + b"%06d" % (batch * 128 + i), value=b"v" * 100))
                for i in range(128)]))


@pytest.mark.parametrize("transport", ["wire", "grpc"])
def test_a_late_read_only_txn_is_not_cancelled(etcd_factory: Callable[..., LocalEtcd],
                                               transport: str) -> None:
    """Reads given at most half the time etcd needs for them, each late: each raises
    EtcdConnectionError, and etcd is still up (with grpcio's call cancelled instead, the
    first one killed it). Only meaningful on etcd 3.5.0-3.5.4, which the tests run. On the
    wire transport each late read runs on to its answer on its connection, which is
    then reused (closing it to end the call would open a new one for every read)."""
    server = etcd_factory()
    prefix = b"/slow/"
    _fill(server, prefix)
    config = StoreConfig(request_timeout=10.0, unary_transport=transport)
    conn = Connection([split(server.endpoint)], Credentials(), config, NullMetrics())
    try:
        version = conn.call("status", etcdapi.status(), deadline=conn.deadline()).version
        assert (3, 5, 0) <= tuple(map(int, version.split(".")[:3])) < (3, 5, 5), (
            f"etcd {version} has the fix (etcd-io/etcd#14178): this test proves nothing")
        durations = []
        for _ in range(3):  # warm (channel, member check); the quickest of three
            started = time.monotonic()
            conn.call("txn", _slow_read(prefix), deadline=conn.deadline())
            durations.append(time.monotonic() - started)
        full = min(durations)
        waits = [w for w in (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05) if w <= full / 2]
        assert len(waits) >= 3, f"the read took only {full:.3f} s: nothing would be late"
        unary = conn.endpoint()[1].unary
        opened = unary.opened if unary is not None else 0
        for n, wait in enumerate(waits):
            with pytest.raises(EtcdConnectionError):
                conn.call("txn", _slow_read(prefix), deadline=conn.deadline(wait))
            # grpcio leaves every late read running. On the wire transport the first one
            # ran on the warm pooled connection, so it was sent and is left running; a
            # later one may find no connection it can open within its wait (the earlier
            # reads still hold theirs), and is then never sent.
            if n == 0 or unary is None:
                assert conn.reads_left_running >= 1, "the late read was not left running"
        wait_until(lambda: not conn.reads_left_running, 20,
                   "the late reads to finish at etcd")
        if unary is not None:  # the late reads' connections came back to the pool
            conn.call("txn", _slow_read(prefix), deadline=conn.deadline())
            # The first late read took the warm connection; each later one a connection
            # of its own at most (the reads before it still running); the last read, a
            # pooled one.
            assert unary.opened - opened <= len(waits) - 1
        assert server.running, "etcd exited: a cancelled read-only Txn (etcd-io/etcd#14110)"
        assert conn.call("txn", _slow_read(prefix), deadline=conn.deadline()).succeeded
    finally:
        conn.close()
