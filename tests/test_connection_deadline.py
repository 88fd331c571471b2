"""What a request that runs out of time reports: the failure it last retried after (a
refused connection is "unreachable"), not merely "no answer", whatever the machine's load
did to the back-off sleeps. The overshooting sleep is forced by an injected clock."""

from __future__ import annotations

import time

import pytest

from cachedstore import EtcdConnectionError, TLSError
from cachedstore.config import StoreConfig
from cachedstore.connection import Connection, Credentials, parse_endpoint
from cachedstore.etcdapi import range_key
from cachedstore.metrics import NullMetrics
from cachedstore.server import free_port
from cachedstore.testing import make_tls_files

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


def test_a_handshake_refused_by_one_of_two_endpoints_is_not_a_certificate_error(
        etcd_factory, tmp_path) -> None:
    """Out of time after one endpoint refused the TLS handshake while another was never
    tried: not a TLSError (which says waiting will not fix it), but the handshake's story
    in an EtcdConnectionError."""
    server = etcd_factory(tls=make_tls_files(tmp_path / "good"))
    wrong_ca = make_tls_files(tmp_path / "other").ca_cert
    clock = _OverloadedClock()
    conn = Connection([parse_endpoint(server.endpoint),
                       parse_endpoint(f"127.0.0.1:{free_port()}")],
                      Credentials(ca_cert=wrong_ca), StoreConfig(), NullMetrics(), clock)
    try:
        with pytest.raises(EtcdConnectionError, match="TLS handshake") as caught:
            conn.call("range", range_key(b"k"), deadline=conn.deadline())
        assert not isinstance(caught.value, TLSError)
        assert clock.skipped == 100.0
    finally:
        conn.close()
