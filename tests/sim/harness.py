"""A deterministic scheduler for real, unchanged ``EtcdStore``s against an in-process etcd.

Every thread that runs store code is real (each store's watch thread, the thread that
consumes its watch requests, one client thread per operation), but none of them runs while
another does: each blocks only at a point this module controls, and parks there until the
scheduler lets it go. The scheduler (:class:`Sim`) acts only when every thread it manages
is parked (:meth:`Sim.settle`), and then lets exactly one go at a time, in an order that
depends on nothing but the calls made to it. So the same calls give the same history.

The controlled blocking points:

- ``clock``: :class:`SimClock` (one per store) ``wait``/``sleep``. A waiter goes on when
  the scheduler releases it: because its event was set (released one at a time, oldest
  park first, once every other thread is parked) or because :meth:`Sim.advance` moved its
  store's time to its deadline (deadlines in order, one waiter at a time);
- ``watch``: the ``__next__`` of a store's Watch call (:class:`SimWatchCall`), until
  :meth:`Sim.deliver` hands it one response of the model's stream, :meth:`Sim.break_stream`
  fails it, or it is cancelled;
- ``held``: a unary call whose request the model has applied, held before its answer
  reaches the caller (an operation started with ``hold=True``, or the watch thread's next
  call after :meth:`Sim.hold_watcher`), until :meth:`Sim.release` (with the answer, or with
  a transport failure: "outcome unknown");
- ``lock``: :class:`SimLock`, which replaces the scope opener's lock of each store (a
  reader waiting for another reader's scope opening).

The transport is plugged in through ``cachedstore.connection.STUB_FACTORIES``: every store
gets an endpoint target of its own whose stubs call the model (``tests/sim/etcd_model.py``).
A thread that blocks anywhere else (a real lock held by a parked thread) is a deadlock of
the harness: :meth:`Sim.settle` fails loudly after ``SAFETY`` real seconds with a dump of
every thread, never silently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from cachedstore import connection
from cachedstore.cache import NOT_SERVING
from cachedstore.config import Backoff, StoreConfig
from cachedstore.store import EtcdStore
from cachedstore.wire import WireError

__all__ = ["SAFETY", "HarnessError", "Op", "Sim", "SimClock", "SimLock", "SimRpcError",
           "SimStore"]

#: Real seconds the scheduler waits for threads to park before it declares a deadlock.
SAFETY = 20.0
#: Thread names the scheduler manages (besides threads that park at one of its points).
_MANAGED = ("sim-", "cachedstore-watch-")
#: Every target ever given to a store of a Sim (the connection layer's table).
_targets = itertools.count(1)


class HarnessError(AssertionError):
    """The harness itself is stuck or misused (not a finding about the store)."""


class SimRpcError(WireError):
    """A transport failure the scheduler injects (stream reset, lost answer)."""


# -- parks -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Park:
    kind: str  # "clock", "watch", "held", "lock"
    thread: str
    seq: int
    ready: Callable[[], bool]
    #: clock parks: the event, the store clock, the deadline (None: none)
    event: threading.Event | None = None
    clock: SimClock | None = None
    deadline: float | None = None
    released: bool = False
    #: held parks: how the answer is released ("ok" or "fail")
    outcome: str = ""
    store: SimStore | None = None
    info: dict[str, Any] = field(default_factory=dict)


class SimClock:
    """A store's time: moves only when :meth:`Sim.advance` moves it. Implements
    ``cachedstore.clock.Clock``; every wait parks with the scheduler."""

    def __init__(self, sim: Sim, name: str, start: float = 1000.0) -> None:
        self._sim = sim
        self.name = name
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.wait(threading.Event(), seconds)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        deadline = None if timeout is None else self.now + max(0.0, timeout)
        if deadline is not None and deadline <= self.now:
            return event.is_set()
        sim = self._sim
        park = sim.new_park("clock", lambda: park.released, event=event, clock=self,
                            deadline=deadline)
        sim.park(park)
        return event.is_set()

    def __repr__(self) -> str:
        return f"SimClock({self.name}, now={self.now:g})"


class SimLock:
    """A lock whose waiters park with the scheduler (``acquire``'s timeout is read on the
    store's clock, as the code that takes it computes it)."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self._held = False
        self._guard = threading.Lock()
        self._freed = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        deadline = None if timeout is None or timeout < 0 else self._clock.now + timeout
        while True:
            with self._guard:
                if not self._held:
                    self._held = True
                    self._freed.clear()
                    return True
            if not blocking:
                return False
            left = None if deadline is None else deadline - self._clock.now
            if left is not None and left <= 0:
                return False
            self._clock.wait(self._freed, left)

    def release(self) -> None:
        with self._guard:
            self._held = False
            self._freed.set()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- the transport ------------------------------------------------------------------------
class _Method:
    """One unary RPC of a stub: callable like a grpcio multi-callable, with ``future``."""

    def __init__(self, store: SimStore, method: str) -> None:
        self._store = store
        self._method = method

    def __call__(self, request: Any, timeout: float | None = None,
                 metadata: Any = None) -> Any:
        return self._store.sim.unary(self._store, self._method, request)

    def future(self, request: Any, timeout: float | None = None,
               metadata: Any = None) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(self(request, timeout, metadata))
        except grpc.RpcError as exc:
            future.set_exception(exc)
        return future


class _Stub:
    def __init__(self, store: SimStore, methods: dict[str, str]) -> None:
        for attribute, method in methods.items():
            setattr(self, attribute, _Method(store, method))


class _WatchStub:
    def __init__(self, store: SimStore) -> None:
        self._store = store

    def Watch(self, requests: Iterator[Any], metadata: Any = None) -> SimWatchCall:  # noqa: N802
        return SimWatchCall(self._store, requests)


class _Stubs:
    """What stands in for an endpoint's channel (``connection._simulated``)."""

    def __init__(self, store: SimStore) -> None:
        self.kv = _Stub(store, {"Range": "range", "Txn": "txn", "Put": "put",
                                "DeleteRange": "delete_range", "Compact": "compact"})
        self.maintenance = _Stub(store, {"Status": "status"})
        self.auth = _Stub(store, {"Authenticate": "authenticate"})
        self.lease = _Stub(store, {"LeaseGrant": "lease_grant", "LeaseRevoke": "lease_revoke",
                                   "LeaseTimeToLive": "lease_time_to_live"})
        self.watch = self.watch_stream = _WatchStub(store)

    def close(self) -> None:
        pass


class SimWatchCall:
    """A store's watch stream: the requests are consumed on a thread of their own and
    forwarded to a ModelWatchStream; ``__next__`` parks until the scheduler hands it one
    of the model's responses."""

    def __init__(self, store: SimStore, requests: Iterator[Any]) -> None:
        self.store = store
        sim = store.sim
        self.sim = sim
        self.model_stream = sim.model.open_watch_stream()
        self.handed: deque[Any] = deque()
        self.error: BaseException | None = None
        self.cancelled = False
        self.closed = False
        self.n = next(store.streams)
        store.call = self
        store.calls += 1
        self._requests = requests
        self._thread = threading.Thread(target=self._send, daemon=True,
                                        name=f"sim-req-{store.index}-{self.n}")
        self._thread.start()

    def _send(self) -> None:
        try:
            for request in self._requests:
                if self.closed or not hasattr(request, "ListFields"):
                    continue  # a PING marker (the wire transport's), or a dead stream
                with self.sim.model_lock:
                    self.model_stream.send(request)
        except Exception as exc:  # the model refused a request: the stream fails
            self.sim.note(f"watch request failed on store {self.store.index}: {exc!r}")
            self.fail(SimRpcError(grpc.StatusCode.INTERNAL, f"request refused: {exc}"))

    def send(self, request: Any) -> bool:
        """A request sent from the caller's thread (the wire transport's ``send``, which
        the watcher uses for creates): straight to the model, behind what came before."""
        if self.closed:
            return False
        try:
            with self.sim.model_lock:
                self.model_stream.send(request)
        except Exception as exc:  # the model refused it: the stream fails, as in _send
            self.sim.note(f"watch request failed on store {self.store.index}: {exc!r}")
            self.fail(SimRpcError(grpc.StatusCode.INTERNAL, f"request refused: {exc}"))
        return True

    # -- the scheduler's side -------------------------------------------------------------
    def hand(self, response: Any) -> None:
        with self.sim.cond:
            self.handed.append(response)
            self.sim.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.sim.cond:
            if self.error is None:
                self.error = error
            self._close()
            self.sim.cond.notify_all()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                with self.sim.model_lock:
                    self.model_stream.close()
            except Exception:  # noqa: S110 -- closing twice, or a stream already gone
                pass

    @property
    def pending(self) -> int:
        if self.closed:
            return 0
        with self.sim.model_lock:
            return int(self.model_stream.pending())

    # -- the watcher's side ---------------------------------------------------------------
    def __iter__(self) -> SimWatchCall:
        return self

    def __next__(self) -> Any:
        park = self.sim.new_park("watch", lambda: bool(self.handed) or self.error is not None
                                 or self.cancelled, store=self.store)
        self.sim.park(park)
        with self.sim.cond:
            if self.handed:
                return self.handed.popleft()
            if self.error is not None:
                raise self.error
        raise SimRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    def cancel(self) -> None:
        with self.sim.cond:
            self.cancelled = True
            self._close()
            self.sim.cond.notify_all()


# -- stores and operations ------------------------------------------------------------------
class SimStore:
    """One simulated store: the EtcdStore, its clock, its transport's state."""

    def __init__(self, sim: Sim, index: int, scope: str, cache_size: int) -> None:
        self.sim = sim
        self.index = index
        self.scope = scope
        self.cache_size = cache_size
        self.clock = SimClock(sim, f"s{index}")
        self.target = f"sim{next(_targets)}:{index}"
        self.call: SimWatchCall | None = None
        self.calls = 0
        self.streams = itertools.count(1)
        self.store: EtcdStore | None = None
        self.torch: Any = None
        #: The watch thread's next unary call is held (Sim.hold_watcher).
        self.hold_watcher = False
        #: The stream whose first creation was delivered, and that creation's revision:
        #: the scheduler's own record of when the store's watch was (re)created, from
        #: which reads must be no older (the store's floor is what a mutant changes).
        self.created_call: SimWatchCall | None = None
        self.created_revision = 0
        #: After :meth:`Sim.rewind`: the newest revision the store knew etcd had
        #: committed then, its count of rewinds found then, and the revision of the first
        #: watch creation delivered to it since (None: none yet). See Sim.could_find.
        self.rewind_known: int | None = None
        self.rewinds_before = 0
        self.rewind_created: int | None = None
        #: The sim's order at the last rewind, and whether an operation invoked after it
        #: got a key-value answer below ``rewind_known`` (each such answer shows it).
        self.rewind_order = 0
        self.rewind_answered_below = False

    @property
    def etcd(self) -> EtcdStore:
        assert self.store is not None
        return self.store

    def __repr__(self) -> str:
        return f"SimStore({self.index}, {self.scope}, cache_size={self.cache_size})"


class Op:
    """A client operation running on a thread of its own."""

    def __init__(self, sim: Sim, store: SimStore, name: str, fn: Callable[[], Any],
                 hold: bool) -> None:
        self.sim = sim
        self.store = store
        self.name = name
        self.fn = fn
        self.hold = hold
        self.done = False
        #: Called on the operation's thread when it returns (records its outcome).
        self.on_done: Callable[[Op], None] | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        #: Header revision of the last unary answer this operation received.
        self.last_revision = 0
        #: Positions in the sim's order of invocations and returns; etcd's revisions then.
        self.invoked = next(sim.order)
        self.inv_rev = int(sim.model.revision)
        self.returned: int | None = None
        self.ret_rev: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"sim-op-{store.index}-{name}-{next(sim.seq)}")

    def _run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # recorded; the rule decides what it means
            self.error = exc
        finally:
            self.returned = next(self.sim.order)
            self.ret_rev = int(self.sim.model.revision)
            if self.on_done is not None:
                self.on_done(self)
            with self.sim.cond:
                self.done = True
                self.sim.cond.notify_all()

    @property
    def park(self) -> _Park | None:
        return self.sim.parks.get(self.thread.name)

    @property
    def held(self) -> bool:
        park = self.park
        return park is not None and park.kind == "held" and not self.done

    @property
    def blocked(self) -> bool:
        return not self.done and not self.held

    def __repr__(self) -> str:
        state = "done" if self.done else ("held" if self.held else "blocked")
        return f"Op({self.name} on s{self.store.index}, {state})"


class Sim:
    """The scheduler: one model, several stores, and every thread parked at its points."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.model_lock = threading.RLock()
        self.cond = threading.Condition()
        self.parks: dict[str, _Park] = {}
        self.seq = itertools.count(1)
        #: One order of every operation's invocation and return (see history.Record).
        self.order = itertools.count(1)
        self.stores: list[SimStore] = []
        self.ops: dict[str, Op] = {}  # thread name -> op
        self.notes: list[str] = []
        self.steps = 0
        self._foreign = {t.ident for t in threading.enumerate()}

    def note(self, text: str) -> None:
        self.notes.append(text)

    # -- parking (called by the managed threads) -------------------------------------------
    def new_park(self, kind: str, ready: Callable[[], bool], **kw: Any) -> _Park:
        return _Park(kind, threading.current_thread().name, next(self.seq), ready, **kw)

    def park(self, park: _Park) -> None:
        started = time.monotonic()
        with self.cond:
            self.parks[park.thread] = park
            self.cond.notify_all()
            try:
                while not park.ready():
                    self.cond.wait(1.0)
                    if time.monotonic() - started > 600:
                        raise HarnessError(f"{park.thread} parked for 10 minutes")
            finally:
                del self.parks[park.thread]
                self.cond.notify_all()

    # -- unary calls -------------------------------------------------------------------------
    def unary(self, store: SimStore, method: str, request: Any) -> Any:
        with self.model_lock:
            response = self.model.call(method, request)  # ModelRpcError propagates
        thread = threading.current_thread()
        op = self.ops.get(thread.name)
        header = getattr(response, "header", None)
        if op is not None and header is not None:
            op.last_revision = int(header.revision)
            if (store.rewind_known is not None and op.invoked > store.rewind_order
                    and method in connection._KEY_VALUE  # noqa: SLF001
                    and op.last_revision < store.rewind_known):
                store.rewind_answered_below = True
        hold = (op is not None and op.hold) or (
            store.hold_watcher and thread.name.startswith("cachedstore-watch-"))
        if hold:
            if op is None:
                store.hold_watcher = False
            park = self.new_park("held", lambda: park.released, store=store,
                                 info={"method": method})
            self.park(park)
            if park.outcome == "fail":
                raise SimRpcError(grpc.StatusCode.UNAVAILABLE,
                                  "connection reset by peer (the answer was lost)")
        return response

    # -- the scheduler -----------------------------------------------------------------------
    def _managed(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t.ident not in self._foreign and t.name.startswith(_MANAGED)]

    def settle(self) -> None:
        """Return once every managed thread is parked and no parked thread may go on;
        releases, one at a time (oldest park first), clock waiters whose event was set."""
        started = time.monotonic()
        with self.cond:
            while True:
                running = [t.name for t in self._managed() if t.name not in self.parks]
                if not running:
                    ready = [p for p in self.parks.values() if p.ready()]
                    if not ready:
                        woken = [p for p in self.parks.values() if p.kind == "clock"
                                 and p.event is not None and p.event.is_set()]
                        if not woken:
                            return
                        min(woken, key=lambda p: p.seq).released = True
                        self.cond.notify_all()
                        started = time.monotonic()
                        continue
                if time.monotonic() - started > SAFETY:
                    raise HarnessError(f"threads did not park within {SAFETY} s: "
                                       f"running {running}\n{self.dump()}")
                self.cond.wait(0.0005)

    def dump(self) -> str:
        frames = sys._current_frames()  # noqa: SLF001
        out = []
        for t in threading.enumerate():
            park = self.parks.get(t.name)
            state = f"parked {park.kind}" if park else "running"
            out.append(f"--- {t.name} ({state})")
            frame = frames.get(t.ident or 0)
            if frame is not None:
                out.append("".join(traceback.format_stack(frame)[-8:]))
        return "\n".join(out)

    def describe(self, op: Op) -> str:
        """An operation, where it is parked, and its thread's stack."""
        park = op.park
        where = "running" if park is None else (
            f"parked {park.kind} (deadline {park.deadline}, now {op.store.clock.now}, "
            f"event set {park.event.is_set() if park.event else None})")
        frame = sys._current_frames().get(op.thread.ident or 0)  # noqa: SLF001
        stack = "".join(traceback.format_stack(frame)[-6:]) if frame else ""
        return f"{op} {where}\n{stack}"

    def advance(self, store: SimStore, seconds: float) -> None:
        """Move ``store``'s time ``seconds`` forward, waking its clock waiters in deadline
        order, one at a time."""
        self.settle()
        clock = store.clock
        target = clock.now + seconds
        for _ in range(10_000):
            with self.cond:
                due = [p for p in self.parks.values() if p.kind == "clock"
                       and p.clock is clock and not p.released and p.deadline is not None
                       and p.deadline <= target]
                if not due:
                    clock.now = target
                    return
                first = min(due, key=lambda p: (p.deadline, p.seq))
                assert first.deadline is not None
                clock.now = max(clock.now, first.deadline)
                first.released = True
                self.cond.notify_all()
            self.settle()
        raise HarnessError(f"advancing {store} by {seconds} s woke 10,000 waiters")

    # -- stores --------------------------------------------------------------------------------
    def add_store(self, scope: str, cache_size: int, *, torch: bool = False,
                  **config: Any) -> SimStore:
        store = SimStore(self, len(self.stores), scope, cache_size)
        connection.STUB_FACTORIES[store.target] = lambda target: _Stubs(store)
        self.stores.append(store)
        cfg = StoreConfig(backoff=Backoff(jitter=0.0))

        def build() -> EtcdStore:
            return EtcdStore(endpoints=[store.target], watch_scope=scope,
                             cache_size=cache_size, metrics=False, clock=store.clock,
                             config=cfg, **config)

        op = self.start(store, "construct", build)
        for _ in range(100):
            if op.done:
                break
            if not self.deliver(store):
                raise HarnessError(f"{store} did not finish construction: {op}\n"
                                   f"{self.dump()}")
        if op.error is not None:
            raise op.error
        etcd: EtcdStore = op.result
        store.store = etcd
        etcd._opener._lock = SimLock(store.clock)  # type: ignore[assignment] # noqa: SLF001
        etcd._aio._executor = _Inline()  # type: ignore[union-attr,assignment] # noqa: SLF001
        if torch:
            from cachedstore.torch import TorchEtcdStore

            store.torch = TorchEtcdStore(store=etcd, timeout=30.0, clock=store.clock)
        return store

    def start(self, store: SimStore, name: str, fn: Callable[[], Any],
              hold: bool = False, on_done: Callable[[Op], None] | None = None) -> Op:
        """Run ``fn`` on a new client thread until it returns or parks."""
        op = Op(self, store, name, fn, hold)
        op.on_done = on_done
        self.ops[op.thread.name] = op
        op.thread.start()
        self.settle()
        if op.done:
            op.thread.join()
            del self.ops[op.thread.name]
        return op

    def start_async(self, store: SimStore, name: str, coro: Callable[[], Any],
                    hold: bool = False, on_done: Callable[[Op], None] | None = None) -> Op:
        """Run the coroutine ``coro()`` with ``asyncio.run`` on a client thread."""
        return self.start(store, name, lambda: asyncio.run(coro()), hold, on_done)

    def release(self, op: Op, outcome: str = "ok") -> None:
        """Let a held operation's answer reach it (``"fail"``: lost, a transport error)."""
        with self.cond:
            park = op.park
            if park is None or park.kind != "held":
                raise HarnessError(f"{op} is not held")
            park.outcome = outcome
            park.released = True
            self.cond.notify_all()
        self.settle()
        self.finish(op)

    def release_watcher(self, store: SimStore, outcome: str = "ok") -> bool:
        with self.cond:
            parks = [p for p in self.parks.values() if p.kind == "held" and p.store is store
                     and p.thread.startswith("cachedstore-watch-")]
            if not parks:
                return False
            parks[0].outcome = outcome
            parks[0].released = True
            self.cond.notify_all()
        self.settle()
        return True

    def finish(self, op: Op) -> None:
        if op.done and op.thread.name in self.ops:
            op.thread.join()
            del self.ops[op.thread.name]

    def held_ops(self) -> list[Op]:
        return [op for op in self.ops.values() if op.held]

    def blocked_ops(self) -> list[Op]:
        return [op for op in self.ops.values() if op.blocked]

    # -- the watch --------------------------------------------------------------------------------
    def pending(self, store: SimStore) -> int:
        call = store.call
        return 0 if call is None else call.pending

    def deliver(self, store: SimStore, max_revisions: int | None = None) -> bool:
        """Hand ``store``'s watch its next response (at most ``max_revisions`` revisions of
        events); False if none is pending."""
        self.settle()
        call = store.call
        if call is None or call.closed or call.error is not None:
            return False
        with self.model_lock:
            response = call.model_stream.take(max_revisions)
        if response is None:
            return False
        if response.created and not response.canceled and store.created_call is not call:
            store.created_call = call
            store.created_revision = int(response.header.revision)
            if store.rewind_known is not None and store.rewind_created is None:
                store.rewind_created = store.created_revision
        call.hand(response)
        self.settle()
        return True

    def break_stream(self, store: SimStore) -> bool:
        """Reset ``store``'s watch stream (what it had not delivered is lost)."""
        self.settle()
        call = store.call
        if call is None or call.closed:
            return False
        call.fail(SimRpcError(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer"))
        self.settle()
        return True

    def rewind(self, revision: int) -> None:
        """etcd restored from a backup at ``revision`` without ``--bump-revision``
        (:meth:`EtcdModel.rewind`). A restore restarts etcd: first every store's watch
        stream breaks and every watch thread sees it (held ones are let go: etcd is down
        for longer than a thread is descheduled), then etcd comes back at ``revision``.
        Answers the scheduler holds stay held: released later, they are answers of the
        history that was lost, arriving late."""
        for store in self.stores:
            self.break_stream(store)
            while self.release_watcher(store):
                pass
            store.hold_watcher = False
        self.settle()
        for store in self.stores:
            cache = store.etcd._cache  # noqa: SLF001
            store.rewind_known = cache._known  # noqa: SLF001
            store.rewinds_before = cache.rewinds
            store.rewind_created = None
            store.rewind_answered_below = False
        rewound_at = next(self.order)
        for store in self.stores:
            store.rewind_order = rewound_at
        with self.model_lock:
            self.model.rewind(revision)
        for store in self.stores:  # a stream made meanwhile ends with the restart too
            self.break_stream(store)

    def could_find(self, store: SimStore) -> bool:
        """Whether ``store`` could have found, by revisions alone, that etcd's history
        went back (rule 10 of cache.py; guarantees.md 16): it did, or its watch was
        created again while etcd's new history was still below the newest revision the
        store knew of, or an operation begun after the rewind got a key-value answer
        below it (every such answer is checked). Once etcd's new history has passed that
        before the store hears from it, nothing in etcd's answers tells it (not
        promised)."""
        if store.rewind_known is None:
            return True
        if store.etcd._cache.rewinds > store.rewinds_before:  # noqa: SLF001
            return True
        if store.rewind_answered_below:
            return True
        return store.rewind_created is not None and store.rewind_created < store.rewind_known

    def hold_watcher(self, store: SimStore) -> None:
        store.hold_watcher = True

    def watch_state(self, store: SimStore) -> str:
        """"up" (created, caught up), "replaying", "down"."""
        etcd = store.etcd
        floor = etcd._cache.floor  # noqa: SLF001
        if floor == NOT_SERVING or etcd._watcher is None or not etcd._watcher.up:  # noqa: SLF001
            return "down"
        return "up" if floor == 0 else "replaying"

    def quiesce(self, max_rounds: int = 200) -> None:
        """Deliver everything, release every held call, reconnect every stream, until every
        store's watch is up, caught up, and has nothing pending."""
        for _ in range(max_rounds):
            progressed = False
            for op in self.held_ops():
                self.release(op)
                progressed = True
            for store in self.stores:
                while self.release_watcher(store):
                    progressed = True
                store.hold_watcher = False
                while self.deliver(store):
                    progressed = True
            if progressed:
                continue
            lagging = [s for s in self.stores if self.watch_state(s) != "up"
                       or self.pending(s)]
            if not lagging:
                return
            for store in lagging:  # back-off, a stall verdict, a quiet scope's refresh
                self.advance(store, 2.5)
        raise HarnessError(f"no quiescence after {max_rounds} rounds: "
                           f"{[(s, self.watch_state(s)) for s in self.stores]}")

    def bound(self, store: SimStore, canonical: str) -> int:
        """The revision a read of ``canonical`` begun now must be no older than: the
        applied revision of the scope covering it, and the revision at which the
        scheduler delivered the creation of the store's current stream (after a
        reconnect, nothing older than that is served while the replay runs); etcd's
        current revision while the store knows its stream is down, or before the
        scheduler delivered the current stream's creation (or no open scope covers the
        name): the read then goes to etcd. The creation is taken from what the scheduler
        did, not from the store's own floor, so that a store serving too early is caught."""
        cache = store.etcd._cache  # noqa: SLF001
        scope = cache.scope_of(canonical)
        # A stream the scheduler broke while the watch thread was held (a resync read) is
        # still the store's until the thread sees the break: like a partition not yet
        # detected, the store serves what its watch applied (its promises hold for that).
        call = store.call
        up = call is not None and store.created_call is call and cache.floor != NOT_SERVING
        if not up or scope is None or scope.opening:
            return int(self.model.revision)
        return max(scope.applied, store.created_revision)

    def _held(self, store: SimStore) -> list[Op]:
        return [o for o in self.ops.values() if o.store is store and o.held]

    def _release_held(self, store: SimStore) -> None:
        for op in self._held(store):
            self.release(op)

    def close(self) -> None:
        """Close every store (through the scheduler), then forget the transport."""
        for store in self.stores:
            if store.store is None:
                continue
            self._release_held(store)
            self.release_watcher(store)
            etcd, torch = store.store, store.torch

            op = self.start(store, "close", functools.partial(_close, etcd, torch))
            for _ in range(100):
                # An operation a failed step left held asks again (each of its round trips
                # is held) and may hold a lock close needs: let it run to its end.
                self._release_held(store)
                if op.done and not self._held(store):
                    break
                self.advance(store, 10.0)
            if not op.done or self._held(store):
                raise HarnessError(f"{store} did not close: {self.dump()}")
        for _ in range(10):
            # An operation a failed step left in a retry's back-off (on its store's clock)
            # ends once that clock moves: the store is closed, so it raises.
            if not [t for t in self._managed() if t.name.startswith("sim-op-")]:
                break
            for store in self.stores:
                self._release_held(store)
                self.advance(store, 10.0)
        for store in self.stores:
            connection.STUB_FACTORIES.pop(store.target, None)
        self.settle()
        leftover = [t.name for t in self._managed()]
        if leftover:
            raise HarnessError(f"threads left after close: {leftover}\n{self.dump()}")


def _close(etcd: EtcdStore, torch: Any) -> None:
    if torch is not None:
        torch.close()  # not its EtcdStore's owner: forgets itself only
    etcd.close()


class _Inline:
    """The aio front's executor, run inline on the calling (event loop's) thread: an etcd
    round trip of ``aget`` then parks on the client thread like any other. The function
    runs when the loop first waits for its future (``asyncio.wrap_future``), not in
    ``submit``, which the front calls under its own lock."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        return _Lazy(fn, args)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class _Lazy(concurrent.futures.Future):  # type: ignore[type-arg]
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (fn, args)

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        call, self._call = self._call, None
        if call is not None:
            try:
                self.set_result(call[0](*call[1]))
            except BaseException as exc:
                self.set_exception(exc)
        super().add_done_callback(fn)
