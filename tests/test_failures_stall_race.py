"""The stall watchdog against a concurrent apply (issue 10, item 12).

The watchdog runs on gRPC's request thread and calls ``cache.watch_down()`` while the
watch thread may be inside ``apply_events``, which re-enables serving once the replay
reaches the stream's creation revision. If ``watch_down`` did not take the cache's lock,
an apply that had already decided "caught up" would overwrite the stall with "serving",
and a stalled stream would keep serving until the stream was torn down.

The interleaving is forced, not hoped for: the apply is parked between its decision and
its store of "serving" (a property standing in for the ``floor`` attribute), the stall is
started on another thread, and the apply is released only once the stall has either
finished or is waiting for the cache's lock (observed by a wrapper around that lock).
"""

from __future__ import annotations

import threading
from typing import Any

from cachedstore.cache import NOT_SERVING, CoherentCache
from cachedstore.metrics import NullMetrics

STALL_THREAD = "stall-watchdog"
APPLY_THREAD = "watch-apply"
BOUND = 10.0  # seconds any step may take before the test fails (never reached when correct)


class _ObservedLock:
    """The cache's lock, reporting when the watchdog thread starts waiting for it."""

    def __init__(self, lock: Any, attempted: threading.Event) -> None:
        self._lock = lock
        self._attempted = attempted

    def __enter__(self) -> bool:
        if threading.current_thread().name == STALL_THREAD:
            self._attempted.set()
        return bool(self._lock.__enter__())

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


class _GatedFloorCache(CoherentCache):
    """The cache with its ``floor`` observable: when the apply thread is about to store 0
    ("caught up, serve everything"), it has already decided so under the lock; it parks
    right there until ``release`` is set. Values live where ``CoherentCache`` keeps them."""

    entered: threading.Event
    release: threading.Event

    @property  # type: ignore[override]
    def floor(self) -> int:
        return int(self.__dict__["floor"])

    @floor.setter
    def floor(self, value: int) -> None:
        if (value == 0 and threading.current_thread().name == APPLY_THREAD
                and not self.entered.is_set()):
            self.entered.set()
            assert self.release.wait(BOUND), "the test never released the apply"
        self.__dict__["floor"] = value


def test_stall_during_apply_is_not_undone_by_the_apply() -> None:
    cache = CoherentCache(16, NullMetrics())
    cache.reset(10, [])
    cache.watch_up(12)  # a reconnected stream replaying up to its creation revision 12
    assert cache.floor == 12

    entered, release = threading.Event(), threading.Event()
    stall_progress = threading.Event()  # the watchdog finished, or waits for the lock
    cache.__class__ = _GatedFloorCache
    assert isinstance(cache, _GatedFloorCache)
    cache.entered, cache.release = entered, release
    cache._lock = _ObservedLock(cache._lock, stall_progress)  # type: ignore[assignment]

    apply = threading.Thread(target=cache.apply_events, args=([("k", b"v", 12)], 12),
                             name=APPLY_THREAD, daemon=True)
    apply.start()
    assert entered.wait(BOUND), "apply_events never reached its critical section"

    def stall() -> None:
        cache.watch_down()
        stall_progress.set()

    watchdog = threading.Thread(target=stall, name=STALL_THREAD, daemon=True)
    watchdog.start()
    assert stall_progress.wait(BOUND), "watch_down neither finished nor waited for the lock"
    release.set()
    apply.join(BOUND)
    watchdog.join(BOUND)
    assert not apply.is_alive() and not watchdog.is_alive()

    # The stall came last: nothing may be served, not even the event just applied.
    assert cache.floor == NOT_SERVING
    assert cache.lookup("k") is None
