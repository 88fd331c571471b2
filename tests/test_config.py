"""StoreConfig, Backoff and the name/endpoint helpers: pure functions, no etcd."""

from __future__ import annotations

import random
from datetime import timedelta

import grpc
import pytest

from cachedstore import InvalidInputError, InvalidTypeError, StoreConfig
from cachedstore.config import Backoff, seconds
from cachedstore.connection import Credentials, parse_endpoint, translate_rpc_error
from cachedstore.errors import (
    AuthenticationError,
    EtcdConnectionError,
    EtcdPermissionError,
    TLSError,
)
from cachedstore.keys import KeySpace, prefix_range_end, to_value
from cachedstore.liveness import pings_fit
from tests.util import FakeRpcError


def test_backoff_grows_caps_and_jitters():
    policy = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(1)
    delays = [policy.delay(a, rng) for a in range(8)]
    for attempt, delay in enumerate(delays):
        base = min(1.0, 0.1 * 2 ** attempt)
        assert base * 0.5 <= delay <= base
    assert Backoff(jitter=0.0).delay(100) == Backoff().maximum


def test_default_partition_detection_bound_is_at_most_10_s():
    """The bound is ``stall_timeout`` (PINGs, or answered progress requests), plus one
    ``progress_interval`` for a progress-request stream that never answered one. The
    default PINGs are used (below ``stall_timeout``) and never more often than etcd's
    default ``--grpc-keepalive-min-time`` of 5 s allows."""
    config = StoreConfig()
    assert config.stall_timeout + config.progress_interval <= 10
    assert config.ping_interval >= 5.0 and pings_fit(config.ping_interval,
                                                     config.stall_timeout)
    assert config.max_txn_ops == 128 and config.max_request_bytes == 1_572_864
    assert config.max_staleness is None  # strict by default


def test_seconds_and_overrides():
    assert seconds(timedelta(milliseconds=1500)) == 1.5
    assert seconds(None) is None
    with pytest.raises(InvalidInputError):
        seconds(-1)
    with pytest.raises(InvalidTypeError):
        seconds("5")  # type: ignore[arg-type]
    config = StoreConfig().with_overrides(timeout=timedelta(seconds=3), cache_size=10,
                                          max_staleness=None)
    assert config.timeout == 3.0 and config.cache_size == 10 and config.max_staleness is None
    with pytest.raises(InvalidInputError):
        StoreConfig().with_overrides(cache_size=0)


@pytest.mark.parametrize("pacing", [float("inf"), 8.0, -0.001, float("nan"), "2ms"])
def test_watch_pacing_is_refused_unless_below_the_stall_timeout(pacing: object) -> None:
    """Pacing as long as the stall timeout would have a paced stream declared stalled (and
    epoll refuses an infinite wait): refused with a clear, typed error."""
    with pytest.raises((InvalidInputError, InvalidTypeError), match="watch_pacing"):
        StoreConfig().with_overrides(watch_pacing=pacing)
    assert StoreConfig().with_overrides(watch_pacing=0).watch_pacing == 0.0
    assert StoreConfig(stall_timeout=300).with_overrides(watch_pacing=200).watch_pacing == 200


@pytest.mark.parametrize("interval", [float("inf"), -1.0, float("nan"), "5s"])
def test_ping_interval_is_refused_unless_finite_and_not_negative(interval: object) -> None:
    with pytest.raises((InvalidInputError, InvalidTypeError), match="ping_interval"):
        StoreConfig().with_overrides(ping_interval=interval)
    assert StoreConfig().with_overrides(ping_interval=0).ping_interval == 0.0


@pytest.mark.parametrize("name", ["progress_interval", "stall_timeout"])
@pytest.mark.parametrize("value", [0, float("inf")])
def test_liveness_intervals_must_be_positive_and_finite(name: str, value: float) -> None:
    """0 would have the watch's request side wake up without end (and ask etcd each time)."""
    with pytest.raises(InvalidInputError, match=name):
        StoreConfig().with_overrides(**{name: value})


def test_keyspace_mapping():
    keys = KeySpace("/job/", 1_572_864)
    assert keys.key(keys.canonical("a")) == b"/job/a"
    assert keys.name_of(b"/job/a") == "a"
    assert keys.name_of(b"/other/a") is None
    raw = b"\xff\xfe"
    assert keys.key(keys.canonical(raw)) == b"/job/" + raw  # any bytes survive
    assert keys.name_of(b"/job/" + raw) == keys.canonical(raw)
    with pytest.raises(InvalidInputError):
        keys.canonical("")
    with pytest.raises(InvalidTypeError):
        keys.canonical(3)
    with pytest.raises(InvalidInputError):
        keys.key("\ud800")  # a lone surrogate is not UTF-8
    assert prefix_range_end(b"/job/") == b"/job0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"") == b"\0"
    assert to_value(bytearray(b"x")) == b"x" and to_value("é") == "é".encode()


def test_parse_endpoint():
    assert parse_endpoint("h:2379") == ("h", 2379)
    assert parse_endpoint("http://10.0.0.1:2379/") == ("10.0.0.1", 2379)
    assert parse_endpoint("[::1]:2379") == ("::1", 2379)
    assert parse_endpoint(("h", 1)) == ("h", 1)
    for bad in ("h", ":2379", "h:port", ""):
        with pytest.raises(InvalidInputError):
            parse_endpoint(bad)


def test_credentials_never_show_the_password():
    creds = Credentials(user="alice", password="s3cret")
    assert "s3cret" not in repr(creds)
    with pytest.raises(InvalidInputError):
        Credentials(user="alice")


@pytest.mark.parametrize(("code", "details", "expected"), [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", EtcdConnectionError),
    (grpc.StatusCode.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED", TLSError),
    (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", EtcdPermissionError),
    (grpc.StatusCode.INVALID_ARGUMENT,
     "etcdserver: authentication failed, invalid user ID or password", AuthenticationError),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty", AuthenticationError),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", InvalidInputError),
    # etcd 3.5 answers a call whose deadline ran out on its side so (seen under load: a
    # torch wait's 250 ms probe failed the rank instead of falling through to the wait)
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", EtcdConnectionError),
])
def test_rpc_errors_are_translated(code, details, expected):
    error = translate_rpc_error(FakeRpcError(code, details), "range")
    assert type(error) is expected


def test_backoff_never_overflows_however_long_the_outage():
    from cachedstore.config import Backoff

    for policy in (Backoff(), Backoff(initial=0), Backoff(multiplier=1e300),
                   Backoff(multiplier=1)):
        for attempt in (0, 1023, 1024, 10**6, 10**12):
            delay = policy.delay(attempt)
            assert 0 <= delay <= max(policy.maximum, policy.initial)
