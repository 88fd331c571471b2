"""Blocked readers: a thread or a coroutine waiting for a key to be put.

A waiter is registered with the cache for a key (or a key prefix) by its owner and stays
registered until its owner removes it: the cache never drops a waiter on its own, so a
wake-up can never be lost between the owner's check of the cache and its wait. ``wake``
hands over the value that was put; ``nudge`` asks the owner to look again (after a resync,
on close). Both may be called from any thread, any number of times.
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["AsyncWaiter", "ThreadWaiter", "Waiter"]


class ThreadWaiter:
    """A blocked thread: it waits on ``event``, then clears it *before* reading ``value``,
    so that a wake arriving between its wait and its clear is still seen."""

    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: bytes | None = None

    def wake(self, value: bytes | None) -> bool:
        """Hand ``value`` over; True (a thread can always be woken)."""
        self.value = value
        self.event.set()
        return True

    def nudge(self) -> bool:
        """Make the thread look again; True."""
        self.event.set()
        return True

    def take(self) -> bytes | None:
        """After a wait returned: reset for the next wait and return the value handed
        over, if any (None: nudged, or the wait timed out)."""
        self.event.clear()
        value, self.value = self.value, None
        return value


def _resolve(future: asyncio.Future[bytes | None], value: bytes | None) -> None:
    if not future.done():
        future.set_result(value)


class AsyncWaiter:
    """A blocked coroutine: woken through its event loop, no thread held while waiting.
    One ``future`` per wait; ``renew`` starts the next one."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[bytes | None] = loop.create_future()

    def wake(self, value: bytes | None) -> bool:
        """Hand ``value`` over through the loop (from any thread); False if the loop was
        closed: nobody can be woken through this waiter any more, and its owner may never
        remove it (its coroutine was left pending), so the cache forgets it."""
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, value)
        except RuntimeError:
            return False
        return True

    def nudge(self) -> bool:
        """Make the coroutine look again; False if the loop was closed (see :meth:`wake`)."""
        return self.wake(None)

    def renew(self) -> None:
        """Start a new wait (on the loop's thread) after the previous future resolved."""
        self.future = self.loop.create_future()


Waiter = ThreadWaiter | AsyncWaiter
