"""What cachedstore logs: one line per warning, failover at INFO, nothing per request."""

from __future__ import annotations

import logging
import socket

from util import eventually

from cachedstore import EtcdStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_requests_log_nothing_and_a_restart_is_one_line(etcd, prefix, caplog):
    caplog.set_level(logging.DEBUG, logger="cachedstore")
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        caplog.clear()
        for i in range(50):
            store.set(f"k{i}", "v")
            store.get(f"k{i}")
            store.get(f"absent{i}", default=None)
        assert [r for r in caplog.records if r.name.startswith("cachedstore")] == []
        restarts = store._watcher.restarts
        store._watcher._call.cancel()  # the stream ends: one warning, one line
        eventually(lambda: store._watcher.restarts > restarts and store.watch_healthy,
                   what="watch restarted")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "\n" not in message and "CANCELLED" in message
    assert "_MultiThreadedRendezvous" not in message


def test_failover_is_logged_once_at_info(etcd, prefix, caplog):
    caplog.set_level(logging.INFO, logger="cachedstore")
    dead = f"127.0.0.1:{_free_port()}"
    with EtcdStore(endpoints=[dead, etcd.endpoint], prefix=prefix) as store:
        store.set("k", "v")
        assert store.get("k") == b"v"
    failovers = [r for r in caplog.records if "failing over" in r.getMessage()]
    assert len(failovers) == 1 and failovers[0].levelno == logging.INFO
    assert dead in failovers[0].getMessage()
