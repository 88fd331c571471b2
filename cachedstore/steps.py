"""A read's decisions written once, its I/O done by whoever drives it: sync or asyncio.

The read-through logic past the hot path (``ReadThrough.get_steps`` and friends in
``reads.py``) is a generator that *yields* what it needs done and is *sent* the answer:

- :class:`Call` ``(fn, args)``: an etcd round trip; the answer is ``fn(*args)``'s result,
  or its exception thrown back into the generator (so that ``try``/``except`` in the logic
  works as in plain code). The thread driver calls it in place; the asyncio driver runs it
  on the store's thread pool, so the event loop never blocks.
- :data:`NEW_WAITER`: a waiter to register with the cache for a blocking read (a
  :class:`~cachedstore.waiters.ThreadWaiter`, or an ``AsyncWaiter`` on the running loop).
- :class:`Pause` ``(waiter, seconds)``: block until the watch wakes ``waiter`` or
  ``seconds`` pass; the answer is the value handed over, or None (nudged, timed out).

A rule of the read path then lives in one place: the two fronts cannot drift apart (they
did: a blocking ``get`` and ``aget`` answered a deleted counter differently). This is the
"sans-I/O" shape of h11 and of etcd's own ``cache/`` demux, at the price of one generator
per call past the hot path (a miss costs an etcd round trip; a hit never gets here).

:func:`drive` is the thread driver; the asyncio driver is ``AsyncFront.drive``
(``aio.py``). Both throw a driver-side exception (a cancelled coroutine, a
``KeyboardInterrupt``) into the generator, so its ``finally`` blocks (waiter removal) run.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NamedTuple, TypeVar

from .clock import Clock
from .waiters import ThreadWaiter

__all__ = ["NEW_WAITER", "Call", "Pause", "Steps", "drive", "resume"]

T = TypeVar("T")


class Call(NamedTuple):
    """An etcd round trip (or any blocking call): answered with ``fn(*args)``.
    ``start_by`` (a time of the store's clock, or None): a driver that queues calls (the
    asyncio one, on the store's executor) answers a call still queued then with
    EtcdConnectionError, as if etcd had not answered in time; the thread driver starts
    every call at once."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    start_by: float | None = None


class Pause(NamedTuple):
    """Block on ``waiter`` for at most ``seconds``: answered with the value it was woken
    with, or None."""

    waiter: Any
    seconds: float


class _NewWaiter:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEW_WAITER"


#: The step asking for a fresh waiter of the driver's kind.
NEW_WAITER = _NewWaiter()

#: A read's logic: yields steps, is sent their answers, returns the read's result.
Steps = Generator[Any, Any, T]


def resume(steps: Steps[T], answer: Any, failure: BaseException | None) -> tuple[bool, Any]:
    """Send ``answer`` into the logic, or throw ``failure`` into it: (True, its result) once
    it returned, else (False, the next step). What the logic raises propagates."""
    try:
        return False, steps.send(answer) if failure is None else steps.throw(failure)
    except StopIteration as done:
        return True, done.value


def drive(steps: Steps[T], clock: Clock) -> T:
    """Run ``steps`` on the calling thread: calls in place, pauses on ``clock``. Returns
    what the logic returns; raises what it raises."""
    done, step = resume(steps, None, None)
    while not done:
        done, step = resume(steps, *_answer(step, clock))
    return step


def _answer(step: Any, clock: Clock) -> tuple[Any, BaseException | None]:
    """(the step's answer, None), or (None, what it raised) to throw into the logic."""
    try:
        if step.__class__ is Call:
            return step.fn(*step.args), None
        if step.__class__ is Pause:
            clock.wait(step.waiter.event, step.seconds)
            return step.waiter.take(), None
        return ThreadWaiter(), None
    except BaseException as exc:  # noqa: BLE001 -- thrown into the logic, which decides
        return None, exc
