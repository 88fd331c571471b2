"""Opening the watch scopes that a store's reads touch (``watch_scope="touched"``).

Before a read of a name can be answered from the cache, the name's scope (``scoping.py``)
must be watched. :class:`ScopeOpener` opens it on the reading thread, once per store:

1. the core registers the scope as *opening* (results that end meanwhile are held);
2. one range request reads the scope whole (up to ``preload_limit`` keys) at a revision R;
3. the core opens the scope with that snapshot as of R: complete, so a key it lacks is
   known to be absent, and the names the read asked for are cached, found or absent;
4. the watch stream adds one watch of the scope from R + 1.

Touching more than ``max_watches`` scopes makes the store fall back, once and for good, to
watching its whole prefix: the core drops every scope for one root scope, and the watch
thread reads the prefix and restarts its stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from .cache import CoherentCache
from .config import StoreConfig
from .connection import Connection
from .keys import KeySpace
from .metrics import NullMetrics, StoreMetrics
from .scoping import Scope, ScopeRanges, scope_key
from .watcher import read_scope

__all__ = ["ScopeOpener"]


class ScopeOpener:
    """Opens the scopes of one store. Thread-safe: one scope is opened at a time (a reader
    of a scope being opened waits for it); blocking for one etcd round trip per scope.

    ``watch`` adds an opened scope to the watch stream; ``fall_back`` hands the root scope
    of a collapsed cache to the watch thread, which reads it and restarts the stream.
    Both are set by the store once its watcher exists."""

    def __init__(self, conn: Connection, keys: KeySpace, cache: CoherentCache,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics) -> None:
        self._conn = conn
        self._keys = keys
        self._cache = cache
        self._ranges = ScopeRanges(keys)
        self._limit = min(config.preload_limit, config.cache_size)
        self._max_watches = config.max_watches
        self._metrics = metrics
        self._lock = threading.Lock()
        self._open: set[str] = set()
        #: What this store adds to ``cachedstore_watch_scopes`` (the root counts 1).
        self._counted = 0 if cache.scoped else 1
        metrics.watch_scopes.inc(self._counted)
        self.watch: Callable[[Scope], None] = lambda scope: None
        self.fall_back: Callable[[Scope], None] = lambda scope: None

    @property
    def n_open(self) -> int:
        return len(self._open)

    def ensure(self, names: Iterable[str], deadline: float) -> set[str]:
        """Open the scopes of canonical ``names`` that are not open yet. Returns the names
        whose scope this call opened: the cache now answers them (found or absent), as
        fresh as a read. Raises cachedstore errors when etcd cannot be read (the scope
        stays closed: a later read tries again)."""
        if not self._cache.scoped:
            return set()
        todo: dict[str, list[str]] = {}
        opened = self._open
        for name in names:
            key = scope_key(name)
            if key not in opened:
                todo.setdefault(key, []).append(name)
        answered: set[str] = set()
        for key, asked in todo.items():
            if self._open_scope(key, asked, deadline):
                answered.update(asked)
        return answered

    def _open_scope(self, key: str, asked: list[str], deadline: float) -> bool:
        with self._lock:
            cache = self._cache
            if key in self._open or not cache.scoped:
                return False
            if len(self._open) >= self._max_watches:
                self._collapse()
                return False
            start, end = self._ranges.of(key)
            scope = cache.begin_scope(key, start, end)
            try:
                revision, entries = read_scope(self._conn, self._keys, scope, self._limit,
                                               deadline)
            except BaseException:
                cache.abort_scope(scope)
                raise
            cache.open_scope(scope, revision, entries,
                             absent=asked if entries is not None else ())
            self._open.add(key)
            self._count(len(self._open))
            self.watch(scope)
            return entries is not None

    def _collapse(self) -> None:
        """Too many scopes: watch the whole prefix from now on (under the lock)."""
        root = self._cache.collapse(*self._ranges.root())
        self._open.clear()
        self._count(1)
        self.fall_back(root)

    def _count(self, n: int) -> None:
        self._metrics.watch_scopes.inc(n - self._counted)
        self._counted = n

    def close(self) -> None:
        """Take this store's scopes out of ``cachedstore_watch_scopes``. Idempotent."""
        with self._lock:
            self._count(0)
