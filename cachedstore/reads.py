"""Read-through and waiting: what a read does when the cache cannot answer it.

:class:`ReadThrough` reads misses from etcd (linearizable, in as few round trips as etcd
allows) and reports every answer to the coherence core through its fill protocol
(``begin`` → read → ``end_fill``); it blocks readers of absent keys on the store's one watch
(waiters registered with the core, no polling). It holds no coherence state of its own.

Blocking reads are bounded by their own deadline, etcd round trips included: a read-through
inside a wait outlasts the wait by at most ``MIN_ROUND_TRIP`` (250 ms: the least a round trip
is given, so that ``timeout=0`` still reads a key that exists but is not cached), and a
wait that ends while etcd is unreachable raises
:class:`~cachedstore.StoreTimeoutError` (its ``__cause__`` says etcd was unreachable).
A look (a read with a zero or short wait) made for a longer operation -- ``wait_until``'s
``ready()``, a queue's pop, torch's blocking reads -- takes that operation's deadline
instead (:meth:`ReadThrough.within`): a slow etcd fails none of its round trips early.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

from . import counters, etcdapi
from .cache import NOT_SERVING, CoherentCache, Entry
from .clock import Clock
from .config import StoreConfig, seconds
from .connection import Connection
from .consistent import Progress, SharedRevision
from .counters import parse_int
from .errors import EtcdConnectionError, InvalidTypeError, KeyNotFoundError, StoreTimeoutError
from .keys import KeySpace
from .metrics import NullMetrics, StoreMetrics
from .opener import ScopeOpener
from .steps import NEW_WAITER, Call, Pause, Steps, drive
from .waiters import ThreadWaiter

__all__ = ["MAX_WAIT", "MISSING", "UNWATCHED_RECHECK", "ReadThrough", "Timeout", "absent",
           "describe", "names_list"]

Timeout = float | timedelta | None
#: A read's findings: name → (value, mod_revision) of each key found.
_Results = dict[str, tuple[bytes | None, int]]
_ReadChunk = Callable[[Sequence[str]], tuple[_Results, int]]
#: The longest single wait on an event: longer waits loop (Event.wait overflows past ~2^63 ns).
MAX_WAIT = 3600.0
#: The least time an etcd round trip of a blocking read is given (see ``call_deadline``):
#: how much a wait that meets an outage can overrun its timeout, at most.
MIN_ROUND_TRIP = 0.25
#: The operation the reads of this thread belong to, if any: (its store's
#: ReadThrough, its deadline on that store's clock); see :meth:`ReadThrough.within`.
_OPERATION: ContextVar[tuple[ReadThrough, float] | None] = ContextVar(
    "cachedstore_operation", default=None)
#: While etcd is unreachable, a waiter re-checks at most this often (it is also nudged the
#: moment the watch is back).
OUTAGE_RECHECK = 2.0
#: A waiter for a name no open watch covers (in a store watching what it touched, its
#: scope's opening gave way to another reader's, or failed) re-checks this often: each
#: check tries to open the scope again, after which the watch wakes it.
UNWATCHED_RECHECK = 0.25
#: How long a consistent read waits for the watch to apply etcd's current revision before
#: it reads etcd itself (a progress response at that revision ends the wait sooner).
CATCH_UP_WAIT = 0.05


class _Missing:
    """The type of :data:`MISSING`, the "no default given" marker."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def names_list(names: Iterable[object], what: str = "names") -> list[Any]:
    """``names`` as a list; a lone ``str``/``bytes`` (iterable, but surely a mistake) is
    refused with InvalidTypeError instead of being read character by character."""
    if isinstance(names, (str, bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"{what} must be a list of names, not a single "
                               f"{type(names).__name__} ({names!r:.40}); wrap it in a list")
    try:
        return list(names)
    except TypeError:
        raise InvalidTypeError(f"{what} must be an iterable of names, not "
                               f"{type(names).__name__}") from None


def absent(name: object, default: Any) -> Any:
    """The answer for an absent key: ``default``, or KeyNotFoundError without one."""
    if default is MISSING:
        raise KeyNotFoundError(name)
    return default


def describe(timeout: Timeout) -> str:
    if isinstance(timeout, timedelta):
        return f"{timeout.total_seconds():g} s"
    return f"{timeout:g} s" if isinstance(timeout, (int, float)) else str(timeout)


class ReadThrough:
    """Misses, blocking reads, ``mget`` and ``check`` of one store. Thread-safe.

    ``after_read`` is a test hook: when set, it is called with the names of every etcd read
    after etcd answered and before the answer reaches the cache.

    Longer than this project's classes usually are: every read past the hot path goes
    through the same fill protocol, deadlines and scope opening, which its parts (misses,
    counters, consistent reads, waits) share; the decisions of ``get``/``mget`` are written
    once as steps (``steps.py``) for both fronts.
    """

    def __init__(self, conn: Connection, keys: KeySpace, cache: CoherentCache,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics, clock: Clock,
                 check_open: Callable[[], None], stale_allowed: Callable[[], bool],
                 opener: ScopeOpener) -> None:
        self._conn = conn
        self._keys = keys
        self._cache = cache
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._check_open = check_open
        self._stale_allowed = stale_allowed
        self._opener = opener
        self.after_read: Callable[[Sequence[str]], None] | None = None
        #: etcd's current revision for consistent reads, one request for concurrent ones.
        self.revisions = SharedRevision(conn, keys.internal + b"anchor", clock)
        #: The watch's progress, told by the watcher (the store wires it).
        self.progress = Progress(clock)
        #: A test hook: called with the revision a consistent read waits for, before the
        #: wait (a mutant removes the wait to show the linearizability check sees it).
        self.before_catch_up: Callable[[int], None] | None = None

    # -- deadlines ---------------------------------------------------------------------------
    def deadline(self, wait: float | None) -> float | None:
        """The deadline of a wait of ``wait`` seconds (None: not blocking)."""
        return None if wait is None else self._clock.monotonic() + wait

    def start_by(self, deadline: float | None) -> float | None:
        """When a round trip of a read with ``deadline`` must have started (a queued call:
        :class:`~cachedstore.steps.Call`): the deadline, but never sooner than
        :data:`MIN_ROUND_TRIP` from now (as :meth:`call_deadline` floors a call); None for
        a read without a deadline."""
        if deadline is None:
            return None
        return max(deadline, self._clock.monotonic() + MIN_ROUND_TRIP)

    def call_deadline(self, deadline: float | None) -> float:
        """An etcd round trip's deadline: the request timeout, cut to the wait's deadline
        but never below :data:`MIN_ROUND_TRIP` from now, so that a wait of 0 s (or one
        whose deadline has just passed) can still read a key that exists but is not
        cached, instead of failing as if etcd were unreachable; and never below the
        deadline of the operation the read belongs to (:meth:`within`)."""
        now = self._clock.monotonic()
        own = now + self._config.request_timeout
        if deadline is None:
            return own
        floor = now + MIN_ROUND_TRIP
        end = self._operation_end()
        if end is not None and end > floor:
            floor = end
        return min(own, max(deadline, floor))

    def look_deadline(self) -> float:
        """The deadline of a read that does not wait and has no deadline of its own (a
        queue's count, a directory's opening read): ``request_timeout``, but inside an
        operation of this store (:meth:`within`) no later than the operation's end (nor
        sooner than :data:`MIN_ROUND_TRIP` from now), so that a wait's ``ready()`` making
        such reads one after another does not outlast the wait by a request timeout each:
        :meth:`call_deadline` of the operation's end, or of no deadline."""
        return self.call_deadline(self._operation_end())

    def _operation_end(self) -> float | None:
        """The deadline of this store's operation the calling thread's reads belong to
        (:meth:`within`), or None."""
        operation = _OPERATION.get()
        return operation[1] if operation is not None and operation[0] is self else None

    @contextmanager
    def within(self, seconds: float) -> Iterator[None]:
        """The reads of this store made inside, on this thread (a context variable), belong
        to an operation that ends ``seconds`` from now: each etcd round trip of theirs is
        given until then (and ``request_timeout`` at most), whatever the read's own wait,
        instead of :data:`MIN_ROUND_TRIP` for a look that does not wait.

        Why: an operation that waits by looking again and again (``wait_until``'s
        ``ready()``, a queue's pop, torch's ``get``/``multi_get``/``wait``) would fail
        every look that a slow etcd answers after 250 ms, and retry it on a new
        connection (the late call is abandoned, or left to finish, on its own) while etcd
        still serves the first one: the slower etcd, the more it is asked. Nests (the
        innermost operation applies); another store's reads keep their own rule."""
        token = _OPERATION.set((self, self._clock.monotonic() + max(0.0, seconds)))
        try:
            yield
        finally:
            _OPERATION.reset(token)

    # -- what the cache may answer -------------------------------------------------------------
    def cached(self, canonical: str, blocking: bool = False) -> Entry | None:
        """The entry to serve for a canonical name, or None: read etcd.

        ``blocking``: the caller will wait if the key is absent; then a complete cache's
        "not here, so absent" is answer enough (the watch will deliver the key). A
        non-blocking read of a key the cache never held still asks etcd, so that a key
        written just before (in real time) is found even if the watch is a moment behind.
        While the watch is down, ``max_staleness`` may allow the entry anyway (counted)."""
        cache = self._cache
        entry = cache.lookup_or_absent(canonical) if blocking else cache.lookup(canonical)
        if entry is not None or not self._stale_allowed():
            return entry
        entry = cache.peek(canonical)
        if entry is not None:
            self._metrics.stale_reads.inc()
        return entry

    def consistent(self, names: Iterable[str], deadline: float | None = None) -> set[str]:
        """Bring the cache up to etcd's current revision for canonical ``names``: ask etcd
        for its revision ``R`` (one request shared with concurrent callers), then wait
        until the watch applied ``R`` in the scopes covering them. Returns the names whose
        scope did: their entries (and a complete scope's "absent") are current as of ``R``
        or later, a linearizable answer. The caller reads the others from etcd (as
        linearizable): names no open scope covers, scopes the watch has not brought to
        ``R`` within :data:`CATCH_UP_WAIT` or by the time a progress response at ``R``
        arrived (a quiet scope gets no event to reach ``R``), and all of them while the
        watch is down. Blocks for one round trip and that wait; raises cachedstore errors
        when etcd cannot be reached."""
        cache = self._cache
        wanted = list(dict.fromkeys(names))
        call_deadline = self.call_deadline(deadline)
        revision = self.revisions.current(call_deadline)
        if self.before_catch_up is not None:
            self.before_catch_up(revision)
        progress = self.progress
        asked = progress.revision  # a progress response newer than this is an answer

        def split() -> tuple[set[str], bool]:
            """(names whose scope applied ``revision``, whether a watched one has not)."""
            fresh, behind = set(), False
            for name in wanted:
                applied = cache.applied_for(name)
                if applied is not None:
                    if applied >= revision:
                        fresh.add(name)
                    else:
                        behind = True
            return fresh, behind

        fresh, behind = split()
        if behind and cache.floor != NOT_SERVING:
            progress.request()
            until = min(call_deadline, self._clock.monotonic() + CATCH_UP_WAIT)

            def settled() -> bool:
                nonlocal fresh, behind
                fresh, behind = split()
                return not behind or (progress.revision > asked
                                      and progress.revision >= revision)

            progress.wait(settled, until)
            fresh = split()[0]  # what the watch applied up to the end of the wait
        return fresh

    def consistent_entry(self, canonical: str, deadline: float | None) -> Entry | None:
        """The entry a consistent read of ``canonical`` may serve (see :meth:`consistent`),
        or None: read etcd."""
        if canonical in self.consistent([canonical], deadline):
            return self._cache.lookup_or_absent(canonical)
        return None

    # -- etcd reads ---------------------------------------------------------------------------
    def _filled(self, names: Sequence[str], per_txn: int, read: _ReadChunk
                ) -> Iterator[tuple[Sequence[str], _Results, int, int]]:
        """Read ``names`` ``per_txn`` at a time with ``read(chunk)`` → (name → (value,
        mod_revision) for the keys found, revision), each chunk under the core's fill
        protocol (``begin`` → read → ``end_fill``, whatever happens). Yields (chunk,
        results, revision, how many fills the gate refused)."""
        cache = self._cache
        for start in range(0, len(names), per_txn):
            chunk = names[start:start + per_txn]
            ticket = cache.begin(chunk)
            results: _Results | None = None
            revision = 0
            try:
                results, revision = read(chunk)
                if self.after_read is not None:
                    self.after_read(chunk)
            finally:
                dropped = cache.end_fill(chunk, ticket, results, revision)
            assert results is not None
            yield chunk, results, revision, dropped

    def fetch(self, names: Sequence[str], deadline: float | None = None
              ) -> dict[str, bytes | None]:
        """Read ``names`` from etcd in Txns of up to ``max_txn_ops`` ranges and fill the
        cache through the core's gate. Returns name → value or None (absent). Each round
        trip is bounded by the request timeout and by ``deadline``."""
        out: dict[str, bytes | None] = {}
        cache = self._cache
        if cache.scoped:  # a scope opened here answers its names: no read of them
            for name in self._opener.ensure(names, lambda: self.call_deadline(deadline)):
                entry = cache.peek(name)
                if entry is not None:  # (a tiny cache may have evicted it already)
                    out[name] = entry[0]
            if out:
                names = [name for name in names if name not in out]
        for chunk, results, revision, dropped in self._filled(
                names, self._config.max_txn_ops,
                lambda chunk: self._read(chunk, self.call_deadline(deadline))):
            for name in chunk:
                value = results.get(name, (None, 0))[0]
                if dropped:
                    # The gate refused this read because a newer update of the key was
                    # applied meanwhile: answer with that newer state, not the older read.
                    newer = cache.peek(name)
                    if newer is not None and newer[1] > revision:
                        value = newer[0]
                out[name] = value
        return out

    def _read(self, names: Sequence[str], deadline: float) -> tuple[_Results, int]:
        key = self._keys.key
        if len(names) == 1:
            response = self._conn.call("range", etcdapi.range_key(key(names[0])),
                                       deadline=deadline)
            kvs = [response.kvs]
        else:
            request = etcdapi.txn(success=[etcdapi.op_range(etcdapi.range_key(key(n)))
                                           for n in names])
            response = self._conn.call("txn", request, deadline=deadline)
            kvs = [r.response_range.kvs for r in response.responses]
        results: _Results = {}
        for name, found in zip(names, kvs, strict=True):
            if found:
                results[name] = (found[0].value, found[0].mod_revision)
        return results, response.header.revision

    def read_counters(self, names: Sequence[str]) -> dict[str, int | bytes | None]:
        """Read the counters ``names`` whole (``counters.py``), in read-only Txns each
        bounded by the request timeout: no raft proposal, no revision, no event. Returns
        name → the counter's value, or, for a key that holds no counter, its plain value
        (None if absent). The keys' own states are reported to the core as fills."""
        out: dict[str, int | bytes | None] = {}

        def read(chunk: Sequence[str]) -> tuple[_Results, int]:
            ops = [op for name in chunk
                   for op in counters.read_ops(counters.Parts(self._keys, name))]
            response = self._conn.call("txn", etcdapi.txn(success=ops),
                                       deadline=self.call_deadline(None))
            seen: _Results = {}
            for i, name in enumerate(chunk):
                answers = response.responses[3 * i:3 * i + 3]
                kvs = answers[0].response_range.kvs
                if kvs:
                    seen[name] = (kvs[0].value, kvs[0].mod_revision)
                found = counters.value_of(answers)
                out[name] = found if isinstance(found, int) \
                    else (found.value if found is not None else None)
            return seen, response.header.revision

        for _ in self._filled(names, max(1, self._config.max_txn_ops // 3), read):
            pass
        return out

    def counter(self, name: object) -> int:
        """``add(name, 0)``: the counter's value read from etcd without writing (0 if the
        key is absent; NotAnIntegerError if it holds something else)."""
        canonical = self._keys.canonical(name)
        self._check_open()
        found = self.read_counters([canonical])[canonical]
        if found is None or isinstance(found, int):
            return found or 0
        return parse_int(found, name)

    def decimals(self, values: dict[str, bytes | None]) -> None:
        """Replace, in place, every counter's marker in ``values`` by the counter's value
        in decimal, read in one round trip for all of them. That round trip answers keys
        already found to exist: it is bounded by the request timeout, even when it
        finishes a blocking read whose own deadline has just passed."""
        marked = [name for name, value in values.items() if counters.is_mark(value)]
        if not marked:
            return
        for name, found in self.read_counters(marked).items():
            values[name] = str(found).encode() if isinstance(found, int) else found

    def decimal(self, canonical: str, value: bytes | None) -> bytes | None:
        """``value`` as a read returns it: a counter's marker becomes the counter's value
        in decimal (one round trip, see :meth:`decimals`); None if it was deleted since."""
        if not counters.is_mark(value):
            return value
        found = {canonical: value}
        self.decimals(found)  # the counter's read also caches the key's current state
        return found[canonical]

    def resolve(self, names: Iterable[str], blocking: bool = False,
                deadline: float | None = None, consistent: bool = False
                ) -> tuple[dict[str, bytes | None], set[str]]:
        """Values of canonical ``names``: served entries first, the rest read from etcd in
        batches. Returns (name → value or None, the names served from the cache).
        ``consistent``: linearizable (:meth:`consistent` decides what the cache serves)."""
        names = list(names)
        fresh = self.consistent(names, deadline) if consistent else None
        values, misses = self._from_cache(names, blocking, fresh)
        if misses:
            values.update(self.fetch(misses, deadline))
        return values, set(names).difference(misses)

    def _from_cache(self, names: list[str], blocking: bool, fresh: set[str] | None = None
               ) -> tuple[dict[str, bytes | None], list[str]]:
        """What the cache may answer of canonical ``names`` (:meth:`cached`; with
        ``fresh``, a consistent read's, only those names): (name → value, the rest)."""
        values: dict[str, bytes | None] = {}
        misses = []
        for name in names:
            if fresh is None:
                entry = self.cached(name, blocking)
            else:
                entry = self._cache.lookup_or_absent(name) if name in fresh else None
            if entry is None:
                misses.append(name)
            else:
                values[name] = entry[0]
        return values, misses

    # -- blocking ------------------------------------------------------------------------------
    def pause(self, name: str, deadline: float, timeout: Timeout,
              outage: EtcdConnectionError | None) -> float:
        """After a waiter's check found nothing: how long to wait for the watch before
        checking again, or StoreTimeoutError once ``deadline`` has passed (its cause the
        outage, if etcd was unreachable). Shared by the thread and asyncio waits."""
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise StoreTimeoutError(
                f"timed out after {describe(timeout)} waiting for key {name!r}"
                + (" (etcd unreachable)" if outage is not None else "")) from outage
        if outage is not None:
            return min(remaining, OUTAGE_RECHECK)
        return self._recheck_within(remaining, lambda: not self._cache.watches(name))

    def _recheck_within(self, remaining: float, unwatched: Callable[[], bool]) -> float:
        """How long a waiter with ``remaining`` seconds left waits for the watch before it
        looks again: at most :data:`UNWATCHED_RECHECK` while ``unwatched()`` says no open
        watch covers what it waits for (in a store watching what it touched; the next look
        may open it), else until the deadline (in steps of :data:`MAX_WAIT`)."""
        if self._cache.scoped and unwatched():
            return min(remaining, UNWATCHED_RECHECK)
        return min(remaining, MAX_WAIT)

    def wait_steps(self, name: str, deadline: float, timeout: Timeout,
                   outage: EtcdConnectionError | None = None) -> Steps[bytes]:
        """Block until ``name`` exists (woken by the watch) and return its value; raise
        StoreTimeoutError at ``deadline``, also when etcd is unreachable until then
        (``outage``: the caller's read of it just failed so; past the deadline, it is not
        read again)."""
        cache = self._cache
        # Registered before the first look: a change between a look and the pause wakes
        # it. A look whose deadline has passed already (a zero timeout: torch's
        # non-blocking reads) never pauses, and takes no waiter (nor wakes a paced watch).
        waiter = (yield NEW_WAITER) if self._clock.monotonic() < deadline else None
        if waiter is not None:
            cache.add_waiter(name, waiter)
        try:
            while True:
                self._check_open()
                entry = cache.lookup_or_absent(name)
                if entry is not None:
                    value = entry[0]
                elif deadline - self._clock.monotonic() <= 0 and outage is not None:
                    value = None
                else:
                    try:
                        value = (yield Call(self.fetch, ([name], deadline),
                                            self.start_by(deadline))).get(name)
                        outage = None
                    except EtcdConnectionError as exc:
                        value, outage = None, exc
                if value is not None:
                    return value
                # Raises once the deadline has passed: always, for a look that took no
                # waiter (the clock only ever increases).
                value = yield Pause(waiter, self.pause(name, deadline, timeout, outage))
                if value is not None:
                    return value
        except GeneratorExit:
            # Closed unfinished: by the garbage collector (an aget whose event loop is
            # gone), on any thread, maybe one that holds the cache's lock: no waiting.
            if waiter is not None:
                cache.remove_waiter_soon(name, waiter)
                waiter = None
            raise
        finally:
            if waiter is not None:
                cache.remove_waiter(name, waiter)

    def _waited(self, name: str, deadline: float, timeout: Timeout, default: Any
                ) -> Steps[bytes | None]:
        """:meth:`wait_steps`, with a timeout answered by ``default`` when there is one."""
        try:
            return (yield from self.wait_steps(name, deadline, timeout))
        except StoreTimeoutError:
            if default is MISSING:
                raise
            return None

    # -- waiting for changes ---------------------------------------------------------------
    def wait_until(self, ready: Callable[[], bool], names: Iterable[str] = (),
                   prefixes: Iterable[str] = (), deadline: float = 0.0, *,
                   clock: Clock | None = None, covered: Callable[[], bool] | None = None,
                   message: Callable[[], str] = lambda: "timed out waiting for a change"
                   ) -> None:
        """Block until ``ready()`` is true: asked at once, then each time the watch applies
        (or this store writes) a change of one of the canonical ``names`` or of a key under
        one of the canonical ``prefixes``, and at least every :data:`UNWATCHED_RECHECK`
        while no open watch covers one of the names (or ``covered()`` says the prefixes are
        not: the next ``ready()`` may open them). StoreTimeoutError (``message()``) once
        ``deadline`` (a time of ``clock``, the store's by default) passed
        with ``ready()`` false; a wait that ends at the deadline raises without asking
        again. ``ready`` may read etcd and has to be thread-safe; the waits poll nothing;
        its reads of this store are this wait's (:meth:`within`): a round trip of theirs
        may take until ``deadline``. Every waiter of the store that is not a read (queue
        pops, torch's ``wait`` of keys and queues) waits through here."""
        clock = clock or self._clock
        cache = self._cache
        names, prefixes = list(names), list(prefixes)
        waiter = ThreadWaiter()
        for name in names:  # before the first look: a change in between wakes the waiter
            cache.add_waiter(name, waiter)
        for prefix in prefixes:
            cache.add_prefix_waiter(prefix, waiter)
        try:
            # ready()'s looks are this wait's: their round trips get its deadline.
            with self.within(deadline - clock.monotonic()):
                self._wait_loop(ready, names, waiter, deadline, clock, covered, message)
        finally:
            for name in names:
                cache.remove_waiter(name, waiter)
            for prefix in prefixes:
                cache.remove_prefix_waiter(prefix, waiter)

    def _wait_loop(self, ready: Callable[[], bool], names: list[str], waiter: ThreadWaiter,
                   deadline: float, clock: Clock, covered: Callable[[], bool] | None,
                   message: Callable[[], str]) -> None:
        """:meth:`wait_until`'s loop: ask, then wait for a change (or a recheck)."""
        cache = self._cache
        while True:
            self._check_open()
            waiter.event.clear()  # before asking: a change meanwhile sets it again
            if ready():
                return
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(message())
            pause = self._recheck_within(remaining, lambda: (
                not all(cache.watches(n) for n in names)
                or (covered is not None and not covered())))
            if not clock.wait(waiter.event, pause) and pause == remaining:
                raise StoreTimeoutError(message())

    # -- get / mget / check past the hot path --------------------------------------------------
    def get_steps(self, op: str, name: object, default: Any, timeout: Timeout,
                  consistent: bool = False) -> Steps[Any]:
        """``get``/``aget`` of a name the hot path could not serve: bytes names, misses,
        absent keys, blocking; and every consistent (linearizable) one."""
        canonical = self._keys.canonical(name)
        wait = seconds(timeout)
        self._check_open()
        deadline = self.deadline(wait)
        if consistent:
            entry = yield Call(self.consistent_entry, (canonical, deadline),
                               self.start_by(deadline))
        else:
            entry = self.cached(canonical, blocking=wait is not None)
        (self._metrics.hit if entry is not None else self._metrics.miss)[op].inc()
        value = None
        if entry is not None:
            value = entry[0]
        elif deadline is None or consistent:
            # A consistent read whose scope the watch has not brought up to date reads
            # etcd before any wait: the wait's look at the cache would be coherent only.
            value = (yield Call(self.fetch, ([canonical], deadline),
                                self.start_by(deadline))).get(canonical)
        while True:
            if value is None and deadline is not None:
                value = yield from self._waited(canonical, deadline, timeout, default)
            if not counters.is_mark(value):
                break
            value = yield Call(self.decimal, (canonical, value), self.start_by(deadline))
            if value is not None or deadline is None:
                break
            # The counter was deleted meanwhile: a blocking read waits for it again.
        return value if value is not None else absent(name, default)

    def mget_steps(self, op: str, names: list[Any], default: Any, timeout: Timeout,
                   first: list[Any], pending: list[int], consistent: bool = False
                   ) -> Steps[list[Any]]:
        """Finish an ``mget``/``amget``/``wait`` whose hot path served every name but those
        at ``pending`` (``first`` holds the served values; with ``consistent``, none: every
        name is pending). One deadline for the whole call."""
        wait = seconds(timeout)
        self._check_open()
        canonical = {i: self._keys.canonical(names[i]) for i in pending}
        deadline = self.deadline(wait)
        # In the order given (not a set's, which follows str hashes): the same call makes
        # the same requests in every process (the simulation replays exactly).
        unique = list(dict.fromkeys(canonical.values()))
        outage: EtcdConnectionError | None = None
        try:
            values, served = yield Call(self.resolve, (unique, wait is not None, deadline,
                                                       consistent), self.start_by(deadline))
        except EtcdConnectionError as exc:
            if deadline is None or consistent or not wait:
                # Not a wait (a zero timeout is a look: its caller retries, as torch's
                # waits do with back-off), or a consistent read: the error is the answer.
                raise
            # A blocking read in an outage waits for every name the cache cannot serve
            # (wait_steps retries etcd while time is left, and at the deadline raises
            # StoreTimeoutError with the outage as its cause), as a blocking get does.
            # What the cache serves (a stale entry max_staleness allows, too) is served.
            values, misses = self._from_cache(unique, blocking=True)
            served, outage = set(unique).difference(misses), exc
        # Per position, as the hot path counts: a name given twice is two hits or misses.
        hits = sum(1 for i in pending if canonical[i] in served)
        self._metrics.hit[op].inc(len(names) - len(pending) + hits)
        self._metrics.miss[op].inc(len(pending) - hits)
        for i in pending:  # in order: the first absent name times out
            name = canonical[i]
            if values.get(name) is None and deadline is not None:
                try:
                    values[name] = yield from self.wait_steps(name, deadline, timeout, outage)
                    outage = None  # that wait was answered: the outage is old news
                except StoreTimeoutError as exc:
                    if default is MISSING:
                        raise
                    values[name] = None
                    # Still unreachable at the deadline: the next names are not read past
                    # it (each such read would add 250 ms); else the outage is old news.
                    cause = exc.__cause__
                    outage = cause if isinstance(cause, EtcdConnectionError) else None
        # A wait needs existence only: a counter's value is not read. A counter deleted
        # between the wait and the read of its value is waited for again (as by ``get``).
        while op != "wait" and any(counters.is_mark(v) for v in values.values()):
            marked = [name for name, v in values.items() if counters.is_mark(v)]
            yield Call(self.decimals, (values,), self.start_by(deadline))
            if deadline is None:
                break
            for name in marked:
                if values.get(name) is None:
                    values[name] = yield from self._waited(name, deadline, timeout, default)
        for i in pending:
            value = values.get(canonical[i])
            first[i] = value if value is not None else absent(names[i], default)
        return first

    def get(self, op: str, name: object, default: Any, timeout: Timeout,
            consistent: bool = False) -> Any:
        """:meth:`get_steps` on the calling thread."""
        return drive(self.get_steps(op, name, default, timeout, consistent), self._clock)

    def mget(self, op: str, names: list[Any], default: Any, timeout: Timeout,
             first: list[Any], pending: list[int], consistent: bool = False) -> list[Any]:
        """:meth:`mget_steps` on the calling thread."""
        return drive(self.mget_steps(op, names, default, timeout, first, pending, consistent),
                     self._clock)

    def check(self, names: Iterable[object], consistent: bool = False) -> bool:
        self._check_open()
        canonical = dict.fromkeys(self._keys.canonical(n) for n in names_list(names))
        values, served = self.resolve(canonical, consistent=consistent)
        self._metrics.hit["check"].inc(len(served))
        self._metrics.miss["check"].inc(len(canonical) - len(served))
        return all(v is not None for v in values.values())
