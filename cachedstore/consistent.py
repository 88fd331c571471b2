"""Linearizable reads from the cache: etcd's current revision, shared, and the watch's
progress towards it.

A ``consistent=True`` read (``reads.py``) is linearizable: it returns a state of each key
no older than the newest write acknowledged, by anyone, before the read began. Kubernetes'
"consistent reads from cache" (KEP-2340) is the model:

1. ask etcd for its current revision ``R`` with one cheap linearizable request (a range
   of one internal key nobody writes: its answer's header carries ``R``);
2. wait until the watch has applied ``R`` for the scopes of the names read;
3. answer from the cache.

:class:`SharedRevision` makes step 1 cost etcd one request however many reads run at
once: a read joins the next request *sent after it began* (a request already on its way
may have been answered before a write the read must see), so a thousand concurrent reads
cost one or two ranges.

Step 2 must not trust progress notifications for ordering: etcd before 3.5.8 can send one
ahead of the events of its revision. :class:`Progress` therefore only tells a waiting
read when to *give up* waiting: once a progress response at ``R`` or later has been
handled and a scope still has not applied ``R`` (it is quiet: nothing of it changed up to
``R``, or etcd sent the progress too early), the read falls back to a plain etcd read of
its names, itself linearizable. Either way the promise holds; only the cost differs.

Thread-safe; no method holds a lock while waiting on etcd.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from . import etcdapi
from .clock import Clock
from .connection import Connection
from .errors import EtcdConnectionError

__all__ = ["Progress", "SharedRevision"]

#: The longest single wait on a condition (re-checked against the injected clock).
_SLICE = 0.05


class SharedRevision:
    """etcd's current revision, read by one request shared among concurrent callers.

    Rounds are numbered; a caller needs a round that *starts* after it arrived (round
    ``started + 1`` as of its arrival) and takes the revision of any round at least that
    late. One round is in flight at a time: callers arriving meanwhile wait for it to end
    and then the first of them sends the next one for all. A failed round fails only its
    sender; the waiters send another."""

    def __init__(self, conn: Connection, key: bytes, clock: Clock) -> None:
        self._conn = conn
        self._request = etcdapi.range_key(key)  # keys-only would not be cheaper: absent key
        self._clock = clock
        self._cond = threading.Condition()
        self._started = 0
        self._finished = 0  # the newest round that ended with an answer
        self._in_flight = False
        self._revision = 0
        #: How many requests were sent, and how many callers wait for a round now (for
        #: tests and benchmarks).
        self.requests = 0
        self.waiting = 0

    def current(self, deadline: float) -> int:
        """A revision at least as new as etcd's when this call began. Blocks for one round
        trip, or two when a round was already on its way; raises EtcdConnectionError (or
        another cachedstore error) when etcd cannot answer before ``deadline``."""
        clock = self._clock
        with self._cond:
            target = self._started + 1
            while self._finished < target:
                if not self._in_flight:
                    self._started += 1
                    self._in_flight = True
                    break
                left = deadline - clock.monotonic()
                if left <= 0:
                    raise EtcdConnectionError(
                        "etcd's current revision: no answer within the request timeout")
                self.waiting += 1
                try:
                    self._cond.wait(min(left, _SLICE))
                finally:
                    self.waiting -= 1
            else:
                return self._revision
            mine = self._started
        revision = 0
        try:
            self.requests += 1
            response = self._conn.call("range", self._request, deadline=deadline)
            revision = int(response.header.revision)
        finally:
            with self._cond:
                self._in_flight = False
                if revision:  # rounds run one at a time: this is the newest one
                    self._finished = max(self._finished, mine)
                    self._revision = revision  # not a maximum: etcd's history may go back
                self._cond.notify_all()
        return revision


class Progress:
    """What the watch thread tells waiting consistent reads: something was applied, or a
    progress response arrived (its revision, a hint to stop waiting, never a proof).

    The watcher calls :meth:`advanced` after each response it handled (cheap when nobody
    waits) and :meth:`progressed` with a progress response's revision; readers call
    :meth:`wait` with a predicate."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._waiting = 0
        #: The revision of the newest progress response handled (0: none yet).
        self.revision = 0
        #: Set by the store: ask the stream for a progress response (coalesced there).
        self.request: Callable[[], None] = lambda: None

    def advanced(self) -> None:
        """The watch applied a response (any thread; lock-free when nobody waits)."""
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def progressed(self, revision: int) -> None:
        """A progress response at ``revision`` was handled (after everything before it)."""
        with self._cond:
            self.revision = max(self.revision, revision)
            self._cond.notify_all()

    def rewound(self) -> None:
        """etcd's history went back (rule 10 of cache.py): the progress seen so far
        counts revisions that etcd no longer has."""
        with self._cond:
            self.revision = 0
            self._cond.notify_all()

    def wait(self, done: Callable[[], Any], until: float) -> Any:
        """Block until ``done()`` is truthy (re-checked at every apply or progress) or the
        clock reaches ``until``; return ``done()``'s last value."""
        clock = self._clock
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    result = done()
                    if result:
                        return result
                    left = until - clock.monotonic()
                    if left <= 0:
                        return result
                    self._cond.wait(min(left, _SLICE))
            finally:
                self._waiting -= 1
