"""Which watch covers a name: the scopes of a store's watch stream.

A store watches either its whole prefix (one scope, the *root*: the default) or only what
it touched (``watch_scope="touched"``): then each name belongs to one scope, its
*directory* (the name up to and including its first ``/``), or, for a name without a
``/``, the name itself. A scope is watched, and its keys cached, once a read of one of its
names needed it; the store's watch stream carries one etcd watch per scope. torch puts each
process group's keys under ``"<group>/"``, so a rank then receives the events of its own
groups, not the whole job's.

Scopes never overlap: a directory's range ends before the next directory or top-level
name, and a name's own range is that one key. :class:`Scope` is the per-scope revision
state that the coherence core (``cache.py``) keeps: etcd orders the events of one watch,
but not those of different watches on one stream (a slow stream's watchers are "victims"
resent later, a new watcher catches up separately), so each scope has its own applied
revision, reset epoch, completeness and high-water marks.
"""

from __future__ import annotations

from .keys import KeySpace, prefix_range_end

__all__ = ["Scope", "ScopeRanges", "scope_key"]


def scope_key(name: str) -> str:
    """The key of the scope that covers canonical ``name`` when scoping by what was touched:
    its directory ``"dir/"``, or the name itself if it has no ``/``."""
    i = name.find("/")
    return name if i < 0 else name[:i + 1]


class ScopeRanges:
    """The etcd key range of each scope key of one store. Immutable, thread-safe."""

    __slots__ = ("_keys",)

    def __init__(self, keys: KeySpace) -> None:
        self._keys = keys

    def root(self) -> tuple[bytes, bytes]:
        """The whole prefix (internal keys excluded)."""
        return self._keys.range_start, self._keys.range_end

    def of(self, key: str) -> tuple[bytes, bytes]:
        """``[start, end)`` of scope ``key``: everything under a directory, or one key."""
        start = self._keys.key(key)
        return (start, prefix_range_end(start)) if key.endswith("/") else (start, start + b"\0")


class Scope:
    """One watched range and what the core knows of it. Only the core (under its lock)
    changes it; the watcher reads ``start``, ``end`` and ``applied``."""

    __slots__ = ("key", "start", "end", "applied", "reset_epoch", "epoch_revision",
                 "complete", "heap", "awaiting_create", "catch_up_to", "opening", "pending",
                 "removed")

    def __init__(self, key: str | None, start: bytes, end: bytes) -> None:
        #: The scope key (None for the root).
        self.key = key
        self.start = start
        self.end = end
        #: Newest revision whose events of this scope have all been applied: where its
        #: watch resumes (+1).
        self.applied = 0
        #: The core's epoch when this scope was last reset, and the revision it was reset at.
        self.reset_epoch = 0
        self.epoch_revision = 0
        #: True while every key of the scope that exists has an entry.
        self.complete = False
        #: High-water marks of evicted keys of this scope: (revision, name), a heap.
        self.heap: list[tuple[int, str]] = []
        #: The stream went down since this scope's watch was last created.
        self.awaiting_create = False
        #: The creation revision its replay must reach before the cache is served (0: none).
        self.catch_up_to = 0
        #: Being opened: its snapshot read is in flight; results are held in ``pending``.
        self.opening = False
        #: (name, value, revision, mod_revision, is a write)
        self.pending: list[tuple[str, bytes | None, int, int, bool]] = []
        #: Dropped from the core (the store fell back to its whole prefix).
        self.removed = False

    def __repr__(self) -> str:
        return f"Scope({self.key!r}, applied={self.applied})"
