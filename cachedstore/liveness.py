"""When a quiet watch stream asks etcd for a sign of life, and when it is stalled: a value
the watcher's request side consults at each wake-up, testable without a network or a clock.

Two ways to ask, both answered by the member (or proxy) at the other end of the stream:

- **PING** (``ping_interval > 0``, the wire transport only): an HTTP/2 PING once the stream
  has heard nothing for ``ping_interval``. etcd's gRPC server acknowledges it in its
  transport; it is not an etcd request (no watch-stream message, no lock of the watch
  store), so a quiet store costs etcd nothing but a frame each way. etcd refuses PINGs
  more often than its ``--grpc-keepalive-min-time`` (5 s by default) when it sent nothing
  in between: three such PINGs and it closes the connection (GOAWAY ``too_many_pings``).
  So the next PING is due ``ping_interval`` (and 2 % more, for clocks whose rates differ)
  after the last thing *heard*, which follows the previous PING's acknowledgement: etcd
  sees them at least ``ping_interval`` apart. The caller PINGs only when ``stall_timeout``
  leaves the answer half a ``ping_interval`` at least (:func:`pings_fit`).
- **Progress request** (grpcio, PINGs refused, or PINGs that do not fit ``stall_timeout``:
  :func:`pings_fit`): one watch-stream message whenever the stream has been quiet for
  ``progress_interval``, as etcd's own clients do.

The watcher PINGs only on a stream etcd itself answered (``Watcher._progress_answered``,
:attr:`Liveness.confirmed`): until then each check due on the PING schedule is a progress
request (so a stream's first check comes after ``ping_interval`` of quiet, like a PING),
and a stream behind etcd's grpc-proxy (which answers no progress request, and would answer
PINGs for etcd) keeps to them.

Progress requests are also sent, every ``progress_interval``, whenever the caller says a
scope is *lagging* (replaying after a reconnect): their answers are what re-reads such a
scope when its range did not change meanwhile (``Watcher._refresh_quiet_scopes``).

A stream that has heard nothing for ``stall_timeout`` is stalled, checked at that very
time (not at the next tick): a silent partition is detected within ``stall_timeout``
(plus the watcher's unary probe, for a progress-request stream that never answered one).

Not thread-safe: one request side owns it. Times are the caller's clock's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Liveness", "Step", "pings_fit"]

#: A PING is due this much later than ``ping_interval`` after the last thing heard.
_PING_MARGIN = 1.02


def pings_fit(ping_interval: float, stall_timeout: float) -> bool:
    """Whether PINGs every ``ping_interval`` can tell a quiet stream from a stalled one
    within ``stall_timeout``: they are on, and leave each answer half an interval."""
    return ping_interval > 0 and ping_interval * _PING_MARGIN * 1.5 <= stall_timeout


@dataclass(frozen=True, slots=True)
class Step:
    """What the request side does at a wake-up: declare the stream stalled, or send a
    PING and/or a progress request (any of them may be False)."""

    stalled: bool = False
    ping: bool = False
    progress: bool = False


_NOTHING = Step()


class Liveness:
    """The liveness schedule of one stream, begun at ``now`` (its start counts as heard).

    ``pinging``: PINGs instead of progress requests (see the module docstring); the caller
    decides (transport, configuration, whether etcd refused them). ``confirmed``: see the
    attribute."""

    __slots__ = ("_progress_interval", "_stall_timeout", "_ping_interval", "_pinging",
                 "confirmed", "_next_tick", "_progress_sent", "_ping_sent")

    def __init__(self, now: float, *, progress_interval: float, stall_timeout: float,
                 ping_interval: float, pinging: bool, confirmed: bool = True) -> None:
        self._progress_interval = progress_interval
        self._stall_timeout = stall_timeout
        self._ping_interval = ping_interval * _PING_MARGIN
        self._pinging = pinging
        #: With ``pinging``: whether etcd itself answered the stream (a progress
        #: response). Until then each check due on the PING schedule is a progress
        #: request instead. The watcher starts a stream unconfirmed and updates this.
        self.confirmed = confirmed
        #: Every ``progress_interval``: whether a scope lags is looked at then.
        self._next_tick = now + progress_interval
        #: When the last progress request was sent (the stream's start at first).
        self._progress_sent = now
        #: When the last PING was sent (-inf: none); it is outstanding while nothing was
        #: heard since.
        self._ping_sent = -math.inf

    def next_wake(self, heard: float) -> float:
        """The clock time of the next wake-up (always later than the last :meth:`step`),
        given the time anything was last heard."""
        wake = min(heard + self._stall_timeout, self._next_tick)
        if not self._pinging:
            return min(wake, max(heard, self._progress_sent) + self._progress_interval)
        if self._ping_sent <= heard:
            return min(wake, heard + self._ping_interval)
        return wake

    def step(self, now: float, heard: float, lagging: bool) -> Step:
        """What is due at ``now``; records what it returns as sent. ``heard``: when the
        stream last heard anything (a response, an event, a PING's acknowledgement);
        ``lagging``: whether a scope is replaying (a progress request every
        ``progress_interval`` then, whatever else the stream hears)."""
        # Each test is the very sum next_wake() computes: a wake-up at that time finds
        # it due, whatever the floating-point rounding of a difference would say.
        if now >= heard + self._stall_timeout:
            return Step(stalled=True)
        check = (self._pinging and self._ping_sent <= heard
                 and now >= heard + self._ping_interval)
        if check:
            self._ping_sent = now
        ping = check and self.confirmed
        tick = now >= self._next_tick
        if tick:
            self._next_tick = now + self._progress_interval
        progress = (tick and lagging) or (check and not self.confirmed) or (
            not self._pinging
            and now >= max(heard, self._progress_sent) + self._progress_interval)
        if progress:
            self._progress_sent = now
        if not (ping or progress):
            return _NOTHING
        return Step(ping=ping, progress=progress)
