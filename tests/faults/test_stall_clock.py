"""Stall detection on an injected clock (issue 10): the watchdog's 6 s stall bound runs on
a :class:`~cachedstore.clock.FakeClock`, so the test moves time instead of sleeping, and
asserts the exact point in (fake) time where the stall is declared.

The watch itself is real: a Connection and a Watcher (given the fake clock) against a real
etcd through a :class:`~tests.faults.proxy.FaultProxy` that goes silent. Only the liveness
probe that precedes the verdict is a real-time gRPC deadline (``progress_interval``).
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

STALL_TIMEOUT, PROGRESS_INTERVAL = 6.0, 2.0  # the defaults


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


def test_stall_declared_exactly_past_the_bound_on_a_fake_clock(proxy: FaultProxy,
                                                                prefix: str) -> None:
    clock = _CountingClock()
    config = StoreConfig(stall_timeout=STALL_TIMEOUT, progress_interval=PROGRESS_INTERVAL)
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
        clock.wait_for_waiters(1)  # the watchdog, parked until the first progress tick
        assert cache.floor != NOT_SERVING
        proxy.stall()

        # Just short of the bound (the stream's last contact was at its start): still up.
        clock.step(STALL_TIMEOUT - 0.1)
        assert cache.floor != NOT_SERVING and watcher.up
        # The next tick is past it: the stream never answered a progress request, so it
        # is probed (a real-time deadline of progress_interval) and then declared stalled.
        before = clock.monotonic()
        clock.advance(PROGRESS_INTERVAL)
        wait_until(lambda: cache.floor == NOT_SERVING, PROGRESS_INTERVAL + 5,
                   "the stall to be declared")
        elapsed = clock.monotonic() - before + STALL_TIMEOUT - 0.1
        assert STALL_TIMEOUT < elapsed <= STALL_TIMEOUT + 2 * PROGRESS_INTERVAL
        wait_until(lambda: watcher.restarts >= 1, 5, "the watch to restart")
    finally:
        watcher.stop()
        conn.close()
    assert not any(t.name == "cachedstore-watch-fake" for t in threading.enumerate())
