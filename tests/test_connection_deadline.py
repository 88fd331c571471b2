"""What a request that runs out of time reports: the failure it last retried after (a
refused connection is "unreachable"), not merely "no answer", whatever the machine's load
did to the back-off sleeps. The overshooting sleep is forced by an injected clock."""

from __future__ import annotations

import time

import pytest

from cachedstore import EtcdConnectionError
from cachedstore.config import StoreConfig
from cachedstore.connection import Connection, Credentials, parse_endpoint
from cachedstore.etcdapi import range_key
from cachedstore.metrics import NullMetrics
from cachedstore.server import free_port

pytestmark = pytest.mark.timeout(30)


class _OverloadedClock:
    """Real time, except that every sleep returns at once having taken 100 s: a machine
    so loaded that a back-off sleep overshoots any deadline."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.skipped += 100.0


def test_a_refused_endpoint_is_reported_unreachable_when_time_runs_out() -> None:
    clock = _OverloadedClock()
    port = free_port()  # nothing listens there
    conn = Connection([parse_endpoint(f"127.0.0.1:{port}")], Credentials(), StoreConfig(),
                      NullMetrics(), clock)
    try:
        with pytest.raises(EtcdConnectionError, match="unreachable") as caught:
            conn.call("range", range_key(b"k"), deadline=conn.deadline())
        assert clock.skipped == 100.0  # one attempt, one back-off that overshot
        assert "no answer" not in str(caught.value)
    finally:
        conn.close()
