"""A randomized, seeded consistency checker for cachedstore under injected faults.

Several processes (``multiprocessing``, spawn), each with its own :class:`EtcdStore`
connected to one etcd through its own :class:`~faults.proxy.FaultProxy`, run a random mix
of ``get``/``mget``/``set``/``delete``/``compare_set``/``add`` on a few shared keys while
the parent resets, cuts and silently stalls their connections and compacts etcd, all on a
schedule drawn from the seed. Every operation is recorded with ``time.monotonic()``
timestamps (system-wide on Linux, so comparable across processes). An independent oracle,
a raw gRPC watch on the parent's direct connection to etcd, records every change with its
revision. Then the history is checked:

- **coherence**: each operation records the revision its store's watch had applied when it
  began (``watch_revision``); what it reads must still have been current at that revision;
- **monotonic reads and read-your-writes** per process and key: every written value is
  unique, so each value read maps to the revision interval in which etcd held it; the
  process's reads and acknowledged writes, in order, must be placeable at non-decreasing
  revisions (a write at its own revision; a failed ``compare_set`` is a read; a
  ``delete`` is a read of "absent");
- **bounded staleness**: a value is never read later than ``stale_bound`` seconds after
  etcd replaced it (the silent-partition detection bound plus slack) -- during a cut,
  reads fail instead of serving the cache;
- **no lost add**: acknowledged ``add`` results are distinct and
  ``acked <= final counter <= acked + maybe`` (maybe: an ``EtcdConnectionError`` saying
  the outcome is unknown);
- **convergence**: after the last write (quiescence, faults long healed), every process
  reads etcd's final state within ``converge_within`` seconds and keeps reading it;
- **availability**: no ``EtcdConnectionError`` outside a fault window of that process
  (plus a recovery allowance), and no exception of an unexpected type.

Reproducible: the operation mix of each process and the fault schedule derive from the
seed (timings are real, so interleavings vary). A failure message names the seed.

Modes (:class:`CheckerConfig`), each also a CI test in ``test_checker.py``:

- ``cache_size`` below the number of keys: the stores evict all the time, and entries
  installed ahead of the watch are evicted while older events are still on their way;
- ``apply_delay``: now and then the watch thread is held before it applies a response, and
  a reader or writer after etcd answered it and before the cache hears of it;
- ``compact_every_fault``: every cut and stall has a compaction in its middle, so the
  store's watch resumes below the compacted revision and resyncs;
- ``reread``: each operation's key is read back at once, so that a wrong entry it left in
  the cache is read before a newer event replaces it;
- ``sabotage``: revert one fix of the coherence core in the workers, to show the checker
  finds the violations it lets through.

More modes (each also a CI test): ``kill`` (etcd, or a cluster's leader, SIGKILLed and
restarted on its data; ``members=3`` runs against a 3-member cluster), ``queues`` (pushes
and pops: none lost, duplicated or invented), ``watch_scopes="mixed"`` (every other
process watches only what it touched; coherence is judged per scope), ``async_reads``
(``aget``), ``consistent_reads`` (linearizability of ``consistent=True`` reads). The same
history is also judged by the simulation's checker (``tests/sim/history.py``).

By hand, from the ``tests`` directory::

    python -m faults.checker --seed 7 --processes 4 --duration 120
    python -m faults.checker --seed 7 --duration 60 --cache-size 2 --apply-delay 0.02 \\
        --compact-every-fault --reread
    python -m faults.checker --seed 7 --duration 120 --members 3 --kill --queues \\
        --mixed-scopes --async-reads 0.2 --consistent-reads 0.3
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from etcd3 import etcdrpc
from sim.history import Record, check_history

from faults.proxy import FaultProxy

__all__ = ["CheckerConfig", "Report", "check", "run"]

_PUT = 0
INF = sys.maxsize
COUNTER = "ctr"
#: The queue of ``CheckerConfig.queues``.
QUEUE = "jobs"


@dataclass(frozen=True)
class CheckerConfig:
    """One checker run. Times in seconds."""

    seed: int
    processes: int = 3
    #: How long the processes operate (faults only in the first ``duration - fault_tail``).
    duration: float = 12.0
    fault_tail: float = 3.0
    #: Reads of every key after the last write, to measure convergence.
    settle: float = 2.0
    keys: int = 5
    stall_timeout: float = 1.0
    progress_interval: float = 0.25
    request_timeout: float = 1.0
    #: A value read later than this after etcd replaced it is a violation.
    stale_bound: float = 3.5
    converge_within: float = 1.0
    #: Connection errors are allowed this long after a fault on the process's path healed.
    recovery_allowance: float = 5.0
    #: Each store's ``cache_size`` (0: the default). Below ``keys + 1`` the stores evict
    #: all the time, so eviction's high-water marks (rule 2 of ``cache.py``) are exercised.
    cache_size: int = 0
    #: Delayed applies: with probability ``delay_probability`` each watch apply, each etcd
    #: read's answer and each write's answer is held up to ``apply_delay`` seconds before it
    #: reaches the cache (``apply_events``, ``after_read``, ``after_write``), widening the
    #: windows of the stale-fill and late-write races (rules 1 and 3).
    apply_delay: float = 0.0
    delay_probability: float = 0.25
    #: Compaction resyncs: compact etcd in the middle of *every* cut and stall, so that the
    #: store's watch resumes below the compacted revision and must resync (rule 4).
    compact_every_fault: bool = False
    #: Read back at once the key each operation read or wrote (one more ``get``), so that a
    #: wrong entry the operation left in the cache is read before a newer event replaces it.
    reread: bool = False
    #: Revert one fix in the worker processes, to show that the checker catches it:
    #: ``"no-marks"`` (eviction keeps no high-water mark), ``"no-gate"`` (fills and writes
    #: in flight are never refused). Never set in a run meant to pass.
    sabotage: str = ""
    #: Kill -9 faults: etcd (in a cluster, its leader) is SIGKILLed and restarted on its
    #: data after a while; every process is in the fault's window. Needs ``run(servers=)``.
    kill: bool = False
    #: Queue operations: ``queue_push`` of unique items and non-blocking ``queue_pop``;
    #: checked: no item lost, none popped twice, none popped that was never pushed.
    queues: bool = False
    #: ``"prefix"``, or ``"mixed"``: odd-numbered processes watch only what they touched
    #: (``watch_scope="touched"``), so both watch layouts meet the same faults.
    watch_scopes: str = "prefix"
    #: Share of reads made with ``aget`` on an event loop of the worker's (the asyncio
    #: front), the rest with ``get``.
    async_reads: float = 0.0
    #: Share of reads made with ``consistent=True`` (recorded as ``cget``): each must also
    #: be linearizable, i.e. return a state no older than every write of its key that any
    #: process had seen acknowledged before the read began (real-time order).
    consistent_reads: float = 0.0

    @property
    def names(self) -> list[str]:
        return [f"k{i}" for i in range(self.keys)]


@dataclass
class Report:
    """Everything a run produced; ``violations`` is empty when the history is correct."""

    config: CheckerConfig
    prefix: str
    plan: list[tuple[float, str, int, float]]
    histories: dict[int, list[list[Any]]]
    metrics: dict[int, dict[str, float]]
    events: list[tuple[int, str, str | None, float]]
    start_at: float
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    #: The values of the items left in the queue at the end (``CheckerConfig.queues``).
    queue_left: list[str] = field(default_factory=list)
    #: How often the oracle's watch had to be resumed (a killed member).
    oracle_restarts: int = 0
    #: etcd's change log under the prefix (see ``_Oracle.changes``).
    changes: list[tuple[int, bytes, bytes | None]] = field(default_factory=list)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole report as JSON (histories, oracle events, plan, results; etcd's
        change log with keys and values as latin-1 text)."""
        data = asdict(self)
        data["changes"] = [(rev, key.decode("latin-1"),
                            None if value is None else value.decode("latin-1"))
                           for rev, key, value in self.changes]
        Path(path).write_text(json.dumps(data))

    def summary(self) -> str:
        lines = [f"checker seed={self.config.seed} processes={self.config.processes} "
                 f"duration={self.config.duration:g}s: {len(self.violations)} violation(s)"]
        lines += [f"  {k}: {v}" for k, v in self.figures.items()]
        lines += [f"  VIOLATION {v}" for v in self.violations[:30]]
        if len(self.violations) > 30:
            lines.append(f"  ... {len(self.violations) - 30} more")
        return "\n".join(lines)


# ------------------------------------------------------------------------ the worker


def _worker(index: int, endpoints: list[str], prefix: str, config: dict[str, Any],
            out_path: str, ready: Any, go: Any, times: Any) -> None:
    """One process: connect, report ``ready``, wait for ``go``, operate on its own store
    until ``times = (start, end of writes, end of settle reads)``, write its history to
    ``out_path``."""
    import asyncio

    from cachedstore import CachedStoreError, EtcdConnectionError, EtcdStore, QueueEmptyError

    cfg = CheckerConfig(**config)
    rng = random.Random(cfg.seed * 1000 + index)
    names = cfg.names
    history: list[list[Any]] = []
    metrics: dict[str, float] = {}
    try:
        if cfg.sabotage:
            _sabotage(cfg.sabotage)
        scope = "touched" if cfg.watch_scopes == "mixed" and index % 2 else "prefix"
        store = EtcdStore(endpoints=endpoints, prefix=prefix, connect_timeout=20,
                          request_timeout=cfg.request_timeout, stall_timeout=cfg.stall_timeout,
                          progress_interval=cfg.progress_interval,
                          cache_size=cfg.cache_size or None, watch_scope=scope)
        loop = asyncio.new_event_loop()
        delays: Counter[str] = Counter()
        if cfg.apply_delay > 0:
            delays = _delay_applies(store, cfg, random.Random(cfg.seed * 1000 + index + 500))
    except BaseException as exc:
        ready.put((index, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((index, None))
    if not go.wait(120):
        store.close()
        return
    start_at, writes_until, settle_until = times[:]
    seen: dict[str, str | None] = {}
    seq = 0
    ops = ["get"] * 8 + ["mget"] * 2 + ["set"] * 3 + ["delete"] + ["cas"] * 3 + ["add"] * 3
    if cfg.queues:
        ops += ["push"] * 2 + ["pop"] * 2
    reread: str | None = None
    try:
        time.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < writes_until:
            again = reread is not None
            if reread is not None:  # read back what the last operation left in the cache
                op, key, reread = "get", reread, None
            else:
                op = rng.choice(ops)
                key = rng.choice(names)
                if op == "get":
                    key = rng.choice(names + [COUNTER])
            applied = _applied(store, key)
            started = time.monotonic()
            arg: Any = None
            try:
                if op == "get":
                    consistent = bool(cfg.consistent_reads) and \
                        rng.random() < cfg.consistent_reads
                    if consistent:
                        op = "cget"
                    if cfg.async_reads and rng.random() < cfg.async_reads:
                        value = loop.run_until_complete(
                            store.aget(key, None, consistent=consistent))
                    else:
                        value = store.get(key, None, consistent=consistent)
                    result: Any = _text(value)
                    seen[key] = result
                elif op == "push":
                    seq += 1
                    key, arg = QUEUE, f"q{index}-{seq}"
                    store.queues.push(QUEUE, arg)
                    result = None
                elif op == "pop":
                    key = QUEUE
                    try:
                        result = _text(store.queues.pop(QUEUE, block=False))
                    except QueueEmptyError:
                        result = None
                elif op == "mget":
                    keys = rng.sample(names + [COUNTER], 3)
                    applied_of = {k: _applied(store, k) for k in keys}
                    values = store.mget(keys, default=None)
                    ended = time.monotonic()
                    for k, v in zip(keys, values, strict=True):
                        seen[k] = _text(v)
                        history.append(["get", k, None, "ok", _text(v), started, ended, "run",
                                        applied_of[k]])
                    continue
                elif op == "set":
                    seq += 1
                    arg = f"p{index}-{seq}"
                    store.set(key, arg)
                    result = None
                    seen[key] = arg
                elif op == "delete":
                    result = store.delete(key)
                    seen[key] = None
                elif op == "cas":
                    seq += 1
                    arg = [seen.get(key) or "", f"p{index}-{seq}"]
                    result = store.compare_set(key, arg[0], arg[1]).decode()
                    if result == arg[1]:
                        seen[key] = result
                    elif result == arg[0]:  # torch semantics: the key is absent
                        seen[key] = None
                    else:
                        seen[key] = result
                else:
                    key = COUNTER
                    result = store.add(COUNTER, 1)
                outcome = "ok"
            except EtcdConnectionError as exc:
                outcome = "maybe" if "may or may not" in str(exc) else "conn"
                result = str(exc)[:200]
            except CachedStoreError as exc:
                outcome = f"error:{type(exc).__name__}"
                result = str(exc)[:200]
            except Exception as exc:  # recorded, then reported as a violation
                outcome = f"unexpected:{type(exc).__name__}"
                result = "".join(traceback.format_exception(exc))[-500:]
            history.append([op, key, arg, outcome, result, started, time.monotonic(), "run",
                            applied])
            if cfg.reread and outcome == "ok" and not again and op not in ("push", "pop"):
                reread = key
        while time.monotonic() < settle_until:
            keys = names + [COUNTER]
            applied_of = {k: _applied(store, k) for k in keys}
            applied = max(applied_of.values())
            started = time.monotonic()
            try:
                values = store.mget(keys, default=None)
            except EtcdConnectionError as exc:
                history.append(["get", "*", None, "conn", str(exc)[:200], started,
                                time.monotonic(), "settle", applied])
                continue
            ended = time.monotonic()
            for k, v in zip(keys, values, strict=True):
                history.append(["get", k, None, "ok", _text(v), started, ended, "settle",
                                applied_of[k]])
            time.sleep(0.005)
        if store.registry is not None:
            for family in store.registry.collect():
                for s in family.samples:
                    if s.name in ("cachedstore_watch_restarts_total",
                                  "cachedstore_fills_dropped_total",
                                  "cachedstore_stale_reads_total",
                                  "cachedstore_cache_evictions_total"):
                        label = s.labels.get("reason", "")
                        metrics[f"{s.name}{{{label}}}" if label else s.name] = s.value
        for where, n in delays.items():
            metrics[f"delays{{{where}}}"] = n
    finally:
        store.close()
        loop.close()
        Path(out_path).write_text(json.dumps({"history": history, "metrics": metrics}))


def _applied(store: Any, name: str) -> int:
    """The revision up to which ``store``'s watch has applied every event of ``name``: the
    store's applied revision, or, in a store that watches what it touched, that of the
    scope covering ``name`` (0 if none: a quiet scope stays behind, and a name no scope
    covers is read from etcd)."""
    cache = store._cache
    if not cache.scoped:
        return int(store.watch_revision)
    scope = cache.scope_of(name)
    return 0 if scope is None or scope.opening else int(scope.applied)


def _delay_applies(store: Any, cfg: CheckerConfig, rng: random.Random
                   ) -> Counter[str]:
    """Hold, now and then, what is on its way into ``store``'s cache: the watch thread
    before it applies a response, a reader and a writer after etcd answered them. Returns
    the number of delays so far per place (``apply``, ``read``, ``write``), kept current."""
    lock = threading.Lock()
    delays: Counter[str] = Counter()

    def pause(where: str) -> None:
        with lock:  # one generator shared by the watch thread and the caller
            length = rng.uniform(0, cfg.apply_delay) if rng.random() < \
                cfg.delay_probability else 0.0
            if length:
                delays[where] += 1
        if length:
            time.sleep(length)

    cache = store._cache
    apply = cache.apply_events

    def delayed_apply(events: Any, revision: int, scope: Any = None) -> None:
        pause("apply")
        apply(events, revision, scope)

    cache.apply_events = delayed_apply
    store._reads.after_read = lambda names: pause("read")
    store._writes.after_write = lambda names: pause("write")
    return delays


#: The checker's sabotage kinds that are the simulation's mutants.
_AS_MUTANT = {"no-marks": "eviction_mark", "no-gate": "late_write_gate"}
_ACTIVE: list[Any] = []


def _sabotage(kind: str) -> None:
    """Revert one coherence fix in this process (before its store is created), so a run
    shows the checker would notice: ``no-marks`` and ``no-gate`` are the simulation's
    mutants ``eviction_mark`` (rule 2) and ``late_write_gate`` (rule 3), left active for
    the worker's life; ``no-catch-up`` makes consistent reads skip their wait."""
    from sim.mutants import MUTANTS

    if kind in _AS_MUTANT:
        mutant = MUTANTS[_AS_MUTANT[kind]]()
        mutant.__enter__()  # never exited: the process ends with it
        _ACTIVE.append(mutant)  # kept: a collected context manager would undo the patch
    elif kind == "no-catch-up":  # consistent reads answer from the cache at once
        from cachedstore.reads import ReadThrough

        def not_waiting(self: Any, names: Any, deadline: Any = None) -> set[str]:
            self.revisions.current(self.call_deadline(deadline))  # the request, no wait
            return {n for n in names if self._cache.applied_for(n) is not None}

        ReadThrough.consistent = not_waiting  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown sabotage {kind!r}")


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "surrogateescape")


# ------------------------------------------------------------------------ the oracle


class _CounterModel:
    """The value of the counter ``name`` as cachedstore lays it out (``counters.py``): its
    key's marker holds a base; ``ones`` counts by its version; each delta key holds one
    increment. Fed every event; computes what ``get`` must return."""

    def __init__(self, name: str) -> None:
        from cachedstore.counters import MARK

        self._mark = MARK
        self._key = name.encode()
        self._parts = b"\xff\xffcounter/" + name.encode() + b"/"
        self._plain: str | None = None
        self._base: int | None = None
        self._ones = 0
        self._deltas: dict[bytes, int] = {}

    def update(self, name: bytes, kv: Any, put: bool) -> bool:
        """Apply one event; True if it concerned the counter (key or parts)."""
        if name == self._key:
            value = bytes(kv.value) if put else None
            if value is not None and value.startswith(self._mark):
                self._base, self._plain = int(value[len(self._mark):]), None
            else:
                self._base, self._plain = None, value.decode() if value is not None else None
            return True
        if not name.startswith(self._parts):
            return False
        part = name[len(self._parts):]
        if part == b"ones":
            self._ones = kv.version if put else 0
        elif put:
            self._deltas[part] = int(kv.value)
        else:
            self._deltas.pop(part, None)
        return True

    def value(self) -> str | None:
        if self._base is None:
            return self._plain
        return str(self._base + self._ones + sum(self._deltas.values()))


class _Oracle:
    """An independent record of every change under the prefix: a raw gRPC watch on a
    direct connection to etcd (no proxy, no faults). When its member is killed it resumes
    from the next revision on the next member (the checker never compacts past it).
    Thread: ``checker-oracle``."""

    def __init__(self, endpoints: list[str], prefix: bytes, start_revision: int, *,
                 watch: bool = True) -> None:
        """``watch=False``: no stream, no thread; record what :meth:`apply` is given."""
        from cachedstore.keys import prefix_range_end

        self._endpoints = endpoints
        self._channels = [grpc.insecure_channel(e) for e in endpoints]
        self._range_end = prefix_range_end(prefix)
        self._prefix = prefix
        self._counter = _CounterModel(COUNTER)
        self._stop = threading.Event()
        self._call: Any = None
        self.events: list[tuple[int, str, str | None, float]] = []
        #: Every change under the prefix as etcd made it: (mod_revision, key without the
        #: prefix, value or None for a delete), for the shared history checker.
        self.changes: list[tuple[int, bytes, bytes | None]] = []
        self.revision = start_revision - 1
        self.restarts = 0
        self.error: BaseException | str | None = None
        self._thread = threading.Thread(target=self._run, name="checker-oracle", daemon=True)
        if watch:
            self._thread.start()

    def _requests(self) -> Iterator[Any]:
        yield etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=self._prefix, range_end=self._range_end, start_revision=self.revision + 1))
        self._stop.wait(3600)

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            channel = self._channels[attempt % len(self._channels)]
            try:
                self._watch(channel)
                if self.error is not None:
                    return  # canceled: nothing to resume
                failure: BaseException | str = "the stream ended"
            except grpc.RpcError as exc:
                failure = exc
            if self._stop.is_set():
                return
            # A fresh channel: gRPC's own reconnect back-off would keep a restarted
            # member unused for seconds.
            index = attempt % len(self._channels)
            self._channels[index].close()
            self._channels[index] = grpc.insecure_channel(self._endpoints[index])
            attempt += 1
            self.restarts += 1
            if attempt > 2000:  # about 100 s of failed attempts
                self.error = failure
                return
            self._stop.wait(0.05)

    def _watch(self, channel: Any) -> None:
        """One watch stream until it fails (raises) or is canceled (sets ``error``)."""
        self._call = etcdrpc.WatchStub(channel).Watch(self._requests(),
                                                      metadata=(("hasleader", "true"),))
        for response in self._call:
            if response.canceled:
                self.error = f"oracle watch canceled: {response.cancel_reason} " \
                             f"(compact revision {response.compact_revision})"
                return
            self.apply(response, time.monotonic())

    def apply(self, response: Any, now: float) -> None:
        """Record one watch response's events (seen at ``now``). The counter's value is
        recorded after each revision that changed it (a Txn changes its key and parts at
        one revision): a response may carry many revisions (a backlog sent at once, after
        the oracle resumed on another member), and recording only the value after the
        last would leave every value in between out of etcd's history."""
        plen = len(self._prefix)
        counter_at = 0
        for event in response.events:
            kv = event.kv
            if counter_at and kv.mod_revision != counter_at:
                self.events.append((counter_at, COUNTER, self._counter.value(), now))
                counter_at = 0
            name = kv.key[plen:]
            self.changes.append((kv.mod_revision, bytes(name),
                                 bytes(kv.value) if event.type == _PUT else None))
            if self._counter.update(name, kv, event.type == _PUT):
                counter_at = kv.mod_revision
                continue
            self.events.append((kv.mod_revision, name.decode(),
                                kv.value.decode() if event.type == _PUT else None, now))
        if counter_at:  # the counter's value after the response's last change of it
            self.events.append((counter_at, COUNTER, self._counter.value(), now))
        if response.events:
            self.revision = response.events[-1].kv.mod_revision

    def wait_for(self, revision: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.revision < revision:
            if self.error is not None:
                raise RuntimeError(f"the oracle failed: {self.error}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the oracle did not reach revision {revision}")
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(5)
        for channel in self._channels:
            channel.close()


# ------------------------------------------------------------------------ the run


def make_plan(config: CheckerConfig) -> list[tuple[float, str, int, float]]:
    """The fault schedule: ``(offset, action, process, duration)`` from the seed; actions
    ``reset`` (RST now), ``cut`` (RST and refuse for ``duration``), ``stall`` (hold bytes for
    ``duration``), ``compact`` (compact etcd to the newest revision; process -1) and, with
    ``kill``, ``kill`` (SIGKILL etcd, or a cluster's leader, and restart it on its data
    after ``duration``; process -2: every process). Most cuts -- with
    ``compact_every_fault`` every cut and stall -- have a compaction in their middle."""
    rng = random.Random(config.seed)
    wanted = {"reset", "cut", "stall", "compact"} | ({"kill"} if config.kill else set())
    while True:  # redraw (deterministically) until every kind of fault is in the plan
        plan = _draw_plan(config, rng)
        if wanted <= {action for _, action, _, _ in plan}:
            return plan


def _draw_plan(config: CheckerConfig, rng: random.Random
               ) -> list[tuple[float, str, int, float]]:
    plan: list[tuple[float, str, int, float]] = []
    busy = [0.0] * config.processes
    end = config.duration - config.fault_tail
    t = rng.uniform(0.3, 1.0)
    down_until = 0.0  # no two kills overlap
    kinds = ["reset", "cut", "cut", "stall", "stall", "compact"] + ["kill"] * config.kill
    while t < end:
        action = rng.choice(kinds)
        if action == "compact":
            plan.append((t, "compact", -1, 0.0))
        elif action == "kill":
            if down_until <= t:
                length = min(rng.uniform(0.3, 1.5), end - t)
                plan.append((t, "kill", -2, length))
                down_until = t + length + 3.0  # restart and (in a cluster) an election
        else:
            target = rng.randrange(config.processes)
            if busy[target] <= t:
                # Stalls long enough to be detected (stall_timeout + 2 * progress_interval).
                lo, hi = (0.3, 2.0) if action == "cut" else (1.6, 3.0)
                length = 0.0 if action == "reset" else min(rng.uniform(lo, hi), end - t)
                plan.append((t, action, target, length))
                busy[target] = t + length + 0.2
                # Compact past its watch's revision: it must resync once the path heals.
                compact = action == "cut" and rng.random() < 0.7
                if compact or (config.compact_every_fault and length > 0):
                    plan.append((t + length / 2, "compact", -1, 0.0))
        t += rng.uniform(0.3, 1.0)
    plan.sort()
    return plan


def run(config: CheckerConfig, endpoint: str, workdir: str | os.PathLike[str],
        servers: Any = None, during: Callable[[], None] | None = None) -> Report:
    """Run one checker round against the etcd at ``endpoint`` (used by nobody else) and
    return its :class:`Report`, checked. Blocks about ``duration + settle`` plus start-up.
    ``servers``: the :class:`~cachedstore.server.LocalEtcd` behind ``endpoint``, or a
    :class:`~cachedstore.testing.LocalEtcdCluster` (its members' endpoints are used, each
    process reaching every member through proxies of its own); needed by ``kill``.
    ``during``: called as the schedule starts (a test crashing etcd). Raises
    :class:`EtcdCrashed` when, in a run without kill faults, an etcd process ended."""
    members = list(getattr(servers, "members", None) or ([servers] if servers else []))
    endpoints = [m.endpoint for m in members] if members else [endpoint]
    if config.kill and not members:
        raise ValueError("kill faults need the etcd servers (run(..., servers=))")
    prefix = f"/checker-{config.seed}-{os.getpid()}-{time.monotonic_ns()}/"
    kvs = _Members(endpoints)
    start_revision = kvs.call("Range", etcdrpc.RangeRequest(key=b"\0")).header.revision + 1
    oracle = _Oracle(endpoints, prefix.encode(), start_revision)
    proxies = [[FaultProxy(e, max_lifetime=config.duration + 600).start() for e in endpoints]
               for _ in range(config.processes)]
    ctx = multiprocessing.get_context("spawn")
    ready, go, times = ctx.Queue(), ctx.Event(), ctx.Array("d", 3)
    outs = [str(Path(workdir) / f"history-{i}.json") for i in range(config.processes)]
    plan = make_plan(config)
    procs = [ctx.Process(target=_worker, name=f"checker-worker-{i}",
                         args=(i, [p.endpoint for p in proxies[i]], prefix, asdict(config),
                               outs[i], ready, go, times))
             for i in range(config.processes)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            index, error = ready.get(timeout=120)
            if error:
                raise RuntimeError(f"process {index} could not connect: {error}")
        # The schedule starts once every process is connected (CLOCK_MONOTONIC is shared).
        start_at = time.monotonic() + 0.2
        writes_until = start_at + config.duration
        settle_until = writes_until + config.settle
        times[:] = [start_at, writes_until, settle_until]
        go.set()
        if during is not None:
            during()
        _inject(plan, proxies, kvs, members, oracle, start_at)
        for p in procs:
            p.join(max(5.0, settle_until - time.monotonic() + 30))
            if p.is_alive():
                p.kill()
                raise RuntimeError(f"{p.name} did not finish")
        if not config.kill and any(not m.running for m in members):
            raise EtcdCrashed(f"an etcd process ended during the run\n"
                              f"{_members_state(members)}")
        try:
            end = kvs.call("Put", etcdrpc.PutRequest(key=(prefix + "__end__").encode(),
                                                     value=b"1"))
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{_members_state(members)}") from exc
        oracle.wait_for(end.header.revision, 10)
        queue_left = _queue_items(kvs, prefix) if config.queues else []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for group in proxies:
            for proxy in group:
                proxy.close()
        oracle.stop()
        kvs.close()
    histories, metrics = {}, {}
    for i, path in enumerate(outs):
        data = json.loads(Path(path).read_text())
        histories[i], metrics[i] = data["history"], data["metrics"]
    report = Report(config, prefix, plan, histories, metrics,
                    [e for e in oracle.events if e[1] != "__end__"], start_at,
                    queue_left=queue_left, oracle_restarts=oracle.restarts,
                    changes=[c for c in oracle.changes if c[1] != b"__end__"])
    check(report)
    return report


class _Members:
    """Direct gRPC stubs to every member (no proxy, no faults): the checker's own requests
    (compaction, the final put, the queue's remaining items) go to the first that answers."""

    def __init__(self, endpoints: list[str]) -> None:
        self._endpoints = endpoints
        self._channels = [grpc.insecure_channel(e) for e in endpoints]
        self._kvs = [etcdrpc.KVStub(c) for c in self._channels]

    def call(self, method: str, request: Any, within: float = 20.0) -> Any:
        """``method`` on the first member that answers, retried for ``within`` seconds.
        A channel that failed is replaced before it is tried again: grpcio backs off its
        reconnects for up to two minutes. (Once, in a fresh CI run, the final Put of a
        run without kills found no answer for 20 s from its single etcd, cause unknown;
        the failures are now in the error.) Raises RuntimeError with the last failure of
        each member."""
        deadline = time.monotonic() + within
        failures: dict[str, str] = {}
        while True:
            for i, kv in enumerate(self._kvs):
                try:
                    return getattr(kv, method)(request, timeout=2)
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.DEADLINE_EXCEEDED,
                                          grpc.StatusCode.UNKNOWN):
                        raise
                    failures[self._endpoints[i]] = f"{exc.code().name}: {exc.details()}"
                    self._reopen(i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd member answered {method} within {within} s; "
                                   f"last failures: {failures}")
            time.sleep(0.1)

    def _reopen(self, i: int) -> None:
        self._channels[i].close()
        self._channels[i] = grpc.insecure_channel(self._endpoints[i])
        self._kvs[i] = etcdrpc.KVStub(self._channels[i])

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


class EtcdCrashed(RuntimeError):
    """An etcd process of a run without kill faults exited by itself: a failure of etcd,
    not a finding about the stores (etcd 3.5.1, which the tests run, has crashes fixed in
    3.5.2 that a watch syncing from an old revision meets: etcd-io/etcd#13505). The
    message has the members' exit codes and log tails. (Twice a CI run's single etcd
    stopped answering this way, its log lost; the next one says why.)"""


def _members_state(members: list[Any]) -> str:
    """Whether each etcd process still runs (its exit code if not) and its log's tail:
    what the checker's own request that found no member leaves to go on. (A CI run's
    final Put twice found its single etcd refusing connections for 20 s, no kill in the
    run.)"""
    from cachedstore.server.process import log_tail

    if not members:
        return "(the etcd servers were not given to run(): their state is unknown)"
    return "\n".join(
        f"{m.endpoint}: pid {m.pid}, running {m.running}, exit code "
        f"{m._proc.exit_code()}; log tail:\n{log_tail(m.log_path, 30)}"  # noqa: SLF001
        for m in members)


def _queue_items(kvs: _Members, prefix: str) -> list[str]:
    """The items left in the checker's queue at the end (their values)."""
    from cachedstore.keys import prefix_range_end
    from cachedstore.queues import item_prefix

    start = prefix.encode() + item_prefix(QUEUE).encode()
    response = kvs.call("Range", etcdrpc.RangeRequest(key=start,
                                                      range_end=prefix_range_end(start)))
    return [kv.value.decode() for kv in response.kvs]


def _inject(plan: list[tuple[float, str, int, float]], proxies: list[list[FaultProxy]],
            kvs: _Members, members: list[Any], oracle: _Oracle, start_at: float) -> None:
    """Carry out the fault schedule (heals and restarts included) on the calling thread."""
    timeline: list[tuple[float, int, str, int]] = []
    for n, (offset, action, target, length) in enumerate(plan):
        timeline.append((start_at + offset, n, action, target))
        if action in ("cut", "stall"):
            timeline.append((start_at + offset + length, n, "heal", target))
        elif action == "kill":
            timeline.append((start_at + offset + length, n, "restart", target))
    timeline.sort()
    killed: Any = None
    for at, _, action, target in timeline:
        time.sleep(max(0.0, at - time.monotonic()))
        group = proxies[target] if target >= 0 else []
        if action == "reset":
            for proxy in group:
                proxy.reset()
        elif action == "cut":
            for proxy in group:
                proxy.reset(refuse=True)
        elif action == "stall":
            for proxy in group:
                proxy.stall()
        elif action == "heal":
            for proxy in group:
                proxy.heal()
        elif action == "kill":
            killed = members[_leader(members)]
            killed.kill()  # SIGKILL: a crash, its data kept
        elif action == "restart" and killed is not None:
            killed.restart()  # on its data dir and ports; blocks until healthy
            killed = None
        elif action == "compact" and oracle.revision > 0 and killed is None:
            try:  # never past the oracle's own position, or it would lose events
                kvs.call("Compact", etcdrpc.CompactionRequest(revision=oracle.revision),
                         within=3.0)
            except grpc.RpcError as exc:
                if "compacted" not in (exc.details() or ""):
                    raise
            except RuntimeError:  # no member answered (a kill): skip this compaction
                pass
    if killed is not None:
        killed.restart()
    for group in proxies:
        for proxy in group:
            proxy.heal()


def _leader(members: list[Any]) -> int:
    """Index of the leader among ``members`` (0 for a single member)."""
    if len(members) == 1:
        return 0
    for i, member in enumerate(members):
        if not member.running:
            continue
        try:
            status = member.status()
        except Exception:  # noqa: BLE001 - a member that cannot say is not the leader
            continue
        header = status.get("header", {})
        if str(status.get("leader")) == str(header.get("member_id")):
            return i
    return 0


# ------------------------------------------------------------------------ the checks


class _Timeline:
    """The states of one key in revision order, from the oracle: state j holds from
    ``starts[j]`` to ``starts[j + 1] - 1``; state 0 is "absent" from revision 0."""

    def __init__(self) -> None:
        self.starts: list[int] = [0]
        self.values: list[str | None] = [None]
        self.seen_at: list[float] = [float("-inf")]
        #: value -> the states holding it (more than one if a retried put applied twice).
        self.index_of: dict[str, list[int]] = {}

    def add(self, revision: int, value: str | None, seen_at: float) -> None:
        self.starts.append(revision)
        self.values.append(value)
        self.seen_at.append(seen_at)
        if value is not None:
            self.index_of.setdefault(value, []).append(len(self.values) - 1)

    def occurrences(self, value: str | None) -> list[int]:
        return self.absent if value is None else self.index_of.get(value, [])

    def last_revision(self, value: str) -> int | None:
        """The revision of the last write of ``value`` (None if never written)."""
        js = self.index_of.get(value)
        return self.starts[js[-1]] if js else None

    def end(self, j: int) -> int:
        return self.starts[j + 1] - 1 if j + 1 < len(self.starts) else INF

    def finish(self) -> None:
        self.absent = [j for j, v in enumerate(self.values) if v is None]
        self.absent_ends = [self.end(j) for j in self.absent]

    def earliest(self, value: str | None, at_least: int, at_most: int) -> int | None:
        """The smallest revision in [``at_least``, ``at_most``] at which the key held
        ``value``, or None."""
        if value is not None:
            js = [j for j in self.index_of.get(value, []) if self.end(j) >= at_least]
            if not js:
                return None
            placed = max(at_least, self.starts[js[0]])
        else:
            k = bisect.bisect_left(self.absent_ends, at_least)
            if k == len(self.absent):
                return None
            placed = max(at_least, self.starts[self.absent[k]])
        return placed if placed <= at_most else None

    def replaced_at(self, value: str | None, at_least: int, at_most: int,
                    acked_at: dict[int, float]) -> float | None:
        """When the *latest* state holding ``value`` within revisions [``at_least``,
        ``at_most``] was replaced (no later than the oracle saw it or its writer was
        acknowledged); None if it is still current or there is none. The latest, so that a
        read of "absent" just after the reader's own ``delete`` is judged by that absence,
        not by an older one: staleness is measured at the most favourable placement the
        history allows, so that a violation is one under every placement."""
        js = [j for j in self.occurrences(value)
              if self.starts[j] <= at_most and self.end(j) >= at_least]
        if not js or js[-1] + 1 >= len(self.starts):
            return None
        j = js[-1]
        return min(self.seen_at[j + 1], acked_at.get(self.starts[j + 1], INF))


def check(report: Report) -> list[str]:
    """Check ``report``'s history, fill ``report.violations`` and ``report.figures``."""
    cfg = report.config
    v = report.violations
    timelines = {key: _Timeline() for key in cfg.names + [COUNTER]}
    for revision, key, value, seen_at in sorted(report.events):
        timelines.setdefault(key, _Timeline()).add(revision, value, seen_at)
    writer_op = {(rec[2] if rec[0] == "set" else rec[2][1]): rec[0]
                 for h in report.histories.values() for rec in h if rec[0] in ("set", "cas")}
    applied_twice = 0
    for key, tl in timelines.items():
        tl.finish()
        for value, js in tl.index_of.items():
            if len(js) > 1:
                # A put is retried after a transport error (at least once): only set's.
                if writer_op.get(value) == "set":
                    applied_twice += 1
                else:
                    v.append(f"key {key}: {value!r} written {len(js)} times")
    final = {k: tl.values[-1] for k, tl in timelines.items()}
    # The newest revision that can have existed when an operation ended at t: below the
    # revision of every acknowledged write that *started* after t (real-time order).
    writes: list[tuple[float, int, float]] = []  # (start, revision, end) of acked writes
    for history in report.histories.values():
        for op, key, arg, outcome, result, started, ended, *_ in history:
            if outcome != "ok":
                continue
            value = arg if op == "set" else arg[1] if op == "cas" and result == arg[1] \
                else str(result) if op == "add" else None
            written = timelines[key].last_revision(value) if value is not None else None
            if written is not None:
                writes.append((started, written, ended))
    # Per key, the revisions of acknowledged writes in the order they were acknowledged:
    # a linearizable read that began after one must place at or after it.
    acked_by_key: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for history in report.histories.values():
        for op, key, arg, outcome, result, _started, ended, *_ in history:
            if outcome != "ok" or op not in ("set", "cas", "add"):
                continue
            value = arg if op == "set" else arg[1] if op == "cas" and result == arg[1] \
                else str(result) if op == "add" else None
            written = timelines[key].last_revision(value) if value is not None else None
            if written is not None:
                acked_by_key[key].append((ended, written))
    acked_ends: dict[str, list[float]] = {}
    acked_max: dict[str, list[int]] = {}
    for key, acked in acked_by_key.items():
        acked.sort()
        acked_ends[key] = [end for end, _ in acked]
        acked_max[key] = list(itertools.accumulate((rev for _, rev in acked), max))

    def acked_before(key: str, t: float) -> int:
        k = bisect.bisect_left(acked_ends.get(key, []), t)
        return acked_max[key][k - 1] if k else 0

    writes.sort()
    write_starts = [w[0] for w in writes]
    later_min = list(itertools.accumulate((w[1] for w in reversed(writes)), min))[::-1]
    acked_at = {revision: ended for _, revision, ended in writes}

    def newest_at(t: float) -> int:
        k = bisect.bisect_right(write_starts, t)
        return later_min[k] - 1 if k < len(later_min) else INF

    # Fault windows per process, for the availability check.
    windows: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for offset, action, target, length in report.plan:
        if target >= 0 or action == "kill":
            start = report.start_at + offset
            # A kill's window covers every process, and the restart (and, in a cluster,
            # an election) after it.
            extra = cfg.recovery_allowance + (5.0 if action == "kill" else 0.0)
            for proc in [target] if target >= 0 else range(cfg.processes):
                windows[proc].append((start, start + length + extra))

    outcomes: Counter[str] = Counter()
    max_stale, stale_reads = 0.0, 0
    acked_adds: list[int] = []
    maybe_adds = 0
    quiescence = max((rec[6] for h in report.histories.values() for rec in h
                      if rec[7] == "run" and rec[0] in ("set", "delete", "cas", "add")),
                     default=report.start_at)
    converge: dict[int, float] = {}
    queue_ops: defaultdict[tuple[str, str], list[str | None]] = defaultdict(list)
    for proc, history in report.histories.items():
        position: dict[str, int] = defaultdict(int)
        for op, key, arg, outcome, result, started, ended, _phase, applied in history:
            outcomes[f"{op}:{outcome.split(':')[0]}"] += 1
            where = f"p{proc} {op}({key}) at +{started - report.start_at:.3f}s"
            if outcome.startswith(("unexpected", "error")):
                v.append(f"{where}: {outcome}: {result}")
                continue
            if outcome in ("conn", "maybe"):
                if op == "add" and outcome == "maybe":
                    maybe_adds += 1
                if op in ("push", "pop"):
                    queue_ops[op, outcome].append(arg if op == "push" else None)
                if not any(started <= b and ended >= a for a, b in windows[proc]):
                    v.append(f"{where}: connection error outside any fault window: {result}")
                continue
            if op in ("push", "pop"):  # judged as a whole below
                queue_ops[op, outcome].append(arg if op == "push" else result)
                continue
            tl = timelines[key]
            # The state this operation observed or produced, as (value, exact revision?).
            if op in ("get", "cget"):
                state, exact = result, False
            elif op == "set":
                state, exact = arg, True
            elif op == "delete":
                state, exact = None, False
            elif op == "cas":
                expected, desired = arg
                if result == desired:
                    state, exact = desired, True
                elif result == expected:
                    state, exact = None, False  # torch semantics: absent
                else:
                    state, exact = result, False
            else:  # add
                acked_adds.append(int(result))
                state, exact = str(result), True
            floor = position[key]
            if exact:
                at = tl.last_revision(state) if state is not None else None
                if at is None:
                    v.append(f"{where}: acknowledged write {state!r} is not in etcd's history")
                    continue
                if at < floor:
                    v.append(f"{where}: write {state!r} at revision {at} after "
                             f"having observed revision {floor} (read-your-writes/monotonic)")
                    continue
                position[key] = at
            else:
                newest = newest_at(ended)
                if op == "cget":
                    linear = acked_before(key, started)
                    if tl.earliest(state, max(floor, applied, linear), newest) is None \
                            and tl.earliest(state, max(floor, applied), newest) is not None:
                        v.append(f"{where}: consistent read of {state!r}, which etcd no "
                                 f"longer held at revision {linear}, written and "
                                 f"acknowledged before the read began (linearizability)")
                        continue
                    applied = max(applied, linear)
                placed = tl.earliest(state, max(floor, applied), newest)
                if placed is None:
                    if tl.earliest(state, floor, newest) is not None:
                        v.append(f"{where}: read {state!r}, which etcd no longer held at "
                                 f"revision {applied}, already applied by this store's "
                                 f"watch when the read began (coherence)")
                    else:
                        v.append(f"{where}: read {state!r}, which etcd did not hold between "
                                 f"revision {floor} (already observed) and {newest} (the "
                                 f"newest when the read returned): monotonic reads / "
                                 f"read-your-writes")
                    continue
                position[key] = placed
                replaced = tl.replaced_at(state, placed, newest, acked_at)
                if op != "delete" and replaced is not None and started > replaced:
                    stale_reads += 1
                    max_stale = max(max_stale, started - replaced)
                    if started - replaced > cfg.stale_bound:
                        v.append(f"{where}: read {state!r} {started - replaced:.3f} s after "
                                 f"etcd replaced it (bound {cfg.stale_bound:g} s)")
        # Convergence: from some point on, every settle read returns the final state.
        settle = [r for r in history if r[7] == "settle"]
        if not settle:
            v.append(f"p{proc}: no reads after quiescence")
            continue
        converged_at = None
        for _op, key, _, outcome, result, started, *_ in settle:
            ok = outcome == "ok" and result == final.get(key)
            if not ok:
                converged_at = None
            elif converged_at is None:
                converged_at = started
        if converged_at is None:
            v.append(f"p{proc}: never converged to etcd's final state")
        else:
            converge[proc] = max(0.0, converged_at - quiescence)
            if converged_at - quiescence > cfg.converge_within:
                v.append(f"p{proc}: converged {converged_at - quiescence:.3f} s after "
                         f"quiescence (bound {cfg.converge_within:g} s)")

    # No lost add.
    if len(set(acked_adds)) != len(acked_adds):
        dup = [n for n, c in Counter(acked_adds).items() if c > 1]
        v.append(f"add returned the same counter value twice: {dup[:10]}")
    final_counter = int(final.get(COUNTER) or 0)
    if not len(acked_adds) <= final_counter <= len(acked_adds) + maybe_adds:
        v.append(f"lost add: counter={final_counter}, acknowledged adds={len(acked_adds)}, "
                 f"maybe={maybe_adds}")
    if cfg.queues:
        v.extend(_check_queue(queue_ops, report.queue_left))
    # The simulation's history checker judges the same history (one set of rules for both).
    shared = check_history(_records(report), report.changes, counters=[COUNTER],
                           final_counters={COUNTER: int(final.get(COUNTER) or 0)})
    v.extend(f"history: {finding}" for finding in shared)
    restarts: Counter[str] = Counter()
    for m in report.metrics.values():
        for name, count in m.items():
            restarts[name.replace("cachedstore_", "")] += int(count)
    faults = Counter(action for _, action, _, _ in report.plan)
    report.figures.update({
        "operations": sum(len(h) for h in report.histories.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "faults": dict(faults),
        "store counters": dict(sorted(restarts.items())),
        "adds": f"acked={len(acked_adds)} maybe={maybe_adds} final={final_counter}",
        "sets applied twice (retried put)": applied_twice,
        "reads older than etcd (count, max s)": (stale_reads, round(max_stale, 4)),
        "convergence after quiescence (s)": {p: round(t, 4) for p, t in converge.items()},
        "etcd revisions": len(report.events),
        "oracle watch resumed": report.oracle_restarts,
    })
    if cfg.queues:
        report.figures["queue"] = (
            f"pushed={len(queue_ops['push', 'ok'])} "
            f"popped={sum(1 for x in queue_ops['pop', 'ok'] if x is not None)} "
            f"empty={sum(1 for x in queue_ops['pop', 'ok'] if x is None)} "
            f"maybe={len(queue_ops['push', 'maybe']) + len(queue_ops['pop', 'maybe'])} "
            f"left={len(report.queue_left)}")
    return v


_SHARED_OPS = {"get": "get", "cget": "get", "set": "set", "delete": "delete",
               "cas": "compare_set", "add": "add", "push": "queue_push", "pop": "queue_pop"}


def _records(report: Report) -> list[Record]:
    """The run's history as the shared checker's records (``tests/sim/history.py``): real
    time orders them (CLOCK_MONOTONIC, shared by the processes); etcd's revision at a
    return is unknown (the newest is used); each process's last settle read of each key
    is a quiescent read (it must return etcd's final state)."""
    def data(text: Any) -> bytes | None:
        return None if text is None else str(text).encode("utf-8", "surrogateescape")

    last_settle: dict[tuple[int, str], int] = {}
    for proc, history in report.histories.items():
        for i, rec in enumerate(history):
            if rec[7] == "settle" and rec[0] == "get" and rec[3] == "ok":
                last_settle[(proc, rec[1])] = i
    out = []
    for proc, history in report.histories.items():
        for i, (op, key, arg, outcome, result, started, ended, _phase, applied) in \
                enumerate(history):
            if op not in _SHARED_OPS or key == "*":
                continue
            r = Record(store=proc, op=_SHARED_OPS[op], names=[key], bounds={key: applied},
                       invoked=started, returned=ended, inv_rev=0, ret_rev=None)
            if outcome != "ok":
                r.error = "EtcdConnectionError" if outcome in ("conn", "maybe") \
                    else outcome.split(":", 1)[-1]
            if op == "set":
                r.args = {"value": data(arg)}
            elif op == "cas":
                r.args = {"expected": data(arg[0]), "desired": data(arg[1])}
            elif op == "add":
                r.args = {"amount": 1}
            elif op == "push":
                r.args = {"value": data(arg)}
            if r.error is None:
                if op == "add":
                    r.result = int(result)
                elif op == "pop" and result is None:
                    r.error = "QueueEmptyError"
                elif op != "push":
                    r.result = data(result)
            r.quiescent = last_settle.get((proc, key)) == i
            out.append(r)
    return out


def _check_queue(ops: dict[tuple[str, str], list[str | None]], left: list[str]
                 ) -> list[str]:
    """Queues neither lose nor duplicate items: every item popped was pushed (acknowledged
    or maybe), none is popped twice or both popped and left, and every acknowledged push is
    popped or left, except where a pop of unknown outcome may have taken it."""
    found: list[str] = []
    pushed = {x for x in ops.get(("push", "ok"), []) if x is not None}
    maybe_pushed = {x for x in ops.get(("push", "maybe"), []) if x is not None}
    popped = [x for x in ops.get(("pop", "ok"), []) if x is not None]
    maybe_pops = len(ops.get(("pop", "maybe"), []))
    for item, count in Counter(popped + left).items():
        if count > 1:
            found.append(f"queue: item {item!r} popped or left {count} times (duplicated)")
    for item in set(popped) | set(left):
        if item not in pushed and item not in maybe_pushed:
            found.append(f"queue: item {item!r} was never pushed")
    lost = pushed - set(popped) - set(left)
    if len(lost) > maybe_pops:
        found.append(f"queue: {len(lost)} acknowledged items lost ({sorted(lost)[:5]}...), "
                     f"only {maybe_pops} pops of unknown outcome")
    return found


# ------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m faults.checker``: start a private etcd (or cluster), run, print the
    report."""
    from cachedstore.server import LocalEtcd
    from cachedstore.testing import LocalEtcdCluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(10**6))
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--keys", type=int, default=5)
    parser.add_argument("--cache-size", type=int, default=0,
                        help="each store's cache_size (0: the default; try 2 with 5 keys)")
    parser.add_argument("--apply-delay", type=float, default=0.0, metavar="SECONDS",
                        help="delay watch applies and etcd answers up to this long")
    parser.add_argument("--compact-every-fault", action="store_true",
                        help="compact etcd in the middle of every cut and stall")
    parser.add_argument("--reread", action="store_true",
                        help="read back at once the key each operation touched")
    parser.add_argument("--sabotage", choices=["no-marks", "no-gate", "no-catch-up"],
                        default="",
                        help="revert a coherence fix in the workers (the run should fail)")
    parser.add_argument("--kill", action="store_true",
                        help="SIGKILL etcd (a cluster's leader) now and then, and restart it")
    parser.add_argument("--members", type=int, default=1,
                        help="run against a cluster of this many members (3: leader loss)")
    parser.add_argument("--queues", action="store_true", help="queue pushes and pops too")
    parser.add_argument("--mixed-scopes", action="store_true",
                        help="odd-numbered processes watch only what they touched")
    parser.add_argument("--async-reads", type=float, default=0.0, metavar="SHARE",
                        help="share of reads made with aget")
    parser.add_argument("--consistent-reads", type=float, default=0.0, metavar="SHARE",
                        help="share of reads made with consistent=True (linearizable)")
    parser.add_argument("--save", metavar="FILE", help="write the whole report as JSON")
    args = parser.parse_args(argv)
    config = CheckerConfig(seed=args.seed, processes=args.processes, duration=args.duration,
                           keys=args.keys, cache_size=args.cache_size,
                           apply_delay=args.apply_delay,
                           compact_every_fault=args.compact_every_fault,
                           reread=args.reread, sabotage=args.sabotage, kill=args.kill,
                           queues=args.queues, async_reads=args.async_reads,
                           consistent_reads=args.consistent_reads,
                           watch_scopes="mixed" if args.mixed_scopes else "prefix")
    started = time.monotonic()
    servers: Any = LocalEtcdCluster(args.members) if args.members > 1 else LocalEtcd()
    with servers, tempfile.TemporaryDirectory() as workdir:
        endpoint = servers.endpoints[0]
        report = run(config, endpoint, workdir, servers=servers)
    print(report.summary())
    print(f"  wall time: {time.monotonic() - started:.1f} s")
    if args.save:
        report.save(args.save)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
