"""Stall detection on an injected clock (issue 10): the watchdog's 8 s stall bound runs on
a :class:`~cachedstore.clock.FakeClock`, so the test moves time instead of sleeping, and
asserts the exact point in (fake) time where the stall is declared.

The watch itself is real: a Connection and a Watcher (given the fake clock) against a real
etcd through a :class:`~tests.faults.proxy.FaultProxy` that goes silent. With progress
requests, only the liveness probe that precedes the verdict is a real-time gRPC deadline
(``progress_interval``); a PINGing stream (the default) has no probe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from cachedstore.cache import NOT_SERVING, CoherentCache
from cachedstore.clock import FakeClock
from cachedstore.config import StoreConfig
from cachedstore.connection import Connection, Credentials
from cachedstore.keys import KeySpace
from cachedstore.metrics import NullMetrics
from cachedstore.server import LocalEtcd
from cachedstore.watcher import Watcher, snapshot

from . import split, wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(60)

STALL_TIMEOUT, PROGRESS_INTERVAL, PING_INTERVAL = 8.0, 2.0, 5.0  # the defaults


class _CountingClock(FakeClock):
    """A FakeClock that counts the waits begun, so the test knows when the watchdog has
    handled a step of time and parked again."""

    def __init__(self) -> None:
        super().__init__()
        self._count_lock = threading.Lock()
        self.waits = 0

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        with self._count_lock:
            self.waits += 1
        return super().wait(event, timeout)

    def step(self, seconds: float) -> None:
        """Advance, then block (real time, ≤ 5 s) until some thread parked again."""
        before = self.waits
        self.advance(seconds)
        wait_until(lambda: self.waits > before, 5, f"a wait after advancing {seconds} s")


@pytest.fixture
def proxy(etcd_factory: Callable[..., LocalEtcd]) -> Iterator[FaultProxy]:
    with FaultProxy(etcd_factory().endpoint, max_lifetime=50) as p:
        yield p


@pytest.mark.parametrize("ping_interval", [PING_INTERVAL, 0.0], ids=["ping", "progress"])
def test_stall_declared_exactly_past_the_bound_on_a_fake_clock(proxy: FaultProxy, prefix: str,
                                                                ping_interval: float) -> None:
    clock = _CountingClock()
    config = StoreConfig().with_overrides(stall_timeout=STALL_TIMEOUT,
                                          progress_interval=PROGRESS_INTERVAL,
                                          ping_interval=ping_interval)
    assert StoreConfig().ping_interval == PING_INTERVAL
    conn = Connection([split(proxy.endpoint)], Credentials(), config, NullMetrics(), clock)
    keys = KeySpace(prefix, config.max_request_bytes)
    cache = CoherentCache(16, NullMetrics())
    revision, entries = snapshot(conn, keys, 0, conn.deadline())
    cache.reset(revision, entries)
    watcher = Watcher(conn, keys, cache, config, NullMetrics(), "cachedstore-watch-fake",
                      clock=clock)
    try:
        watcher.start(revision)
        assert watcher.ready.wait(5)
        clock.wait_for_waiters(1)  # the watchdog, parked until its first wake-up
        assert cache.floor != NOT_SERVING
        if ping_interval:
            # The stream's first check (a PING's time) is a progress request: once etcd
            # answered it, the stream PINGs (a proxy would not have answered).
            clock.step(PING_INTERVAL * 1.02)
            wait_until(lambda: watcher._progress_answered, 5, "the progress answer")
            clock.wait_for_waiters(1)
        started = clock.monotonic()  # the last contact (the progress answer, or the start)
        proxy.stall()

        # Just short of the bound (the stream's last contact was at its start): still up.
        clock.step(STALL_TIMEOUT - 0.1)
        assert cache.floor != NOT_SERVING and watcher.up
        before = clock.monotonic()
        if ping_interval:
            # A PING went out (unanswered): the stall is declared at the bound itself.
            clock.advance(0.1)
            wait_until(lambda: cache.floor == NOT_SERVING, 5, "the stall to be declared")
            assert clock.monotonic() - started == STALL_TIMEOUT
        else:
            # The stream never answered a progress request, so it is probed (a real-time
            # deadline of progress_interval) and then declared stalled.
            clock.advance(0.1)
            wait_until(lambda: cache.floor == NOT_SERVING, PROGRESS_INTERVAL + 5,
                       "the stall to be declared")
            elapsed = clock.monotonic() - before + STALL_TIMEOUT - 0.1
            assert STALL_TIMEOUT <= elapsed <= STALL_TIMEOUT + PROGRESS_INTERVAL
        wait_until(lambda: watcher.restarts >= 1, 5, "the watch to restart")
    finally:
        watcher.stop()
        conn.close()
    assert not any(t.name == "cachedstore-watch-fake" for t in threading.enumerate())
