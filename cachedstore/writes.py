"""Writes, compare-and-swap and versioned reads of one store (leases: ``leases.py``).

Every write follows the coherence core's protocol for operations in flight: its keys are
registered (``begin``) before the request is sent, and etcd's answer is reported with the
revision etcd assigned (``end_write``), so a write recorded late — the thread descheduled
between etcd's answer and the cache update while the watch applied newer events or a
resync ran — can never install a value etcd no longer holds. A request that got no answer
is abandoned (``abandon``). No write is re-sent once it may have reached etcd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from . import counters, etcdapi
from .cache import CoherentCache, Ticket
from .config import StoreConfig
from .connection import UNSENT_ONLY, Connection
from .counters import parse_int
from .errors import (
    CachedStoreError,
    InvalidInputError,
)
from .keys import REQUEST_OVERHEAD, KeySpace, int64, to_value

__all__ = ["Versioned", "Writer"]

log = logging.getLogger("cachedstore.writes")


class Versioned(NamedTuple):
    """A key's value with etcd's metadata, as ``store.versioned.read`` returns it."""

    value: bytes
    #: The revision of the key's last modification: the token of ``versioned.put_if``.
    mod_revision: int
    #: How many times the key was put since it was created (1 after the first put).
    version: int
    #: The lease the key is attached to, 0 for none.
    lease: int


class Writer:
    """The write side of one store. Thread-safe; every method blocks for its round trips.

    ``after_write`` is a test hook: when set, it is called with the names of every write
    after etcd answered and before the answer reaches the cache.

    Longer than this project's classes usually are: each kind of write (put, delete,
    batches, compare-and-swap, counters and their folding, conditional writes) follows the
    same in-flight protocol of the core, which they share here.
    """

    def __init__(self, conn: Connection, keys: KeySpace, cache: CoherentCache,
                 config: StoreConfig, check_open: Callable[[], None]) -> None:
        self._conn = conn
        self._keys = keys
        self._cache = cache
        self._config = config
        self._check_open = check_open
        self.after_write: Callable[[Sequence[str]], None] | None = None
        self._fold_warned = False

    def _target(self, name: object) -> tuple[str, bytes]:
        canonical = self._keys.canonical(name)
        return canonical, self._keys.key(canonical)

    def _sent(self, method: str, names: Sequence[str], request: Any, deadline: float
              ) -> tuple[Ticket, Any]:
        """Send one write request with ``names`` registered in flight (``begin``); the
        caller reports etcd's answer (``end_write``/``end_fill``/``abandon``). A request
        that got no answer is abandoned here and its error raised."""
        ticket = self._cache.begin(names)
        try:
            response = self._conn.call(method, request, retry=UNSENT_ONLY, deadline=deadline)
            if self.after_write is not None:
                self.after_write(names)
        except BaseException:
            self._cache.abandon(names)
            raise
        return ticket, response

    def _send(self, method: str, request: Any, writes: Sequence[tuple[str, bytes | None]],
              deadline: float | None = None) -> Any:
        """Send one write request under the in-flight protocol; record its writes."""
        ticket, response = self._sent(method, [name for name, _ in writes], request,
                                      deadline or self._conn.deadline())
        self._cache.end_write(writes, ticket, response.header.revision)
        return response

    # -- plain writes --------------------------------------------------------------------------
    def set(self, name: object, value: object) -> None:
        canonical, key = self._target(name)
        data = _plain(value)
        self._keys.check_size(key, data)
        self._check_open()
        self._send("put", etcdapi.put(key, data), [(canonical, data)])

    def set_if_changed(self, name: object, value: object) -> bool:
        """Write ``value`` unless the key holds exactly it already: one Txn that compares
        the value; equal, it only reads the key (no revision, no watch event); different
        or absent, it puts. Returns whether it wrote."""
        canonical, key = self._target(name)
        data = _plain(value)
        self._keys.check_size(key, data)
        self._check_open()
        request = etcdapi.txn([etcdapi.value_equals(key, data)],
                              [etcdapi.op_range(etcdapi.range_key(key))],
                              [etcdapi.op_put(etcdapi.put(key, data))])
        ticket, response = self._sent("txn", [canonical], request, self._conn.deadline())
        revision = response.header.revision
        if not response.succeeded:
            self._cache.end_write([(canonical, data)], ticket, revision)
            return True
        kvs = response.responses[0].response_range.kvs
        seen = {canonical: (kvs[0].value, kvs[0].mod_revision)} if kvs else {}
        self._cache.end_fill([canonical], ticket, seen, revision)
        return False

    def mset(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        writes: dict[str, tuple[bytes, bytes]] = {}
        for name, value in pairs:
            canonical, key = self._target(name)
            data = _plain(value)
            self._keys.check_size(key, data)
            writes.pop(canonical, None)  # etcd refuses a key twice in one Txn
            writes[canonical] = (key, data)
        self._check_open()
        budget = self._config.max_request_bytes - REQUEST_OVERHEAD
        batch: list[str] = []
        size = 0
        for canonical, (key, data) in writes.items():
            if batch and (len(batch) == self._config.max_txn_ops
                          or size + len(key) + len(data) > budget):
                self._put_batch(batch, writes)
                batch, size = [], 0
            batch.append(canonical)
            size += len(key) + len(data)
        if batch:
            self._put_batch(batch, writes)

    def _put_batch(self, names: list[str], writes: dict[str, tuple[bytes, bytes]]) -> None:
        ops = [etcdapi.op_put(etcdapi.put(writes[n][0], writes[n][1])) for n in names]
        self._send("txn", etcdapi.txn(success=ops), [(n, writes[n][1]) for n in names])

    def delete(self, name: object) -> bool:
        canonical, key = self._target(name)
        self._check_open()
        # One Txn that also deletes the parts of a counter (``counters.py``), if it is one.
        request = etcdapi.txn(success=[etcdapi.op_delete(etcdapi.delete(key)),
                                       counters.clear(counters.Parts(self._keys, canonical))])
        response = self._send("txn", request, [(canonical, None)])
        return bool(response.responses[0].response_delete_range.deleted > 0)

    # -- compare-and-swap ----------------------------------------------------------------------
    def cas(self, canonical: str, key: bytes, compare: Any, data: bytes, deadline: float,
            lease: int = 0, prev_kv: bool = False) -> tuple[bool, Any, int]:
        """One Txn: if ``compare`` holds put ``data``, else read the key. Returns (succeeded,
        kv, revision): on failure the key's kv (None if absent); on success with
        ``prev_kv`` the kv it replaced (None if it created the key). Either way the core
        learns the outcome: the put as a write, the read as a fill through the gate (a
        caller may return what it read, so a later get must not return anything older)."""
        request = etcdapi.txn(
            [compare], [etcdapi.op_put(etcdapi.put(key, data, lease=lease, prev_kv=prev_kv))],
            [etcdapi.op_range(etcdapi.range_key(key))])
        cache = self._cache
        ticket, response = self._sent("txn", [canonical], request, deadline)
        revision = response.header.revision
        if response.succeeded:
            put = response.responses[0].response_put
            found = put.prev_kv if prev_kv and put.HasField("prev_kv") else None
            cache.end_write([(canonical, data)], ticket, revision)
        else:
            kvs = response.responses[0].response_range.kvs
            found = kvs[0] if kvs else None
            seen = {canonical: (found.value, found.mod_revision)} if found else {}
            cache.end_fill([canonical], ticket, seen, revision)
        return response.succeeded, found, revision

    def read_modify_write(self, name: object, transform: Callable[[bytes | None], bytes]
                          ) -> bytes:
        """Store ``transform(current value or None)`` atomically: a CAS loop on the key's
        ``mod_revision`` (or its absence), starting from the cached value as a guess."""
        canonical, key = self._target(name)
        self._check_open()
        guess = self._cache.peek(canonical)
        current, mod_revision = (guess[0], guess[2]) if guess else (None, 0)
        deadline = self._conn.deadline()
        while True:
            if counters.is_mark(current):
                current, mod_revision = self.fold(canonical, deadline)
            new = transform(current)
            if new.startswith(counters.MARK):  # e.g. two appends that spell the marker
                raise InvalidInputError(f"the new value of {name!r} would start with the "
                                        f"bytes that mark a counter; they are reserved")
            self._keys.check_size(key, new)
            compare = etcdapi.absent(key) if current is None \
                else etcdapi.unmodified(key, mod_revision)
            succeeded, found, _ = self.cas(canonical, key, compare, new, deadline)
            if succeeded:
                return new
            current, mod_revision = (found.value, found.mod_revision) if found else (None, 0)

    def add(self, name: object, amount: int) -> int:
        """``amount != 0``: one Txn that no other ``add`` can make fail (see
        ``counters.py``); a key holding a plain decimal is converted to a counter first by
        one compare-and-swap. ``amount == 0`` is :meth:`ReadThrough.counter`'s business."""
        canonical = self._keys.canonical(name)
        self._check_open()
        parts = counters.Parts(self._keys, canonical)
        deadline = self._conn.deadline()
        cache = self._cache
        while True:
            ticket, response = self._sent("txn", [canonical],
                                          counters.add_request(parts, amount), deadline)
            revision = response.header.revision
            outcome, result = counters.add_result(response, amount)
            if outcome == "created":
                cache.end_write([(canonical, counters.mark(amount))], ticket, revision)
                return amount
            kv: Any = response.responses[1].response_range.kvs[0] if outcome == "added" \
                else result
            cache.end_fill([canonical], ticket, {canonical: (kv.value, kv.mod_revision)},
                           revision)
            if outcome == "added":
                deltas = response.responses[3].response_range.kvs
                if len(deltas) >= counters.COMPACT_AT:
                    self._compact(canonical, parts, response, deadline)
                return int(result)
            # A plain value someone set: make it a counter (once; retried only if the key
            # changes meanwhile), then add as usual.
            value = parse_int(kv.value, name) + amount
            request = counters.convert_request(parts, kv, value)
            if self._put_if(canonical, request, counters.mark(value), deadline).succeeded:
                return value

    def create_counter(self, canonical: str) -> int | Any:
        """Create counter ``canonical`` with value 0 if its key was never put (one Txn,
        :func:`counters.create_request`, under the in-flight protocol: a write if it
        created, else a fill of what it read). Returns 0, the counter's value if someone
        created it meanwhile, or the key's kv if it holds a plain value."""
        self._check_open()
        request = counters.create_request(counters.Parts(self._keys, canonical))
        ticket, response = self._sent("txn", [canonical], request, self._conn.deadline())
        revision = response.header.revision
        if response.succeeded:
            self._cache.end_write([(canonical, counters.mark(0))], ticket, revision)
            return 0
        kvs = response.responses[0].response_range.kvs
        seen = {canonical: (kvs[0].value, kvs[0].mod_revision)} if kvs else {}
        self._cache.end_fill([canonical], ticket, seen, revision)
        return counters.value_of(response.responses)

    def append(self, name: object, value: object) -> bytes:
        data = _plain(value)
        return self.read_modify_write(name, lambda current: (current or b"") + data)

    def compare_set(self, name: object, expected: object, desired: object) -> bytes:
        canonical, key = self._target(name)
        want = to_value(expected, "expected")
        data = _plain(desired, "desired")
        self._keys.check_size(key, data)
        self._check_open()
        deadline = self._conn.deadline()
        compare = etcdapi.value_equals(key, want) if want else etcdapi.absent(key)
        while True:
            succeeded, found, _ = self.cas(canonical, key, compare, data, deadline)
            if succeeded:
                return data
            if found is None:
                return want
            if counters.is_mark(found.value):
                self.fold(canonical, deadline)
                compare = etcdapi.value_equals(key, want) if want else etcdapi.absent(key)
                continue
            if found.value != want:
                return bytes(found.value)
            # Present with an empty value and expected == "": swap on its mod_revision.
            compare = etcdapi.unmodified(key, found.mod_revision)

    def _compact(self, canonical: str, parts: counters.Parts, added: Any, deadline: float
                 ) -> None:
        """Fold the increments an add just read into its counter's base (one Txn, not
        retried: a racing add leaves it for a later one), so that reads of a counter that
        many ``add(k, n != 1)`` went into stay small. One watch event per COMPACT_AT adds.

        Upkeep only: the add it follows is committed and counted whatever happens here, so
        no error of the fold reaches the add's caller (who would retry, and count twice).
        A fold that etcd refuses or that gets no answer leaves the deltas for a later
        one; the in-flight protocol (``_sent``) keeps the cache coherent either way."""
        request = counters.compact_request(parts, added.responses, self._config.max_txn_ops)
        if request is None:
            return
        try:
            self._put_if(canonical, request, request.success[0].request_put.value, deadline)
        except CachedStoreError as exc:
            # Warned once per store: a refusal repeats at every add past COMPACT_AT deltas.
            level = logging.DEBUG if self._fold_warned else logging.WARNING
            self._fold_warned = True
            log.log(level, "cachedstore: folding the increments of counter %r failed (%s); "
                    "the add is counted, the increments stay until a later fold",
                    canonical, exc)

    def _put_if(self, canonical: str, request: Any, data: bytes, deadline: float) -> Any:
        """Send a Txn whose success branch puts ``data`` under ``canonical`` (and maybe
        more), under the in-flight protocol: recorded if it succeeded, else only
        unregistered. Returns etcd's answer."""
        ticket, response = self._sent("txn", [canonical], request, deadline)
        if response.succeeded:
            self._cache.end_write([(canonical, data)], ticket, response.header.revision)
        else:
            self._cache.abandon([canonical])
        return response

    def fold(self, canonical: str, deadline: float) -> tuple[bytes | None, int]:
        """Turn the counter ``canonical`` back into a plain decimal key (so that ``append``
        and ``compare_set`` see the decimal value TCPStore would hold). Returns the key's
        value and mod_revision afterwards. Retried while ``add``s race it."""
        parts = counters.Parts(self._keys, canonical)
        while True:
            response = self._conn.call("txn", etcdapi.txn(success=counters.read_ops(parts)),
                                       deadline=deadline)
            found = counters.value_of(response.responses)
            if not isinstance(found, int):  # no longer a counter
                return (found.value, found.mod_revision) if found is not None else (None, 0)
            key_kv = response.responses[0].response_range.kvs[0]
            request = counters.fold_request(parts, key_kv, found, response.header.revision)
            text = str(found).encode()
            folded = self._put_if(canonical, request, text, deadline)
            if folded.succeeded:
                return text, folded.header.revision

    # -- versioned reads and conditional writes ---------------------------------------------
    def read(self, name: object) -> Versioned | None:
        canonical, key = self._target(name)
        self._check_open()
        cache = self._cache
        ticket = cache.begin([canonical])
        seen: dict[str, tuple[bytes | None, int]] | None = None
        revision = 0
        try:
            response = self._conn.call("range", etcdapi.range_key(key),
                                       deadline=self._conn.deadline())
            revision = response.header.revision
            kv = response.kvs[0] if response.kvs else None
            seen = {canonical: (kv.value, kv.mod_revision)} if kv else {}
        finally:
            cache.end_fill([canonical], ticket, seen, revision)
        if kv is None:
            return None
        if counters.is_mark(kv.value):
            # A counter's adds never change its key's mod_revision, so a put_if on the
            # token would lose them: fold it into a plain decimal first, then read that.
            self.fold(canonical, self._conn.deadline())
            return self.read(name)
        return Versioned(bytes(kv.value), kv.mod_revision, kv.version, kv.lease)

    def put_if(self, name: object, value: object, mod_revision: int, lease: int
               ) -> tuple[bool, Versioned | None]:
        canonical, key = self._target(name)
        data = _plain(value)
        self._keys.check_size(key, data)
        int64(mod_revision, "mod_revision")
        int64(lease, "lease")
        self._check_open()
        compare = etcdapi.unmodified(key, mod_revision) if mod_revision \
            else etcdapi.absent(key)
        succeeded, found, revision = self.cas(canonical, key, compare, data,
                                              self._conn.deadline(), lease=lease, prev_kv=True)
        if succeeded:
            return True, Versioned(data, revision, found.version + 1 if found else 1, lease)
        if found is None:
            return False, None
        return False, Versioned(bytes(found.value), found.mod_revision, found.version,
                                found.lease)


def _plain(value: object, what: str = "value") -> bytes:
    """``to_value``, refusing the counters' marker (a value no one else may write)."""
    data = to_value(value, what)
    if data.startswith(counters.MARK):
        raise InvalidInputError(f"{what} starts with the bytes that mark a counter "
                                f"({counters.MARK!r}); they are reserved")
    return data
