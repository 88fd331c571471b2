"""The coherence core: every rule that keeps the cache coherent with etcd, in one place.

:class:`CoherentCache` owns all coherence state of a store: the LRU entries, the revision
high-water marks of evicted keys, the operations in flight, the reset epoch, whether the
cache may be served, and the waiters. The watcher feeds it (``apply_events``, ``reset``,
``watch_up``/``watch_down``); the front end asks it (``lookup``) and reports what etcd
answered (``begin``/``end_fill``/``end_write``). Nothing else touches its state, and it does
no I/O, so a model-based test drives it through millions of interleavings without etcd.

Every entry is a tuple ``(value, as_of, mod_revision)``: ``value`` is the key's bytes, or
None for "absent"; ``as_of`` is the etcd revision at which that state was known to be
current; ``mod_revision`` the key's own last-modified revision (0 when absent).

Rules, all enforced here under one lock:

1. **Newer only.** A state known as of revision ``r`` is installed only if ``r`` is newer
   than everything known about the key: its entry's ``as_of`` and its high-water mark.
   Events never move a key back in time; a local write followed by its own watch event is
   a no-op.
2. **Eviction keeps what the watch has not caught up with.** Evicting an entry that is
   ahead of the watch (``as_of > applied_revision``: installed by a local write, a
   read-through or a CAS read) records its ``as_of`` as the key's high-water mark, kept
   outside the LRU until ``applied_revision`` passes it. So an older event still on its way
   cannot be installed after the eviction. The table holds only keys ahead of the watch.
3. **In flight.** A read-through fill *and* a local write register their keys before the
   request is sent (:meth:`begin`). Every update of a registered key applied meanwhile is
   recorded (``_dirty``, outside the LRU); the result is installed only if it is newer than
   all of them (:meth:`end_fill`, :meth:`end_write`).
4. **Epoch.** A reset (events lost to compaction, or the start) forgets every entry and
   mark and starts a new epoch at the reset revision ``S``. A result whose operation began
   in an earlier epoch is installed only if its revision is newer than ``S`` (older ones
   are covered by the state at ``S``).
5. **Completeness.** While the cache is *complete* (preloaded with every key under the
   prefix and nothing evicted since), a key it does not hold is absent as of the applied
   revision. The first eviction or a reset without a snapshot ends that.
6. **Serving.** Entries are served only while ``as_of >= floor``. The floor is
   ``NOT_SERVING`` while the watch is down, the watch's creation revision while it replays
   missed events after a (re)connect, and 0 once it has caught up. The hot path pays one
   comparison for all this; ``watch_down`` takes the lock, so a stall declared on another
   thread is never undone by an apply in progress.
7. **Counters.** A counter's key holds a marker (``counters.py``); its entry holds it as a
   :class:`~cachedstore.counters.CounterMark`, which the front end never returns as a
   value: it reads the counter instead (its increments are outside the watched range).
8. **Waiters** stay registered until their owner removes them (see ``waiters.py``); a put
   wakes exactly the waiters of that key (and of prefixes it falls under).
9. **Scopes.** Every name belongs to at most one watched scope (``scoping.py``): the root
   (the whole prefix, one watch) or, when the store watches only what it touched, its
   directory's. Rules 1-6 hold per scope: each has its own applied revision (etcd orders
   the events of one watch, not of several on a stream), reset epoch, completeness and
   mark heap. A name no scope covers is never cached. A scope being opened (its snapshot
   read in flight) holds the results that end meanwhile and installs those newer than its
   snapshot when it opens. The floor is per stream: ``NOT_SERVING`` until every scope's
   watch is created again after the stream went down, then the newest creation revision
   a scope has not replayed yet. A scope opened on a healthy stream serves its snapshot at
   once: its watch starts right after it (the lag of any watch). A snapshot (an opening,
   a resync, a quiet scope's refresh) installs only the names its scope covers: a name
   with a scope of its own inside a directory's range keeps what that scope applied.

10. **History only moves forward.** A linearizable answer (a read, a write) to a request
   sent after the core knew of revision ``K`` (an event applied, an answer, a snapshot)
   carries a revision of at least ``K``. One older means etcd's history went back: a
   member that lost acknowledged writes (etcd#14370), members that diverged after a crash
   (etcd#13766), a restore from a backup without ``--bump-revision``. Then every scope,
   entry, mark and record is forgotten, a new root scope opens (``on_rewind`` has the
   watcher read it and restart its stream), every waiter re-checks, and no result of an
   operation begun before with a ticket is ever installed: its revision numbers belong
   to the lost history. Each ticket carries ``K`` as of :meth:`begin`; snapshot reads and
   the watcher's check of a stream created behind what the core knew (one linearizable
   read) take one from :attr:`known_revision` and report with :meth:`answered`, and so
   does the store's connection for every key-value call it sends (no answer goes
   unchecked). Found only if etcd answers below ``K``: once its new history has passed
   ``K``, revisions alone cannot tell.

This class is a little over 300 lines: the rules above share one lock and one state, and
splitting them would spread one invariant over several objects.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping
from typing import TypeVar

from .counters import stored
from .metrics import NullMetrics, StoreMetrics
from .scoping import Scope
from .waiters import AsyncWaiter, ThreadWaiter, Waiter

__all__ = ["NOT_SERVING", "AsyncWaiter", "CoherentCache", "Entry", "Scope", "ThreadWaiter",
           "Ticket"]

Entry = tuple[bytes | None, int, int]
#: Floor while the watch is down: no entry is that new, so nothing is served.
NOT_SERVING = sys.maxsize
#: What :meth:`CoherentCache.begin` returns: the epoch the operation began in, and the
#: newest revision the core knew of then (rule 10).
Ticket = tuple[int, int]
_Woken = list[tuple[Waiter, bytes]]


_V = TypeVar("_V")


def _items(table: Mapping[str, _V], only: str | None) -> Iterable[tuple[str, _V]]:
    """Every item of ``table``, or (``only`` given) that name's item if it has one."""
    if only is None:
        return table.items()
    return ((only, table[only]),) if only in table else ()


class _LRU:
    """At most ``maxsize`` entries by name, the least recently used evicted first, telling
    its owner what it evicts. Changed only under the owner's lock; read without it.

    ``data`` holds the entries in recency order (an OrderedDict: least recent first, O(1)
    moves and pops at both ends). A reader that does not hold the lock (the hot path,
    :meth:`CoherentCache.lookup`) never changes ``data``: it reads it with ``data.get`` and
    marks the name used with ``touched[name] = None`` (one C-level store each, atomic under
    the GIL; a dict, so that the order of recency, and so of eviction, does not follow str
    hashes: the same calls evict the same names in every process). Every
    change (under the lock) first moves the names marked since the previous change to the
    recent end (:meth:`_settle`), so the order is exact LRU order up to the reads between
    two changes, which all count as more recent than that earlier change, in no particular
    order among themselves. (The one-entry-per-hit ``move_to_end`` of an exact LRU would
    be a change of ``data``, which needs the lock; ``benchmarks/hitpath.py --hit-ratio``
    measures what the approximation costs in hits on a skewed workload.) Writing an entry
    makes it the most recent, as before; ``get`` and ``__getitem__`` (the locked paths)
    do not. (Hot paths call ``data.get`` and store into ``touched`` themselves: in
    CPython 3.11 calling a bound method kept in an attribute costs a slow generic lookup.)
    """

    __slots__ = ("_on_evict", "data", "maxsize", "touched")

    def __init__(self, maxsize: int, on_evict: Callable[[str, Entry], None]) -> None:
        self.maxsize = maxsize
        self._on_evict = on_evict
        self.data: OrderedDict[str, Entry] = OrderedDict()
        #: Names read since the last change (``touched[name] = None``, lock-free).
        self.touched: dict[str, None] = {}

    def _settle(self) -> None:
        """Move the names read since the last change to the recent end (under the lock),
        in the order they were first read. Readers may add names meanwhile (``list`` of a
        dict of str is one step under the GIL): those wait for the next change; a name
        that is gone (evicted after its reader found it) is dropped."""
        touched = self.touched
        if touched:
            data = self.data
            move = data.move_to_end
            pop = touched.pop
            for name in list(touched):
                pop(name, None)
                if name in data:
                    move(name)

    def __len__(self) -> int:
        return len(self.data)

    def __contains__(self, name: object) -> bool:
        return name in self.data

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __getitem__(self, name: str) -> Entry:
        return self.data[name]

    def get(self, name: str) -> Entry | None:
        return self.data.get(name)

    def __setitem__(self, name: str, entry: Entry) -> None:
        self._settle()
        data = self.data
        if name in data:
            data[name] = entry
            data.move_to_end(name)
            return
        while data and len(data) >= self.maxsize:
            self.popitem()
        data[name] = entry

    def __delitem__(self, name: str) -> None:
        del self.data[name]
        self.touched.pop(name, None)

    def items(self) -> ItemsView[str, Entry]:
        """The entries, least recent first (iterate under the lock: only it changes them)."""
        return self.data.items()

    def clear(self) -> None:
        self.data.clear()
        self.touched.clear()

    def popitem(self) -> tuple[str, Entry]:
        """Evict the least recently used entry (as of the last :meth:`_settle`)."""
        name, entry = self.data.popitem(last=False)
        self.touched.pop(name, None)
        self._on_evict(name, entry)
        return name, entry


class CoherentCache:
    """The coherence core of one store. Thread-safe; no method blocks except on its lock,
    and none does I/O. Waiters are woken after the lock is released.

    When the store watches only what it touched, scopes are opened with
    :meth:`begin_scope`/:meth:`open_scope` and ``locate`` finds the scope covering a name
    among them (``scoping.locate``; ``scope_key``, a name → scope key mapping, is the
    simple form of it). Without either the cache has one root scope covering every name
    (``root``, the whole prefix's range, is what the watcher watches).

    Longer than this project's classes usually are, on purpose: every coherence rule at the
    top of this module reads and changes the same state under one lock (entries, marks,
    records in flight, epochs, scopes, waiters), and the rules lean on each other. Split
    into classes, each rule and the lock's invariant would be spread across them; the design
    notes ask for the rules in one core (docs/design.md).
    """

    def __init__(self, maxsize: int, metrics: StoreMetrics | NullMetrics,
                 scope_key: Callable[[str], str] | None = None,
                 root: tuple[bytes, bytes] = (b"", b""),
                 locate: Callable[[dict[str, Scope], str], Scope | None] | None = None
                 ) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics
        self._lru = _LRU(maxsize, self._evicted)
        self.maxsize = maxsize
        self.floor = NOT_SERVING
        self._stream_up = False
        self._epoch = 0
        #: Rule 10: the newest revision etcd is known to have committed, and the epoch
        #: of the last time its history went back (no older ticket's result installs).
        self._known = 0
        self._rewound = 0
        self._root_range = root
        #: How often etcd's history was found to have gone back (rule 10).
        self.rewinds = 0
        #: Called (outside the lock, on the thread that found it) with the new root scope,
        #: the revision the core knew of and the older one etcd answered, when etcd's
        #: history went back (rule 10): the store has the watcher read and watch it. Any
        #: thread that makes a request may run it (the connection checks every answer):
        #: it must not wait for etcd or for a lock held across a request.
        self.on_rewind: Callable[[Scope, int, int], None] | None = None
        if locate is None and scope_key is not None:
            def locate(scopes: dict[str, Scope], name: str) -> Scope | None:
                return scopes.get(scope_key(name))
        self._locate = locate
        self._scopes: dict[str, Scope] = {}
        self._root: Scope | None = None
        if locate is None:
            self._root = Scope(None, *root)
            self._root.awaiting_create = True
        self._inflight: dict[str, int] = {}
        self._dirty: dict[str, int] = {}
        self._marks: dict[str, int] = {}
        self._waiters: dict[str, list[Waiter]] = {}
        self._prefix_waiters: dict[str, list[Waiter]] = {}
        self._n_waiters = 0
        self._n_blocked = 0  # waiters a thread or coroutine is blocked on (not knowledge)
        #: Removals a finalizer could not make at once (:meth:`remove_waiter_soon`).
        self._removals: collections.deque[tuple[str, Waiter]] = collections.deque()
        #: Called (outside the lock, on the registering thread) when a blocking waiter is
        #: added: the store has the watch stop pacing (``StoreConfig.watch_pacing``).
        self.on_waiter: Callable[[], None] | None = None
        self.closed = False

    # -- scopes -----------------------------------------------------------------------------
    def _scope_of(self, name: str) -> Scope | None:
        root = self._root
        if root is not None:
            return root
        locate = self._locate
        return None if locate is None else locate(self._scopes, name)

    def _all_scopes(self) -> list[Scope]:
        root = self._root
        return [root] if root is not None else list(self._scopes.values())

    def scope_of(self, name: str) -> Scope | None:
        """The scope covering canonical ``name`` (opening or open), or None."""
        with self._lock:
            return self._scope_of(name)

    def watches(self, name: str) -> bool:
        """Whether an open scope (not one still opening) covers canonical ``name``: its
        writes reach this store's waiters through the watch."""
        with self._lock:
            scope = self._scope_of(name)
            return scope is not None and not scope.opening

    def watched_scopes(self) -> list[Scope]:
        """The open scopes: what the watch stream must watch, each from its ``applied``+1."""
        with self._lock:
            return [s for s in self._all_scopes() if not s.opening]

    @property
    def scoped(self) -> bool:
        """True while the cache holds only the scopes a store touched (no root)."""
        return self._root is None

    @property
    def n_scopes(self) -> int:
        return len(self._all_scopes())

    @property
    def applied_revision(self) -> int:
        """The root's applied revision: every event up to it has been applied. With scopes,
        the newest any scope applied (each scope has applied every event *of its own*
        range up to its own revision; a quiet scope's stays behind). 0: none."""
        with self._lock:
            applied = [s.applied for s in self._all_scopes() if not s.opening]
        return max(applied, default=0)

    def applied_for(self, name: str) -> int | None:
        """The revision up to which every event of the scope covering canonical ``name``
        has been applied, or None when no open scope covers it (a consistent read then
        reads etcd). Entries of that scope are current as of it (rules 1-3)."""
        with self._lock:
            scope = self._scope_of(name)
            if scope is None or scope.opening or scope.removed:
                return None
            return scope.applied

    @property
    def complete(self) -> bool:
        """True while the root scope holds every key under the prefix that exists."""
        root = self._root
        return root is not None and root.complete and not root.opening

    def begin_scope(self, key: str, start: bytes, end: bytes) -> Scope:
        """Register the scope ``key`` (range ``[start, end)``) before its snapshot is read:
        results that end meanwhile are held for :meth:`open_scope`. Returns the scope
        already registered under ``key`` (opening or open) if there is one."""
        with self._lock:
            if self._root is not None:  # a rewind made a root meanwhile (rule 10): it
                stray = Scope(key, start, end)  # covers every name; this one is never
                stray.removed = True  # opened, watched or consulted
                return stray
            scope = self._scopes.get(key)
            if scope is None:
                scope = self._scopes[key] = self._opening_scope(key, start, end)
            return scope

    def _opening_scope(self, key: str | None, start: bytes, end: bytes) -> Scope:
        """A new scope, opening (under the lock): its watch is created with the stream's."""
        scope = Scope(key, start, end)
        scope.opening = True
        scope.awaiting_create = not self._stream_up
        return scope

    def abort_scope(self, scope: Scope) -> None:
        """Forget a scope whose snapshot could not be read (it was never served). Its
        waiters re-check: their names are no longer covered by a watch."""
        waiters: list[Waiter] = []
        with self._lock:
            if scope.opening and self._scopes.get(scope.key or "") is scope:
                waiters = self._waiters_of(scope)
                del self._scopes[scope.key or ""]
                scope.removed = True
                self._refloor()  # it may have been the last scope awaiting its creation
        self._nudge(waiters)

    def collapse(self, start: bytes, end: bytes) -> Scope:
        """Fall back to watching the whole prefix ``[start, end)``: every scope and entry
        is dropped, and one root scope, opening, covers every name from now on. Open it
        with :meth:`open_scope` once its snapshot is read. A root there already (a rewind
        made one meanwhile, rule 10) is returned as it is: it covers every name."""
        with self._lock:
            if self._root is not None:
                return self._root
            root = self._new_root(start, end)
            waiters = self._all_waiters()
        self._nudge(waiters)
        return root

    def _new_root(self, start: bytes, end: bytes) -> Scope:
        """Drop every scope (the root too: their late events and snapshots are ignored),
        entry, mark and record of an update in flight, and put one root scope covering
        ``[start, end)``, opening, in their place (under the lock): a fall-back to the
        whole prefix, or a start over after etcd's history went back (rule 10)."""
        for scope in self._all_scopes():
            scope.removed = True
        self._scopes.clear()
        self._metrics.entries.dec(len(self._lru))
        self._lru.clear()
        self._dirty.clear()
        self._marks.clear()
        root = self._root = self._opening_scope(None, start, end)
        return root

    def open_scope(self, scope: Scope, revision: int,
                   snapshot: Iterable[tuple[str, bytes, int]] | None,
                   absent: Iterable[str] = ()) -> None:
        """Open a scope begun with :meth:`begin_scope` (or :meth:`collapse`) with its state
        as of ``revision``: :meth:`reset` of it, then the results held meanwhile that are
        newer are installed. ``absent``: names of the scope to cache as absent as of
        ``revision`` (the snapshot lacks them). Its watch must start after ``revision``."""
        self.reset(revision, snapshot, scope, absent)

    # -- the hot path --------------------------------------------------------------------
    def lookup(self, name: object) -> Entry | None:
        """The entry for ``name`` if it may be served now, else None. Never raises.

        Lock-free, and never returns what the locked lookup (entry read under the lock,
        floor compared after it) would not:

        * ``lru.get`` is one C-level dict lookup: under the GIL it sees the entry tuple
          before or after any single change (insert, replace, evict, clear), never a torn
          one, and entries are immutable tuples. Readers never change ``data``.
        * ``floor`` is read after the entry, as the locked lookup does: a ``watch_down``,
          reset or ``close`` that set it before this read refuses the entry (rule 6), one
          that sets it later is ordered after this read.
        * A change made under the lock can span several names (a transaction's events, a
          reset dropping entries and loading a snapshot, an mset, the eviction inside an
          install): a lone ``get`` could see it half done. So the lookup then checks
          ``locked()``: held, and the entry is read again under the lock (the locked path,
          exactly as before); free, and every change the ``get`` could have seen half done
          has finished since. Then the entry was either the state before that change (the
          read is ordered before its end, where the locked path places the change) or
          after it; either is an answer the locked path gives to a read that overlaps it.
        * A miss needs no check: a miss is always safe (the read goes to etcd, gated by
          revision and epoch, rules 1-4), and a reset's new epoch is enforced there.

        So a concurrent eviction returns the entry (evicted later) or None (a read-through),
        an apply or reset returns the entry before or after it, never a mix that another
        read of this thread could expose, and close returns nothing once its floor is set.
        Recency: the name is marked used (``touched``), see :class:`_LRU`.
        """
        lru = self._lru
        try:
            entry = lru.data.get(name)  # type: ignore[call-overload]  # any name may come
        except TypeError:  # unhashable: no such name
            return None
        if entry is None or entry[1] < self.floor:
            return None
        if self._lock.locked():  # a change may be half done: the locked path, as before
            with self._lock:
                entry = lru.data.get(name)  # type: ignore[call-overload]
            if entry is None or entry[1] < self.floor:
                return None
        lru.touched[name] = None  # type: ignore[index]  # found, so it is a name
        return entry

    def lookup_or_absent(self, name: str) -> Entry | None:
        """Like :meth:`lookup`, and while the name's scope is complete and caught up, a key
        it does not hold is answered as absent as of the scope's applied revision (no etcd
        read needed). Takes the lock (not the hot path)."""
        with self._lock:
            entry = self._lru.get(name)
            if entry is None:
                if self.floor == 0:
                    scope = self._scope_of(name)
                    if scope is not None and scope.complete and not scope.opening:
                        return (None, scope.applied, 0)
                return None
        if entry[1] < self.floor:
            return None
        self._lru.touched[name] = None
        return entry

    def peek(self, name: str) -> Entry | None:
        """The entry for ``name`` whether or not it may be served (max_staleness, CAS)."""
        with self._lock:
            entry: Entry | None = self._lru.get(name)
            return entry

    # -- installing ------------------------------------------------------------------------
    def _evicted(self, name: str, entry: Entry) -> None:
        scope = self._scope_of(name)
        if scope is not None:
            scope.complete = False  # the evicted key's state is no longer known here
            # Rule 2: an entry ahead of the watch leaves its revision behind.
            if entry[1] > scope.applied and entry[1] > self._marks.get(name, 0):
                self._marks[name] = entry[1]
                heapq.heappush(scope.heap, (entry[1], name))
        self._metrics.evictions.inc()
        self._metrics.entries.dec()

    def _install(self, name: str, value: bytes | None, revision: int, mod_revision: int,
                 woken: _Woken) -> None:
        """Rule 1: store the state as of ``revision`` unless something at least as new is
        known; a put hands itself to the key's waiters (woken after the lock)."""
        old = self._lru.get(name)
        if old is not None and revision <= old[1]:
            return
        mark = self._marks.get(name)
        if mark is not None:
            if revision <= mark:
                return
            del self._marks[name]  # the entry now holds more than the mark did
        if old is None:
            self._metrics.entries.inc()
        value = stored(value)  # a counter's marker: served by reading the counter
        self._lru[name] = (value, revision, mod_revision if value is not None else 0)
        if value is not None:
            waiters = self._waiters.get(name)
            if waiters:
                woken.extend((w, value) for w in waiters)
            if self._prefix_waiters:
                for prefix, ws in self._prefix_waiters.items():
                    if name.startswith(prefix):
                        woken.extend((w, value) for w in ws)

    def _update(self, name: str, value: bytes | None, revision: int, mod_revision: int,
                woken: _Woken) -> None:
        """An update (event or local write): recorded for operations in flight (rule 3),
        then installed."""
        if name in self._inflight and revision > self._dirty.get(name, 0):
            self._dirty[name] = revision
        self._install(name, value, revision, mod_revision, woken)

    def _result(self, name: str, value: bytes | None, revision: int, mod_revision: int,
                write: bool, woken: _Woken) -> None:
        """A result the gate let through: held while its scope opens (rule 9), else
        installed (a write as an update, rule 3)."""
        scope = self._scope_of(name)
        if scope is None or scope.removed:
            return
        if scope.opening:
            scope.pending.append((name, value, revision, mod_revision, write))
        elif write:
            self._update(name, value, revision, mod_revision, woken)
        else:
            self._install(name, value, revision, mod_revision, woken)

    def _wake(self, woken: _Woken) -> None:
        """Wake ``woken`` (outside the lock); forget those nobody can be woken through."""
        dead = [waiter for waiter, value in woken if not waiter.wake(value)]
        if dead:
            self._forget(dead)

    def _nudge(self, waiters: list[Waiter]) -> None:
        """Nudge ``waiters`` (outside the lock); forget those nobody can be woken through."""
        dead = [waiter for waiter in waiters if not waiter.nudge()]
        if dead:
            self._forget(dead)

    def _forget(self, dead: list[Waiter]) -> None:
        """Unregister ``dead`` waiters: an :class:`AsyncWaiter` whose event loop was closed
        with its coroutine still pending (a loop stopped without cancelling its tasks). The
        coroutine's own removal never runs, and the waiter would count as a blocked reader
        (:meth:`awaited`, which turns watch pacing off) for the store's life. Found at the
        first wake or nudge that reaches it. Only blocking reads register such waiters. When
        the garbage collector later closes the coroutine, its removal finds nothing
        (:meth:`remove_waiter_soon`)."""
        gone = {id(waiter) for waiter in dead}
        with self._lock:
            for table in (self._waiters, self._prefix_waiters):
                for key, waiters in list(table.items()):
                    for waiter in [w for w in waiters if id(w) in gone]:
                        self._unregister_held(table, key, waiter, True)

    # -- the watch -------------------------------------------------------------------------
    def apply_events(self, events: Iterable[tuple[str, bytes | None, int]],
                     revision: int, scope: Scope | None = None) -> None:
        """Apply one watch response of ``scope`` (default: the root): ``(name, value or
        None, mod_revision)`` in order, all of its revisions up to ``revision``. Wakes the
        waiters of keys that were put. A dropped scope's late events are ignored."""
        woken: _Woken = []
        with self._lock:
            if self._removals:  # (each watch response, so that none waits for a reader)
                self._remove_later_ones()
            scope = scope or self._root
            if scope is None or scope.removed or scope.opening:
                return
            if revision > self._known:
                self._known = revision  # rule 10: committed, so every answer from now on
            nested = self._root is None  # ranges may nest: a name's own scope applies it
            reset_at = scope.epoch_revision  # rule 4: a reset's snapshot covers these
            for name, value, mod_revision in events:
                if mod_revision <= reset_at or (nested and self._scope_of(name) is not scope):
                    continue
                self._update(name, value, mod_revision, mod_revision, woken)
            if revision > scope.applied:
                scope.applied = revision
                heap, marks = scope.heap, self._marks
                while heap and heap[0][0] <= revision:  # rule 2: the watch caught up
                    mark, name = heapq.heappop(heap)
                    if marks.get(name) == mark:
                        del marks[name]
            if scope.catch_up_to and revision >= scope.catch_up_to:
                scope.catch_up_to = 0  # replayed everything up to its creation revision
                self._refloor()
        self._wake(woken)

    def _refloor(self) -> None:
        """Rule 6 over all scopes (under the lock)."""
        if not self._stream_up or self.closed:
            self.floor = NOT_SERVING
            return
        floor = 0
        root = self._root
        for scope in (root,) if root is not None else self._scopes.values():
            if scope.awaiting_create:
                floor = NOT_SERVING
                break
            if scope.catch_up_to > floor:  # max(), without a call per scope: each scope
                floor = scope.catch_up_to  # opened runs this over all of them
        self.floor = floor

    def watch_down(self) -> None:
        """Stop serving: the watch stream is not delivering. Safe from any thread."""
        with self._lock:
            self._stream_up = False
            self.floor = NOT_SERVING
            for scope in self._all_scopes():
                scope.awaiting_create = True

    def watch_up(self, creation_revision: int, scope: Scope | None = None) -> None:
        """``scope``'s watch (default: the root's) is (re)created at etcd revision
        ``creation_revision`` on a healthy stream. After the stream went down, the cache
        serves entries at least that new until the scope has replayed up to it. With no
        scope and no root: the stream itself is up (its first watch was created)."""
        with self._lock:
            if self.closed:
                return
            scope = scope or self._root
            if scope is not None and scope.awaiting_create and not scope.removed:
                scope.awaiting_create = False
                scope.catch_up_to = (creation_revision if scope.applied < creation_revision
                                     else 0)
            self._stream_up = True
            self._refloor()

    def _reset_scope(self, scope: Scope, revision: int,
                     snapshot: Iterable[tuple[str, bytes, int]] | None,
                     woken: _Woken) -> None:
        """Rule 4 for one scope (under the lock)."""
        # Entries newer than the reset (a write or read that returned while the scope
        # was read afresh) stay: they are states etcd held after ``revision``.
        # So do the high-water marks and in-flight records newer than the reset: a write
        # of this store evicted ahead of the watch, or an update applied while a fill
        # was in flight, stays newer than the snapshot (a quiet scope's refresh runs on a
        # live stream: nothing else would hide the snapshot's older state of such a key).
        lru = self._lru
        root = scope is self._root
        scope_of = self._scope_of
        # A key scope covers one name: look that one up, not every entry of the cache (a
        # scope opens per name touched; scanning made each opening cost O(cache size)).
        only = scope.key[1:] if scope.key is not None and scope.key[0] == "k" else None
        gone = [n for n, e in _items(lru.data, only)
                if e[1] <= revision and (root or scope_of(n) is scope)]
        for name in gone:
            del lru[name]
        self._metrics.entries.dec(len(gone))
        for table in (self._dirty, self._marks):
            for name in [n for n, at in _items(table, only)
                         if at <= revision and (root or scope_of(n) is scope)]:
                del table[name]
        scope.heap[:] = [(at, n) for at, n in scope.heap if self._marks.get(n) == at]
        heapq.heapify(scope.heap)
        self._epoch += 1
        scope.reset_epoch = self._epoch
        scope.epoch_revision = revision
        scope.applied = revision
        scope.catch_up_to = 0  # the snapshot replaces the replay
        scope.complete = snapshot is not None
        # Rule 9: a snapshot speaks only for the names its scope covers. A directory's
        # range also holds names with a key scope of their own (or a deeper directory's),
        # which may have applied newer events, and then been evicted without a mark (they
        # were not ahead of their own scope): installing the snapshot's older state of
        # such a name would serve it stale for good.
        for name, value, mod_revision in snapshot or ():
            if not root and scope_of(name) is not scope:
                continue
            self._install(name, value, revision, mod_revision, woken)  # may evict
        if scope.opening:  # rule 9: what ended while the snapshot was read, if newer
            scope.opening = False
            for name, held, at, mod_revision, write in scope.pending:
                if at > revision:
                    if write:
                        self._update(name, held, at, mod_revision, woken)
                    else:
                        self._install(name, held, at, mod_revision, woken)
            scope.pending = []
        self._refloor()

    def reset(self, revision: int,
              snapshot: Iterable[tuple[str, bytes, int]] | None = None,
              scope: Scope | None = None, absent: Iterable[str] = ()) -> None:
        """Forget everything of ``scope`` (default: the root) — events were lost, e.g. to
        compaction, or this is the start; its watch (re)starts after ``revision``. A new
        epoch begins (rule 4); waiters re-check. ``snapshot``, if given, is every key of
        the scope as of ``revision`` (name, value, mod_revision): it is loaded and the
        scope is complete. An opening scope opens (rule 9). ``absent``: names (of this
        scope, not in the snapshot) cached as absent as of ``revision``."""
        woken: _Woken = []
        if snapshot is not None:
            snapshot = list(snapshot)
        # Names the snapshot holds exist at ``revision``, whatever ``absent`` says: the
        # snapshot's own install may evict them at once (a tiny cache; no mark: they are
        # not ahead of the watch), and "absent" must not then be installed in their place.
        held = {name for name, _, _ in snapshot} if snapshot else set()
        with self._lock:
            scope = scope or self._root
            if scope is None or scope.removed:
                return
            if revision > self._known:
                self._known = revision
            self._reset_scope(scope, revision, snapshot, woken)
            for name in absent:
                if name not in held and self._scope_of(name) is scope:
                    self._install(name, None, revision, 0, woken)
            waiters = self._waiters_of(scope)
        self._wake(woken)
        self._nudge(waiters)

    # -- operations in flight (rules 3 and 4) --------------------------------------------------
    def begin(self, names: Iterable[str]) -> Ticket:
        """Register a fill or a write of ``names`` before its request is sent; pass the
        ticket to :meth:`end_fill`/:meth:`end_write` (or :meth:`abandon`) exactly once."""
        with self._lock:
            inflight = self._inflight
            for name in names:
                inflight[name] = inflight.get(name, 0) + 1
            return self._epoch, self._known

    def _finish(self, name: str, ticket: Ticket, revision: int) -> bool:
        """Unregister one name; True if a result read or written at ``revision`` may be
        installed (no newer update meanwhile, no reset of its scope it predates)."""
        count = self._inflight[name] - 1
        if count:
            self._inflight[name] = count
            newer = self._dirty.get(name, 0)
        else:
            del self._inflight[name]
            newer = self._dirty.pop(name, 0)
        scope = self._scope_of(name)
        epoch = ticket[0]
        if scope is None or epoch < self._rewound:  # rule 10: a number of a lost history
            return False
        if epoch < scope.reset_epoch and revision <= scope.epoch_revision:
            return False
        return newer <= revision

    def end_fill(self, names: Iterable[str], ticket: Ticket,
                 results: dict[str, tuple[bytes | None, int]] | None, revision: int) -> int:
        """Finish fills begun with ``ticket``: insert ``results`` (name → (value or None,
        mod_revision); a missing name means absent) read at ``revision``, unless the gate
        refuses them. ``results=None`` (the read failed) only unregisters. Returns how many
        fills the gate refused (counted in ``cachedstore_fills_dropped_total``); a name no
        scope covers is not cached, and not counted."""
        dropped = 0
        woken: _Woken = []
        rewound = None
        with self._lock:
            if results is not None:
                rewound = self._went_back(ticket, revision)
            for name in names:
                allowed = self._finish(name, ticket, revision)
                if results is None:
                    continue
                if not allowed:
                    if self._scope_of(name) is not None:
                        dropped += 1
                    continue
                value, mod_revision = results.get(name, (None, 0))
                self._result(name, value, revision, mod_revision, False, woken)
        if dropped:
            self._metrics.fills_dropped.inc(dropped)
        self._wake(woken)
        self._rewound_to(rewound)
        return dropped

    def end_write(self, writes: Iterable[tuple[str, bytes | None]], ticket: Ticket,
                  revision: int) -> None:
        """Finish writes begun with ``ticket`` that etcd applied at ``revision``: each
        ``(name, value or None for a delete)`` is recorded (read-your-writes) unless the
        gate refuses it; a refused write is already covered by something newer."""
        woken: _Woken = []
        with self._lock:
            rewound = self._went_back(ticket, revision)
            for name, value in writes:
                if self._finish(name, ticket, revision):
                    self._result(name, value, revision, revision, True, woken)
        self._wake(woken)
        self._rewound_to(rewound)

    def abandon(self, names: Iterable[str]) -> None:
        """Unregister operations that got no answer from etcd (failed or unknown outcome)."""
        with self._lock:
            ticket = (self._epoch, 0)
            for name in names:
                self._finish(name, ticket, 0)

    def apply_write(self, name: str, value: bytes | None, revision: int) -> None:
        """Record a write made without :meth:`begin` (prefer begin/end_write: a write
        recorded late without registration can be overtaken by newer events)."""
        woken: _Woken = []
        with self._lock:
            self._result(name, value, revision, revision, True, woken)
        self._wake(woken)

    # -- history (rule 10) -----------------------------------------------------------------
    @property
    def known_revision(self) -> Ticket:
        """A ticket for a linearizable request about to be sent that installs nothing:
        pass it to :meth:`answered` with the revision of its answer."""
        with self._lock:
            return self._epoch, self._known

    def answered(self, ticket: Ticket, revision: int) -> bool:
        """A linearizable request sent after ``ticket`` (:meth:`known_revision`) was
        answered at etcd revision ``revision``. Returns True if etcd's history went back
        since the ticket (rule 10; the cache then started over: this answer showed it, or
        another, such as the connection's check of this very answer), else False."""
        with self._lock:
            rewound = self._went_back(ticket, revision)
            since = ticket[0] < self._rewound
        self._rewound_to(rewound)
        return since

    def _went_back(self, ticket: Ticket, revision: int
                   ) -> tuple[Scope, int, int, list[Waiter]] | None:
        """Rule 10 (under the lock): an answer at ``revision`` to a request sent with
        ``ticket``. Older than what the core knew then: start over; returns what
        :meth:`_rewound_to` reports outside the lock. A ticket older than the last rewind
        proves nothing (it knew the lost history's numbers)."""
        epoch, known = ticket
        if revision >= known or epoch < self._rewound or self.closed:
            if revision > self._known and epoch >= self._rewound:
                self._known = revision
            return None
        root = self._new_root(*self._root_range)
        self._epoch += 1
        self._rewound = self._epoch
        self._known = revision
        self.rewinds += 1
        # Nothing is served until the watcher has read the new root and watches it.
        root.awaiting_create = True
        self._refloor()
        return root, known, revision, self._all_waiters()

    def _rewound_to(self, rewound: tuple[Scope, int, int, list[Waiter]] | None) -> None:
        if rewound is None:
            return
        root, known, revision, waiters = rewound
        self._nudge(waiters)
        if self.on_rewind is not None:
            self.on_rewind(root, known, revision)

    # -- waiters ---------------------------------------------------------------------------------
    def add_waiter(self, name: str, waiter: Waiter) -> None:
        self._register(self._waiters, name, waiter, True)

    def remove_waiter(self, name: str, waiter: Waiter) -> None:
        self._unregister(self._waiters, name, waiter, True)

    def remove_waiter_soon(self, name: str, waiter: Waiter) -> None:
        """:meth:`remove_waiter` for a finalizer: it never waits for the lock. The garbage
        collector closes an abandoned read's logic (an aget whose event loop is gone: its
        task and waiter form a cycle) on whatever thread it runs, which may be holding
        this lock. Done now if the lock is free, else by the next watch response applied or
        thread that registers or removes a waiter (until then the waiter is counted)."""
        if self._lock.acquire(blocking=False):
            try:
                self._unregister_held(self._waiters, name, waiter, True)
            finally:
                self._lock.release()
        else:
            self._removals.append((name, waiter))  # (atomic: no lock)

    def add_prefix_waiter(self, prefix: str, waiter: Waiter, *, blocking: bool = True) -> None:
        """Wake ``waiter`` on every put of a name starting with ``prefix`` (queues).
        ``blocking=False``: nobody waits on it (it marks knowledge that a put ends), so it
        does not make the cache :meth:`awaited`; remove it with the same flag."""
        self._register(self._prefix_waiters, prefix, waiter, blocking)

    def remove_prefix_waiter(self, prefix: str, waiter: Waiter, *,
                             blocking: bool = True) -> None:
        self._unregister(self._prefix_waiters, prefix, waiter, blocking)

    def _register(self, table: dict[str, list[Waiter]], key: str, waiter: Waiter,
                  blocking: bool) -> None:
        with self._lock:
            if self._removals:
                self._remove_later_ones()
            table.setdefault(key, []).append(waiter)
            self._n_waiters += 1
            self._n_blocked += blocking
        self._metrics.waiters.inc()
        hook = self.on_waiter
        if blocking and hook is not None:
            hook()

    def _unregister(self, table: dict[str, list[Waiter]], key: str, waiter: Waiter,
                    blocking: bool) -> None:
        with self._lock:
            if self._removals:
                self._remove_later_ones()
            self._unregister_held(table, key, waiter, blocking)

    def _unregister_held(self, table: dict[str, list[Waiter]], key: str, waiter: Waiter,
                         blocking: bool) -> None:
        waiters = table.get(key)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
            self._n_waiters -= 1
            self._n_blocked -= blocking
            self._metrics.waiters.dec()
        if not waiters:
            del table[key]

    def _remove_later_ones(self) -> None:
        """Under the lock: the removals :meth:`remove_waiter_soon` left."""
        while self._removals:
            name, waiter = self._removals.popleft()
            self._unregister_held(self._waiters, name, waiter, True)

    def _waiters_of(self, scope: Scope) -> list[Waiter]:
        """The waiters a reset of ``scope`` concerns: all of them for the root, else those
        of names it covers and of prefixes whose names it may cover (a scope's reset leaves
        the other scopes' knowledge, and their waiters, alone)."""
        if scope is self._root or scope.key is None:
            return self._all_waiters()
        directory = scope.key[0] == "d"
        covered = scope.key[1:]
        found = [w for name, ws in self._waiters.items() if self._scope_of(name) is scope
                 for w in ws]
        for prefix, ws in self._prefix_waiters.items():
            if covered.startswith(prefix) or (directory and prefix.startswith(covered)):
                found.extend(ws)
        return found

    def _all_waiters(self) -> list[Waiter]:
        return [w for table in (self._waiters, self._prefix_waiters)
                for ws in table.values() for w in ws]

    def nudge_all(self) -> None:
        """Make every waiter re-check (on close, after a reset, after a fork)."""
        with self._lock:
            waiters = self._all_waiters()
        self._nudge(waiters)

    # -- introspection and lifecycle ---------------------------------------------------------------
    @property
    def n_waiters(self) -> int:
        return self._n_waiters

    def awaited(self) -> bool:
        """Whether someone is waiting for what the watch delivers next: a blocking waiter
        is registered, or the cache is not serving (a scope awaits its create or replays,
        and reads go to etcd meanwhile). Lock-free: a caller that must not miss a waiter
        registered concurrently orders itself against ``on_waiter`` (the wire transport
        asks under the lock its ``hurry`` takes)."""
        return self._n_blocked > 0 or self.floor != 0

    @property
    def n_marks(self) -> int:
        """How many evicted keys are held back by a high-water mark (rule 2)."""
        return len(self._marks)

    def marks(self) -> dict[str, int]:
        with self._lock:
            return dict(self._marks)

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        """Stop serving for good, drop every entry and release every waiter (they then see
        ``closed``)."""
        with self._lock:
            self.closed = True
            self._stream_up = False
            self.floor = NOT_SERVING
            self._metrics.entries.dec(len(self._lru))
            self._lru.clear()
        self.nudge_all()
