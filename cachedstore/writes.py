"""Writes, compare-and-swap, versioned reads and leases of one store.

Every write follows the coherence core's protocol for operations in flight: its keys are
registered (``begin``) before the request is sent, and etcd's answer is reported with the
revision etcd assigned (``end_write``), so a write recorded late — the thread descheduled
between etcd's answer and the cache update while the watch applied newer events or a
resync ran — can never install a value etcd no longer holds. A request that got no answer
is abandoned (``abandon``). No write is re-sent once it may have reached etcd.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from . import etcdapi
from .cache import CoherentCache
from .config import StoreConfig, seconds
from .connection import UNSENT_ONLY, Connection
from .errors import (
    EtcdError,
    InvalidInputError,
    InvalidTypeError,
    LeaseNotFoundError,
    NotAnIntegerError,
)
from .keys import REQUEST_OVERHEAD, KeySpace, to_value

__all__ = ["Versioned", "Writer"]


class Versioned(NamedTuple):
    """A key's value with etcd's metadata, as :meth:`EtcdStore.read` returns it."""

    value: bytes
    #: The revision of the key's last modification: the token of :meth:`EtcdStore.put_if`.
    mod_revision: int
    #: How many times the key was put since it was created (1 after the first put).
    version: int
    #: The lease the key is attached to, 0 for none.
    lease: int


class Writer:
    """The write side of one store. Thread-safe; every method blocks for its round trips.

    ``after_write`` is a test hook: when set, it is called with the names of every write
    after etcd answered and before the answer reaches the cache.
    """

    def __init__(self, conn: Connection, keys: KeySpace, cache: CoherentCache,
                 config: StoreConfig, check_open: Callable[[], None]) -> None:
        self._conn = conn
        self._keys = keys
        self._cache = cache
        self._config = config
        self._check_open = check_open
        self.after_write: Callable[[Sequence[str]], None] | None = None

    def _target(self, name: object) -> tuple[str, bytes]:
        canonical = self._keys.canonical(name)
        return canonical, self._keys.key(canonical)

    def _send(self, method: str, request: Any, writes: Sequence[tuple[str, bytes | None]],
              deadline: float | None = None) -> Any:
        """Send one write request under the in-flight protocol; record its writes."""
        names = [name for name, _ in writes]
        ticket = self._cache.begin(names)
        try:
            response = self._conn.call(method, request, retry=UNSENT_ONLY,
                                       deadline=deadline or self._conn.deadline())
            if self.after_write is not None:
                self.after_write(names)
        except BaseException:
            self._cache.abandon(names)
            raise
        self._cache.end_write(writes, ticket, response.header.revision)
        return response

    # -- plain writes --------------------------------------------------------------------------
    def set(self, name: object, value: object) -> None:
        canonical, key = self._target(name)
        data = to_value(value)
        self._keys.check_size(key, data)
        self._check_open()
        self._send("put", etcdapi.put(key, data), [(canonical, data)])

    def mset(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        writes: dict[str, tuple[bytes, bytes]] = {}
        for name, value in pairs:
            canonical, key = self._target(name)
            data = to_value(value)
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
        response = self._send("delete_range", etcdapi.delete(key), [(canonical, None)])
        return bool(response.deleted > 0)

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
        ticket = cache.begin([canonical])
        try:
            response = self._conn.call("txn", request, deadline=deadline, retry=UNSENT_ONLY)
            if self.after_write is not None:
                self.after_write([canonical])
        except BaseException:
            cache.abandon([canonical])
            raise
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
            new = transform(current)
            self._keys.check_size(key, new)
            compare = etcdapi.absent(key) if current is None \
                else etcdapi.unmodified(key, mod_revision)
            succeeded, found, _ = self.cas(canonical, key, compare, new, deadline)
            if succeeded:
                return new
            current, mod_revision = (found.value, found.mod_revision) if found else (None, 0)

    def add(self, name: object, amount: int) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidTypeError(f"amount must be an int, not {type(amount).__name__}")

        def plus(current: bytes | None) -> bytes:
            base = 0 if current is None else parse_int(current, name)
            return str(base + amount).encode()

        return int(self.read_modify_write(name, plus))

    def append(self, name: object, value: object) -> bytes:
        data = to_value(value)
        return self.read_modify_write(name, lambda current: (current or b"") + data)

    def compare_set(self, name: object, expected: object, desired: object) -> bytes:
        canonical, key = self._target(name)
        want = to_value(expected, "expected")
        data = to_value(desired, "desired")
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
            if found.value != want:
                return bytes(found.value)
            # Present with an empty value and expected == "": swap on its mod_revision.
            compare = etcdapi.unmodified(key, found.mod_revision)

    # -- versioned reads, conditional writes, leases ---------------------------------------------
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
        return Versioned(bytes(kv.value), kv.mod_revision, kv.version, kv.lease)

    def put_if(self, name: object, value: object, mod_revision: int, lease: int
               ) -> tuple[bool, Versioned | None]:
        canonical, key = self._target(name)
        data = to_value(value)
        self._keys.check_size(key, data)
        for what, number in (("mod_revision", mod_revision), ("lease", lease)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise InvalidTypeError(f"{what} must be an int >= 0, got {number!r}")
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

    def grant_lease(self, ttl: float) -> int:
        ttl_s = seconds(ttl, "ttl")
        if ttl_s is None or not 0 < ttl_s < 2**62:
            raise InvalidInputError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
        self._check_open()
        response = self._conn.call("lease_grant", etcdapi.lease_grant(math.ceil(ttl_s)),
                                   deadline=self._conn.deadline())
        if response.error:
            raise EtcdError(f"etcd lease grant: {response.error}")
        return int(response.ID)

    def revoke_lease(self, lease: int) -> None:
        self._check_open()
        try:
            self._conn.call("lease_revoke", etcdapi.lease_revoke(lease),
                            deadline=self._conn.deadline())
        except LeaseNotFoundError:
            pass


def parse_int(value: bytes, name: object) -> int:
    try:
        return int(value)
    except ValueError:
        raise NotAnIntegerError(
            f"add() on key {name!r}: its value {value[:40]!r} is not a decimal integer"
        ) from None
