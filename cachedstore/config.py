"""Every tunable of a store, with its default and what it bounds, in one place."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from datetime import timedelta

__all__ = ["WATCH_SCOPES", "WATCH_TRANSPORTS", "Backoff", "StoreConfig", "seconds"]


def seconds(value: float | timedelta | None, what: str = "timeout") -> float | None:
    """``value`` in seconds as a float (``timedelta`` accepted); None stays None.

    Raises ``InvalidInputError`` (a ``ValueError``) for a negative or non-numeric value.
    """
    from .errors import InvalidInputError, InvalidTypeError

    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{what} must be seconds (a number) or a timedelta, "
                               f"not {type(value).__name__}")
    if value < 0 or value != value:
        raise InvalidInputError(f"{what} must be >= 0 seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential back-off between watch/connection attempts.

    A value: ``delay(attempt)`` derives the wait before retry number ``attempt`` (0-based)
    without mutating anything, so the policy can be tested without a network or a clock.

    - ``initial``: wait before the first retry, in seconds.
    - ``maximum``: the cap of any single wait.
    - ``multiplier``: growth per attempt.
    - ``jitter``: the fraction of each wait that is randomised (0.5 draws from
      [0.5 × d, d]), so that thousands of clients cut off together do not reconnect together.
    """

    initial: float = 0.05
    maximum: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry ``attempt``; any attempt number works, however large (the
        exponent is capped once the cap is reached, so it never overflows)."""
        steps = max(0, attempt)
        if self.multiplier > 1 and 0 < self.initial < self.maximum:
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


#: The values of :attr:`StoreConfig.watch_scope`.
WATCH_SCOPES = ("prefix", "touched")
#: The values of :attr:`StoreConfig.watch_transport`.
WATCH_TRANSPORTS = ("grpc", "wire")


@dataclass(frozen=True)
class StoreConfig:
    """Settings of an :class:`~cachedstore.EtcdStore`; every keyword of the store maps here.

    Times are in seconds.
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
    #: How long a quiet watch stream waits before it asks etcd for a progress response,
    #: when it does not PING (see ``ping_interval``); also how often a scope replaying
    #: after a reconnect asks (its answer re-reads a scope whose range did not change).
    progress_interval: float = 2.0
    #: With ``watch_transport="wire"``: a quiet watch stream sends an HTTP/2 PING once it
    #: heard nothing for this long (2 % more), instead of progress requests. etcd
    #: acknowledges a PING in its gRPC transport: a quiet store costs it no request at
    #: all. Used when ``stall_timeout`` is at least 1.5 times as long (the answer has half
    #: an interval), once etcd answered the stream's first check, a progress request (so
    #: never behind etcd's grpc-proxy, which answers none and would answer PINGs). It
    #: must not be below etcd's ``--grpc-keepalive-min-time`` (5 s by default): etcd closes
    #: a connection that PINGs more often (``too_many_pings``), and the store then uses
    #: progress requests for good (logged). 0 disables PINGs.
    ping_interval: float = 5.0
    #: A watch stream that has heard nothing from etcd (no event, no progress response, no
    #: PING acknowledgement) for this long is declared stalled: the cache stops being
    #: served and the stream is restarted. That bounds silent-partition detection (8 s by
    #: default): ``stall_timeout``, plus ``progress_interval`` for a stream of progress
    #: requests that never answered one (grpc-proxy's), which is probed once first.
    stall_timeout: float = 8.0
    #: With credentials (a user, or a client certificate), how often the watch re-checks
    #: that they still grant reading the prefix: one count-only range with the current
    #: token, also run as soon as the token was renewed. etcd never re-checks an open
    #: watch, so without this a deleted user or a revoked role kept its watch, and the
    #: store kept serving. A denial stops serving within this interval plus one request;
    #: reads then raise ``EtcdPermissionError``/``AuthenticationError``. None disables it.
    auth_check_interval: float | None = 5.0
    #: gRPC keepalive pings on idle connections (etcd refuses pings more often than 5 s).
    keepalive_time: float = 10.0
    keepalive_timeout: float = 5.0
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
    #: (one connection; honours grpcio's proxy environment variables). Both work with
    #: TLS, auth and etcd's grpc-proxy; unary calls always use grpcio.
    watch_transport: str = "wire"
    #: With ``watch_transport="wire"``: while no thread or coroutine is blocked on the
    #: store (in ``get``/``mget``/``wait`` with a timeout, a queue ``pop``, a barrier) and
    #: its cache is serving, the watch thread begins waiting for its stream at most once
    #: per this many seconds, so that events arriving faster are applied in batches
    #: (interrupt moderation: each wake-up of the thread costs tens of µs of CPU however
    #: little it reads; ``benchmarks/FANOUT.md``, "CPU per watch event"). An event after a
    #: quiet spell is applied at once, and a backlog is read at full speed; in a busy
    #: spell, non-blocking reads (``timeout=0``, torch's ``check``) may see an event up to
    #: this much later. Blocked readers are never delayed. 0 disables it; it must stay
    #: below ``stall_timeout``.
    watch_pacing: float = 0.005
    #: One ``get``/``aget`` call in this many is timed into
    #: ``cachedstore_request_duration_seconds`` (hits and misses alike, so its quantiles are
    #: unbiased); 1 times every call at about 0.7 µs more per cache hit. Counts are exact.
    latency_sample_every: int = 16
    #: Retry policy of the watch stream and of connection attempts.
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        from .errors import InvalidInputError

        for name, allowed in (("watch_scope", WATCH_SCOPES),
                              ("watch_transport", WATCH_TRANSPORTS)):
            if getattr(self, name) not in allowed:
                raise InvalidInputError(
                    f"{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"got {getattr(self, name)!r}")
        for name in ("progress_interval", "stall_timeout"):
            if not 0 < getattr(self, name) < math.inf:
                raise InvalidInputError(f"{name} must be above 0 seconds and finite, got "
                                        f"{getattr(self, name)!r}")
        if not 0 <= self.ping_interval < math.inf:
            raise InvalidInputError(
                f"ping_interval must be at least 0 seconds and finite, got "
                f"{self.ping_interval!r}")
        if not 0 <= self.watch_pacing < self.stall_timeout:
            raise InvalidInputError(
                f"watch_pacing must be at least 0 and below stall_timeout "
                f"({self.stall_timeout:g} s), got {self.watch_pacing!r}")

    @property
    def snapshot_limit(self) -> int:
        """The most keys a snapshot read (of the prefix or of a scope) may hold to be
        installed whole: ``preload_limit``, but never more than the cache holds."""
        return min(self.preload_limit, self.cache_size)

    def with_overrides(self, **overrides: object) -> StoreConfig:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        for name in ("timeout", "request_timeout", "connect_timeout", "progress_interval",
                     "stall_timeout", "keepalive_time", "keepalive_timeout", "max_staleness",
                     "watch_pacing", "ping_interval"):
            if name in given:
                given[name] = seconds(given[name], name)  # type: ignore[arg-type]
        for name in ("cache_size", "max_txn_ops", "max_request_bytes", "latency_sample_every",
                     "preload_limit", "max_watches"):
            if name in given:
                value = given[name]
                lowest = 0 if name == "preload_limit" else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                    from .errors import InvalidInputError

                    raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
        return replace(self, **given)  # type: ignore[arg-type]
