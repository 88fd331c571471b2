"""W simulated ranks against one etcd (or one TCPStore server): :func:`run_pattern`.

The ranks are split into contiguous blocks, one :class:`~benchmarks.fanout.worker.RankGroup`
per block: in this process (``processes=0``, the default up to W = 64) or in ``processes``
spawned worker processes. Each rank has its own store, so etcd sees W clients, W watch
streams and W caches, as in a real job.

One call of :func:`run_pattern` measures one pattern on fresh stores under a fresh job
prefix, from etcd's own ``/metrics``:

1. sample; build the W stores; wait until every store's watch applied etcd's current
   revision; sample again: the *connect* counts;
2. run the pattern's steps (each step on all ranks concurrently, steps separated by this
   function); the *wall* time runs from the first step's start to the last step's end;
3. wait until every store's watch applied etcd's current revision (so every watch message
   the pattern caused was sent), sample: the pattern's *counts*;
4. close everything.

Bounds: the steps share ``budget`` seconds (an absolute deadline every worker enforces by
closing its stores, after which the result says ``finished=False`` and carries the counts up
to then); every settle wait is bounded; worker processes are killed if they do not exit.
Blocking: the call blocks for the whole measurement. Not thread-safe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .etcd_metrics import Counts, SettledSampler
from .patterns import PATTERNS
from .recording import Access
from .worker import RankGroup, serve

__all__ = ["PatternResult", "PatternUnsupportedError", "default_processes", "run_pattern"]

SETTLE_TIMEOUT = 60.0
#: etcd's counts must stand still this long (seconds) for a pattern's traffic to be over.
QUIET_FOR = 0.3
CONNECT_TIMEOUT = 300.0


class PatternUnsupportedError(ValueError):
    """The installed torch lacks an API the pattern calls (``Pattern.unsupported``)."""


@dataclass
class PatternResult:
    """One pattern at one W: etcd's counts (None for TCPStore), wall time, deliveries."""

    pattern: str
    world: int
    backend: str
    wall_s: float
    finished: bool
    counts: Counts | None = None
    connect: Counts | None = None
    connect_s: float = 0.0
    needed_deliveries: int = 0
    semantic_writes: int = 0
    errors: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    processes: int = 0
    #: CPU time of the processes the ranks ran in, during the measured steps (seconds,
    #: all their threads: ranks, watches, gRPC), summed over the processes.
    client_cpu_s: float = 0.0
    #: The ranks' time in the measured steps, summed over ranks (``worker.BREAKDOWN_KEYS``).
    breakdown: dict[str, float] = field(default_factory=dict)
    #: ``client_cpu_s`` by thread kind (``worker.THREAD_KINDS``).
    cpu_by_thread: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern, "world": self.world, "backend": self.backend,
            "wall_s": self.wall_s, "finished": self.finished, "connect_s": self.connect_s,
            "counts": self.counts.as_dict() if self.counts else None,
            "per_rank": self.counts.per_rank(self.world) if self.counts else None,
            "connect": self.connect.as_dict() if self.connect else None,
            "needed_deliveries": self.needed_deliveries,
            "semantic_writes": self.semantic_writes, "errors": self.errors,
            "extras": self.extras, "processes": self.processes,
            "client_cpu_s": self.client_cpu_s, "breakdown": self.breakdown,
            "cpu_by_thread": self.cpu_by_thread,
        }


def default_processes(world: int) -> int:
    """0 (ranks as threads of this process) up to W = 64, else 4 worker processes."""
    return 0 if world <= 64 else 4


class _Remote:
    """A :class:`RankGroup` in a spawned process, called through a pipe."""

    def __init__(self, ctx: Any, name: str) -> None:
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child,), name=name, daemon=True)
        self._proc.start()
        child.close()

    def send(self, method: str, *args: Any) -> None:
        self._conn.send((method, args))

    def result(self, timeout: float) -> Any:
        if not self._conn.poll(max(0.0, timeout)):
            raise TimeoutError(f"worker {self._proc.name} did not answer within {timeout:.0f} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {self._proc.name} failed:\n{value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("close")
            self.result(30)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


class _Local:
    """A :class:`RankGroup` in this process, with the same send/result interface."""

    def __init__(self) -> None:
        self._group: RankGroup | None = None
        self._pending: list[tuple[str, tuple[Any, ...]]] = []

    def send(self, method: str, *args: Any) -> None:
        self._pending.append((method, args))

    def result(self, timeout: float) -> Any:
        method, args = self._pending.pop(0)
        if method == "init":
            self._group = RankGroup(*args)
            return len(self._group.ranks)
        if self._group is None:
            raise RuntimeError("init first")
        return getattr(self._group, method)(*args)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()


def _split(world: int, parts: int) -> list[list[int]]:
    parts = max(1, min(parts, world))
    size, extra = divmod(world, parts)
    out, start = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _call_all(workers: list[Any], method: str, *args: Any, timeout: float) -> list[Any]:
    for w in workers:
        w.send(method, *args)
    deadline = time.monotonic() + timeout
    return [w.result(deadline - time.monotonic()) for w in workers]


def run_pattern(pattern: str, world: int, etcd_endpoint: str | None = None,
                metrics_url: str | None = None, *, tcp_endpoint: str | None = None,
                in_process: bool = False, processes: int | None = None,
                budget: float = 120.0, prefix: str | None = None) -> PatternResult:
    """Run ``pattern`` (a key of :data:`~benchmarks.fanout.patterns.PATTERNS`) with
    ``world`` simulated ranks, each with its own store, and measure it.

    Exactly one of ``etcd_endpoint`` (``"host:port"``, with ``metrics_url`` its
    ``http://host:port`` metrics base, e.g. ``LocalEtcd.metrics_url``), ``tcp_endpoint``
    (a ``TCPStore`` server) or ``in_process`` is given. ``in_process``: the ranks share one
    ``HashStore`` of this process (they must be its threads: ``processes=0``), the floor
    that no store over a network can go below: the harness's and torch's own CPU. Returns a :class:`PatternResult` whose ``counts`` are
    etcd's traffic of the pattern (``None`` for TCPStore); ``counts.per_rank(world)`` gives
    the per-rank figures. Raises ``ValueError`` for an unknown pattern or bad arguments,
    ``RuntimeError``/``TimeoutError`` if a worker fails to start or answer,
    :class:`PatternUnsupportedError` (before starting anything) if the installed torch
    lacks an API the pattern calls.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {sorted(PATTERNS)}")
    if (etcd_endpoint is not None) + (tcp_endpoint is not None) + in_process != 1:
        raise ValueError("give exactly one of etcd_endpoint, tcp_endpoint and in_process")
    if in_process and processes != 0:
        raise ValueError("in_process needs the ranks as threads of this process: "
                         f"processes=0, not {processes}")
    if etcd_endpoint is not None and metrics_url is None:
        raise ValueError("etcd_endpoint needs metrics_url (etcd's /metrics base URL)")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    reason = PATTERNS[pattern].unsupported(world)
    if reason is not None:
        raise PatternUnsupportedError(f"{pattern} at W={world}: {reason}")
    endpoint = etcd_endpoint or tcp_endpoint or ":0"
    host, _, port = endpoint.rpartition(":")
    kind = "etcd" if etcd_endpoint is not None else "tcp" if tcp_endpoint else "hash"
    job = prefix or f"/fanout/{uuid.uuid4().hex[:8]}/{pattern}/"
    backend = {"kind": kind, "host": host, "port": int(port), "prefix": job}
    nproc = default_processes(world) if processes is None else processes
    blocks = _split(world, nproc or 1)
    if nproc:
        ctx = mp.get_context("spawn")
        workers: list[Any] = [_Remote(ctx, f"fanout-worker-{i}") for i in range(len(blocks))]
    else:
        workers = [_Local()]
    # etcd's counts, each covering every proposal committed before it (SettledSampler).
    measure = SettledSampler(etcd_endpoint, metrics_url) \
        if etcd_endpoint is not None and metrics_url is not None else None
    try:
        for w, ranks in zip(workers, blocks, strict=True):
            w.send("init", ranks, world, backend, pattern, budget)
        for w in workers:
            w.result(60)
        s0 = measure() if measure else None
        t = time.perf_counter()
        _call_all(workers, "connect", timeout=CONNECT_TIMEOUT)
        setup = PATTERNS[pattern].setup_steps
        for step in range(-setup, 0):  # unmeasured (counted with the connection)
            for reply in _call_all(workers, "run_step", step, time.monotonic() + budget,
                                   timeout=budget + 60):
                if reply["errors"]:
                    raise RuntimeError(f"{pattern} setup step {step}: {reply['errors']}")
        connect_s = time.perf_counter() - t
        s1 = None
        live1: dict[str, float] = {}
        if measure and s0 is not None:
            s1 = _settled(workers, measure)
            live1 = _liveness(workers)
        deadline = time.monotonic() + budget
        errors: list[str] = []
        extras: dict[str, Any] = {}
        finished = True
        replies: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for step in range(PATTERNS[pattern].steps(world)):
            replies = _call_all(workers, "run_step", step, deadline,
                                timeout=max(0.0, deadline - time.monotonic()) + 60)
            for reply in replies:
                errors.extend(e for e in reply["errors"] if len(errors) < 10)
                for k, v in reply["extras"].items():
                    extras[k] = v  # cumulative per rank: the last step's totals
                if reply["unfinished"]:
                    finished = False
            if not finished:
                break
        wall = time.perf_counter() - t0
        for summed in ("cas_attempts", "barrier_forwarded"):  # per worker: their sum
            if summed in extras:
                extras[summed] = sum(r["extras"].get(summed, 0) for r in replies)
        client_cpu = sum(r.get("cpu_s", 0.0) for r in replies)  # totals so far, per worker
        breakdown: dict[str, float] = {}
        by_thread: dict[str, float] = {}
        for reply in replies:
            for total, part in ((breakdown, reply.get("breakdown", {})),
                                (by_thread, reply.get("cpu_by_thread", {}))):
                for k, v in part.items():
                    total[k] = total.get(k, 0.0) + v
        counts = connect = None
        if measure and s0 is not None and s1 is not None:
            s2 = _settled(workers, measure)
            counts, connect = s2.minus(s1), s1.minus(s0)
            live2 = _liveness(workers)
            for what, total in live2.items():  # totals over the job, as counts are
                extras[f"liveness_{what}"] = total - live1.get(what, 0.0)
        access = Access()
        for part in _call_all(workers, "access", timeout=120):
            access.merge(part)
        return PatternResult(
            pattern=pattern, world=world, backend=kind, wall_s=wall, finished=finished,
            counts=counts, connect=connect, connect_s=connect_s,
            needed_deliveries=access.needed_deliveries(), semantic_writes=access.n_writes,
            errors=errors, extras=extras, processes=nproc, client_cpu_s=client_cpu,
            breakdown=breakdown, cpu_by_thread=by_thread)
    finally:
        for w in workers:
            w.close()
        if measure is not None:
            measure.close()


def _liveness(workers: list[Any]) -> dict[str, float]:
    """Every store's liveness messages so far, by kind, summed over the workers."""
    totals: dict[str, float] = {}
    for part in _call_all(workers, "liveness", timeout=60):
        for kind, value in part.items():
            totals[kind] = totals.get(kind, 0.0) + value
    return totals


def _settled(workers: list[Any], measure: Any) -> Any:
    """Wait until every store watching its prefix applied etcd's current revision, and
    etcd's revision and event messages stand still (a store watching what it touched has
    no revision to wait for: a scope whose keys did not change never reaches it); sample
    etcd again."""
    revision = measure().revision
    _call_all(workers, "settle", revision, time.monotonic() + SETTLE_TIMEOUT,
              timeout=SETTLE_TIMEOUT + 30)
    last = measure()
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while time.monotonic() < deadline:
        time.sleep(QUIET_FOR)
        now = measure()
        if _unasked(now) == _unasked(last) and now.revision == last.revision:
            return now
        last = now
    return last


def _unasked(sample: Any) -> int:
    """Watch messages etcd sent that answered nothing: events. A quiet store's progress
    request and its answer leave this unchanged, so W idle stores asking every
    ``progress_interval`` (512 a second at W = 1,024) no longer keep a settle waiting its
    whole timeout, and the counts no longer carry that wait's progress traffic."""
    return int(sample.watch_msgs_sent - sample.watch_msgs_received)
