"""Snapshot reads: etcd's current revision and, with it, every key of a range as of that
revision, as the core installs them (``CoherentCache.reset`` and ``open_scope``).

Read by the store at its start (the whole prefix), by the scope opener (the scopes a read
touched), and by the watch thread (a resync after compaction, a quiet scope's refresh, the
access re-check). Each function is one or two requests through :class:`Connection.call`
(failing over, re-authenticating, up to its deadline) and raises cachedstore errors.

A snapshot is ``(name, value, mod_revision)`` per key, names of the store's key space
only; None where the range holds more than the caller's ``limit`` (the core then caches
nothing of it in advance).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import etcdapi
from .connection import Connection
from .errors import CachedStoreError
from .etcdapi import Failure
from .keys import KeySpace
from .scoping import Scope

__all__ = ["Entries", "current_revision", "read_scope", "read_scopes", "snapshot"]

#: The keys of a range as of one revision: ``(name, value, mod_revision)``.
Entries = list[tuple[str, bytes, int]]


def current_revision(conn: Connection, keyspace: KeySpace, deadline: float) -> int:
    """etcd's current revision, read with a count-only range over the prefix (so that it
    also checks the read permission on it). Raises cachedstore errors."""
    return snapshot(conn, keyspace, 0, deadline)[0]


def snapshot(conn: Connection, keyspace: KeySpace, limit: int, deadline: float
             ) -> tuple[int, Entries | None]:
    """etcd's current revision R and, if the prefix holds at most ``limit`` keys, all of
    them as of R: ``(name, value, mod_revision)``; None when there are more (or R was
    compacted in between). One count-only range, plus one range when there are keys to load.
    Raises cachedstore errors."""
    request = etcdapi.range_prefix(keyspace.range_start, keyspace.range_end, count_only=True)
    counted = conn.call("range", request, deadline=deadline)
    revision = int(counted.header.revision)
    if limit <= 0 or counted.count > limit:  # 0: preloading disabled
        return revision, None
    if counted.count == 0:
        return revision, []
    request = etcdapi.range_prefix(keyspace.range_start, keyspace.range_end, revision=revision)
    try:
        response = conn.call("range", request, deadline=deadline)
    except CachedStoreError as exc:
        if etcdapi.classify(None, str(exc)) is Failure.COMPACTED:
            return revision, None
        raise
    return revision, _entries(keyspace, response.kvs)


def read_scopes(conn: Connection, keyspace: KeySpace, scopes: list[Scope], limit: int,
                deadline: float) -> tuple[int, list[Entries | None]]:
    """etcd's current revision R and, for each of ``scopes``, every key of it as of R if
    it holds at most ``limit`` (None otherwise): one range request (a Txn of them for
    several scopes) of at most ``limit + 1`` keys each. Raises cachedstore errors."""
    requests = [etcdapi.range_prefix(scope.start, scope.end, limit=max(1, limit + 1),
                                     count_only=limit <= 0) for scope in scopes]
    if len(requests) == 1:
        response = conn.call("range", requests[0], deadline=deadline)
        answers = [response]
    else:
        response = conn.call("txn", etcdapi.txn(success=[etcdapi.op_range(r)
                                                          for r in requests]),
                             deadline=deadline)
        answers = [r.response_range for r in response.responses]
    found: list[Entries | None] = []
    for answer in answers:
        if limit <= 0 or answer.more or len(answer.kvs) > limit:
            found.append(None)
        else:
            found.append(_entries(keyspace, answer.kvs))
    return int(response.header.revision), found


def read_scope(conn: Connection, keyspace: KeySpace, scope: Scope, limit: int,
               deadline: float) -> tuple[int, Entries | None]:
    """:func:`read_scopes` of one scope."""
    revision, found = read_scopes(conn, keyspace, [scope], limit, deadline)
    return revision, found[0]


def _entries(keyspace: KeySpace, kvs: Iterable[Any]) -> Entries:
    """The key-values of a range answer as entries, those outside the key space left out."""
    name_of = keyspace.name_of
    entries = [(name_of(kv.key), kv.value, kv.mod_revision) for kv in kvs]
    return [e for e in entries if e[0] is not None]  # type: ignore[misc]
