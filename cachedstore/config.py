"""Every tunable of a store, with its default and what it bounds, in one place.

:class:`StoreConfig` holds them all; two small values group what belongs together: the
watch stream's :class:`LivenessPolicy` (four times that constrain each other, with named
presets) and the retry :class:`Backoff`. Each checks its fields when it is made (a wrong
type raises ``InvalidTypeError``, a value out of range ``InvalidInputError``, both naming
the field), so a config that exists is a sensible one; times given as ``timedelta`` are
stored as float seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import ClassVar

from .errors import InvalidInputError, InvalidTypeError
from .liveness import pings_fit

__all__ = ["KEEPALIVE_TIME", "KEEPALIVE_TIMEOUT", "LATENCY_SAMPLE_EVERY", "UNARY_TRANSPORTS",
           "WATCH_SCOPES", "WATCH_TRANSPORTS", "Backoff", "LivenessPolicy", "StoreConfig",
           "seconds"]

#: gRPC keepalive PINGs on an idle unary connection, every this many seconds (etcd refuses
#: them more often than its ``--grpc-keepalive-min-time``, 5 s by default) ...
KEEPALIVE_TIME = 10.0
#: ... and how long one may go unanswered before gRPC drops the connection.
KEEPALIVE_TIMEOUT = 5.0
#: One ``get``/``aget`` call in this many is timed into
#: ``cachedstore_request_duration_seconds`` (hits and misses alike, so its quantiles are
#: unbiased; counts are exact). A timed hit costs about 1.5 µs more than an untimed one
#: (two clock reads and prometheus-client's ``observe``): one in 16 added ~90 ns to the
#: median hit, one in 64 adds ~20 ns (``benchmarks/hitpath.py``), and still times 15,000
#: calls a second of a loop that reads a million.
LATENCY_SAMPLE_EVERY = 64

#: The values of :attr:`StoreConfig.watch_scope`.
WATCH_SCOPES = ("prefix", "touched")
#: The values of :attr:`StoreConfig.watch_transport`.
WATCH_TRANSPORTS = ("grpc", "wire")
#: The values of :attr:`StoreConfig.unary_transport`.
UNARY_TRANSPORTS = ("grpc", "wire")


def seconds(value: float | timedelta | None, what: str = "timeout", *,
            above_zero: bool = False, finite: bool = False) -> float | None:
    """``value`` in seconds as a float (``timedelta`` accepted); None stays None.

    Raises ``InvalidTypeError`` (a ``TypeError``) for a value that is not a number or a
    ``timedelta``, and ``InvalidInputError`` (a ``ValueError``) for NaN, a negative value,
    0 with ``above_zero`` and infinity with ``finite``; ``what`` names the value.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{what} must be seconds (a number) or a timedelta, "
                               f"not {type(value).__name__}")
    low_enough = value > 0 if above_zero else value >= 0  # False for NaN
    if not low_enough or (finite and value == math.inf):
        raise InvalidInputError(f"{what} must be {'above' if above_zero else 'at least'} 0 "
                                f"seconds{' and finite' if finite else ''}, got {value!r}")
    return float(value)


def _check_seconds(owner: object, name: str, *, above_zero: bool = False,
                   optional: bool = False) -> float:
    """Field ``name`` of the frozen dataclass ``owner``, checked as a finite time (None
    allowed if ``optional``) and stored back as float seconds; returns it (inf if None)."""
    value = getattr(owner, name)
    if value is None and not optional:
        raise InvalidTypeError(f"{name} must be seconds (a number) or a timedelta, not None")
    checked = seconds(value, name, above_zero=above_zero, finite=True)
    object.__setattr__(owner, name, checked)
    return math.inf if checked is None else checked


def _check_number(owner: object, name: str, lowest: float, highest: float = math.inf, *,
                  integer: bool = False) -> None:
    """Field ``name`` of ``owner``: a number (an ``int`` if ``integer``; never a bool) in
    ``[lowest, highest]``, and finite."""
    value = getattr(owner, name)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise InvalidTypeError(f"{name} must be {'an integer' if integer else 'a number'}, "
                               f"not {type(value).__name__}")
    if not lowest <= value <= highest or value == math.inf:  # NaN fails the first test
        within = f"from {lowest:g} to {highest:g}" if highest < math.inf else \
            f"at least {lowest:g}" + ("" if integer else " and finite")
        raise InvalidInputError(f"{name} must be {within}, got {value!r}")


def _check_type(owner: object, name: str, kind: type) -> None:
    value = getattr(owner, name)
    if not isinstance(value, kind):
        raise InvalidTypeError(f"{name} must be a {kind.__name__}, not "
                               f"{type(value).__name__}")


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential back-off between watch/connection attempts.

    A value: ``delay(attempt)`` derives the wait before retry number ``attempt`` (0-based)
    without mutating anything, so the policy can be tested without a network or a clock.

    - ``initial``: wait before the first retry, in seconds (above 0).
    - ``maximum``: the cap of any single wait (at least ``initial``).
    - ``multiplier``: growth per attempt (at least 1).
    - ``jitter``: the fraction of each wait that is randomised, from 0 to 1 (0.5 draws
      from [0.5 × d, d]), so that thousands of clients cut off together do not reconnect
      together.
    """

    initial: float = 0.05
    maximum: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        _check_seconds(self, "initial", above_zero=True)
        if _check_seconds(self, "maximum") < self.initial:
            raise InvalidInputError(f"maximum must be at least initial ({self.initial:g} s), "
                                    f"got {self.maximum!r}")
        _check_number(self, "multiplier", 1.0)
        _check_number(self, "jitter", 0.0, 1.0)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry ``attempt``; any attempt number works, however large (the
        exponent is capped once the cap is reached, so it never overflows)."""
        steps = max(0, attempt)
        if self.multiplier > 1 and self.initial < self.maximum:
            # Past this many steps the cap holds anyway: never raise to a huge power.
            steps = min(steps, math.ceil(math.log(self.maximum / self.initial,
                                                  self.multiplier)))
        try:
            grown = self.initial * self.multiplier ** min(steps, 64)
        except OverflowError:
            grown = self.maximum
        base = min(self.maximum, grown)
        draw = (rng or random).random()
        return base * (1.0 - self.jitter * draw)


@dataclass(frozen=True)
class LivenessPolicy:
    """How a store's watch stream tells a quiet etcd from a lost one, and how often a busy
    one is read: four times that constrain each other, so one value. Times in seconds.

    A silent partition (bytes held, nothing closed) is detected within ``stall_timeout``
    for a stream that PINGs or has answered a progress request, and within
    :attr:`detection_bound` (``stall_timeout + progress_interval``) at worst: a stream of
    progress requests that has not answered one yet (a new one, or any behind etcd's
    grpc-proxy) is probed once first. ``cachedstore/liveness.py`` has the schedule.

    Presets (class attributes), each with its detection bound (PINGs or an answered
    progress request / at worst):

    ================  ===================================  ============  ====================
    preset            ping / progress / stall / pacing     bound         for
    ================  ===================================  ============  ====================
    ``DEFAULT``       5 / 2 / 8 / 0.005                    8 s / 10 s    most jobs
    ``FAST``          0 / 0.5 / 2 / 0                      2 s / 2.5 s   small clusters, tests
    ``FANOUT``        10 / 5 / 30 / 0.01                   30 s / 35 s   thousands of stores
    ================  ===================================  ============  ====================

    ``FAST`` sends etcd a progress request every 0.5 s of quiet per store (PINGs that fit
    a 2 s stall timeout would be more frequent than etcd's default
    ``--grpc-keepalive-min-time`` of 5 s allows) and does not pace: fine for a few stores.
    ``FANOUT`` costs etcd no request while quiet (a PING every 10 s, answered in etcd's
    transport), declares a stream stalled only after 30 s (watch threads of many stores
    sharing few cores can starve for seconds) and paces a busy stream at 10 ms (20 µs of
    CPU per event instead of 25 at 5 ms, ``benchmarks/FANOUT.md``).
    """

    #: With ``watch_transport="wire"``: a quiet watch stream sends an HTTP/2 PING once it
    #: heard nothing for this long (2 % more), instead of progress requests. etcd
    #: acknowledges a PING in its gRPC transport: a quiet store costs it no request at all.
    #: Used only when ``stall_timeout`` is at least 1.5 times as long (the answer has half
    #: an interval: :attr:`pings`), once etcd answered the stream's first check, a progress
    #: request (so never behind etcd's grpc-proxy, which answers none and would answer
    #: PINGs). It must not be below etcd's ``--grpc-keepalive-min-time`` (5 s by default):
    #: etcd closes a connection that PINGs more often (``too_many_pings``), and the store
    #: then uses progress requests for good (logged). 0 disables PINGs. Finite, at least 0.
    ping_interval: float = 5.0
    #: How long a quiet watch stream waits before it asks etcd for a progress response,
    #: when it does not PING; also how often a scope replaying after a reconnect asks (its
    #: answer re-reads a scope whose range did not change). Finite, above 0.
    progress_interval: float = 2.0
    #: A watch stream that has heard nothing from etcd (no event, no progress response, no
    #: PING acknowledgement) for this long is declared stalled: the cache stops being
    #: served and the stream is restarted. Finite, above 0.
    stall_timeout: float = 8.0
    #: With ``watch_transport="wire"``: while no thread or coroutine is blocked on the
    #: store (in ``get``/``mget``/``wait`` with a timeout, a queue ``pop``, a barrier) and
    #: its cache is serving, the watch thread begins waiting for its stream at most once
    #: per this many seconds in a busy spell (10 events within two intervals), so that
    #: events arriving that fast are applied in batches (interrupt moderation: each
    #: wake-up of the thread costs tens of µs of CPU however little it reads;
    #: ``benchmarks/FANOUT.md``, "CPU per watch event"). An event after a
    #: quiet spell is applied at once, and a backlog is read at full speed; in a busy
    #: spell, non-blocking reads (``timeout=0``, torch's ``check``) may see an event up to
    #: this much later. Blocked readers are never delayed. 0 disables it; it must stay
    #: below ``stall_timeout``.
    watch_pacing: float = 0.005

    DEFAULT: ClassVar[LivenessPolicy]
    FAST: ClassVar[LivenessPolicy]
    FANOUT: ClassVar[LivenessPolicy]

    def __post_init__(self) -> None:
        _check_seconds(self, "ping_interval")
        _check_seconds(self, "progress_interval", above_zero=True)
        stall_timeout = _check_seconds(self, "stall_timeout", above_zero=True)
        if _check_seconds(self, "watch_pacing") >= stall_timeout:
            raise InvalidInputError(
                f"watch_pacing must be at least 0 and below stall_timeout "
                f"({stall_timeout:g} s), got {self.watch_pacing!r}")

    @property
    def detection_bound(self) -> float:
        """The longest a silent partition goes unnoticed: ``stall_timeout`` plus one
        ``progress_interval`` (for a stream that has not answered a progress request)."""
        return self.stall_timeout + self.progress_interval

    @property
    def pings(self) -> bool:
        """Whether a quiet stream may PING (``ping_interval`` is on and fits
        ``stall_timeout``); the wire transport and etcd's first answer permitting."""
        return pings_fit(self.ping_interval, self.stall_timeout)


LivenessPolicy.DEFAULT = LivenessPolicy()
LivenessPolicy.FAST = LivenessPolicy(ping_interval=0.0, progress_interval=0.5,
                                     stall_timeout=2.0, watch_pacing=0.0)
LivenessPolicy.FANOUT = LivenessPolicy(ping_interval=10.0, progress_interval=5.0,
                                       stall_timeout=30.0, watch_pacing=0.01)

#: The fields of :class:`LivenessPolicy`, also keywords of ``EtcdStore`` and
#: :meth:`StoreConfig.with_overrides`.
LIVENESS_TIMES = tuple(f.name for f in fields(LivenessPolicy))


class _FromLiveness:
    """A read-only attribute of :class:`StoreConfig`: the same-named field of its
    ``liveness`` (``config.stall_timeout`` is ``config.liveness.stall_timeout``); of the
    class itself, the default's."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, config: StoreConfig | None, owner: type | None = None) -> float:
        value: float = getattr(LivenessPolicy.DEFAULT if config is None else config.liveness,
                               self._name)
        return value


@dataclass(frozen=True)
class StoreConfig:
    """Settings of an :class:`~cachedstore.EtcdStore`; every keyword of the store maps here.

    Times are in seconds (a ``timedelta`` is converted). Every field is checked here, when
    the config is made: ``InvalidTypeError`` for a wrong type, ``InvalidInputError`` for a
    value out of range, naming the field. None is allowed only where a field says so.
    """

    #: Most entries the LRU cache holds (values and "absent as of revision R" markers).
    cache_size: int = 65_536
    #: Default wait of blocking operations (``wait``; ``get``/``mget`` block only when
    #: given an explicit ``timeout``).
    timeout: float = 300.0
    #: Budget of one store operation's etcd calls, failover to other endpoints included. An
    #: unreachable cluster raises ``EtcdConnectionError`` after at most this long.
    request_timeout: float = 10.0
    #: Budget of the constructor's first contact with etcd (authentication, current
    #: revision, watch creation). Unreachable → ``EtcdConnectionError`` within this.
    connect_timeout: float = 10.0
    #: How the watch stream tells a quiet etcd from a lost one (PINGs, progress requests,
    #: the stall timeout) and how often a busy one is read: a ``LivenessPolicy`` (presets
    #: ``LivenessPolicy.DEFAULT``, ``.FAST``, ``.FANOUT``: see "Liveness" below). Its four
    #: times are also keywords of ``EtcdStore`` (``ping_interval``, ``progress_interval``,
    #: ``stall_timeout``, ``watch_pacing``), which replace those of ``liveness``, and
    #: read-only attributes of the config. Silent-partition detection: within
    #: ``stall_timeout`` (8 s by default), ``liveness.detection_bound`` at worst (10 s).
    liveness: LivenessPolicy = LivenessPolicy.DEFAULT
    #: With credentials (a user, or a client certificate), how often the watch re-checks
    #: that they still grant reading the prefix: one count-only range with the current
    #: token, also run as soon as the token was renewed. etcd never re-checks an open
    #: watch, so without this a deleted user or a revoked role kept its watch, and the
    #: store kept serving. A denial stops serving within this interval plus one request;
    #: reads then raise ``EtcdPermissionError``/``AuthenticationError``. None disables it.
    auth_check_interval: float | None = 5.0
    #: Most operations in one etcd Txn (etcd's ``--max-txn-ops``, 128 by default).
    max_txn_ops: int = 128
    #: etcd's ``--max-request-bytes`` (1.5 MiB by default): larger puts are refused here,
    #: before anything is sent, with a ``ValueError``.
    max_request_bytes: int = 1_572_864
    #: Opt-in bounded staleness: while the watch is down, serve cached values for at most
    #: this many seconds after the last confirmed watch contact (each such read counted in
    #: ``cachedstore_stale_reads_total``). None (default): never serve while down.
    max_staleness: float | None = None
    #: If the prefix holds at most this many keys (and no more than ``cache_size``) when the
    #: store starts or resyncs, they are all loaded into the cache: while nothing has been
    #: evicted, a key the cache does not hold is then known to be absent without an etcd
    #: read (a blocking ``get``/``mget``/``wait`` of a key not yet written costs no request).
    #: 0 disables it.
    preload_limit: int = 10_000
    #: What the store's one watch stream covers. ``"prefix"``: the whole prefix (every
    #: store receives every write under it; its cache can be preloaded whole).
    #: ``"touched"``: only what its reads touched, one etcd watch per *scope* on the one
    #: stream: a name's own key, or its whole directory once 8 names directly in that
    #: directory were read (gloo's all-gather). A new scope costs one read (of the scope
    #: whole, at most ``preload_limit`` keys kept); reads in it are then served as in
    #: ``"prefix"`` mode. A torch rank then receives its own process groups' writes only.
    watch_scope: str = "prefix"
    #: With ``watch_scope="touched"``: the most scopes watched. Touching one more makes the
    #: store fall back to watching its whole prefix (once, for good).
    max_watches: int = 64
    #: How the watch stream reaches etcd. ``"wire"``: on an HTTP/2 connection of its
    #: own, read by the watch thread itself (``cachedstore/wire.py``), at half of
    #: grpcio's client CPU per event or less (``benchmarks/FANOUT.md``); a store then holds
    #: two connections to its endpoint. ``"grpc"``: through grpcio, like every other call
    #: (one connection; honours grpcio's proxy environment variables; no PINGs, so a quiet
    #: store sends progress requests). Both work with TLS, auth and etcd's grpc-proxy.
    #: (Unary calls: ``unary_transport``.)
    watch_transport: str = "wire"
    #: How unary calls (range, txn, put, ...) reach etcd. ``"wire"``: on the caller's
    #: thread over HTTP/2 connections of a small pool (``cachedstore/unary.py``), one
    #: call at a time per connection: about half of grpcio's client CPU per call and
    #: two thirds of its latency when one thread calls (``benchmarks/unary_cpu.py``), as
    #: much CPU when dozens of threads of one process call at once (``FANOUT.md``); a
    #: store then holds a connection per call in flight at once (one for a single thread)
    #: besides its watch's (one idle over 120 s is replaced, not reused; a store that
    #: reads nothing while it is built opens its first one then). ``"grpc"``:
    #: through grpcio (one connection; honours grpcio's proxy environment variables).
    #: Both work with TLS, auth and etcd's grpc-proxy, and both leave a read-only Txn
    #: to finish past its caller's wait (etcd < 3.5.5 must not see it cancelled): on its
    #: own connection (``"wire"``; a thread reads the answer, then pools the connection)
    #: or as a grpcio future.
    unary_transport: str = "wire"
    #: Retry policy of the watch stream and of connection attempts.
    backoff: Backoff = field(default_factory=Backoff)

    # The liveness times, read flat as before they were grouped (``config.stall_timeout``).
    ping_interval = _FromLiveness()
    progress_interval = _FromLiveness()
    stall_timeout = _FromLiveness()
    watch_pacing = _FromLiveness()

    def __post_init__(self) -> None:
        _check_number(self, "cache_size", 1, integer=True)
        _check_seconds(self, "timeout")
        _check_seconds(self, "request_timeout", above_zero=True)
        _check_seconds(self, "connect_timeout", above_zero=True)
        _check_type(self, "liveness", LivenessPolicy)
        _check_seconds(self, "auth_check_interval", above_zero=True, optional=True)
        _check_number(self, "max_txn_ops", 1, integer=True)
        _check_number(self, "max_request_bytes", 1, integer=True)
        _check_seconds(self, "max_staleness", optional=True)
        _check_number(self, "preload_limit", 0, integer=True)
        for name, allowed in (("watch_scope", WATCH_SCOPES),
                              ("watch_transport", WATCH_TRANSPORTS),
                              ("unary_transport", UNARY_TRANSPORTS)):
            _check_type(self, name, str)
            if getattr(self, name) not in allowed:
                raise InvalidInputError(
                    f"{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"got {getattr(self, name)!r}")
        _check_number(self, "max_watches", 1, integer=True)
        _check_type(self, "backoff", Backoff)

    @property
    def snapshot_limit(self) -> int:
        """The most keys a snapshot read (of the prefix or of a scope) may hold to be
        installed whole: ``preload_limit``, but never more than the cache holds."""
        return min(self.preload_limit, self.cache_size)

    def with_overrides(self, **overrides: object) -> StoreConfig:
        """A copy with the given fields replaced (``None`` values are ignored), checked as
        any new config is. The liveness times may be given flat (``stall_timeout=3``): they
        replace those of ``liveness`` (the one given, else this config's)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        flat = {name: given.pop(name) for name in LIVENESS_TIMES if name in given}
        if flat:
            liveness = given.get("liveness", self.liveness)
            if isinstance(liveness, LivenessPolicy):  # else refused below, like any field
                given["liveness"] = replace(liveness, **flat)  # type: ignore[arg-type]
        return replace(self, **given)  # type: ignore[arg-type]
