"""FIFO queues and key listing of an :class:`~cachedstore.EtcdStore` (torch Store semantics).

A component below the store, built like ``Writer``: :class:`Queues` is constructed with
its collaborators (the connection, the key space, the coherence core, the scope opener)
and never sees the store. The store exposes it as ``store.queues`` and lists keys through
it; ``TorchEtcdStore`` uses it for torch's queue methods and its ``check``/``wait``.

Layout. Queue names and key names are separate namespaces, as in torch's ``HashStore`` and
``TCPStore``: a queue ``q`` and a key ``q`` can coexist. Each pushed item is one etcd key::

    <store prefix> NUL "queue/" <queue name, percent-encoded> "/" <16 random hex digits>

The leading NUL byte (:data:`RESERVED`) keeps items out of the way of every name torch or a
person would choose; percent-encoding (``/`` becomes ``%2F``) keeps queue ``a`` from seeing
the items of queue ``a/b``. Items are ordered by etcd's creation revision, so FIFO is the
order in which etcd committed the pushes. :meth:`Queues.num_keys` and :meth:`Queues.list_keys` leave the
queue namespace out, like torch's stores, which count and list keys but not queue items.

Atomicity. :meth:`Queues.push` is a put-if-absent Txn. :meth:`Queues.pop` is etcd's queue recipe: read the
oldest item, then delete it in a Txn guarded by its ``mod_revision``; a popper that loses
the race gets the new oldest item in the same response and tries that one, so each item is
popped exactly once across processes, and a loser costs one Txn, never a re-read by every
waiter. Within one store only one blocked popper per queue asks etcd at a time (the others
wait their turn in-process), so a push wakes at most one popper per process.

Blocking. A blocked pop waits on the store's watch (a prefix waiter on the queue's item
prefix): no polling, no extra stream. It is woken by the put of an item, and nudged on
resync and close.

Costs (etcd requests): push 1 Txn; pop 2 (range + Txn), 1 Txn when the same store popped
that queue before and remembers the next item; a lost race +1 Txn; ``queue_len`` 1
count-only range; ``num_keys`` 1 Txn of two count-only ranges; ``list_keys`` 2 keys-only
ranges (more on key spaces over 10,000 keys).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from . import etcdapi
from .cache import CoherentCache, ThreadWaiter, Ticket
from .clock import SYSTEM_CLOCK, Clock
from .config import seconds
from .connection import Connection
from .errors import QueueEmptyError, StoreTimeoutError
from .keys import QUEUE_DIRECTORY, KeySpace, prefix_range_end, to_value
from .opener import ScopeOpener
from .scoping import Scope

__all__ = ["RESERVED", "QueueEmptyError", "Queues", "item_prefix"]

#: Canonical-name prefix of every queue item; names starting with it belong to queues.
RESERVED = QUEUE_DIRECTORY
#: Keys listed per etcd range request by :meth:`Queues.list_keys`.
_PAGE = 10_000
#: Most queues per store whose emptiness :meth:`Queues.is_nonempty` remembers.
_MAX_KNOWN_EMPTY = 64


@functools.lru_cache(maxsize=4096)
def item_prefix(canonical: str) -> str:
    """The canonical-name prefix of the items of queue ``canonical``.

    Memoized (a pure function of the name): torch's ``wait`` and ``check`` ask for it
    several times per key, and ``quote`` costs ~1 µs per byte of the name (a tenth of a
    rank's CPU in a store-based barrier at W = 64)."""
    encoded = quote(canonical.encode("utf-8", "surrogateescape"), safe="")
    return f"{RESERVED}{encoded}/"


def _oldest(start: bytes, end: bytes) -> Any:
    return etcdapi.range_prefix(start, end, limit=1, oldest_first=True)


class _Gate:
    """Per queue: one blocked popper talks to etcd at a time; the item it saw next in line
    (a guess that saves the range request of the following pop)."""

    __slots__ = ("lock", "guess")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.guess: Any = None


class _KnownEmpty:
    """Item prefixes known to hold no item: :data:`RESERVED` (no queue has an item) or one
    queue's. Each holds a prefix waiter registered before the count that found it empty,
    so any later put of an item (through the watch, or a local push) sets its event and
    ends the knowledge; so do a resync and close."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiters: dict[str, ThreadWaiter] = {}
        #: The revision of this store's newest push: its item is in the cache with no
        #: watch event applied yet (the event, when it comes, changes nothing).
        self.last_push = 0

    def pushed(self, revision: int) -> None:
        """This store pushed an item at ``revision``: nothing it remembered as empty is."""
        with self.lock:
            self.last_push = max(self.last_push, revision)
            for waiter in self.waiters.values():
                waiter.event.set()

    def pushed_since(self, revision: int) -> bool:
        with self.lock:
            return self.last_push > revision

    def says_empty(self, prefix: str) -> bool:
        with self.lock:
            waiter = self.waiters.get(prefix)
            return waiter is not None and not waiter.event.is_set()


class Queues:
    """The queues of one store, and the listing of its keys. Thread-safe.

    Collaborators: ``conn`` (etcd calls), ``keys`` (names and etcd keys), ``cache`` (the
    coherence core: writes applied, prefix waiters), ``opener`` (the queues' directory
    scope in a store watching what it touched), ``timeout`` (the default wait of a
    blocking pop), ``check_open`` (raises once the store is closed), ``serving_live`` (True
    while the watch is up and the cache served), ``call_deadline`` (a round trip's deadline
    within a wait's, ``ReadThrough.call_deadline``), ``look_deadline`` (that of a count or
    a directory's opening read: ``ReadThrough.look_deadline``, which keeps those a wait's
    ``ready()`` makes within the wait), ``wait_until`` (the store's one wait
    for changes, ``ReadThrough.wait_until``), ``sent`` (a write request sent with its
    names registered in flight, as every write of the store: ``Writer._sent``),
    ``clock`` (times the waits).

    Longer than this project's classes usually are: everything that knows the layout of the
    queue namespace is here (push, pop and length; the emptiness remembered for torch's
    ``check``; listing and counting keys, which leave queue items out).
    """

    def __init__(self, conn: Connection, keys: KeySpace, cache: CoherentCache,
                 opener: ScopeOpener, timeout: float, check_open: Callable[[], None],
                 serving_live: Callable[[], bool],
                 call_deadline: Callable[[float | None], float],
                 look_deadline: Callable[[], float],
                 wait_until: Callable[..., None],
                 sent: Callable[[str, Sequence[str], Any, float], tuple[Ticket, Any]],
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._conn = conn
        self._keys = keys
        self._cache = cache
        self._opener = opener
        self._timeout = timeout
        self._check_open = check_open
        self._serving_live = serving_live
        self._call_deadline = call_deadline
        self._look_deadline = look_deadline
        self._wait_until = wait_until
        self._sent = sent
        self._clock = clock
        self._gates: dict[str, _Gate] = {}
        self._gates_lock = threading.Lock()
        self._known = _KnownEmpty()

    def _prefix_range(self, canonical_prefix: str) -> tuple[bytes, bytes]:
        start = self._keys.key(canonical_prefix)
        return start, prefix_range_end(start)

    def _item_range(self, canonical: str) -> tuple[bytes, bytes]:
        return self._prefix_range(item_prefix(canonical))

    # -- push / pop / length ---------------------------------------------------------------
    def push(self, name: str | bytes, value: str | bytes) -> None:
        """Append ``value`` to queue ``name``: one put-if-absent Txn of a new item key.
        Queues are a namespace of their own: queue ``k`` and key ``k`` are unrelated.

        Blocks for the round trip; wakes this store's blocked poppers at once and the
        others' through their watches. Like ``set``, it is not re-sent once it may have
        reached etcd (EtcdConnectionError then says the outcome is unknown). Atomic across
        processes."""
        canonical = self._keys.canonical(name)
        data = to_value(value)
        prefix = item_prefix(canonical)
        self._check_open()
        deadline = self._conn.deadline()
        while True:
            item = prefix + os.urandom(8).hex()
            key = self._keys.key(item)
            self._keys.check_size(key, data)
            request = etcdapi.txn([etcdapi.absent(key)],
                                  [etcdapi.op_put(etcdapi.put(key, data))])
            ticket, response = self._sent("txn", [item], request, deadline)
            if response.succeeded:  # else: 64 random bits collided; draw again
                revision = response.header.revision
                self._known.pushed(revision)  # before the cache holds it: see is_nonempty
                self._cache.end_write([(item, data)], ticket, revision)
                return
            self._cache.abandon([item])

    def _gate(self, canonical: str) -> _Gate:
        with self._gates_lock:
            gate = self._gates.get(canonical)
            if gate is None:
                gate = self._gates[canonical] = _Gate()
            return gate

    def _take(self, start: bytes, end: bytes, guess: Any) -> tuple[bytes | None, Any]:
        """Pop the oldest item of ``[start, end)``: (its value or None if the queue is
        empty, the next item as a guess for the following pop, or None)."""
        conn = self._conn
        # One request timeout for the whole pop, never cut short by a wait's end: a pop
        # woken just before its deadline still takes the item it was woken for.
        deadline = conn.deadline()
        if guess is None:
            kvs = conn.call("range", _oldest(start, end), deadline=deadline).kvs
            if not kvs:
                return None, None
            guess = kvs[0]
        while True:
            request = etcdapi.txn(
                [etcdapi.unmodified(guess.key, guess.mod_revision)],
                [etcdapi.op_delete(etcdapi.delete(guess.key)),
                 etcdapi.op_range(_oldest(start, end))],
                [etcdapi.op_range(_oldest(start, end))])
            name = self._keys.name_of(guess.key)
            names = [] if name is None else [name]
            ticket, response = self._sent("txn", names, request, deadline)
            if response.succeeded:
                self._cache.end_write([(n, None) for n in names], ticket,
                                      response.header.revision)
                after = response.responses[1].response_range.kvs
                return bytes(guess.value), (after[0] if after else None)
            self._cache.abandon(names)
            current = response.responses[0].response_range.kvs
            if not current:
                return None, None  # someone else took the last item
            guess = current[0]  # lost the race: try the new oldest item

    def pop(self, name: str | bytes, block: bool = True,
            timeout: float | timedelta | None = None, *, clock: Clock | None = None) -> bytes:
        """Remove and return the oldest item of queue ``name``.

        ``block=False``: raise :class:`QueueEmptyError` (a KeyError) at once if the queue
        is empty. ``block=True``: wait (on the store's watch, no polling) for an item until
        ``timeout`` (default: the store's ``timeout``) and raise
        :class:`~cachedstore.StoreTimeoutError` when it passes. Each item is returned by
        exactly one pop across all processes. The delete Txn is not re-sent once it may
        have reached etcd: EtcdConnectionError then says the outcome is unknown (the item
        may have been taken). StoreClosedError if the store is closed while waiting.
        ``clock`` times the wait instead of the store's (``TorchEtcdStore`` passes its own)."""
        canonical = self._keys.canonical(name)
        wait = seconds(timeout)
        self._check_open()
        if not block:
            value, _ = self._take(*self._item_range(canonical), None)
            if value is None:
                raise QueueEmptyError(name)
            return value
        budget = self._timeout if wait is None else wait
        clock = clock or self._clock
        deadline = clock.monotonic() + budget
        gate = self._gate(canonical)

        def timed_out() -> str:
            return f"timed out after {budget:g} s waiting for queue {name!r}"

        if not gate.lock.acquire(timeout=max(0.0, min(budget, threading.TIMEOUT_MAX))):
            raise StoreTimeoutError(timed_out())
        try:
            return self._pop_waiting(canonical, gate, deadline, clock, timed_out)
        finally:
            gate.lock.release()

    def _pop_waiting(self, canonical: str, gate: _Gate, deadline: float, clock: Clock,
                     timed_out: Callable[[], str]) -> bytes:
        """A blocking pop, holding the queue's gate: asks etcd again each time the watch
        applies the put of an item (the store's one wait for changes)."""
        start, end = self._item_range(canonical)
        # The waiter is woken only by a watched directory: wait for it to be opened
        # (another reader's opening can outlast one round trip's deadline).
        while self._cache.scoped and not self.watched():
            self._opener.ensure_directory(RESERVED, lambda: self._call_deadline(deadline))
            if clock.monotonic() >= deadline:
                raise StoreTimeoutError(timed_out())
        taken: list[bytes] = []
        looked = [float("-inf")]  # when the last look at etcd began

        def take() -> bool:
            looked[0] = clock.monotonic()
            value, gate.guess = self._take(start, end, gate.guess)
            if value is not None:
                taken.append(value)
            return value is not None

        try:
            self._wait_until(take, (), [item_prefix(canonical)], deadline, clock=clock,
                             covered=self.watched, message=timed_out)
        except StoreTimeoutError:
            # A look at etcd at the deadline, unless the last one was: an item etcd holds
            # while this store's watch is behind is taken rather than timed out on.
            if looked[0] >= deadline or not take():
                raise
        return taken[0]

    def length(self, name: str | bytes) -> int:
        """How many items queue ``name`` holds (0 if it never existed): one count-only
        range."""
        canonical = self._keys.canonical(name)
        self._check_open()
        start, end = self._item_range(canonical)
        request = etcdapi.range_prefix(start, end, count_only=True)
        return int(self._conn.call("range", request, deadline=self._conn.deadline()).count)

    # -- emptiness, remembered while the watch vouches for it ------------------------------
    def _vouched(self) -> bool:
        """Whether the watch vouches for what the store remembers as empty. Remembered
        emptiness is a derived answer: trusted only while the cache is served caught up
        (floor 0). After a reconnect the watch is up before it has replayed what it
        missed, and the put of an item pushed meanwhile, which ends the knowledge, may
        still be on its way: until the replay passes its creation revision, count."""
        return self._serving_live() and self._cache.floor == 0

    def watched(self) -> bool:
        """Whether an open watch of this store covers the queues' directory: then every
        put of an item wakes its prefix waiters. Does not block."""
        return self._opener.covers_directory(RESERVED)

    def open_directory(self, names: Sequence[str | bytes]) -> tuple[Scope, int, int] | None:
        """In a store watching what it touched: open the queues' directory together with
        the scopes of ``names`` (one read), for a ``check`` or ``wait`` that looks for both
        a key and a queue. Returns what :meth:`is_nonempty` takes as ``opened``. Blocks for
        one round trip at most; raises cachedstore errors when etcd cannot be read."""
        canonical = [self._keys.canonical(name) for name in names]
        return self._opener.ensure_directory(RESERVED, self._look_deadline, canonical)

    def is_nonempty(self, name: str | bytes,
                    opened: tuple[Scope, int, int] | None = None) -> bool:
        """True if queue ``name`` holds an item (torch's ``check``/``wait`` treat a
        non-empty queue as an existing key).

        Emptiness is remembered, and trusted while the watch is healthy and caught up (not
        while it replays what it missed during an outage), until the watch or a local push
        delivers the put of an item, a resync, or close: first for all queues at once (a
        store whose queues are all empty answers every name without a request), else per
        queue (up to 64 per store). Otherwise one Txn of two count-only ranges. Coherent
        like a cached read: an item another process pushed is seen once this store's
        watch has applied it. ``opened``: what :meth:`open_directory` returned, if called.
        """
        canonical = self._keys.canonical(name)
        self._check_open()
        known = self._known
        prefix = item_prefix(canonical)
        if self._vouched() and (known.says_empty(RESERVED) or known.says_empty(prefix)):
            return False
        # A store watching what it touched watches the queues' directory from now on.
        if opened is None:
            opened = self._opener.ensure_directory(RESERVED, self._look_deadline)
        fresh = {RESERVED: ThreadWaiter(), prefix: ThreadWaiter()}
        for p, waiter in fresh.items():  # before the count: no put slips by unseen
            self._cache.add_prefix_waiter(p, waiter, blocking=False)  # knowledge, not a wait
        kept: set[str] = set()
        try:
            counts = self._counts(prefix, opened)
            self._remember(counts, fresh, kept)
            return counts[prefix] > 0
        finally:
            for p, waiter in fresh.items():
                if p not in kept:
                    self._cache.remove_prefix_waiter(p, waiter, blocking=False)

    def _counts(self, prefix: str, opened: tuple[Scope, int, int] | None) -> dict[str, int]:
        """How many items all queues and queue ``prefix`` hold, asked once the waiters of
        :meth:`is_nonempty` are registered."""
        if opened is not None and opened[2] == 0 and opened[0].applied == opened[1] \
                and not opened[0].removed and not self._known.pushed_since(opened[1]):
            # Read whole and empty, no event applied since the read, and no push of this
            # store since (its item enters the cache with no event; the event that
            # follows changes nothing, so wakes no one): any item put from now on wakes
            # the waiters registered before. No count needed.
            return {RESERVED: 0, prefix: 0}
        ranges = [etcdapi.op_range(etcdapi.range_prefix(s, e, count_only=True))
                  for s, e in (self._prefix_range(RESERVED), self._prefix_range(prefix))]
        response = self._conn.call("txn", etcdapi.txn(success=ranges),
                                   deadline=self._look_deadline())
        return {RESERVED: int(response.responses[0].response_range.count),
                prefix: int(response.responses[1].response_range.count)}

    def _remember(self, counts: dict[str, int], fresh: dict[str, ThreadWaiter],
                  kept: set[str]) -> None:
        """Keep the waiters of the prefixes found empty as the knowledge that they are
        (adding each kept prefix to ``kept``); forget knowledge that puts have ended."""
        known = self._known
        replaced = []
        with known.lock:
            if len(known.waiters) >= _MAX_KNOWN_EMPTY:  # forget what puts have ended
                replaced += [(p, w) for p, w in known.waiters.items() if w.event.is_set()]
                for p, _ in replaced:
                    del known.waiters[p]
            # Remembered only while an open watch covers the queues: else no put would
            # end the knowledge.
            kept_valid = self.watched()
            for p, waiter in fresh.items():
                if counts[p] or not kept_valid or \
                        (p != RESERVED and len(known.waiters) >= _MAX_KNOWN_EMPTY):
                    continue
                old = known.waiters.pop(p, None)
                if old is not None:
                    replaced.append((p, old))
                known.waiters[p] = waiter
                kept.add(p)
        for p, old in replaced:
            self._cache.remove_prefix_waiter(p, old, blocking=False)

    # -- counting and listing keys ---------------------------------------------------------
    def _key_ranges(self, under: str) -> list[tuple[bytes, bytes]]:
        """The etcd ranges holding the store's keys whose names start with ``under``,
        queue items excluded."""
        keys = self._keys
        if under:
            if under.startswith(RESERVED):
                return []
            start = keys.key(under)
            return [(start, prefix_range_end(start))]
        queue_start = keys.key(RESERVED)
        return [(keys.range_start, queue_start),
                (prefix_range_end(queue_start), keys.range_end)]

    def num_keys(self, under: str = "") -> int:
        """How many keys exist under the store's prefix (names starting with ``under``),
        queue items not counted: one Txn of count-only ranges."""
        self._check_open()
        ranges = self._key_ranges(under)
        if not ranges:
            return 0
        ops = [etcdapi.op_range(etcdapi.range_prefix(s, e, count_only=True))
               for s, e in ranges]
        response = self._conn.call("txn", etcdapi.txn(success=ops),
                                   deadline=self._conn.deadline())
        return sum(int(r.response_range.count) for r in response.responses)

    def list_keys(self, under: str = "") -> list[str]:
        """Every key name under the store's prefix (starting with ``under``, which is
        stripped), queue items left out, in etcd's key order. Linearizable; keys-only
        ranges of up to 10,000 keys each. Names are canonical ``str`` (bytes decoded with
        surrogateescape)."""
        self._check_open()
        out: list[str] = []
        cut = len(under)
        for start, end in self._key_ranges(under):
            cursor = start
            while True:
                request = etcdapi.range_prefix(cursor, end, keys_only=True, limit=_PAGE)
                response = self._conn.call("range", request, deadline=self._conn.deadline())
                for kv in response.kvs:
                    name = self._keys.name_of(kv.key)
                    if name is not None:
                        out.append(name[cut:])
                if not response.more or not response.kvs:
                    break
                cursor = bytes(response.kvs[-1].key) + b"\0"
        return out
