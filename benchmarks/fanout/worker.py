"""A block of simulated ranks in one process: :class:`RankGroup`, and :func:`serve`.

Each rank has its own store (a ``cachedstore.torch.TorchEtcdStore``, i.e. its own
``EtcdStore`` with its own connection and watch, a ``TCPStore`` client, or a view of one
``HashStore`` that the process's ranks share: the *floor*, what the harness and torch's
Python cost with a store that costs next to nothing) and runs pattern
steps on a thread of its own (``fanout-rank_N``, from a pool that lives as long as the group).

Blocking and bounds: :meth:`RankGroup.run_step` blocks until every rank finished the step or
the absolute ``deadline`` (``time.monotonic()``, which is system-wide on Linux, so a parent
can hand the same deadline to every worker process) passes; then the group is *aborted*: its
stores are closed, so that every blocked call raises, and the step reports the ranks that
did not finish. A store's own timeout is set to the pattern's budget as a second bound.

:func:`serve` runs a :class:`RankGroup` in a worker process, driven over a
``multiprocessing`` pipe by :mod:`benchmarks.fanout.simulator`. Not thread-safe: one caller
drives a group.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from .patterns import PATTERNS, RankContext
from .recording import Access, RecordingStore

__all__ = ["BREAKDOWN_KEYS", "STORE_OPTIONS_ENV", "THREAD_KINDS", "RankGroup", "serve"]

#: JSON object of EtcdStore keywords every rank's store gets (``--store-options``).
STORE_OPTIONS_ENV = "FANOUT_STORE_OPTIONS"

#: A rank's step, in seconds, summed over the group's ranks and the measured steps:
#: ``wall`` (the rank's own step, from its thread taking it up to its end), ``start``
#: (from the step's submission to its thread taking it up), ``cpu`` (the rank thread's
#: CPU time), ``etcd`` (wall time inside ``Connection.call``: waiting for etcd's answers,
#: the call's own CPU included), ``etcd_cpu`` (the rank thread's CPU inside those calls),
#: ``watch`` (wall time blocked in the store's waits, ``Clock.wait``: for the watch's
#: event) and ``ranks`` (rank-steps counted).
BREAKDOWN_KEYS = ("wall", "start", "cpu", "etcd", "etcd_cpu", "watch", "ranks")


#: Where the process's CPU time went, by thread (``RankGroup.cpu_by_thread``): the rank
#: threads, the stores' watch threads, other Python threads, and the rest (threads Python
#: did not start: gRPC's core, torch's; and threads that ended within the step).
THREAD_KINDS = ("rank", "watch", "python", "native")


def _thread_kind(name: str) -> str:
    if name.startswith("fanout-rank"):
        return "rank"
    if name.startswith("cachedstore-watch"):
        return "watch"
    return "python"


def _python_thread_cpu() -> dict[int, tuple[str, float]]:
    """Every live Python thread's CPU time so far: ``{ident: (kind, seconds)}`` (empty
    where the platform has no per-thread CPU clocks)."""
    out: dict[int, tuple[str, float]] = {}
    getclock = getattr(time, "pthread_getcpuclockid", None)
    if getclock is None:
        return out
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            out[thread.ident] = (_thread_kind(thread.name),
                                 time.clock_gettime(getclock(thread.ident)))
        except (OSError, ValueError, OverflowError):
            continue  # it ended meanwhile
    return out


class _Probe:
    """Where a rank thread's time goes, measured from outside the library.

    :meth:`install` wraps ``cachedstore.connection.Connection.call`` and
    ``cachedstore.clock.SystemClock.wait`` (every blocking wait of a store on its watch
    goes through its clock, the system clock here) once per process, with thread-local
    accounting: only a thread inside :meth:`measure` (a rank running its step) is counted,
    so watch threads, their progress requests and the simulator's settling are not. Nested
    calls (a call's re-authentication) count once. TCPStore ranks have neither: their
    ``etcd`` and ``watch`` stay 0.
    """

    _local = threading.local()
    _installed = False
    _install_lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        with cls._install_lock:
            if cls._installed:
                return
            from cachedstore.clock import SystemClock
            from cachedstore.connection import Connection

            local = cls._local
            call, wait = Connection.call, SystemClock.wait

            def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
                acc = getattr(local, "acc", None)
                if acc is None or local.depth:
                    return call(self, *args, **kwargs)
                local.depth = 1
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return call(self, *args, **kwargs)
                finally:
                    acc["etcd"] += time.perf_counter() - t
                    acc["etcd_cpu"] += time.thread_time() - c
                    local.depth = 0

            def timed_wait(self: Any, event: threading.Event, timeout: float | None) -> bool:
                acc = getattr(local, "acc", None)
                if acc is None:
                    return wait(self, event, timeout)
                t = time.perf_counter()
                try:
                    return wait(self, event, timeout)
                finally:
                    acc["watch"] += time.perf_counter() - t

            Connection.call = timed_call  # type: ignore[method-assign]
            SystemClock.wait = timed_wait  # type: ignore[method-assign]
            cls._installed = True

    @classmethod
    def measure(cls, run: Any, ctx: Any, step: int, submitted: float,
                totals: dict[str, float], lock: threading.Lock) -> None:
        """``run(ctx, step)`` on this thread, its time added to ``totals``."""
        local = cls._local
        acc = {"etcd": 0.0, "etcd_cpu": 0.0, "watch": 0.0}
        local.acc, local.depth = acc, 0
        t, c = time.perf_counter(), time.thread_time()
        try:
            run(ctx, step)
        finally:
            wall, cpu = time.perf_counter() - t, time.thread_time() - c
            local.acc = None
            with lock:
                totals["wall"] += wall
                totals["start"] += t - submitted
                totals["cpu"] += cpu
                for k, v in acc.items():
                    totals[k] += v
                totals["ranks"] += 1


_hash_stores: dict[str, Any] = {}
_hash_lock = threading.Lock()


def _hash_store(prefix: str) -> Any:
    """The process's one ``HashStore`` for a job (``prefix``): threads of one process are
    the only ranks that can share it."""
    import torch.distributed as dist

    with _hash_lock:
        if prefix not in _hash_stores:
            _hash_stores[prefix] = dist.HashStore()
        return _hash_stores[prefix]


def _make_store(backend: dict[str, Any], timeout: timedelta, options: dict[str, Any]) -> Any:
    import torch.distributed as dist

    if backend["kind"] == "etcd":
        from cachedstore.torch import TorchEtcdStore

        return TorchEtcdStore(backend["host"], backend["port"], prefix=backend["prefix"],
                              timeout=timeout, **options)
    if backend["kind"] == "tcp":
        client = dist.TCPStore(backend["host"], backend["port"], is_master=False,
                               wait_for_workers=False, timeout=timeout, use_libuv=True)
        return dist.PrefixStore(backend["prefix"], client)
    if backend["kind"] == "hash":
        shared = _hash_store(backend["prefix"])
        shared.set_timeout(timeout)
        return dist.PrefixStore(backend["prefix"], shared)
    raise ValueError(f"unknown backend {backend['kind']!r}")


class RankGroup:
    """Ranks ``ranks`` of a ``world``-rank job, running pattern ``pattern`` on ``backend``.

    ``backend``: ``{"kind": "etcd"|"tcp"|"hash", "host", "port", "prefix"}`` (``"hash"``
    ignores host and port). ``budget``: seconds,
    the store timeout of every blocking call.
    """

    def __init__(self, ranks: list[int], world: int, backend: dict[str, Any], pattern: str,
                 budget: float) -> None:
        self.ranks = list(ranks)
        self.world = world
        self.backend = dict(backend)
        self.pattern = PATTERNS[pattern]
        self.timeout = timedelta(seconds=budget)
        self._logs: dict[int, list[tuple[str, str]]] = {r: [] for r in self.ranks}
        self._inner: list[Any] = []
        self._ctx: list[RankContext] = []
        self._pool: cf.ThreadPoolExecutor | None = None
        self.aborted = False
        #: Measured steps: this process's CPU time (all its threads) and the ranks' time.
        self.cpu_s = 0.0
        self.cpu_by_thread = dict.fromkeys(THREAD_KINDS, 0.0)
        self.breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
        self._breakdown_lock = threading.Lock()
        if backend["kind"] == "etcd":
            _Probe.install()

    def connect(self) -> int:
        """Build every rank's store; returns how many were built.

        ``EtcdStore``s are built one after another; TCPStore clients 64 at a time (on a
        machine without DNS the server stalls ~10 s in reverse lookups of new clients,
        which concurrent construction pays once per batch rather than per client).
        """
        import torch.distributed as dist

        options = {**json.loads(os.environ.get(STORE_OPTIONS_ENV, "{}")),
                   **self.pattern.store_options} if self.backend["kind"] == "etcd" else {}
        if self.backend["kind"] == "tcp":
            with cf.ThreadPoolExecutor(64, thread_name_prefix="fanout-connect") as pool:
                inners = list(pool.map(lambda _: _make_store(self.backend, self.timeout, {}),
                                       self.ranks))
        else:
            inners = [_make_store(self.backend, self.timeout, options) for _ in self.ranks]
        for rank, inner in zip(self.ranks, inners, strict=True):
            self._inner.append(inner)
            store = RecordingStore(inner, self._logs[rank])
            self._ctx.append(RankContext(
                rank=rank, world=self.world, store=store,
                default_store=dist.PrefixStore("default_pg", store),
                etcd_store=getattr(inner, "etcd_store", None), timeout=self.timeout))
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, len(self.ranks)),
                                           thread_name_prefix="fanout-rank")
        # Start every rank's thread now, not in the first measured step (the pool starts a
        # thread per submission while none is idle): each waits until all have started.
        ready = threading.Barrier(len(self.ranks))
        cf.wait([self._pool.submit(ready.wait, 60) for _ in self.ranks], timeout=90)
        return len(self._ctx)

    def run_step(self, step: int, deadline: float) -> dict[str, Any]:
        """Run ``step`` on every rank concurrently (a negative step: the pattern's setup);
        see the module docstring for bounds.

        Returns ``{"errors": [...], "unfinished": n, "extras": {...}, "cpu_s": x,
        "breakdown": {...}}``; ``cpu_s`` (this process's CPU time) and ``breakdown`` (see
        :data:`BREAKDOWN_KEYS`) are totals over the measured steps so far.
        """
        if self._pool is None or self.aborted:
            return {"errors": ["group not connected or aborted"], "unfinished": len(self.ranks),
                    "extras": {}}
        run = self.pattern.step if step >= 0 else self.pattern.setup
        if run is None:
            return {"errors": [f"pattern {self.pattern.name} has no setup step {step}"],
                    "unfinished": len(self.ranks), "extras": {}}
        cpu, threads = time.process_time(), _python_thread_cpu() if step >= 0 else {}
        if step >= 0:
            submitted = time.perf_counter()
            futures = [self._pool.submit(_Probe.measure, run, ctx, step, submitted,
                                         self.breakdown, self._breakdown_lock)
                       for ctx in self._ctx]
        else:
            futures = [self._pool.submit(run, ctx, step) for ctx in self._ctx]
        done, pending = cf.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        if step >= 0:
            spent = time.process_time() - cpu
            self.cpu_s += spent
            kinds = dict.fromkeys(THREAD_KINDS, 0.0)
            for ident, (kind, now) in _python_thread_cpu().items():
                kinds[kind] += now - threads.get(ident, (kind, 0.0))[1]
            kinds["native"] = max(0.0, spent - sum(kinds.values()))
            for kind, value in kinds.items():
                self.cpu_by_thread[kind] += value
        errors: list[str] = []
        if pending:
            errors.append(f"{len(pending)} of {len(futures)} ranks had not finished step "
                          f"{step} at the deadline")
            self.abort()
            cf.wait(pending, timeout=30)
        for f in done:
            exc = f.exception()
            if exc is not None and len(errors) < 5:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        failed = sum(1 for f in done if f.exception() is not None)
        extras = {"cas_attempts": sum(c.scratch.get("cas_attempts", 0) for c in self._ctx),
                  "barrier_forwarded": sum(getattr(c.store, "barrier_calls", 0)
                                           for c in self._ctx)}
        return {"errors": errors, "unfinished": len(pending) + failed, "extras": extras,
                "cpu_s": self.cpu_s, "cpu_by_thread": dict(self.cpu_by_thread),
                "breakdown": dict(self.breakdown)}

    def settle(self, revision: int, deadline: float) -> bool:
        """Block until every etcd store applied ``revision`` (True), or ``deadline`` (False).

        TCPStore ranks, and stores watching what they touched (each scope has its own
        revision), have nothing to settle here; the simulator waits for etcd's counts.
        """
        stores = [c.etcd_store for c in self._ctx
                  if c.etcd_store is not None and not c.etcd_store._cache.scoped]
        while True:
            if all(s.closed or s.watch_revision >= revision for s in stores):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def liveness(self) -> dict[str, float]:
        """What this group's etcd stores sent so far to learn etcd is alive, by kind
        (``cachedstore_watch_liveness_requests_total``): ``ping`` (HTTP/2 PINGs, which
        etcd's metrics do not count) and ``progress`` (progress requests, which they do)."""
        totals = {"ping": 0.0, "progress": 0.0}
        for ctx in self._ctx:
            store = ctx.etcd_store
            if store is None or store.registry is None:
                continue
            for kind in totals:
                value = store.registry.get_sample_value(
                    "cachedstore_watch_liveness_requests_total", {"kind": kind})
                totals[kind] += value or 0.0
        return totals

    def access(self) -> Access:
        """Who read and wrote which key so far."""
        acc = Access()
        for rank, log in self._logs.items():
            acc.add_log(rank, log)
        return acc

    def abort(self) -> None:
        """Close every store now: calls blocked in them raise (a ``HashStore`` has no
        close: its waits end at the store timeout); the group is unusable."""
        self.aborted = True
        for inner in self._inner:
            with contextlib.suppress(Exception):
                close = getattr(inner, "close", None)
                if close is not None:
                    close()

    def close(self) -> None:
        """Close the stores and stop the rank threads (idempotent)."""
        self.abort()
        if self.backend["kind"] == "hash":
            with _hash_lock:
                _hash_stores.pop(self.backend["prefix"], None)
        self._inner.clear()
        self._ctx.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def serve(conn: Any) -> None:
    """Worker-process main: execute ``(method, args)`` requests on a :class:`RankGroup`.

    The first request must be ``("init", (ranks, world, backend, pattern, budget))``; every
    request gets ``("ok", result)`` or ``("error", traceback)``; ``("close", ())`` ends.
    """
    import logging

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    group: RankGroup | None = None
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                return
            try:
                if method == "init":
                    group = RankGroup(*args)
                    result: Any = len(group.ranks)
                elif group is None:
                    raise RuntimeError("init first")
                else:
                    result = getattr(group, method)(*args)
                conn.send(("ok", result))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            if method == "close":
                return
    finally:
        if group is not None:
            group.close()
