"""Time, injectable: every timeout, back-off, stall bound and staleness bound reads a Clock.

Production code uses :data:`SYSTEM_CLOCK`. Tests pass a :class:`FakeClock` and move time
with :meth:`FakeClock.advance`, so a 25-minute outage or a 6 s stall bound runs in
milliseconds without a single real sleep.

A clock has three operations, all thread-safe:

- ``monotonic()``: seconds, only ever increasing;
- ``sleep(seconds)``: block for that long (on a fake clock: until time is advanced past it);
- ``wait(event, timeout)``: block until ``event`` is set or ``timeout`` seconds pass;
  returns ``event.is_set()``. ``timeout=None`` waits for the event alone.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def wait(self, event: threading.Event, timeout: float | None) -> bool: ...


class SystemClock:
    """Real time: ``time.monotonic``, ``time.sleep`` and ``Event.wait``."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        return event.wait(timeout)

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK = SystemClock()


class FakeClock:
    """Time that moves only when a test calls :meth:`advance`.

    Threads blocked in ``sleep``/``wait`` wake when the event is set (for ``wait``) or when
    ``advance`` moves time to or past their deadline. ``waiting`` tells how many threads
    are blocked, so a test can advance only once the code under test is parked.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._cond = threading.Condition()
        self._waiting = 0

    def monotonic(self) -> float:
        with self._cond:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every thread whose deadline has come."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        with self._cond:
            self._now += seconds
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """How many threads are blocked in ``sleep`` or ``wait`` right now."""
        with self._cond:
            return self._waiting

    def wait_for_waiters(self, n: int = 1, timeout: float = 5.0) -> None:
        """Block (in real time, at most ``timeout``) until ``n`` threads are parked here."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self._waiting} of {n} threads parked on the clock")
                self._cond.wait(min(left, 0.01))

    def sleep(self, seconds: float) -> None:
        self.wait(threading.Event(), seconds)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        with self._cond:
            deadline = None if timeout is None else self._now + max(0.0, timeout)
            self._waiting += 1
            self._cond.notify_all()
            try:
                while not event.is_set():
                    if deadline is not None and self._now >= deadline:
                        break
                    # A set() from another thread does not notify this condition: poll it
                    # at a short real interval (a test clock, never on the production path).
                    self._cond.wait(0.002)
            finally:
                self._waiting -= 1
            return event.is_set()

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now:g})"
