"""The revision-gated LRU cache and the waiters that block on it.

Every entry is a tuple ``(value, as_of, mod_revision)``: ``value`` is the key's bytes, or
None for "absent"; ``as_of`` is the etcd revision at which that state was known to be
current; ``mod_revision`` the key's own last-modified revision (0 when absent).

Coherence rules (see ``coherence.md``), all enforced here under one lock:

- An update (watch event or local write at revision ``r``) replaces an entry only if
  ``r > as_of``: events never move a key back in time, and a local write followed by its
  own watch event is a no-op.
- A read-through *fill* read at revision ``R`` is inserted only if no update of that key
  newer than ``R`` was applied while it was in flight (tracked per key in ``_dirty``,
  independently of the LRU, so eviction loses nothing), if no resync happened meanwhile
  (``_epoch``), and if the cached entry is older than ``R``.
- While the cache is *complete* — it was preloaded with every key under the prefix and has
  evicted nothing since — a key it does not hold is known to be absent (as of the applied
  revision) without asking etcd. The first eviction or reset ends that.
- Entries are served only while ``as_of >= floor``. The floor is ``NOT_SERVING`` while the
  watch is down, the watch's creation revision while it replays missed events after a
  (re)connect, and 0 once it has caught up. The hot path pays one comparison for all this.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from cachetools import LRUCache

from .metrics import NullMetrics, StoreMetrics

__all__ = ["NOT_SERVING", "AsyncWaiter", "CoherentCache", "Entry", "ThreadWaiter"]

Entry = tuple[bytes | None, int, int]
#: Floor while the watch is down: no entry is that new, so nothing is served.
NOT_SERVING = sys.maxsize


class ThreadWaiter:
    """A blocked thread. ``wake(value)`` hands it the value; ``nudge()`` asks it to re-check."""

    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: bytes | None = None

    def wake(self, value: bytes | None) -> None:
        self.value = value
        self.event.set()

    def nudge(self) -> None:
        self.event.set()


def _resolve(future: asyncio.Future[bytes | None], value: bytes | None) -> None:
    if not future.done():
        future.set_result(value)


class AsyncWaiter:
    """A blocked coroutine: woken through its event loop, no thread held while waiting."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[bytes | None] = loop.create_future()

    def wake(self, value: bytes | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, value)
        except RuntimeError:  # the loop was closed: nobody is waiting any more
            pass

    def nudge(self) -> None:
        self.wake(None)


Waiter = ThreadWaiter | AsyncWaiter


class _LRU(LRUCache):  # type: ignore[type-arg]
    """cachetools' LRU with an eviction callback."""

    def __init__(self, maxsize: int, on_evict: Callable[[], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self) -> tuple[Any, Any]:
        item = super().popitem()
        self._on_evict()
        return item


class CoherentCache:
    """The cache of one store. Thread-safe; no method blocks except on its own lock."""

    def __init__(self, maxsize: int, metrics: StoreMetrics | NullMetrics) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics
        self._lru = _LRU(maxsize, self._evicted)
        self.floor = NOT_SERVING
        self._epoch = 0
        self._inflight: dict[str, int] = {}
        self._dirty: dict[str, int] = {}
        self._waiters: dict[str, list[Waiter]] = {}
        self._prefix_waiters: dict[str, list[Waiter]] = {}
        self._n_waiters = 0
        #: Newest revision whose events have all been applied (events and resync points).
        self.applied_revision = 0
        #: True while every key under the prefix that exists has an entry here.
        self.complete = False
        self.closed = False

    # -- the hot path --------------------------------------------------------------------
    def lookup(self, name: object) -> Entry | None:
        """The entry for ``name`` if it may be served now, else None. Never raises."""
        with self._lock:
            try:
                entry = self._lru[name]
            except (KeyError, TypeError):
                return None
        if entry[1] < self.floor:
            return None
        return entry

    def lookup_or_absent(self, name: str) -> Entry | None:
        """Like :meth:`lookup`, and while the cache is complete and caught up, a key it does
        not hold is answered as absent as of the applied revision (no etcd read needed)."""
        with self._lock:
            try:
                entry = self._lru[name]
            except KeyError:
                if self.complete and self.floor == 0:
                    return (None, self.applied_revision, 0)
                return None
        if entry[1] < self.floor:
            return None
        return entry

    def peek(self, name: str) -> Entry | None:
        """The entry for ``name`` whether or not it may be served (max_staleness, add)."""
        with self._lock:
            try:
                return self._lru[name]  # type: ignore[no-any-return]
            except KeyError:
                return None

    # -- updates ---------------------------------------------------------------------------
    def _evicted(self) -> None:
        self.complete = False  # the evicted key's state is no longer known here
        self._metrics.evictions.inc()
        self._metrics.entries.dec()

    def _store(self, name: str, entry: Entry) -> None:
        if name not in self._lru:
            self._metrics.entries.inc()
        self._lru[name] = entry

    def _update(self, name: str, value: bytes | None, revision: int, mod_revision: int,
                woken: list[tuple[Waiter, bytes]]) -> None:
        """An update (event or local write): recorded for fills in flight, then installed."""
        if name in self._inflight and revision > self._dirty.get(name, 0):
            self._dirty[name] = revision
        self._install(name, value, revision, mod_revision, woken)
        if value is not None and self._prefix_waiters:
            for prefix, waiters in self._prefix_waiters.items():
                if name.startswith(prefix):
                    woken.extend((w, value) for w in waiters)

    def _install(self, name: str, value: bytes | None, revision: int, mod_revision: int,
                 woken: list[tuple[Waiter, bytes]]) -> None:
        """Store the state as of ``revision`` unless the entry is at least as new; a value
        hands itself to the key's waiters (collected in ``woken``, woken after the lock)."""
        old = self._lru.get(name)
        if old is not None and revision <= old[1]:
            return
        self._store(name, (value, revision, mod_revision))
        if value is not None:
            waiters = self._waiters.pop(name, None)
            if waiters:
                woken.extend((w, value) for w in waiters)

    def apply_events(self, events: Iterable[tuple[str, bytes | None, int]],
                     revision: int) -> None:
        """Apply one watch response: ``(name, value or None, mod_revision)`` in order, all
        of revisions up to ``revision``. Wakes the waiters of keys that were put."""
        woken: list[tuple[Waiter, bytes]] = []
        with self._lock:
            for name, value, mod_revision in events:
                self._update(name, value, mod_revision, mod_revision, woken)
            if revision > self.applied_revision:
                self.applied_revision = revision
            if self.floor != NOT_SERVING and revision >= self.floor:
                self.floor = 0  # caught up with everything up to the creation revision
        for waiter, value in woken:
            waiter.wake(value)

    def apply_write(self, name: str, value: bytes | None, revision: int) -> None:
        """Record a write this process made, at the revision etcd assigned (read-your-writes)."""
        woken: list[tuple[Waiter, bytes]] = []
        with self._lock:
            self._update(name, value, revision, revision if value is not None else 0, woken)
        for waiter, v in woken:
            waiter.wake(v)

    # -- read-through fills ----------------------------------------------------------------
    def begin_fill(self, names: Iterable[str]) -> int:
        """Register fills of ``names`` before reading them from etcd; returns a token."""
        with self._lock:
            inflight = self._inflight
            for name in names:
                inflight[name] = inflight.get(name, 0) + 1
            return self._epoch

    def end_fill(self, names: Iterable[str], token: int,
                 results: dict[str, tuple[bytes | None, int]] | None, revision: int) -> int:
        """Finish fills begun with ``token``: insert ``results`` (name → (value or None,
        mod_revision); a missing name means absent) read at ``revision``, unless the gate
        refuses them. ``results=None`` (the read failed) only unregisters. Returns how many
        fills the gate refused."""
        dropped = 0
        woken: list[tuple[Waiter, bytes]] = []
        with self._lock:
            stale_epoch = token != self._epoch
            for name in names:
                count = self._inflight[name] - 1
                if count:
                    self._inflight[name] = count
                    newer = self._dirty.get(name, 0)
                else:
                    del self._inflight[name]
                    newer = self._dirty.pop(name, 0)
                if results is None:
                    continue
                if stale_epoch or newer > revision:
                    dropped += 1
                    continue
                value, mod_revision = results.get(name, (None, 0))
                self._install(name, value, revision, mod_revision, woken)
        if dropped:
            self._metrics.fills_dropped.inc(dropped)
        for waiter, value in woken:
            waiter.wake(value)
        return dropped

    # -- watch state -------------------------------------------------------------------------
    def watch_down(self) -> None:
        """Stop serving: the watch is not delivering."""
        self.floor = NOT_SERVING

    def watch_up(self, creation_revision: int) -> None:
        """The watch stream is (re)created at etcd revision ``creation_revision``: serve
        entries at least that new now, all entries once the replay has reached it."""
        with self._lock:
            self.floor = 0 if self.applied_revision >= creation_revision else creation_revision

    def reset(self, revision: int,
              snapshot: Iterable[tuple[str, bytes, int]] | None = None) -> None:
        """Forget everything (events were lost, e.g. to compaction, or this is the start);
        the watch (re)starts after ``revision``. Fills in flight are refused; waiters
        re-check etcd. ``snapshot``, if given, is every key under the prefix as of
        ``revision`` (name, value, mod_revision): it is loaded and the cache is complete."""
        with self._lock:
            self._metrics.entries.dec(len(self._lru))
            self._lru.clear()
            self._dirty.clear()
            self._epoch += 1
            self.applied_revision = revision
            self.complete = snapshot is not None
            for name, value, mod_revision in snapshot or ():
                self._store(name, (value, revision, mod_revision))  # eviction clears complete
            waiters = [w for ws in self._waiters.values() for w in ws]
            waiters += [w for ws in self._prefix_waiters.values() for w in ws]
        for waiter in waiters:
            waiter.nudge()

    # -- waiters -------------------------------------------------------------------------------
    def add_waiter(self, name: str, waiter: Waiter) -> None:
        with self._lock:
            self._waiters.setdefault(name, []).append(waiter)
            self._n_waiters += 1
        self._metrics.waiters.inc()

    def remove_waiter(self, name: str, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(name)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiters[name]
            self._n_waiters -= 1
        self._metrics.waiters.dec()

    def add_prefix_waiter(self, prefix: str, waiter: Waiter) -> None:
        """Wake ``waiter`` (``wake(value)``) on every put of a name starting with ``prefix``
        that the watch or a local write applies, until :meth:`remove_prefix_waiter`. It is
        nudged on resets and close like any waiter. (Queues block on this.)"""
        with self._lock:
            self._prefix_waiters.setdefault(prefix, []).append(waiter)
            self._n_waiters += 1
        self._metrics.waiters.inc()

    def remove_prefix_waiter(self, prefix: str, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._prefix_waiters.get(prefix)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._prefix_waiters[prefix]
            self._n_waiters -= 1
        self._metrics.waiters.dec()

    def nudge_all(self) -> None:
        """Make every waiter re-check (on close, and after a reset)."""
        with self._lock:
            waiters = [w for ws in self._waiters.values() for w in ws]
            waiters += [w for ws in self._prefix_waiters.values() for w in ws]
        for waiter in waiters:
            waiter.nudge()

    @property
    def n_waiters(self) -> int:
        return self._n_waiters

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        """Drop every entry and release every waiter (they then see ``closed``)."""
        self.closed = True
        self.floor = NOT_SERVING
        with self._lock:
            self._metrics.entries.dec(len(self._lru))
            self._lru.clear()
        self.nudge_all()
