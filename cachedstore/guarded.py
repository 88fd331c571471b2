"""Snapshots of several keys and guarded writes of several keys: one etcd Txn each.

``put_if`` and ``read`` work on one key. Some protocols keep their state in several keys
and need the same guarantees across them: torchrun's rendezvous backend keeps each agent's
heartbeat in a key of its own, so that agents do not race a compare-and-swap on one state
key every few seconds (``torch/rendezvous.py``). This module gives them

- :func:`read_many`: a linearizable snapshot of some keys and key ranges, all at one
  revision (one read-only Txn: no raft proposal);
- :func:`put_many_if`: puts and deletes applied only if every key in ``expect`` still has
  the ``mod_revision`` given (0: absent) and no key under a prefix (or in a name range) of
  ``unchanged_since`` was modified after the revision given, and in the same Txn a
  snapshot read after them (on success) or instead of them (on failure).

Neither is answered from the cache, and a snapshot does not fill it: its names are not
known before it is read, so the in-flight gate of ``cache.py`` cannot cover them (like
``list_keys``). The writes follow the gate: registered before the Txn is sent, recorded
with the revision etcd assigned, abandoned when the guard fails or no answer came.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from . import counters, etcdapi
from .errors import InvalidInputError, InvalidTypeError
from .keys import REQUEST_OVERHEAD, int64, prefix_range_end, to_value
from .writes import Versioned, Writer

__all__ = ["Snapshot", "VersionedKeys", "put_many_if", "read_many"]

#: How often a snapshot that found a counter is read again after folding it.
_FOLD_ATTEMPTS = 3


class Snapshot(NamedTuple):
    """Keys read at one etcd revision."""

    #: The revision the reads saw (etcd's header revision of the Txn).
    revision: int
    #: Canonical name → value and metadata of every key found, in etcd's key order.
    found: dict[str, Versioned]


class _Reads:
    """The range operations of a snapshot and how to turn their answers into names."""

    def __init__(self, writer: Writer, names: Iterable[object],
                 prefixes: Iterable[object]) -> None:
        keys = writer._keys
        self.ops: list[Any] = []
        #: Key bytes the ranges carry (twice over: the success and the failure branch).
        self.size = 0
        seen: set[str] = set()
        for name in names:
            canonical = keys.canonical(name)
            if canonical not in seen:
                seen.add(canonical)
                key = keys.key(canonical)
                self.ops.append(etcdapi.op_range(etcdapi.range_key(key)))
                self.size += 2 * len(key)
        for prefix in prefixes:
            start = keys.key(keys.canonical(prefix))  # non-empty, not reserved
            self.ops.append(etcdapi.op_range(etcdapi.range_prefix(start,
                                                                  prefix_range_end(start))))
            self.size += 4 * len(start)
        self._keys = keys

    def collect(self, responses: Any, revision: int) -> Snapshot:
        found: dict[str, Versioned] = {}
        for response in responses:
            for kv in response.response_range.kvs:
                name = self._keys.name_of(kv.key)
                if name is not None:
                    found[name] = Versioned(bytes(kv.value), kv.mod_revision, kv.version,
                                            kv.lease)
        return Snapshot(revision, dict(sorted(found.items(),
                                              key=lambda item: self._keys.key(item[0]))))


def _has_counter(snapshot: Snapshot) -> list[str]:
    return [name for name, v in snapshot.found.items() if counters.is_mark(v.value)]


def read_many(writer: Writer, names: Iterable[object] = (),
              prefixes: Iterable[object] = ()) -> Snapshot:
    """The keys ``names`` and every key whose name starts with one of ``prefixes``, read
    from etcd at one revision: one read-only Txn. A counter (``add``) found is folded into
    a plain decimal (a write, as ``VersionedKeys.read`` does) and the whole
    snapshot read again; a counter that is added to again each time, three times over, is
    returned as stored (its marker). Raises InvalidInputError for a bad name or more
    ranges than a Txn takes."""
    reads = _Reads(writer, names, prefixes)
    if not reads.ops:
        raise InvalidInputError("read_many needs at least one name or prefix")
    _check_ops("reads", len(reads.ops), writer)
    writer._check_open()
    conn = writer._conn
    deadline = conn.deadline()
    for _ in range(_FOLD_ATTEMPTS):
        response = conn.call("txn", etcdapi.txn(success=reads.ops), deadline=deadline)
        snapshot = reads.collect(response.responses, response.header.revision)
        marked = _has_counter(snapshot)
        if not marked:
            return snapshot
        for name in marked:
            writer.fold(name, deadline)
    return snapshot  # added to while folding, three times over: as stored


def put_many_if(writer: Writer, expect: Mapping[Any, int],
                puts: Mapping[Any, object], deletes: Iterable[object] = (), *,
                lease: int = 0, names: Iterable[object] = (),
                prefixes: Iterable[object] = (),
                unchanged_since: Mapping[Any, int] | None = None) -> tuple[bool, Snapshot]:
    """If every key of ``expect`` was last modified at the revision given (0: the key is
    absent) and no key of ``unchanged_since`` was modified after the revision given (a
    name there stands for every key it is a prefix of; a pair ``(first, last)`` for every
    key from ``first`` to ``last``, both included), put ``puts`` (attached to ``lease`` if
    non-zero) and delete ``deletes``, then read ``names`` and ``prefixes``; otherwise only
    read them. One Txn; a raft proposal whether or not the guard holds (etcd writes any
    Txn that may write).

    Returns ``(True, the snapshot after the writes)`` or ``(False, the snapshot)``; when
    the snapshot found a counter, it is read again by :func:`read_many` (at a later
    revision). Not re-sent once it may have reached etcd (EtcdConnectionError: outcome
    unknown). InvalidInputError for a bad name, a name both put and deleted, more
    operations than a Txn takes, more bytes than a request takes or a range whose
    ``first`` sorts after its ``last``; InvalidTypeError for a revision or lease that is
    not an int from 0 to 2**63 - 1 or a range that is not a pair of names;
    LeaseNotFoundError if the lease expired."""
    keys = writer._keys
    names, prefixes = list(names), list(prefixes)
    quiet = dict(unchanged_since or {})
    for what, number in [("lease", lease), *(("mod_revision", r) for r in expect.values()),
                         *(("revision", r) for r in quiet.values())]:
        int64(number, what)
    compares = []
    size = 0
    for name, revision in expect.items():
        key = keys.key(keys.canonical(name))
        compares.append(etcdapi.unmodified(key, revision) if revision
                        else etcdapi.absent(key))
        size += len(key)
    for scope, revision in quiet.items():
        start, end = _scope_range(keys, scope)
        compares.append(etcdapi.unmodified_since(start, end, revision))
        size += len(start) + len(end)
    writes: dict[str, bytes | None] = {}
    ops: list[Any] = []
    for name, value in puts.items():
        canonical = keys.canonical(name)
        key, data = keys.key(canonical), to_value(value)
        if data.startswith(counters.MARK):
            raise InvalidInputError(f"the value of {name!r} starts with the bytes that mark "
                                    f"a counter ({counters.MARK!r}); they are reserved")
        if canonical in writes:
            raise InvalidInputError(f"{name!r} is given twice (as different spellings)")
        writes[canonical] = data
        ops.append(etcdapi.op_put(etcdapi.put(key, data, lease=lease)))
        size += len(key) + len(data)
    for name in deletes:
        canonical = keys.canonical(name)
        if canonical in writes:
            raise InvalidInputError(f"{name!r} is both written and deleted, or given twice")
        writes[canonical] = None
        ops.append(etcdapi.op_delete(etcdapi.delete(keys.key(canonical))))
        parts = counters.Parts(keys, canonical)
        ops.append(counters.clear(parts))  # as delete() does
        size += len(keys.key(canonical)) + len(parts.start) + len(parts.end)
    reads = _Reads(writer, names, prefixes)
    size += reads.size
    _check_ops("compares", len(compares), writer)
    _check_ops("writes and reads", len(ops) + len(reads.ops), writer)
    budget = writer._config.max_request_bytes - REQUEST_OVERHEAD
    if size > budget:
        raise InvalidInputError(f"the Txn carries {size} bytes of keys and values; etcd "
                                f"accepts at most {budget} in one request "
                                f"(max_request_bytes)")
    writer._check_open()
    request = etcdapi.txn(compares, ops + reads.ops, reads.ops)
    ticket, response = writer._sent("txn", list(writes), request,
                                    writer._conn.deadline())
    revision = response.header.revision
    if response.succeeded:
        writer._cache.end_write(list(writes.items()), ticket, revision)
        snapshot = reads.collect(response.responses[len(ops):], revision)
    else:
        writer._cache.abandon(list(writes))
        snapshot = reads.collect(response.responses, revision)
    if reads.ops and _has_counter(snapshot):
        snapshot = read_many(writer, names, prefixes)
    return response.succeeded, snapshot


def _scope_range(keys: Any, scope: object) -> tuple[bytes, bytes]:
    """The etcd key range ``[start, end)`` of a scope of ``unchanged_since``: a name
    prefix, or a pair of names (both included)."""
    if isinstance(scope, tuple):
        if len(scope) != 2:
            raise InvalidTypeError(f"a range of names is a pair (first, last), got {scope!r}")
        first, last = (keys.key(keys.canonical(name)) for name in scope)
        if first > last:
            raise InvalidInputError(f"the range {scope!r} is empty: its first name sorts "
                                    f"after its last")
        return first, last + b"\0"
    start = keys.key(keys.canonical(scope))
    return start, prefix_range_end(start)


def _check_ops(what: str, n: int, writer: Writer) -> None:
    limit = writer._config.max_txn_ops
    if n > limit:
        raise InvalidInputError(f"{n} {what} in one Txn; etcd takes at most {limit} "
                                f"(max_txn_ops, etcd's --max-txn-ops)")


class VersionedKeys:
    """Versioned reads and conditional writes of one store (``store.versioned``): the
    optimistic-concurrency primitives of protocols like torchrun's rendezvous. Nothing here
    is answered from the cache; writes follow its in-flight gate, so the store's own reads
    see them as soon as they return. Every method blocks for one round trip (a counter
    found is folded first: one more) and is thread-safe."""

    def __init__(self, writer: Writer) -> None:
        self._writer = writer

    def read(self, name: object) -> Versioned | None:
        """The key's current value and metadata, read from etcd (linearizable, never from
        the cache), or None if absent. The answer also fills the cache through the
        revision gate. A counter is folded into a plain decimal first (its adds never
        change the key's ``mod_revision``, so a ``put_if`` on that token would lose
        them)."""
        return self._writer.read(name)

    def put_if(self, name: object, value: object, *, mod_revision: int, lease: int = 0
               ) -> tuple[bool, Versioned | None]:
        """Compare-and-swap on the key's ``mod_revision``: write ``value`` (attached to
        ``lease`` if non-zero) only if the key was last modified at ``mod_revision``, or,
        with ``mod_revision=0``, only if it is absent.

        Returns ``(True, the new Versioned)`` on success, else ``(False, the current
        Versioned or None if absent)``. One Txn; not re-sent once it may have reached etcd
        (EtcdConnectionError then says the outcome is unknown). LeaseNotFoundError if the
        lease expired; InvalidTypeError for a revision or lease that is not an int from 0
        to 2**63 - 1. Atomic across processes."""
        return self._writer.put_if(name, value, mod_revision, lease)

    def read_many(self, names: Iterable[object] = (), prefixes: Iterable[object] = ()
                  ) -> Snapshot:
        """The keys ``names`` and every key whose name starts with one of ``prefixes``,
        read from etcd at one revision (linearizable, never from the cache, and not filling
        it): one read-only Txn. Returns a :class:`Snapshot` (revision, name → Versioned).
        InvalidInputError for a bad name or more ranges than a Txn takes
        (``max_txn_ops``)."""
        return read_many(self._writer, names, prefixes)

    def put_many_if(self, expect: Mapping[Any, int], puts: Mapping[Any, object],
                    deletes: Iterable[object] = (), *, lease: int = 0,
                    names: Iterable[object] = (), prefixes: Iterable[object] = (),
                    unchanged_since: Mapping[Any, int] | None = None
                    ) -> tuple[bool, Snapshot]:
        """:meth:`put_if` over several keys: if every key of ``expect`` was last modified
        at the revision given (0: absent), and no key of ``unchanged_since`` was modified
        after the revision given (a name there stands for every key whose name starts with
        it, a pair ``(first, last)`` for every name from ``first`` to ``last``, both
        included), put ``puts`` (attached to ``lease`` if non-zero), delete ``deletes``,
        then read ``names`` and ``prefixes``; otherwise only read them. One Txn, atomic
        across processes.

        Returns ``(True, the Snapshot after the writes)`` or ``(False, the Snapshot)``. Not
        re-sent once it may have reached etcd (EtcdConnectionError: outcome unknown).
        InvalidInputError for a bad name, a name both put and deleted, more operations or
        bytes than one Txn takes, or a range whose first name sorts after its last;
        InvalidTypeError for a revision or lease that is not an int from 0 to 2**63 - 1;
        LeaseNotFoundError if the lease expired."""
        return put_many_if(self._writer, expect, puts, deletes, lease=lease, names=names,
                           prefixes=prefixes, unchanged_since=unchanged_since)
