"""Opening the watch scopes that a store's reads touch (``watch_scope="touched"``).

Before a read of a name can be answered from the cache, a scope (``scoping.py``) must
cover the name. :class:`ScopeOpener` opens the missing ones on the reading thread:

1. it picks, for each directory of the uncovered names, a directory scope (when this read
   and earlier ones together asked for ``COARSEN_AT`` names directly in it) or one key
   scope per name;
2. the core registers them as *opening* (results that end meanwhile are held);
3. one request (a range, or a Txn of ranges) reads them whole, up to ``preload_limit``
   keys each, at one revision R;
4. the core opens each with its snapshot as of R: complete, so a key it lacks is known to
   be absent, and the names the read asked for are cached, found or absent;
5. the watch stream adds one watch per scope, from R + 1.

Touching more than ``max_watches`` scopes makes the store fall back, once and for good, to
watching its whole prefix: the core drops every scope for one root scope, and the watch
thread reads the prefix and restarts its stream.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from .cache import CoherentCache
from .clock import SYSTEM_CLOCK, Clock
from .config import StoreConfig
from .connection import Connection
from .keys import KeySpace
from .metrics import NullMetrics, StoreMetrics
from .scoping import COARSEN_AT, Scope, ScopeRanges, dir_key, directory_of, key_key
from .snapshot import read_scopes

__all__ = ["ScopeOpener"]

log = logging.getLogger("cachedstore.watch")


class ScopeOpener:
    """Opens the scopes of one store. Thread-safe: one scope is opened at a time (a reader
    of a scope being opened waits for it); blocking for one etcd round trip per scope.

    Deadlines are given as a function (``call_deadline``) that returns an etcd round
    trip's deadline as of now: a reader waits for another reader's opening no longer than
    its own deadline as of when it asked, and gives up opening then (its read goes to etcd
    uncached, under a fresh deadline) instead of failing as if etcd were unreachable; the
    read that opens a scope takes the deadline afresh once the wait is over.

    ``watch`` adds an opened scope to the watch stream; ``fall_back`` hands the root scope
    of a collapsed cache to the watch thread, which reads it and restarts the stream.
    Both are set by the store once its watcher exists."""

    def __init__(self, conn: Connection, keys: KeySpace, cache: CoherentCache,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._conn = conn
        self._clock = clock
        self._keys = keys
        self._cache = cache
        self._ranges = ScopeRanges(keys)
        self._limit = config.snapshot_limit
        self._max_watches = config.max_watches
        self._metrics = metrics
        self._max_txn_ops = config.max_txn_ops
        #: One opening at a time (held across its etcd read).
        self._lock = threading.Lock()
        #: Guards the books below, never across a call: a rewind (found by any thread,
        #: while another's opening may hold ``_lock``) forgets them without waiting.
        self._books = threading.Lock()
        self._closed = False
        self._open: set[str] = set()
        #: Key scopes opened per directory (a directory scope is opened from COARSEN_AT on).
        self._keyed: dict[str, int] = {}
        #: What this store adds to ``cachedstore_watch_scopes`` (the root counts 1).
        self._counted = 0 if cache.scoped else 1
        metrics.watch_scopes.inc(self._counted)
        self.watch: Callable[[Scope], None] = lambda scope: None
        #: A test hook: called with the scope keys of every snapshot read after etcd
        #: answered and before the scopes open.
        self.after_read: Callable[[list[str]], None] | None = None
        self.fall_back: Callable[[Scope], None] = lambda scope: None

    def ensure(self, names: Iterable[str], call_deadline: Callable[[], float]) -> set[str]:
        """Open scopes covering the canonical ``names`` that no scope covers yet. Returns
        the names this call's scopes answer: the cache now holds them (found or absent),
        as fresh as a read; none if another opening outlasted ``call_deadline()``. Raises
        cachedstore errors when etcd cannot be read (the scopes stay closed: a later read
        tries again)."""
        cache = self._cache
        if not cache.scoped:
            return set()
        uncovered = [name for name in dict.fromkeys(names) if cache.scope_of(name) is None]
        if not uncovered:
            return set()
        if not self._acquire(call_deadline()):
            return set()
        try:
            if not cache.scoped:
                return set()
            deadline = call_deadline()
            uncovered = [name for name in uncovered if cache.scope_of(name) is None]
            plan = self._plan(uncovered)
            if not plan:
                return set()
            if len(self._open) + len(plan) > self._max_watches:
                self._collapse()
                return set()
            answered: set[str] = set()
            keys = list(plan)
            per_txn = max(1, self._max_txn_ops)
            for i in range(0, len(keys), per_txn):
                if not cache.scoped:  # a chunk's read found etcd's history went back
                    break
                answered |= self._open_scopes({k: plan[k] for k in keys[i:i + per_txn]},
                                              deadline)[0]
            return answered
        finally:
            self._lock.release()

    def _acquire(self, deadline: float) -> bool:
        """Take the lock, waiting until ``deadline`` (clock time) at most."""
        return self._lock.acquire(timeout=max(0.0, deadline - self._clock.monotonic()))

    def ensure_directory(self, directory: str, call_deadline: Callable[[], float],
                         names: Iterable[str] = ()) -> tuple[Scope, int, int] | None:
        """Open a directory scope of ``directory`` (ending with ``/``) unless one covers it
        already: prefix waiters of names under it (queues) are then woken by the watch.
        The scopes of the canonical ``names`` no scope covers yet are opened by the same
        read (torch's ``check`` of a key and of its queue: one request, not two). Returns
        (the scope, the revision R of its snapshot, how many keys it held at R) if this
        call opened it with a complete snapshot, else None (also when another opening
        outlasted ``call_deadline()``). Raises cachedstore errors when etcd cannot be
        read."""
        cache = self._cache
        if not cache.scoped or self.covers_directory(directory):
            return None
        if not self._acquire(call_deadline()):
            return None
        try:
            if not cache.scoped or self.covers_directory(directory):
                return None
            plan = self._plan([n for n in dict.fromkeys(names) if cache.scope_of(n) is None])
            if len(plan) >= self._max_txn_ops:
                plan = {}  # one Txn: the directory alone, the names read as usual
            plan.pop(dir_key(directory), None)
            plan[dir_key(directory)] = []  # last: its snapshot is the one returned
            if len(self._open) + len(plan) > self._max_watches:
                self._collapse()
                return None
            return self._open_scopes(plan, call_deadline())[1]
        finally:
            self._lock.release()

    def covers_directory(self, directory: str) -> bool:
        """Whether an open directory scope (or the root), not one still opening, covers
        ``directory``: its writes reach this store's prefix waiters. Thread-safe, does not
        block."""
        scope = self._cache.scope_of(directory)  # its directory scope, or an ancestor's
        return scope is not None and not scope.opening and \
            (scope.key is None or scope.key[0] == "d")

    def _plan(self, names: list[str]) -> dict[str, list[str]]:
        """Scope key → the names it is opened for: a directory scope where this read and
        earlier ones asked for ``COARSEN_AT`` names directly in it, else key scopes."""
        by_dir: dict[str, list[str]] = {}
        for name in names:
            by_dir.setdefault(directory_of(name), []).append(name)
        plan: dict[str, list[str]] = {}
        for directory, asked in by_dir.items():
            if directory and self._keyed.get(directory, 0) + len(asked) >= COARSEN_AT:
                plan[dir_key(directory)] = asked
            else:
                for name in asked:
                    plan[key_key(name)] = [name]
        return plan

    def _open_scopes(self, plan: dict[str, list[str]], deadline: float
                     ) -> tuple[set[str], tuple[Scope, int, int] | None]:
        """Open the scopes of ``plan`` (scope key → names asked) with one read. Returns the
        names answered, and (scope, revision, keys held) of the last scope if its snapshot
        was complete."""
        cache = self._cache
        scopes = [cache.begin_scope(key, *self._ranges.of(key)) for key in plan]
        sent = cache.known_revision  # rule 10: the snapshot's revision is checked
        try:
            revision, found = read_scopes(self._conn, self._keys, scopes, self._limit,
                                          deadline)
            if self.after_read is not None:
                self.after_read(list(plan))
        except BaseException:
            for scope in scopes:
                cache.abort_scope(scope)
            raise
        if cache.answered(sent, revision):  # etcd's history went back (found by this
            return set(), None  # answer, or since it was sent): every scope is gone
        answered: set[str] = set()
        last: tuple[Scope, int, int] | None = None
        for scope, (key, asked), entries in zip(scopes, plan.items(), found, strict=True):
            cache.open_scope(scope, revision, entries,
                             absent=asked if entries is not None else ())
            with self._books:  # a rewind marks every scope removed, then forgets
                if not scope.removed:
                    self._open.add(key)
                    if key[0] == "k":
                        directory = directory_of(key[1:])
                        self._keyed[directory] = self._keyed.get(directory, 0) + 1
            if entries is not None:
                answered.update(asked)
            last = (scope, revision, len(entries)) if entries is not None else None
            if not scope.removed:
                self.watch(scope)
        with self._books:
            if not self._closed:  # close() does not wait for an opening to end
                self._count(len(self._open) if cache.scoped else 1)
        return answered, last

    def _collapse(self) -> None:
        """Too many scopes: watch the whole prefix from now on (under the lock)."""
        if not self._cache.scoped:  # a rewind made a root meanwhile (rule 10 of cache.py)
            return
        log.warning("cachedstore: this store touched more than max_watches=%d scopes; it "
                    "watches its whole prefix from now on", self._max_watches)
        root = self._cache.collapse(*self._ranges.root())
        self._forget_scopes()
        self.fall_back(root)

    def rewound(self) -> None:
        """etcd's history went back and the cache started over with a root scope (rule
        10 of cache.py): this store watches its whole prefix from now on, and every
        scope it opened is gone. Thread-safe; does not wait for an opening in progress
        (it finds its scopes removed)."""
        self._forget_scopes()

    def _forget_scopes(self) -> None:
        """The cache fell back to its root, or started over."""
        with self._books:
            self._open.clear()
            self._keyed.clear()
            if not self._closed:
                self._count(1)

    def _count(self, n: int) -> None:
        self._metrics.watch_scopes.inc(n - self._counted)
        self._counted = n

    def close(self) -> None:
        """Take this store's scopes out of ``cachedstore_watch_scopes``. Idempotent."""
        with self._books:
            self._closed = True
            self._count(0)
