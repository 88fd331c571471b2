"""Named mutants: each reverts one rule of the store, so that a run shows the simulation
would notice. ``MUTANTS`` maps a name to a context manager that patches the rule out for
its duration (in this process) and restores it after.

Add one by writing a ``@contextmanager`` that patches a method (``_patched`` restores
it) and registering it in ``MUTANTS``; ``test_store_sim.py`` then asserts that the state
machine finds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from cachedstore import counters, keys, queues
from cachedstore.aio import AsyncFront
from cachedstore.cache import NOT_SERVING, CoherentCache
from cachedstore.connection import Connection
from cachedstore.errors import StoreTimeoutError
from cachedstore.reads import MISSING, absent
from cachedstore.writes import Writer

__all__ = ["MUTANTS"]


@contextlib.contextmanager
def _patched(owner: Any, attribute: str, replacement: Any) -> Iterator[None]:
    original = owner.__dict__[attribute]
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


@contextlib.contextmanager
def eviction_mark() -> Iterator[None]:
    """Rule 2 of cache.py gone: an entry evicted ahead of the watch leaves no mark."""
    def evicted(self: Any, name: str, entry: Any) -> None:
        scope = self._scope_of(name)
        if scope is not None:
            scope.complete = False
        self._metrics.evictions.inc()
        self._metrics.entries.dec()

    with _patched(CoherentCache, "_evicted", evicted):
        yield


@contextlib.contextmanager
def late_write_gate() -> Iterator[None]:
    """Rule 3 of cache.py gone: a fill or write that ends after newer updates (or a
    reset) is installed anyway."""
    finish = CoherentCache._finish

    def always(self: Any, name: str, ticket: int, revision: int) -> bool:
        finish(self, name, ticket, revision)
        return True

    with _patched(CoherentCache, "_finish", always):
        yield


@contextlib.contextmanager
def aliases() -> Iterator[None]:
    """One name, one key gone: a name given as bytes gets a cache entry of its own, one
    that no watch event (named by the str the key decodes to) ever invalidates."""
    canonical = keys.KeySpace.canonical

    def split(self: Any, name: object) -> str:
        if isinstance(name, (bytes, bytearray, memoryview)):
            return _Alias(canonical(self, name))  # the right key, the wrong entry
        return canonical(self, name)

    with _patched(keys.KeySpace, "canonical", split):
        yield


class _Alias(str):
    """A canonical name that hashes apart from the str the watch uses (same key bytes)."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash(("alias", str(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Alias) and str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


@contextlib.contextmanager
def epoch() -> Iterator[None]:
    """Rule 4 of cache.py gone: a result that began before a reset is installed even if
    the reset's snapshot is newer (compaction resyncs and scope openings)."""
    finish = CoherentCache._finish

    def no_epoch(self: Any, name: str, ticket: int, revision: int) -> bool:
        return finish(self, name, (self._epoch, ticket[1]), revision)

    with _patched(CoherentCache, "_finish", no_epoch):
        yield


@contextlib.contextmanager
def serve_while_replaying() -> Iterator[None]:
    """Rule 6 of cache.py weakened: after a reconnect, entries are served as soon as the
    stream is created, before the replay of what it missed reached its creation revision."""
    refloor = CoherentCache._refloor

    def eager(self: Any) -> None:
        refloor(self)
        if self.floor != NOT_SERVING:
            self.floor = 0

    with _patched(CoherentCache, "_refloor", eager):
        yield

# -- the fixes of issue 24, each reverted ---------------------------------------------------
@contextlib.contextmanager
def directory_snapshot() -> Iterator[None]:
    """Issue 24, 1: a scope's snapshot installs every name of its range, also those with
    a scope of their own inside it (a key scope that applied newer events)."""
    reset_scope = CoherentCache._reset_scope

    def unfiltered(self: Any, scope: Any, revision: int, snapshot: Any, woken: Any) -> None:
        reset_scope(self, scope, revision, snapshot, woken)
        for name, value, mod_revision in snapshot or ():
            self._install(name, value, revision, mod_revision, woken)

    with _patched(CoherentCache, "_reset_scope", unfiltered):
        yield


@contextlib.contextmanager
def counter_parts() -> Iterator[None]:
    """Issue 24, 2: a long name's counter parts are named by a digest behind "~", which
    the short name "~<digest>" spells too."""
    with _patched(counters, "DIGEST_ESCAPE", b"~"):
        yield


@contextlib.contextmanager
def fold_limit() -> Iterator[None]:
    """Issue 24, 3: the fold of 64 increments ignores max_txn_ops (122 operations) and its
    failure reaches the add's caller, after etcd applied the add."""
    def fold(self: Any, canonical: str, parts: Any, added: Any, deadline: float) -> None:
        request = counters.compact_request(parts, added.responses, 122)
        if request is not None:
            self._put_if(canonical, request, request.success[0].request_put.value, deadline)

    with _patched(Writer, "_compact", fold):
        yield


@contextlib.contextmanager
def queue_replay() -> Iterator[None]:
    """Issue 24, 4: a queue's remembered emptiness is trusted as soon as the stream is up
    again, before its replay of the outage caught up."""
    def healthy(self: Any) -> bool:
        return bool(self._serving_live())

    with _patched(queues.Queues, "_vouched", healthy):
        yield


@contextlib.contextmanager
def deleted_counter_aget() -> Iterator[None]:
    """Issue 24, 5: ``aget`` with a read logic of its own (as before ``steps.py`` made one
    logic serve both fronts), drifted: a blocking aget of a counter deleted before its
    value was read returns the default (the blocking get waits for the key again)."""
    async def get(self: Any, op: str, name: Any, default: Any, timeout: Any,
                  consistent: bool = False) -> Any:
        from cachedstore.config import seconds

        reads = self._reads
        canonical = reads._keys.canonical(name)  # noqa: SLF001
        wait = seconds(timeout)
        deadline = reads.deadline(wait)
        entry = reads.cached(canonical, blocking=wait is not None)
        value = entry[0] if entry is not None else None
        if entry is None and deadline is None:
            value = (await self.run(reads.fetch, [canonical])).get(canonical)
        if value is None and deadline is not None:
            try:
                value = await self.drive(reads.wait_steps(canonical, deadline, timeout))
            except StoreTimeoutError:
                if default is MISSING:
                    raise
        if counters.is_mark(value):
            value = await self.run(reads.decimal, canonical, value)
        return value if value is not None else absent(name, default)

    with _patched(AsyncFront, "get", get):
        yield


@contextlib.contextmanager
def absent_after_snapshot() -> Iterator[None]:
    """Found by this simulation: a scope's opening caches the names asked as absent even
    when its snapshot holds them (evicted at once in a tiny cache)."""
    def reset(self: Any, revision: int, snapshot: Any = None, scope: Any = None,
              absent: Any = ()) -> None:
        woken: list[Any] = []
        with self._lock:
            scope = scope or self._root
            if scope is None or scope.removed:
                return
            if revision > self._known:
                self._known = revision
            self._reset_scope(scope, revision, snapshot, woken)
            for name in absent:
                if self._scope_of(name) is scope:
                    self._install(name, None, revision, 0, woken)
            waiters = self._waiters_of(scope)
        self._wake(woken)
        for waiter in waiters:
            waiter.nudge()

    with _patched(CoherentCache, "reset", reset):
        yield


@contextlib.contextmanager
def history_rewind() -> Iterator[None]:
    """Rule 10 of cache.py gone: an answer older than what the store knew etcd had
    committed when it asked does not make the cache start over (etcd's history went
    back: the store serves what etcd lost, and its watch resumes after it)."""
    def went_back(self: Any, ticket: Any, revision: int) -> None:
        if revision > self._known:
            self._known = revision

    with _patched(CoherentCache, "_went_back", went_back):
        yield


@contextlib.contextmanager
def rewind_epoch() -> Iterator[None]:
    """Rule 10 of cache.py, its epoch gone: a result of an operation begun before etcd's
    history went back is installed after the cache started over (its revision is a
    number of the history etcd lost)."""
    finish = CoherentCache._finish

    def finish_any(self: Any, name: str, ticket: Any, revision: int) -> bool:
        rewound, self._rewound = self._rewound, 0
        try:
            return bool(finish(self, name, ticket, revision))
        finally:
            self._rewound = rewound

    with _patched(CoherentCache, "_finish", finish_any):
        yield


class _NoHistory:
    """A ``Connection.history`` that stays unset whatever the store assigns."""

    def __get__(self, obj: object, owner: object = None) -> None:
        return None

    def __set__(self, obj: object, value: object) -> None:
        pass


@contextlib.contextmanager
def every_answer_checked() -> Iterator[None]:
    """Rule 10 of cache.py checked only where a ticket ends (reads, writes, snapshots):
    the connection no longer checks every key-value answer, so a store whose only
    requests after etcd's history went back are a refused guard, a queue's count or a
    consistent read's revision request never finds out."""
    Connection.history = _NoHistory()  # type: ignore[assignment]
    try:
        yield
    finally:
        del Connection.history


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "eviction_mark": eviction_mark,
    "late_write_gate": late_write_gate,
    "aliases": aliases,
    "epoch": epoch,
    "serve_while_replaying": serve_while_replaying,
    "directory_snapshot": directory_snapshot,
    "counter_parts": counter_parts,
    "fold_limit": fold_limit,
    "queue_replay": queue_replay,
    "deleted_counter_aget": deleted_counter_aget,
    "absent_after_snapshot": absent_after_snapshot,
    "history_rewind": history_rewind,
    "rewind_epoch": rewind_epoch,
    "every_answer_checked": every_answer_checked,
}
