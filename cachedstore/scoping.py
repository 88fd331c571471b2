"""Which watch covers a name: the scopes of a store's watch stream.

A store watches either its whole prefix (one scope, the *root*: the default) or only what
its reads touched (``watch_scope="touched"``). Then a name is covered by one of:

- its own *key scope* (one etcd single-key watch), or
- a *directory scope* (``"dir/"``, a range watch of everything under it), opened instead
  of key scopes once a store reads ``COARSEN_AT`` names directly in one directory (gloo's
  all-gather of a group: one watch, not one per rank).

A name's scope is its key scope if there is one, else the deepest open directory scope
above it (:func:`locate`). A scope is only opened for a name no scope covers yet, so a
covered name never changes scope. Ranges may nest (a directory scope also receives the
events of names that have their own scope, or a deeper one): each event is applied only by
the scope that covers its name, and the others' copies are dropped. torch puts each process
group's keys under its own directories (``"default_pg/<group>//cpu//0/<rank>"``), so a
rank then receives the writes of its own groups, not the whole job's.

:class:`Scope` is the per-scope revision state the coherence core (``cache.py``) keeps:
etcd orders the events of one watch, but not those of different watches on one stream (a
slow stream's watchers are "victims" resent later, a new watcher catches up separately), so
each scope has its own applied revision, reset epoch, completeness and high-water marks.
"""

from __future__ import annotations

from collections.abc import Mapping

from .keys import KeySpace, prefix_range_end

__all__ = ["COARSEN_AT", "Scope", "ScopeRanges", "directory_of", "dir_key", "key_key",
           "locate", "scope_key"]

#: Names read directly in one directory from which the directory is watched as a whole.
COARSEN_AT = 8


def key_key(name: str) -> str:
    """The scope key of ``name``'s own key scope."""
    return "k" + name


def dir_key(directory: str) -> str:
    """The scope key of a directory scope (``directory`` ends with ``/``)."""
    return "d" + directory


def directory_of(name: str) -> str:
    """The directory ``name`` is directly in (up to its last ``/``), "" at the top."""
    return name[:name.rfind("/") + 1]


def scope_key(name: str) -> str:
    """The key of the scope that covers canonical ``name`` when every name is its own
    directory's (``"d" + "dir/"``), or its own key's (``"k" + name``) without a ``/``:
    the simple mapping (no nesting) the core also accepts."""
    i = name.find("/")
    return key_key(name) if i < 0 else dir_key(name[:i + 1])


def locate(scopes: Mapping[str, Scope], name: str) -> Scope | None:
    """The scope covering ``name``: its key scope, else the deepest directory scope
    above it, else None."""
    scope = scopes.get("k" + name)
    if scope is not None:
        return scope
    i = len(name)
    while True:
        i = name.rfind("/", 0, i)
        if i < 0:
            return None
        scope = scopes.get("d" + name[:i + 1])
        if scope is not None:
            return scope


class ScopeRanges:
    """The etcd key range of each scope key of one store. Immutable, thread-safe."""

    __slots__ = ("_keys",)

    def __init__(self, keys: KeySpace) -> None:
        self._keys = keys

    def root(self) -> tuple[bytes, bytes]:
        """The whole prefix (internal keys excluded)."""
        return self._keys.range_start, self._keys.range_end

    def of(self, key: str) -> tuple[bytes, bytes]:
        """``[start, end)`` of scope ``key``: everything under a directory; for a key
        scope, the key and an empty end (etcd's single-key watch and read)."""
        start = self._keys.key(key[1:])
        return (start, prefix_range_end(start)) if key[0] == "d" else (start, b"")


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
