"""StoreConfig, LivenessPolicy, Backoff and the name/endpoint helpers; and, for the knobs no
other test changes, a store (a local etcd) that shows each knob's effect.

Every knob, and the test that changes it and sees the effect
(``test_every_knob_has_a_test_that_changes_it`` keeps this table true):

| knob | test |
| --- | --- |
| `cache_size` | tests/test_store.py::test_blocking_reads_ask_etcd_once_anything_was_evicted |
| `timeout` | tests/test_store.py::test_wait_uses_the_store_timeout_by_default |
| `request_timeout` | tests/test_config.py::test_request_timeout_bounds_an_operation_on_a_silent_link |
| `connect_timeout` | tests/test_config.py::test_connect_timeout_bounds_the_first_contact |
| `liveness` | tests/test_config.py::test_a_liveness_preset_reaches_the_watch |
| `ping_interval` | tests/test_watch_pings.py::test_a_quiet_store_pings_and_sends_etcd_no_watch_message |
| `progress_interval` | tests/faults/test_outages.py::test_silent_partition_detected_within_bound |
| `stall_timeout` | tests/faults/test_outages.py::test_silent_partition_detected_within_bound |
| `watch_pacing` | tests/test_wire.py::test_a_blocked_get_ends_the_stores_pacing |
| `auth_check_interval` | tests/faults/test_revocation.py::test_revoked_access_stops_serving |
| `max_txn_ops` | tests/test_store.py::test_max_txn_ops_is_honoured |
| `max_request_bytes` | tests/test_properties.py::test_values_at_and_over_the_request_limit |
| `max_staleness` | tests/faults/test_outages.py::test_max_staleness_serves_cached_values_for_a_bounded_time |
| `preload_limit` | tests/test_store.py::test_large_prefix_is_not_preloaded |
| `watch_scope` | tests/test_scoped_watch.py::test_a_store_receives_its_groups_writes_not_the_jobs |
| `max_watches` | tests/test_scoped_watch.py::test_too_many_scopes_fall_back_to_the_whole_prefix |
| `watch_transport` | tests/test_config.py::test_the_wire_transport_has_a_connection_of_its_own |
| `unary_transport` | tests/test_config.py::test_the_wire_transport_has_a_connection_of_its_own |
| `backoff` | tests/test_config.py::test_backoff_paces_the_retries |
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from cachedstore import (
    EtcdConnectionError,
    EtcdStore,
    InvalidInputError,
    InvalidTypeError,
    StoreConfig,
)
from cachedstore.config import (
    KEEPALIVE_TIME,
    LATENCY_SAMPLE_EVERY,
    LIVENESS_TIMES,
    Backoff,
    LivenessPolicy,
    seconds,
)
from cachedstore.connection import Connection, Credentials, parse_endpoint, translate_rpc_error
from cachedstore.errors import (
    AuthenticationError,
    EtcdPermissionError,
    TLSError,
)
from cachedstore.etcdapi import range_key
from cachedstore.keys import KeySpace, prefix_range_end, to_value
from cachedstore.liveness import pings_fit
from cachedstore.metrics import NullMetrics
from cachedstore.server import LocalEtcd, free_port
from tests.faults.proxy import FaultProxy
from tests.util import FakeRpcError, eventually, sample

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------- the values


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
    assert config.liveness is LivenessPolicy.DEFAULT
    assert config.liveness.detection_bound == config.stall_timeout + config.progress_interval
    assert config.liveness.detection_bound <= 10
    assert config.ping_interval >= 5.0 and pings_fit(config.ping_interval,
                                                     config.stall_timeout)
    assert config.max_txn_ops == 128 and config.max_request_bytes == 1_572_864
    assert config.max_staleness is None  # strict by default


@pytest.mark.parametrize(("preset", "times", "bound", "pings"), [
    (LivenessPolicy.DEFAULT, (5.0, 2.0, 8.0, 0.005), 10.0, True),
    (LivenessPolicy.FAST, (0.0, 0.5, 2.0, 0.0), 2.5, False),
    (LivenessPolicy.FANOUT, (10.0, 5.0, 30.0, 0.01), 35.0, True),
], ids=["DEFAULT", "FAST", "FANOUT"])
def test_liveness_presets_and_their_detection_bounds(
        preset: LivenessPolicy, times: tuple[float, ...], bound: float, pings: bool) -> None:
    """The documented presets: FAST never PINGs (PINGs that fit 2 s would come faster than
    etcd's default 5 s allows), the others PING no faster than that."""
    assert dataclasses.astuple(preset) == times
    assert preset.detection_bound == bound and preset.pings is pings
    if pings:
        assert preset.ping_interval >= 5.0


def test_readme_documents_the_liveness_presets() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("DEFAULT", "FAST", "FANOUT"):
        p: LivenessPolicy = getattr(LivenessPolicy, name)
        row = (f"| `LivenessPolicy.{name}` | {p.ping_interval:g} | {p.progress_interval:g} "
               f"| {p.stall_timeout:g} | {p.watch_pacing:g} | {p.stall_timeout:g} s "
               f"({p.detection_bound:g} s at worst) |")
        assert row in readme, row


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


@pytest.mark.parametrize(("kwargs", "error", "field"), [
    ({"cache_size": -5}, InvalidInputError, "cache_size"),
    ({"cache_size": 2.5}, InvalidTypeError, "cache_size"),
    ({"cache_size": True}, InvalidTypeError, "cache_size"),
    ({"timeout": "x"}, InvalidTypeError, "timeout"),
    ({"timeout": -1}, InvalidInputError, "timeout"),
    ({"timeout": math.inf}, InvalidInputError, "timeout"),
    ({"timeout": None}, InvalidTypeError, "timeout"),
    ({"request_timeout": 0}, InvalidInputError, "request_timeout"),
    ({"connect_timeout": math.nan}, InvalidInputError, "connect_timeout"),
    ({"auth_check_interval": 0}, InvalidInputError, "auth_check_interval"),
    ({"max_txn_ops": 0}, InvalidInputError, "max_txn_ops"),
    ({"max_request_bytes": "1MiB"}, InvalidTypeError, "max_request_bytes"),
    ({"max_staleness": -0.5}, InvalidInputError, "max_staleness"),
    ({"preload_limit": -1}, InvalidInputError, "preload_limit"),
    ({"watch_scope": "some"}, InvalidInputError, "watch_scope"),
    ({"watch_scope": 1}, InvalidTypeError, "watch_scope"),
    ({"max_watches": 0}, InvalidInputError, "max_watches"),
    ({"watch_transport": "quic"}, InvalidInputError, "watch_transport"),
    ({"backoff": 0.5}, InvalidTypeError, "backoff"),
    ({"liveness": "fast"}, InvalidTypeError, "liveness"),
])
def test_a_config_refuses_nonsense_naming_the_field(kwargs: dict[str, Any],
                                                    error: type[Exception], field: str) -> None:
    """Checked when the config is made, whichever way: the constructor, or the store's
    keywords (``with_overrides``, where None means "not given")."""
    with pytest.raises(error, match=field):
        StoreConfig(**kwargs)
    if None not in kwargs.values():
        with pytest.raises(error, match=field):
            StoreConfig().with_overrides(**kwargs)


@pytest.mark.parametrize(("kwargs", "error", "field"), [
    ({"initial": 0}, InvalidInputError, "initial"),
    ({"initial": "1s"}, InvalidTypeError, "initial"),
    ({"maximum": 0.01}, InvalidInputError, "maximum"),
    ({"maximum": math.inf}, InvalidInputError, "maximum"),
    ({"multiplier": 0.5}, InvalidInputError, "multiplier"),
    ({"multiplier": math.inf}, InvalidInputError, "multiplier"),
    ({"jitter": 1.5}, InvalidInputError, "jitter"),
    ({"jitter": None}, InvalidTypeError, "jitter"),
])
def test_a_backoff_refuses_nonsense(kwargs: dict[str, Any], error: type[Exception],
                                    field: str) -> None:
    with pytest.raises(error, match=field):
        Backoff(**kwargs)


def test_times_may_be_timedeltas_and_are_stored_as_seconds() -> None:
    config = StoreConfig(timeout=timedelta(minutes=1), max_staleness=timedelta(seconds=2),
                         liveness=LivenessPolicy(stall_timeout=timedelta(seconds=9)),
                         backoff=Backoff(initial=timedelta(milliseconds=10)))
    assert (config.timeout, config.max_staleness, config.stall_timeout) == (60.0, 2.0, 9.0)
    assert config.backoff.initial == 0.01
    assert type(StoreConfig(cache_size=3, timeout=1).timeout) is float


def test_the_liveness_times_are_given_flat_or_as_a_policy() -> None:
    """``stall_timeout=`` (a keyword of the store) replaces that field of the liveness given
    with it, else of the config's; the flat names read the policy's fields."""
    config = StoreConfig().with_overrides(stall_timeout=3)
    assert config.liveness == dataclasses.replace(LivenessPolicy.DEFAULT, stall_timeout=3.0)
    assert config.stall_timeout == 3.0 and config.ping_interval == 5.0
    fast = StoreConfig(liveness=LivenessPolicy.FANOUT).with_overrides(
        liveness=LivenessPolicy.FAST, progress_interval=timedelta(seconds=1))
    assert fast.liveness == dataclasses.replace(LivenessPolicy.FAST, progress_interval=1.0)
    assert config.with_overrides(ping_interval=None).liveness == config.liveness
    # The four are read-only: a config is changed by making another.
    with pytest.raises(AttributeError):
        config.stall_timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        StoreConfig(stall_timeout=1.0)  # type: ignore[call-arg]
    assert StoreConfig.watch_pacing == LivenessPolicy.DEFAULT.watch_pacing  # of the class
    assert set(LIVENESS_TIMES) == {"ping_interval", "progress_interval", "stall_timeout",
                                   "watch_pacing"}


def test_dropped_knobs_are_constants() -> None:
    """``keepalive_time``, ``keepalive_timeout`` and ``latency_sample_every`` are no
    settings (nothing needed to change them): module constants, refused as fields."""
    assert (KEEPALIVE_TIME, LATENCY_SAMPLE_EVERY) == (10.0, 64)
    for name in ("keepalive_time", "keepalive_timeout", "latency_sample_every"):
        with pytest.raises(TypeError):
            StoreConfig(**{name: 1})
    assert len(dataclasses.fields(StoreConfig)) == 15


@pytest.mark.parametrize("pacing", [float("inf"), 8.0, -0.001, float("nan"), "2ms"])
def test_watch_pacing_is_refused_unless_below_the_stall_timeout(pacing: object) -> None:
    """Pacing as long as the stall timeout would have a paced stream declared stalled (and
    epoll refuses an infinite wait): refused with a clear, typed error."""
    with pytest.raises((InvalidInputError, InvalidTypeError), match="watch_pacing"):
        StoreConfig().with_overrides(watch_pacing=pacing)
    with pytest.raises((InvalidInputError, InvalidTypeError), match="watch_pacing"):
        LivenessPolicy(watch_pacing=pacing)  # type: ignore[arg-type]
    assert StoreConfig().with_overrides(watch_pacing=0).watch_pacing == 0.0
    assert StoreConfig().with_overrides(stall_timeout=300, watch_pacing=200).watch_pacing == 200


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


def test_every_knob_has_a_test_that_changes_it() -> None:
    """The table in this module's docstring names, for every field of StoreConfig and of
    its LivenessPolicy, a test that exists."""
    assert __doc__ is not None
    rows = dict(re.findall(r"^\| `(\w+)` \| (tests/\S+) \|$", __doc__, re.M))
    knobs = {f.name for f in dataclasses.fields(StoreConfig)} | set(LIVENESS_TIMES)
    assert set(rows) == knobs
    for knob, where in rows.items():
        path, _, name = where.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), (knob, where)


# ------------------------------------------------------------- each knob's effect, live


class _SleepRecorder:
    """Real time, except that a sleep returns at once, recorded, having taken its time."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return time.monotonic() + sum(self.slept)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def _retry_waits(backoff: Backoff) -> list[float]:
    """The back-off waits of one range to an endpoint that refuses connections, until its
    request timeout (3 s, of the recorded sleeps) ran out."""
    clock = _SleepRecorder()
    config = StoreConfig(backoff=backoff, request_timeout=3.0)
    conn = Connection([parse_endpoint(f"127.0.0.1:{free_port()}")], Credentials(), config,
                      NullMetrics(), clock)  # type: ignore[arg-type]
    try:
        with pytest.raises(EtcdConnectionError):
            conn.call("range", range_key(b"k"), deadline=conn.deadline())
    finally:
        conn.close()
    return clock.slept


def test_backoff_paces_the_retries() -> None:
    waits = _retry_waits(Backoff(initial=0.1, maximum=0.4, multiplier=2.0, jitter=0.0))
    assert waits[:3] == [0.1, 0.2, 0.4] and set(waits[2:]) == {0.4}
    assert 3.0 - 0.4 <= sum(waits) <= 3.0
    default = _retry_waits(Backoff())
    assert 0.025 <= default[0] <= 0.05 and max(default) <= 2.0


def test_request_timeout_bounds_an_operation_on_a_silent_link(etcd: LocalEtcd,
                                                              prefix: str) -> None:
    """A link that holds every byte (no error, no close): a read from etcd raises
    ``EtcdConnectionError`` once ``request_timeout`` (1 s, of the default 10) is spent."""
    with FaultProxy(etcd.endpoint) as proxy:
        with EtcdStore(endpoints=[proxy.endpoint], prefix=prefix,
                       request_timeout=1.0) as store:
            store.set("k", "v")
            proxy.stall()
            started = time.monotonic()
            with pytest.raises(EtcdConnectionError):
                store.versioned.read("k")
            took = time.monotonic() - started
            proxy.heal()
        assert 0.9 <= took < 5.0, took


def test_connect_timeout_bounds_the_first_contact(etcd: LocalEtcd, prefix: str) -> None:
    """A store whose link to etcd holds every byte gives up within ``connect_timeout`` (1 s,
    of the default 10)."""
    with FaultProxy(etcd.endpoint) as proxy:
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(EtcdConnectionError):
            EtcdStore(endpoints=[proxy.endpoint], prefix=prefix, connect_timeout=1.0)
        took = time.monotonic() - started
        proxy.heal()
    assert 0.5 <= took < 5.0, took


@pytest.mark.parametrize(("watch", "unary", "connections"), [
    ("wire", "wire", 2), ("grpc", "wire", 2), ("wire", "grpc", 2), ("grpc", "grpc", 1)])
def test_the_wire_transport_has_a_connection_of_its_own(
        etcd: LocalEtcd, prefix: str, watch: str, unary: str, connections: int) -> None:
    """``watch_transport="wire"``: the watch stream on a connection of its own;
    ``unary_transport="wire"``: the unary calls on a pool of their own (one connection,
    calls made by one thread at a time); ``"grpc"`` for both: one grpcio connection for
    everything (and the grpcio channel of a store that uses it for nothing never
    connects). All deliver, and all read and write."""
    with FaultProxy(etcd.endpoint) as proxy, \
            EtcdStore(endpoints=[proxy.endpoint], prefix=prefix, watch_transport=watch,
                      unary_transport=unary) as store, \
            EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as writer:
        writer.set("k", "v")
        eventually(lambda: store._cache.peek("k") is not None, what="the watch event")
        store.set("mine", "1")
        assert store.get("mine") == b"1" and store.add("n", 1) == 1
        assert proxy.accepted == connections


def test_a_liveness_preset_reaches_the_watch(etcd: LocalEtcd, prefix: str) -> None:
    """``liveness=LivenessPolicy.FAST``: a quiet stream asks etcd for progress every 0.5 s
    and never PINGs (by default its first check is 5 s away, and PINGs follow)."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                   liveness=LivenessPolicy.FAST) as store:
        assert store.config.liveness == LivenessPolicy.FAST

        def progress_requests() -> float:
            return sample(store.registry, "cachedstore_watch_liveness_requests_total",
                          kind="progress")

        eventually(lambda: progress_requests() >= 3, timeout=4.5,
                   what="three progress requests")
        assert sample(store.registry, "cachedstore_watch_liveness_requests_total",
                      kind="ping") == 0
        assert store.watch_healthy and store._watcher is not None
        assert store._watcher.restarts == 0


# ---------------------------------------------------------------------- names, endpoints


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


@pytest.mark.parametrize(("host", "port", "error"), [
    ("http://127.0.0.1:2379", 2379, InvalidInputError),  # a URL as the host
    ("127.0.0.1:2379", 2379, InvalidInputError),  # "host:port" as the host
    ("etcd:2379", 2379, InvalidInputError),
    ("[::1]:2379", 2379, InvalidInputError),
    ("", 2379, InvalidInputError),
    ("h", 0, InvalidInputError),
    ("h", 65536, InvalidInputError),
    ("h", "port", InvalidTypeError),
    ("h", 2379.0, InvalidTypeError),
    ("h", True, InvalidTypeError),
    (["h"], 2379, InvalidTypeError),
])
def test_a_store_refuses_a_bad_host_or_port_before_connecting(host: Any, port: Any,
                                                              error: type[Exception]) -> None:
    """A URL or "host:port" given as the host used to be tried as an IPv6 address
    ("[127.0.0.1:2379]:2379") until connect_timeout ran out; each mistake is now a typed
    error at once, naming what to give instead."""
    started = time.monotonic()
    with pytest.raises(error) as caught:
        EtcdStore(host, port, connect_timeout=30)
    assert time.monotonic() - started < 5
    if isinstance(host, str) and ":" in host:
        assert "endpoints=" in str(caught.value)


def test_hosts_that_are_addresses_pass_the_check() -> None:
    from cachedstore.store import _host_and_port

    assert _host_and_port("::1", 2379) == ("::1", 2379)
    assert _host_and_port("[fe80::1]", "2379") == ("fe80::1", 2379)  # as in endpoints=
    assert _host_and_port("etcd-0.etcd", 1) == ("etcd-0.etcd", 1)


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
    for policy in (Backoff(), Backoff(initial=1e-300), Backoff(multiplier=1e300),
                   Backoff(multiplier=1)):
        for attempt in (0, 1023, 1024, 10**6, 10**12):
            delay = policy.delay(attempt)
            assert 0 <= delay <= max(policy.maximum, policy.initial)
