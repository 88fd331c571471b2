"""The whole store, simulated: several real ``EtcdStore``s on one in-process etcd.

A hypothesis ``RuleBasedStateMachine`` drives 3 unchanged stores (``watch_scope``
``"prefix"`` and ``"touched"``, caches of 2 to 4 entries, a ``TorchEtcdStore`` on each)
through the scheduler of ``harness.py``: it decides when each watch delivers (one revision,
a batch, late), when a stream breaks or is compacted away, when a request's answer comes
back after etcd applied it (or is lost), when time moves (stall watchdog, back-off, quiet
scope refreshes), when another client writes, and when etcd's history goes back (a
restore without ``--bump-revision``: ``EtcdModel.rewind``). Every operation is recorded; the
history is checked (``history.py``) after every step and, after quiescence, for
convergence, counters, queues and blocked reads.

Run by hand for longer: ``SIM_EXAMPLES=2000 python -m pytest tests/sim/test_store_sim.py``;
``cd tests && python -m sim.test_store_sim`` prints, per mutant, the number of machines
until one failed. Runs are exact replays, in one process and across processes (the store
orders what it iterates by insertion, never by str hashes: the same steps give the same
history whatever ``PYTHONHASHSEED`` is; ``test_same_steps_same_history``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
from typing import Any, ClassVar

import pytest
from etcd3 import etcdrpc
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cachedstore.queues import item_prefix

from .etcd_model import EtcdModel
from .harness import HarnessError, Op, Sim, SimStore
from .history import BLOCKING, UNKNOWN, Record, check_history
from .mutants import MUTANTS

EXAMPLES = int(os.environ.get("SIM_EXAMPLES", "150"))
STEPS = int(os.environ.get("SIM_STEPS", "40"))
#: Machines each mutant gets to fail one (hypothesis draws its machines differently for
#: each budget: at 150, the machines after the rewind rules came met
#: ``absent_after_snapshot`` in none; at 200, by the 46th; at 300, by the 79th). Since
#: the rule ``rewind_found_by_a_count``, the last one found at 200 is
#: ``directory_snapshot``, by the 153rd (derandomized: the same every run).
MUTANT_BUDGET = 200
#: The model's and the stores' max_txn_ops: below what a counter's fold of 64 deltas takes.
MAX_TXN_OPS = 64

LONG = "L" * 201
#: A name that spells LONG's counter parts' digest (counters.Parts): "~" + blake2b.
SHORT = "~" + hashlib.blake2b(LONG.encode(), digest_size=20).hexdigest()
SWEEP = [f"d/k{i}" for i in range(8)]
KEYS = ["a", "b", *SWEEP, "d/z"]
COUNTERS = ["c", LONG, SHORT]
#: Counters another client deletes (the blocking read of a deleted counter).
DELETED = ["gone", "gone/" + "G" * 201]
QUEUES = ["q", "r"]
#: (watch_scope, cache_size) of the three stores.
CONFIGS = [
    (("prefix", 2), ("touched", 3), ("touched", 2)),
    (("touched", 2), ("prefix", 3), ("touched", 4)),
    (("prefix", 4), ("touched", 2), ("prefix", 2)),
]

#: Operations whose effect on etcd survives a rewind if etcd applied them at a revision
#: it kept (``StoreMachine.judged``).
SURVIVING_WRITES = frozenset({"set", "delete", "compare_set", "add", "queue_push",
                              "queue_pop"})

#: Operations that may answer from a store's cache (or from what it derives from it).
CACHE_READS = frozenset({"get", "aget", "blocking_get", "mget", "wait", "check",
                         "torch_check"})

stores = st.integers(0, 2)
#: Half the time one of two hot names, so that hazards of one key meet within a machine.
keys = st.one_of(st.sampled_from(["a", "b"]), st.sampled_from(KEYS))
#: Names nobody writes: reading them evicts what a cache of 2 to 4 entries held.
COLD = ["x0", "x1", "x2", "x3"]
holds = st.sampled_from([False, False, True])
key_sets = st.one_of(st.lists(keys, min_size=1, max_size=3, unique=True),
                     st.just(SWEEP), st.just([*SWEEP, "d/z"]))


class StoreMachine(RuleBasedStateMachine):
    #: Machines started so far (examples to the first failure, for mutant checks).
    started: ClassVar[int] = 0
    #: A digest of each finished machine's history (the determinism test).
    digests: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.sim: Sim | None = None
        self.records: list[Record] = []
        self.values = itertools.count(1)
        self.inflight: list[Op] = []
        self.seen: dict[str, bytes] = {}
        self.ok = True
        #: After :meth:`rewind`: the revision etcd's history went back to, and the
        #: operations recorded before it (judged against the history that was lost).
        self.rewound_to: int | None = None
        self.before_rewind: list[Record] = []
        self.returned_before: set[int] = set()

    # -- plumbing ---------------------------------------------------------------------
    @property
    def s(self) -> Sim:
        assert self.sim is not None
        return self.sim

    def value(self, store: int) -> bytes:
        return f"s{store}v{next(self.values)}".encode()

    def busy(self, store: int) -> int:
        return sum(1 for op in self.inflight if op.store.index == store and not op.done)

    def run(self, store: int, op: str, names: list[str], fn: Any, *, hold: bool = False,
            args: dict[str, Any] | None = None, extra: dict[str, str] | None = None,
            is_async: bool = False) -> Op:
        """Start one recorded operation on ``store``'s client thread."""
        sim = self.s
        target = sim.stores[store]
        bounds = {n: sim.bound(target, n) for n in names}
        for label, name in (extra or {}).items():
            bounds[label] = sim.bound(target, name)
        record = Record(store=store, op=op, names=list(names), args=dict(args or {}),
                        bounds=bounds)
        self.records.append(record)

        def done(o: Op) -> None:
            record.returned, record.ret_rev = o.returned, o.ret_rev
            record.revision = o.last_revision or None
            if o.error is not None:
                record.error = type(o.error).__name__
            else:
                record.result = o.result
                if op in ("get", "aget", "blocking_get", "compare_set") \
                        and isinstance(o.result, bytes):
                    self.seen[names[0]] = o.result

        start = sim.start_async if is_async else sim.start
        started = start(target, op, fn, hold, done)
        record.invoked, record.inv_rev = started.invoked, started.inv_rev
        if not started.done:
            self.inflight.append(started)
        return started

    def collect(self) -> None:
        self.inflight = [op for op in self.inflight if not op.done]
        for op in self.inflight:
            self.s.finish(op)

    def free(self, store: int) -> bool:
        return self.busy(store) == 0

    # -- setup --------------------------------------------------------------------------
    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config: tuple[tuple[str, int], ...]) -> None:
        type(self).started += 1
        self.sim = Sim(EtcdModel(max_txn_ops=MAX_TXN_OPS))
        for scope, size in config:
            self.sim.add_store(scope, size, torch=True, max_txn_ops=MAX_TXN_OPS)

    # -- reads ---------------------------------------------------------------------------
    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys, hold=holds)
    def get(self, store: int, name: str, hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "get", [name], lambda: etcd.get(name, None), hold=hold)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys, hold=holds)
    def get_bytes_name(self, store: int, name: str, hold: bool) -> None:
        """The same key spelled as bytes (one name, one key)."""
        etcd = self.s.stores[store].etcd
        self.run(store, "get", [name], lambda: etcd.get(name.encode(), None), hold=hold)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, names=key_sets, hold=holds)
    def mget(self, store: int, names: list[str], hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "mget", names, lambda: etcd.mget(names, None), hold=hold)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys, hold=holds)
    def aget(self, store: int, name: str, hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "aget", [name], lambda: etcd.aget(name, None), hold=hold,
                 is_async=True)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys)
    def blocking_get(self, store: int, name: str) -> None:
        if not self.free(store):
            return
        etcd = self.s.stores[store].etcd
        self.run(store, "blocking_get", [name], lambda: etcd.get(name, timeout=1000))

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, names=key_sets)
    def wait(self, store: int, names: list[str]) -> None:
        if not self.free(store):
            return
        etcd = self.s.stores[store].etcd
        self.run(store, "wait", names, lambda: etcd.wait(names, timeout=1000))

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, names=key_sets, hold=holds)
    def check(self, store: int, names: list[str], hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "check", names, lambda: etcd.check(names), hold=hold)

    # -- writes ----------------------------------------------------------------------------
    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys, hold=holds)
    def set(self, store: int, name: str, hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        value = self.value(store)
        self.seen[name] = value
        self.run(store, "set", [name], lambda: etcd.set(name, value), hold=hold,
                 args={"value": value})

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys, hold=holds)
    def delete(self, store: int, name: str, hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "delete", [name], lambda: etcd.delete(name), hold=hold)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=keys, hold=holds, guess=st.booleans())
    def compare_set(self, store: int, name: str, hold: bool, guess: bool) -> None:
        etcd = self.s.stores[store].etcd
        expected = self.seen.get(name, b"") if guess else b""
        desired = self.value(store)
        self.run(store, "compare_set", [name],
                 lambda: etcd.compare_set(name, expected, desired), hold=hold,
                 args={"expected": expected, "desired": desired})

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(COUNTERS), amount=st.sampled_from([1, 1, 2, 5]),
          hold=holds)
    def add(self, store: int, name: str, amount: int, hold: bool) -> None:
        self._add(store, name, amount, hold)

    def _add(self, store: int, name: str, amount: int, hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "add", [name], lambda: etcd.add(name, amount), hold=hold,
                 args={"amount": amount})

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(COUNTERS))
    def add_burst(self, store: int, name: str) -> None:
        """65 add(name, 2)s: the 64th reads 64 deltas and folds them (counters.py)."""
        if not self.free(store):
            return
        for _ in range(65):
            self._add(store, name, 2, False)
            if self.busy(store):
                break

    # -- queues ----------------------------------------------------------------------------
    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, queue=st.sampled_from(QUEUES), hold=holds)
    def queue_push(self, store: int, queue: str, hold: bool) -> None:
        etcd = self.s.stores[store].etcd
        value = self.value(store)
        self.run(store, "queue_push", [queue], lambda: etcd.queues.push(queue, value),
                 hold=hold, args={"value": value})

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, queue=st.sampled_from(QUEUES), block=st.booleans())
    def queue_pop(self, store: int, queue: str, block: bool) -> None:
        if not self.free(store):
            return
        etcd = self.s.stores[store].etcd
        self.run(store, "queue_pop", [queue],
                 lambda: etcd.queues.pop(queue, block=block, timeout=1000))

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, queue=st.sampled_from(QUEUES))
    def queue_len(self, store: int, queue: str) -> None:
        etcd = self.s.stores[store].etcd
        self.run(store, "queue_len", [queue], lambda: etcd.queues.length(queue))

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, names=st.lists(st.sampled_from([*QUEUES, "a"]), min_size=1,
                                       max_size=2, unique=True), hold=holds)
    def torch_check(self, store: int, names: list[str], hold: bool) -> None:
        torch = self.s.stores[store].torch
        extra = {"queue:" + n: item_prefix(n) + "0" for n in names}
        self.run(store, "torch_check", names, lambda: torch.check(names), hold=hold,
                 extra=extra)

    # -- other clients ---------------------------------------------------------------------
    def _raw(self, method: str, request: Any) -> None:
        with self.s.model_lock:
            self.s.model.call(method, request)

    @precondition(lambda self: self.sim is not None)
    @rule(name=keys)
    def raw_put(self, name: str) -> None:
        self._raw("put", etcdrpc.PutRequest(key=name.encode(), value=self.value(9)))

    @precondition(lambda self: self.sim is not None)
    @rule(name=keys)
    def raw_delete(self, name: str) -> None:
        self._raw("delete_range", etcdrpc.DeleteRangeRequest(key=name.encode()))

    @precondition(lambda self: self.sim is not None)
    @rule(names=st.lists(keys, min_size=2, max_size=3, unique=True))
    def raw_txn(self, names: list[str]) -> None:
        ops = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=n.encode(),
                                                                 value=self.value(9)))
               for n in names]
        self._raw("txn", etcdrpc.TxnRequest(success=ops))

    @precondition(lambda self: self.sim is not None)
    @rule(queue=st.sampled_from(QUEUES))
    def raw_push(self, queue: str) -> None:
        n = next(self.values)
        key = (item_prefix(queue) + f"{n:016x}").encode("utf-8", "surrogateescape")
        self._raw("put", etcdrpc.PutRequest(key=key, value=b"raw%d" % n))

    # -- hazards: the shapes of interleaving the coherence rules exist for --------------------
    # Each is a short sequence of the steps above with its store, names and timing drawn;
    # a rule of the store that is missing lets a read of this machine return what etcd no
    # longer held (the history check, after every step, says which).
    @precondition(lambda self: self.sim is not None)
    @rule(store=stores)
    def evict(self, store: int) -> None:
        """Read 4 names nobody writes: a cache of 2 to 4 entries evicts all it held."""
        etcd = self.s.stores[store].etcd
        for name in COLD:
            self.run(store, "get", [name], lambda n=name: etcd.get(n, None))

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(["a", "b"]),
          write=st.sampled_from(["set", "compare_set", "fill"]),
          batch=st.sampled_from([1, None]))
    def own_write_then_older_event(self, store: int, name: str, write: str,
                                   batch: int | None) -> None:
        """Another client's put is on its way in this store's watch when the store writes
        (or reads through) the same key; the entry, ahead of the watch, is evicted; then
        the older event arrives (rule 2: eviction keeps a mark)."""
        self.deliver_all(store)
        self.get(store, name, False)  # watched from now on (a store of touched scopes)
        self.raw_put(name)
        if write == "fill":
            self.evict(store)
            self.get(store, name, False)
        elif write == "set":
            self.set(store, name, False)
        else:
            self.compare_set(store, name, False, True)
        self.evict(store)
        self.deliver(store, batch)
        self.get(store, name, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(["a", "b"]),
          write=st.sampled_from(["set", "fill"]), outcome=st.sampled_from(["ok", "fail"]))
    def late_answer(self, store: int, name: str, write: str, outcome: str) -> None:
        """A write's (or a read-through's) answer is held after etcd applied it, while
        another client's newer put is applied by this store's watch and the key evicted;
        then the late answer reaches the cache (rule 3: a result older than what was
        applied meanwhile is refused)."""
        if write == "fill":
            self.evict(store)
            op = self.run(store, "get", [name],
                          lambda: self.s.stores[store].etcd.get(name, None), hold=True)
        else:
            value = self.value(store)
            etcd = self.s.stores[store].etcd
            op = self.run(store, "set", [name], lambda: etcd.set(name, value), hold=True,
                          args={"value": value})
        self.raw_put(name)
        self.deliver_all(store)
        self.evict(store)
        while op.held:
            self.s.release(op, outcome)
        self.collect()
        self.get(store, name, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(["a", "b"]))
    def answer_across_a_resync(self, store: int, name: str) -> None:
        """A read-through's answer is held while etcd compacts past the store's watch,
        another client writes, and the store resyncs (rule 4: a result from before a reset
        older than its snapshot is refused)."""
        self.get(store, name, False)  # watched from now on (a store of touched scopes)
        self.evict(store)
        etcd = self.s.stores[store].etcd
        op = self.run(store, "get", [name], lambda: etcd.get(name, None), hold=True)
        self.raw_put(name)
        self.compact()
        self.break_stream(store)
        for _ in range(3):  # back-off, the compacted create, the resync, the new stream
            self.advance(store, 2.5)
            self.deliver_all(store)
        self.evict(store)
        while op.held:
            self.s.release(op)
        self.collect()
        self.get(store, name, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(["a", "b"]), bytes_first=st.booleans())
    def two_spellings(self, store: int, name: str, bytes_first: bool) -> None:
        """The same key read as str and as bytes around another client's put (one name,
        one key: both spellings share the entry the watch updates)."""
        first = self.get_bytes_name if bytes_first else self.get
        first(store, name, False)
        self.raw_put(name)
        self.deliver_all(store)
        self.get_bytes_name(store, name, False)
        self.get(store, name, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(["a", "b"]))
    def read_during_replay(self, store: int, name: str) -> None:
        """The stream breaks; another client writes; the stream is created again and the
        store reads before the replay of what it missed is applied (rule 6: nothing older
        than the creation revision is served)."""
        self.deliver_all(store)
        self.get(store, name, False)
        self.break_stream(store)
        self.raw_put(name)
        self.advance(store, 2.5)
        self.deliver(store, 1)  # the creation, not yet the replay
        self.get(store, name, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, hold_snapshot=st.booleans())
    def directory_over_a_key_scope(self, store: int, hold_snapshot: bool) -> None:
        """``d/z`` and 6 more names of ``d/`` are read one by one (key scopes, in a store
        watching what it touched); the 8th name read opens the directory scope, its
        snapshot read held; another client puts ``d/z``, its key scope applies it, and
        other events evict it; then the snapshot is installed (issue 24, 1: it must not
        replace what the key scope applied)."""
        etcd = self.s.stores[store].etcd
        self.raw_put("d/z")  # the state the snapshot will hold
        for name in ["d/z", *SWEEP[:6]]:
            self.get(store, name, False)
        self.evict(store)  # the cold names are watched too from now on
        op = self.run(store, "get", [SWEEP[6]], lambda: etcd.get(SWEEP[6], None),
                      hold=hold_snapshot)
        self.raw_put("d/z")
        for name in COLD:  # their events fill the cache: d/z is evicted
            self.raw_put(name)
        self.deliver_all(store)
        while op.held:
            self.s.release(op)
        self.collect()
        self.get(store, "d/z", False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, present=st.lists(st.sampled_from(SWEEP), min_size=1, max_size=3,
                                         unique=True))
    def directory_opened_by_a_read_of_all(self, store: int, present: list[str]) -> None:
        """Some names of ``d/`` exist; the store reads all 8 at once (the directory scope
        opens with one snapshot; the names it lacks are cached as absent), then reads each
        (a name the snapshot held must never be cached as absent: the finding of this
        simulation, whose order of installs follows the set of names asked)."""
        for name in present:
            self.raw_put(name)
        self.mget(store, SWEEP, False)
        for name in present:
            self.get(store, name, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, queue=st.sampled_from(QUEUES))
    def queue_pushed_during_an_outage(self, store: int, queue: str) -> None:
        """The store remembers a queue empty; its stream breaks; another client pushes an
        item and then writes ``a``; the stream is created again and, before the replay
        is applied, the store reads ``a`` (from etcd) and checks the queue (issue 24, 4:
        the memory is not trusted until the replay caught up)."""
        self.torch_check(store, [queue], False)
        self.break_stream(store)
        self.raw_push(queue)
        self.raw_put("a")
        self.advance(store, 2.5)
        self.deliver(store, 1)
        self.get(store, "a", False)
        self.torch_check(store, [queue], False)

    @precondition(lambda self: self.sim is not None)
    @rule(stores=st.tuples(stores, stores), long_first=st.booleans())
    def counters_side_by_side(self, stores: tuple[int, int], long_first: bool) -> None:
        """Two counters whose names are built to collide in their parts' keys (a long
        name's digest, and a short name that spells it) are added to in turn, from two
        stores (issue 24, 2: their parts never coincide)."""
        first, second = (LONG, SHORT) if long_first else (SHORT, LONG)
        self._add(stores[0], first, 1, False)
        self._add(stores[0], first, 2, False)
        self._add(stores[1], second, 1, False)
        self._add(stores[1], second, 2, False)
        self._add(stores[0], first, 1, False)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, name=st.sampled_from(DELETED), front=st.sampled_from(
        ["get", "aget"]))
    def counter_deleted_under_a_blocking_read(self, store: int, name: str,
                                              front: str) -> None:
        """A blocking read finds a counter's marker; its read of the counter's value is
        held while another client deletes the counter (issue 24, 5: the read waits for
        the key again, whatever the front)."""
        self._add(store, name, 1, False)
        etcd = self.s.stores[store].etcd
        if front == "get":
            op = self.run(store, "blocking_get", [name],
                          lambda: etcd.get(name, timeout=1000), hold=True)
        else:  # timeout 0: asyncio's own waits run on real time, which the sim cannot move
            op = self.run(store, "blocking_get", [name],
                          lambda: etcd.aget(name, timeout=0), hold=True, is_async=True)
        self._raw("delete_range", etcdrpc.DeleteRangeRequest(key=name.encode()))
        while op.held:
            self.s.release(op)
        self.collect()

    # -- the scheduler -------------------------------------------------------------------------
    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, batch=st.sampled_from([1, 1, 2, None]))
    def deliver(self, store: int, batch: int | None) -> None:
        self.s.deliver(self.s.stores[store], batch)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores)
    def deliver_all(self, store: int) -> None:
        target = self.s.stores[store]
        for _ in range(50):
            if not self.s.deliver(target):
                break

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores)
    def break_stream(self, store: int) -> None:
        self.s.break_stream(self.s.stores[store])

    @precondition(lambda self: self.sim is not None)
    @rule()
    def compact(self) -> None:
        model = self.s.model
        if model.revision > max(1, model.compact_revision):
            with self.s.model_lock:
                model.compact(etcdrpc.CompactionRequest(revision=model.revision))

    @precondition(lambda self: self.sim is not None and self.rewound_to is None
                  and self.s.model.revision > max(1, self.s.model.compact_revision))
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        """etcd's history goes back: restored from a backup without ``--bump-revision``
        (rule 10 of cache.py). What was written after the backup is gone and its revisions
        are handed out again. From now on the operations are judged against the new
        history, with the writes of before that survived it (:meth:`judged`)."""
        model = self.s.model
        to = data.draw(st.integers(max(1, model.compact_revision), model.revision - 1),
                       label="rewind to")
        self._rewind(to)

    def _rewind(self, to: int) -> None:
        self.collect()
        self.before_rewind, self.records = self.records, []
        self.returned_before = {id(r) for r in self.before_rewind if r.returned is not None}
        self.rewound_to = to
        self.s.rewind(to)

    @precondition(lambda self: self.sim is not None and self.rewound_to is None)
    @rule(store=stores, reader=stores, name=st.sampled_from(["a", "b"]),
          own=st.booleans(), late=st.booleans())
    def rewind_under_a_cached_key(self, store: int, reader: int, name: str, own: bool,
                                  late: bool) -> None:
        """etcd's history goes back under a key that stores hold (rule 10 of cache.py):
        ``name`` is read, then written (by ``store``, or by another client), every watch
        delivers it, ``reader`` reads it, and etcd goes back to before the write. With
        ``late``, ``store``'s read-through of it is answered before the rewind and handed
        over after it (its revision is a number of the lost history). Then both stores
        read it again."""
        self.get(store, name, False)
        self.get(reader, name, False)  # both cache it (touched scopes: both watch it)
        backup = self.s.model.revision
        if own:
            self.set(store, name, False)
        else:
            self.raw_put(name)
        for index in range(len(self.s.stores)):
            self.deliver_all(index)
        self.get(reader, name, False)
        op = None
        if late:
            self.evict(store)
            etcd = self.s.stores[store].etcd
            op = self.run(store, "get", [name], lambda: etcd.get(name, None), hold=True)
        to = max(backup, 1, self.s.model.compact_revision)
        if self.s.model.revision <= to:  # the write failed: nothing to lose
            while op is not None and op.held:
                self.s.release(op)
            self.collect()
            return
        self._rewind(to)
        for index in range(len(self.s.stores)):  # back-off, the create, the resync...
            for _ in range(3):
                self.advance(index, 2.5)
                self.deliver_all(index)
        while op is not None and op.held:
            self.s.release(op)
        self.collect()
        self.get(reader, name, False)
        self.get(store, name, False)

    @precondition(lambda self: self.sim is not None and self.rewound_to is None)
    @rule(store=stores, name=st.sampled_from(["a", "b"]), queue=st.sampled_from(QUEUES))
    def rewind_found_by_a_count(self, store: int, name: str, queue: str) -> None:
        """etcd's history goes back under a key ``store`` holds, and the store's only
        request before its watch is back is a queue's count: no ticket of the cache's
        ends with it, so only the connection's check of every answer finds the rewind
        (rule 10 of cache.py). Meanwhile another client takes etcd's new history past
        what the store knew: the watch's creation no longer shows it. Then the store
        reads the key again."""
        self.get(store, name, False)
        backup = self.s.model.revision
        self.raw_put(name)
        self.deliver_all(store)
        self.get(store, name, False)  # cached: the value etcd is about to lose
        self.collect()
        to = max(backup, 1, self.s.model.compact_revision)
        if self.s.model.revision <= to:
            return
        known = self.s.stores[store].etcd._cache._known  # noqa: SLF001
        self._rewind(to)
        self.queue_len(store, queue)
        self.collect()
        other = "b" if name == "a" else "a"
        while self.s.model.revision <= known:
            self.raw_put(other)
        for _ in range(3):  # back-off, the create, the resync...
            self.advance(store, 2.5)
            self.deliver_all(store)
        self.collect()
        self.get(store, name, False)

    def judged(self) -> list[Record]:
        """The operations the history checker judges against etcd's history as it is:
        all of them; after a rewind, those invoked since, and the writes of before it.
        A write of before survived if it returned before the rewind, when etcd's revision
        was one the rewind kept; one that may have been applied later (it returned after
        a newer revision, or after the rewind, or not yet; an unknown outcome) is judged
        as of unknown outcome: it may or may not be in etcd's history. Reads of before are
        not judged again (they were judged against the history they read, which etcd
        lost), but a blocking one still waiting must be woken. A store that could not find
        the rewind (``Sim.could_find``) is not judged on what its cache answers."""
        to = self.rewound_to
        if to is None:
            return self.records
        # What the cache of a store that could not find the rewind serves is not promised:
        # its reads (and what it derives from its cache) are left out; its writes, and the
        # reads that go to etcd, stay.
        blind = {store.index for store in self.s.stores if not self.s.could_find(store)}
        kept = []
        for r in self.before_rewind:
            if r.op not in SURVIVING_WRITES or (r.error is not None
                                                and r.error not in UNKNOWN):
                continue  # not a write, or one etcd refused
            if r.error is None and id(r) in self.returned_before \
                    and r.ret_rev is not None and r.ret_rev <= to:
                kept.append(r)
            else:
                kept.append(dataclasses.replace(r, error="EtcdConnectionError",
                                                result=None))
        # A blocking read begun before the rewind and still waiting must still be woken
        # (the convergence check's "waiting only for a name etcd does not hold").
        waiting = [r for r in self.before_rewind if r.op in BLOCKING and r.returned is None
                   and r.store not in blind]
        return kept + waiting + [r for r in self.records
                                 if r.store not in blind or r.op not in CACHE_READS]

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, seconds=st.sampled_from([0.3, 2.5, 2.5, 9.0]))
    def advance(self, store: int, seconds: float) -> None:
        self.s.advance(self.s.stores[store], seconds)

    @precondition(lambda self: self.sim is not None and bool(self.s.held_ops()))
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "ok", "ok", "fail"]))
    def release(self, data: st.DataObject, outcome: str) -> None:
        held = self.s.held_ops()
        op = held[data.draw(st.integers(0, len(held) - 1), label="op")]
        self.s.release(op, outcome)

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores)
    def hold_watcher(self, store: int) -> None:
        self.s.hold_watcher(self.s.stores[store])

    @precondition(lambda self: self.sim is not None)
    @rule(store=stores, outcome=st.sampled_from(["ok", "ok", "fail"]))
    def release_watcher(self, store: int, outcome: str) -> None:
        self.s.release_watcher(self.s.stores[store], outcome)

    # -- checks -------------------------------------------------------------------------------
    @invariant()
    def history_holds(self) -> None:
        if self.sim is None:
            return
        self.collect()
        self.ok = False
        violations = check_history(self.judged(), self.s.model.history(),
                                   counters=COUNTERS, deleted_counters=DELETED)
        assert not violations, "\n".join(violations)
        self.ok = True

    def teardown(self) -> None:
        sim = self.sim
        if sim is None:
            return
        text = repr([(r.store, r.op, r.names, r.result, r.error, r.invoked, r.returned,
                      r.bounds, r.ret_rev) for r in [*self.before_rewind, *self.records]])
        type(self).digests.append(hashlib.sha1(text.encode()).hexdigest())
        try:
            if self.ok:
                self.finale(sim)
        finally:
            sim.close()

    def finale(self, sim: Sim) -> None:
        """Quiescence, then convergence and the checks that need the end state."""
        sim.quiesce()
        for store in sim.stores:
            sim.advance(store, 0.3)
        sim.quiesce()
        self.collect()
        for store in sim.stores:
            for name in KEYS:
                record = self.final_read(store, name)
                record.quiescent = True
        etcd = sim.stores[0].etcd
        for queue in QUEUES:
            self.run(0, "queue_len", [queue], lambda q=queue: etcd.queues.length(q))
        final = {}
        for name in COUNTERS:
            op = sim.start(sim.stores[0], "final-add", lambda n=name: etcd.add(n, 0))
            assert op.done and op.error is None, op.error
            final[name] = op.result
        violations = check_history(self.judged(), sim.model.history(), counters=COUNTERS,
                                   final_counters=final, quiescent=True,
                                   deleted_counters=DELETED)
        if violations and self.inflight:
            violations.append("operations still in flight:\n" + "\n".join(
                sim.describe(op) for op in self.inflight))
        assert not violations, "\n".join(violations)

    def final_read(self, store: SimStore, name: str) -> Record:
        etcd = store.etcd
        self.run(store.index, "get", [name], lambda: etcd.get(name, None))
        return self.records[-1]


def machine_settings(examples: int, *, shrink: bool = True) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                    derandomize=True, phases=phases, database=None,
                    suppress_health_check=list(HealthCheck))


def test_store_simulation() -> None:
    run_state_machine_as_test(StoreMachine, settings=machine_settings(EXAMPLES))


def examples_to_failure(mutant: str | None, budget: int) -> tuple[int | None, str]:
    """How many machines ran until one failed with ``mutant`` active (None: the store as
    it is), and the first line of the failure; (None, "") if none failed."""
    StoreMachine.started = 0
    with MUTANTS[mutant]() if mutant else contextlib.nullcontext():
        try:
            run_state_machine_as_test(StoreMachine,
                                      settings=machine_settings(budget, shrink=False))
        except HarnessError:
            raise  # the harness failed (a store that did not close...): not a finding
        except AssertionError as exc:
            return StoreMachine.started, (str(exc).splitlines() or [""])[0]
    return None, ""


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_simulation_finds_each_mutant(mutant: str) -> None:
    """Each rule the simulation guards, reverted alone, fails a machine within the budget
    (the store as it is passes ``test_store_simulation`` with the same settings)."""
    budget = int(os.environ.get("SIM_MUTANT_EXAMPLES", str(MUTANT_BUDGET)))
    found, message = examples_to_failure(mutant, budget)
    assert found is not None, f"the simulation did not find mutant {mutant!r} in {budget}"
    print(f"{mutant}: machine {found}: {message[:200]}")


def test_same_steps_same_history() -> None:
    """Determinism: the same examples run twice give the same histories (in one process:
    str hashing, which orders sets inside the store, is the same)."""
    runs = []
    for _ in range(2):
        StoreMachine.digests = []
        with contextlib.suppress(AssertionError):  # a finding is test_store_simulation's
            run_state_machine_as_test(StoreMachine, settings=machine_settings(4, shrink=False))
        runs.append(StoreMachine.digests)
    assert runs[0] == runs[1]


if __name__ == "__main__":
    budget = int(os.environ.get("SIM_MUTANT_EXAMPLES", str(MUTANT_BUDGET)))
    for name in [None, *sorted(MUTANTS)]:
        found, message = examples_to_failure(name, budget)
        print(f"{name or '(no mutant)'}: {found} machines to the first failure "
              f"(budget {budget}) {message[:160]}", flush=True)
