"""``cachedstore demo``: a high-fan-out job run against etcd twice, cached and uncached.

``--workers`` processes play the ranks of a training job. Every round each of them

1. publishes its address (``set``),
2. reads every rank's address, blocking until all are present (``mget`` with a timeout),
3. takes part in a barrier (``add`` on a counter; the last rank sets a "done" key that
   everyone waits for with a blocking ``get``),
4. reads a shared config key ``--hot-reads`` times (the hot key).

The same workload runs twice, one phase after the other, under separate key prefixes:

* **cached** -- each worker uses an :class:`~cachedstore.EtcdStore`: reads come from its
  watch-fed cache, blocking waits are woken by its one watch stream;
* **uncached** -- each worker uses :class:`UncachedClient`, a bare etcd v3 client on the same
  connection layer: every read is one etcd request (``mget``: one Txn of ranges), a
  blocking wait is a range plus, while the key is absent, one watch stream on that key, and
  ``add`` is a read followed by a compare-and-swap Txn. That is what a careful client
  without a cache does; it does not poll.

The summary compares operations, hit ratio, latency percentiles and the etcd requests of
both phases: client side (unary RPCs plus watch streams opened, from each worker's
``cachedstore_etcd_requests_total``) and as counted by etcd itself
(``grpc_server_handled_total`` on its ``/metrics``).

etcd's count is read from the first endpoint's ``/metrics`` (plain HTTP only; with TLS it
is reported as unavailable). All workers talk to the first endpoint unless it fails, so on a
cluster that is the member that sees the traffic; on a shared cluster other clients' requests
are counted too.

Without ``endpoints`` a throw-away etcd (:class:`~cachedstore.server.LocalEtcd`) is started
and removed on exit, Ctrl-C included; with ``endpoints`` the keys live under a random
``/cachedstore-demo/<id>/`` prefix that is deleted at the end.

Worker processes are started with the ``spawn`` method (gRPC does not survive ``fork``) and
ignore SIGINT: the parent stops them. Each serves its metrics on ``metrics_port + rank`` when
``metrics_port`` is given (the one-port-per-process scheme of ``grafana/prometheus.yml``).
"""

from __future__ import annotations

import array
import contextlib
import math
import multiprocessing as mp
import os
import queue
import secrets
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3 import etcdrpc
from prometheus_client import CollectorRegistry

from .config import StoreConfig
from .connection import Connection, Credentials, parse_endpoint, translate_rpc_error
from .errors import (
    EtcdConnectionError,
    EtcdError,
    KeyNotFoundError,
    StoreTimeoutError,
)
from .keys import KeySpace, to_value
from .metrics import StoreMetrics

__all__ = [
    "MODES",
    "UNCACHED_MEANS",
    "DemoError",
    "DemoSettings",
    "UncachedClient",
    "run_demo",
]

#: The two phases, in the order they run.
MODES = ("cached", "uncached")
#: What "uncached" means, printed under the table and put in the JSON summary.
UNCACHED_MEANS = (
    "uncached = a bare etcd v3 client: every read is one etcd request (mget: one Txn of "
    "ranges); a blocking wait is a range plus one watch stream on the key while it is "
    "absent; add is a read then a compare-and-swap Txn. No polling."
)
#: Seconds the parent waits for the spawned workers to import and report ready.
READY_TIMEOUT = 60.0
#: Seconds the parent waits for etcd to finish handling every RPC it started before
#: reading its request count (a closed watch stream is counted when its handler returns).
SETTLE_TIMEOUT = 3.0
_PUT = 0  # etcd mvccpb Event.EventType.PUT


class DemoError(Exception):
    """The demo cannot run or went wrong; ``exit_code`` follows the CLI's exit codes."""

    def __init__(self, message: str, exit_code: int = 3) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class DemoSettings:
    """What to run. Times in seconds. ``endpoints=None``: start a throw-away etcd."""

    workers: int = 4
    rounds: int = 20
    hot_reads: int = 200
    endpoints: tuple[str, ...] | None = None
    #: Root of the demo's keys on a real cluster; a random id is appended.
    prefix_root: str = "/cachedstore-demo/"
    #: connect_timeout and request_timeout of every client.
    dial_timeout: float = 5.0
    #: Budget of each blocking wait (all-gather, barrier).
    wait_timeout: float = 30.0
    #: Worker ``rank`` serves its metrics on ``metrics_port + rank``; None: no server.
    metrics_port: int | None = None
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        """Raise :class:`DemoError` (exit code 2) for settings that cannot work."""
        if self.workers < 1 or self.rounds < 1 or self.hot_reads < 0:
            raise DemoError("--workers and --rounds must be >= 1, --hot-reads >= 0", 2)
        if self.workers > 128:
            raise DemoError("--workers is limited to 128 (one etcd Txn per all-gather)", 2)
        if self.dial_timeout <= 0 or self.wait_timeout <= 0:
            raise DemoError("timeouts must be > 0 seconds", 2)
        if self.metrics_port is not None and not (
                self.metrics_port >= 1 and self.metrics_port + self.workers - 1 <= 65535):
            raise DemoError(f"--metrics-port {self.metrics_port}: need {self.workers} ports "
                            f"from there, all within 1..65535", 2)

    def store_config(self) -> StoreConfig:
        return StoreConfig().with_overrides(connect_timeout=self.dial_timeout,
                                            request_timeout=self.dial_timeout)

    def credentials(self) -> Credentials:
        return Credentials(self.ca_cert, self.cert_key, self.cert_cert, self.user,
                           self.password)


# --------------------------------------------------------------------------- the contender


class UncachedClient:
    """A bare etcd v3 client on cachedstore's :class:`~cachedstore.connection.Connection`.

    The same calls as the store's (``get``, ``mget``, ``set``, ``add``) with no cache:
    every read is one request; a blocking wait reads the key and, while it is absent,
    watches that one key from the revision of the read (no polling, no missed put). RPCs
    are counted in ``metrics`` like the store's (watch streams as method ``watch``).
    Not thread-safe (one per worker); every call blocks for its round trips.
    """

    def __init__(self, endpoints: Sequence[str], credentials: Credentials,
                 config: StoreConfig, metrics: StoreMetrics, prefix: str) -> None:
        self._conn = Connection([parse_endpoint(e) for e in endpoints], credentials, config,
                                metrics)
        self._keys = KeySpace(prefix, config.max_request_bytes)
        self._metrics = metrics
        #: Watch streams opened by blocking waits so far.
        self.watch_streams = 0
        try:
            self._conn.authenticate(self._conn.deadline(config.connect_timeout))
        except BaseException:
            self._conn.close()
            raise

    def _key(self, name: str | bytes) -> bytes:
        return self._keys.key(self._keys.canonical(name))

    def get(self, name: str | bytes, timeout: float | None = None) -> bytes:
        """One range; if absent and ``timeout`` is given, wait for the key's creation."""
        key = self._key(name)
        response = self._conn.call("range", etcdrpc.RangeRequest(key=key),
                                   deadline=self._conn.deadline())
        if response.kvs:
            return bytes(response.kvs[0].value)
        if timeout is None:
            raise KeyNotFoundError(name)
        return self._wait(key, response.header.revision, time.monotonic() + timeout, timeout)

    def mget(self, names: Sequence[str | bytes], timeout: float | None = None) -> list[bytes]:
        """One Txn of ranges (at most ``max_txn_ops`` names); absent keys waited for."""
        keys = [self._key(n) for n in names]
        ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k)) for k in keys]
        response = self._conn.call("txn", etcdrpc.TxnRequest(success=ops),
                                   deadline=self._conn.deadline())
        revision = response.header.revision
        deadline = None if timeout is None else time.monotonic() + timeout
        values = []
        for name, key, op in zip(names, keys, response.responses, strict=True):
            kvs = op.response_range.kvs
            if kvs:
                values.append(bytes(kvs[0].value))
            elif deadline is None:
                raise KeyNotFoundError(name)
            else:
                values.append(self._wait(key, revision, deadline, timeout))
        return values

    def set(self, name: str | bytes, value: str | bytes) -> None:
        """One put."""
        self._conn.call("put", etcdrpc.PutRequest(key=self._key(name), value=to_value(value)),
                        deadline=self._conn.deadline())

    def add(self, name: str | bytes, amount: int = 1) -> int:
        """Read the counter, then compare-and-swap it on its mod_revision until it sticks."""
        key = self._key(name)
        deadline = self._conn.deadline()
        response = self._conn.call("range", etcdrpc.RangeRequest(key=key), deadline=deadline)
        found = response.kvs[0] if response.kvs else None
        while True:
            if found is None:
                new = amount
                compare = etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                                          target=etcdrpc.Compare.CREATE, create_revision=0)
            else:
                new = int(found.value) + amount
                compare = etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                                          target=etcdrpc.Compare.MOD,
                                          mod_revision=found.mod_revision)
            request = etcdrpc.TxnRequest(
                compare=[compare],
                success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                    key=key, value=str(new).encode()))],
                failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))])
            txn = self._conn.call("txn", request, deadline=deadline)
            if txn.succeeded:
                return new
            kvs = txn.responses[0].response_range.kvs
            found = kvs[0] if kvs else None

    def delete_prefix(self) -> int:
        """Delete every key under the prefix; returns how many existed."""
        request = etcdrpc.DeleteRangeRequest(key=self._keys.range_start,
                                             range_end=self._keys.range_end)
        return int(self._conn.call("delete_range", request,
                                   deadline=self._conn.deadline()).deleted)

    def status(self) -> Any:
        """etcd's Maintenance.Status of the endpoint in use (version, db size, leader...)."""
        return self._conn.call("status", etcdrpc.StatusRequest(),
                               deadline=self._conn.deadline())

    def _wait(self, key: bytes, revision: int, deadline: float, timeout: float | None
              ) -> bytes:
        """Watch ``key`` from ``revision + 1`` until it is put; one watch stream."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeoutError(f"timed out after {timeout:g} s waiting for key {key!r}")
        done = threading.Event()
        create = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=key, start_revision=revision + 1,
            filters=[etcdrpc.WatchCreateRequest.NODELETE]))

        def requests() -> Any:
            yield create
            done.wait()  # keep the send side open: etcd ends a half-closed stream

        _, endpoint = self._conn.endpoint()
        self.watch_streams += 1
        started = time.perf_counter()
        code = "ok"
        call = endpoint.watch.Watch(requests(), timeout=remaining,
                                    metadata=self._conn.metadata())
        try:
            for response in call:
                if response.canceled:
                    code = "CANCELLED"
                    raise EtcdError(f"etcd canceled the watch on {key!r}: "
                                    f"{response.cancel_reason or 'no reason given'}")
                for event in response.events:
                    if event.type == _PUT:
                        return bytes(event.kv.value)
            code = "ENDED"
            raise EtcdConnectionError(f"the watch on {key!r} ended without the key")
        except grpc.RpcError as exc:
            status = exc.code() if hasattr(exc, "code") else None
            code = status.name if status is not None else "UNKNOWN"
            details = (exc.details() if hasattr(exc, "details") else "") or ""
            # etcd may notice the deadline first and answer UNKNOWN "context deadline exceeded"
            if status is grpc.StatusCode.DEADLINE_EXCEEDED \
                    or "deadline exceeded" in details.lower():
                raise StoreTimeoutError(
                    f"timed out after {timeout:g} s waiting for key {key!r}") from None
            raise translate_rpc_error(exc, "watch") from exc
        finally:
            done.set()
            call.cancel()
            self._metrics.rpc("watch", code, time.perf_counter() - started)

    def close(self) -> None:
        """Close the channels. Idempotent."""
        self._conn.close()

    def __enter__(self) -> UncachedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    settings: DemoSettings
    endpoints: tuple[str, ...]
    prefix: str
    parent_pid: int


def _registry_counts(registry: CollectorRegistry) -> dict[str, float]:
    """Cache hits/misses and etcd RPCs by method recorded in ``registry`` so far."""
    counts: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "cachedstore_cache_requests_total":
                key = "hits" if sample.labels.get("result") == "hit" else "misses"
            elif sample.name == "cachedstore_etcd_requests_total":
                key = "rpc:" + sample.labels.get("method", "?")
            else:
                continue
            counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _run_phase(mode: str, spec: _WorkerSpec, registry: CollectorRegistry,
               report: Callable[[tuple[Any, ...]], None]) -> dict[str, Any]:
    """One worker's share of one phase; returns its counts and latency samples."""
    s = spec.settings
    rank, workers, wait = spec.rank, s.workers, s.wait_timeout
    prefix = f"{spec.prefix}{mode}/"
    before = _registry_counts(registry)
    started = time.perf_counter()
    client: Any
    if mode == "cached":
        from .store import EtcdStore

        client = EtcdStore(endpoints=list(spec.endpoints), prefix=prefix, registry=registry,
                           config=s.store_config(), ca_cert=s.ca_cert, cert_key=s.cert_key,
                           cert_cert=s.cert_cert, user=s.user, password=s.password)
    else:
        client = UncachedClient(spec.endpoints, s.credentials(), s.store_config(),
                                StoreMetrics(registry), prefix)
    hot, gather, barrier = array.array("d"), array.array("d"), array.array("d")
    ops = reads = 0
    clock = time.perf_counter
    try:
        if rank == 0:
            client.set("config", '{"lr": 0.001, "batch_size": 512, "nccl_timeout_s": 600}')
            ops += 1
        names = [[f"r{r}/addr/{i}" for i in range(workers)] for r in range(s.rounds)]
        address = f"10.0.{rank // 250}.{rank % 250 + 1}:29500"
        for r in range(s.rounds):
            t0 = clock()
            client.set(f"r{r}/addr/{rank}", address)
            client.mget(names[r], timeout=wait)
            t1 = clock()
            if client.add(f"r{r}/arrived", 1) == workers:
                client.set(f"r{r}/done", "1")
                ops += 1
            client.get(f"r{r}/done", timeout=wait)
            t2 = clock()
            gather.append(t1 - t0)
            barrier.append(t2 - t1)
            for _ in range(s.hot_reads):
                t = clock()
                client.get("config", timeout=wait)
                hot.append(clock() - t)
            ops += 4 + s.hot_reads
            reads += workers + 1 + s.hot_reads
            report(("progress", rank, mode))
        wall = clock() - started
        if mode == "cached":
            watch_streams = 1 + int(client.stats()["watch_restarts"])
        else:
            watch_streams = client.watch_streams
    finally:
        client.close()
    after = _registry_counts(registry)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    rpcs = {k[4:]: v for k, v in delta.items() if k.startswith("rpc:") and v}
    if mode == "cached":  # the store's own watch stream is not a unary RPC: count it here
        rpcs["watch"] = rpcs.get("watch", 0.0) + watch_streams
    return {
        "rank": rank, "mode": mode, "wall": wall, "ops": ops, "reads": reads,
        "hits": delta.get("hits", 0.0), "misses": delta.get("misses", 0.0), "rpcs": rpcs,
        "hot": hot.tobytes(), "gather": gather.tobytes(), "barrier": barrier.tobytes(),
    }


def _worker_main(spec: _WorkerSpec, go: Sequence[Any], abort: Any, out: Any) -> None:
    """Entry point of a worker process (spawned): wait for each phase's go, run it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    server = None
    try:
        registry = CollectorRegistry()
        if spec.settings.metrics_port is not None:
            from .exposition import start_metrics_server

            server = start_metrics_server(spec.settings.metrics_port + spec.rank,
                                          registry=registry)
        out.put(("ready", spec.rank, None))
        for index, mode in enumerate(MODES):
            while not go[index].wait(0.2):
                if abort.is_set() or os.getppid() != spec.parent_pid:
                    return
            out.put(("done", spec.rank, _run_phase(mode, spec, registry, out.put)))
    except BaseException as exc:  # reported to the parent, which prints one line
        from .cli import exit_code_for, one_line

        out.put(("error", spec.rank, (exit_code_for(exc), one_line(exc))))
    finally:
        if server is not None:
            server.close()


# --------------------------------------------------------------------------- the parent


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not); 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _etcd_counts(metrics_url: str | None) -> dict[str, float] | None:
    """etcd's ``grpc_server_handled_total`` by method (and started/handled totals) from its
    ``/metrics``, or None when it cannot be read."""
    if metrics_url is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(metrics_url, timeout=3.0) as response:
            text = response.read().decode()
        counts: dict[str, float] = {"started": 0.0, "handled": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "grpc_server_started_total":
                    counts["started"] += sample.value
                elif sample.name == "grpc_server_handled_total":
                    counts["handled"] += sample.value
                    method = "etcd:" + sample.labels.get("grpc_method", "?")
                    counts[method] = counts.get(method, 0.0) + sample.value
        return counts
    except (OSError, ValueError):
        return None


def _settled_etcd_counts(metrics_url: str | None, before: dict[str, float] | None
                         ) -> dict[str, float] | None:
    """:func:`_etcd_counts` once etcd has handled every RPC the phase started: once no more
    RPCs are in flight than when the phase began (``before``), or after ``SETTLE_TIMEOUT``."""
    baseline = 0.0 if before is None else before["started"] - before["handled"]
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        counts = _etcd_counts(metrics_url)
        if counts is None or counts["started"] - counts["handled"] <= baseline \
                or time.monotonic() >= deadline:
            return counts
        time.sleep(0.02)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _phase_summary(results: list[dict[str, Any]], wall: float,
                   etcd_before: dict[str, float] | None,
                   etcd_after: dict[str, float] | None) -> dict[str, Any]:
    def merged(name: str) -> array.array[float]:
        out = array.array("d")
        for result in results:
            out.frombytes(result[name])
        return out

    hot, gather, barrier = merged("hot"), merged("gather"), merged("barrier")
    rpcs: dict[str, float] = {}
    for result in results:
        for method, n in result["rpcs"].items():
            rpcs[method] = rpcs.get(method, 0.0) + n
    hits = sum(r["hits"] for r in results)
    misses = sum(r["misses"] for r in results)
    server: dict[str, int] | None = None
    if etcd_before is not None and etcd_after is not None:
        server = {k[5:]: int(v - etcd_before.get(k, 0.0)) for k, v in etcd_after.items()
                  if k.startswith("etcd:") and v - etcd_before.get(k, 0.0) > 0}
    return {
        "wall_seconds": round(wall, 3),
        "operations": sum(r["ops"] for r in results),
        "reads": sum(r["reads"] for r in results),
        "cache_hits": int(hits),
        "cache_misses": int(misses),
        "hit_ratio": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "hot_read_p50_us": round(_percentile(hot, 0.50) * 1e6, 1),
        "hot_read_p99_us": round(_percentile(hot, 0.99) * 1e6, 1),
        "all_gather_p50_ms": round(_percentile(gather, 0.50) * 1e3, 3),
        "all_gather_p99_ms": round(_percentile(gather, 0.99) * 1e3, 3),
        "barrier_p50_ms": round(_percentile(barrier, 0.50) * 1e3, 3),
        "barrier_p99_ms": round(_percentile(barrier, 0.99) * 1e3, 3),
        "etcd_requests_client": int(sum(rpcs.values())),
        "etcd_requests_client_by_method": {k: int(v) for k, v in sorted(rpcs.items())},
        "etcd_requests_server": None if server is None else sum(server.values()),
        "etcd_requests_server_by_method": server,
    }


def _ratio(uncached: float | None, cached: float | None) -> float | None:
    if uncached is None or cached is None or cached <= 0:
        return None
    return round(uncached / cached, 1)


class _Progress:
    """The live display: a rich progress bar per phase, on stderr. Main thread only."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._total = total
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.console = Console(stderr=True)
            self._progress = Progress(
                TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("rounds"), TimeElapsedColumn(), console=self.console)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def __enter__(self) -> _Progress:
        if self._progress is not None:
            self._progress.start()
            for mode in MODES:
                self._tasks[mode] = self._progress.add_task(mode, total=self._total,
                                                            start=False)
        return self

    def start(self, mode: str) -> None:
        if self._progress is not None:
            self._progress.start_task(self._tasks[mode])

    def advance(self, mode: str) -> None:
        if self._progress is not None:
            self._progress.advance(self._tasks[mode])

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def run_demo(settings: DemoSettings, *, progress: bool = True) -> dict[str, Any]:
    """Run the demo and return its summary (what ``--json`` prints).

    Blocks until both phases are done (well under a minute with the defaults on 2 cores).
    Starts and always removes its own etcd when ``settings.endpoints`` is None; stops its
    worker processes and (on a real cluster) deletes its keys on every way out, including
    KeyboardInterrupt, which is re-raised. Raises :class:`DemoError` with an exit code
    when etcd cannot be started or reached or a worker fails. Call from the main thread.
    """
    settings.validate()
    if settings.metrics_port is not None:
        taken = [p for p in range(settings.metrics_port,
                                  settings.metrics_port + settings.workers) if not _port_free(p)]
        if taken:
            raise DemoError(f"--metrics-port: port {taken[0]} on 127.0.0.1 is in use "
                            f"(the demo needs {settings.workers} ports from "
                            f"{settings.metrics_port})", 2)
    total = settings.workers * settings.rounds
    display = _Progress(progress, total)
    with contextlib.ExitStack() as stack:
        etcd_info = _start_etcd(settings, display, stack)
        prefix = f"{settings.prefix_root.rstrip('/')}/{secrets.token_hex(4)}/"
        if settings.endpoints is not None:
            stack.callback(_delete_keys, settings, prefix)
        summary = _run_workers(settings, etcd_info, prefix, display, stack)
    return summary


def _start_etcd(settings: DemoSettings, display: _Progress, stack: contextlib.ExitStack
                ) -> dict[str, Any]:
    """Start the throw-away etcd or check the given endpoints; returns where it is."""
    from .server import EtcdNotFoundError, EtcdStartError, LocalEtcd

    if settings.endpoints is None:
        try:
            etcd = LocalEtcd()
        except EtcdNotFoundError as exc:
            raise DemoError(f"cannot start etcd: {exc}") from None
        stack.callback(etcd.close)
        try:
            etcd.start()
        except EtcdStartError as exc:
            raise DemoError(f"cannot start etcd: {str(exc).splitlines()[0]}") from None
        endpoints: tuple[str, ...] = (etcd.endpoint,)
        metrics_url: str | None = f"{etcd.metrics_url}/metrics"
        embedded = True
    else:
        endpoints = settings.endpoints
        scheme = "https" if settings.ca_cert or settings.cert_cert else "http"
        metrics_url = None if scheme == "https" else f"http://{endpoints[0]}/metrics"
        embedded = False
    with UncachedClient(endpoints, settings.credentials(), settings.store_config(),
                        StoreMetrics(CollectorRegistry()), "/") as client:
        version = client.status().version
    if _etcd_counts(metrics_url) is None:
        metrics_url = None
    where = ("a throw-away local etcd, removed on exit" if embedded
             else "the given cluster; keys under a demo prefix, deleted at the end")
    display.note(f"etcd {version} at {', '.join(endpoints)} ({where})")
    return {"endpoints": list(endpoints), "embedded": embedded, "version": version,
            "metrics_url": metrics_url}


def _delete_keys(settings: DemoSettings, prefix: str) -> None:
    """Delete the demo's keys on a real cluster (best effort, bounded by dial_timeout)."""
    assert settings.endpoints is not None
    with contextlib.suppress(Exception), UncachedClient(
            settings.endpoints, settings.credentials(), settings.store_config(),
            StoreMetrics(CollectorRegistry()), prefix) as client:
        client.delete_prefix()


def _stop_processes(processes: Sequence[Any], abort: Any) -> None:
    """Stop the workers still running (after an error or Ctrl-C): SIGTERM, then SIGKILL."""
    abort.set()
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _run_workers(settings: DemoSettings, etcd_info: dict[str, Any], prefix: str,
                 display: _Progress, stack: contextlib.ExitStack) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = [ctx.Event() for _ in MODES]
    abort = ctx.Event()
    endpoints = tuple(etcd_info["endpoints"])
    processes = [
        ctx.Process(target=_worker_main, name=f"cachedstore-demo-worker-{rank}",
                    args=(_WorkerSpec(rank, settings, endpoints, prefix, os.getpid()),
                          go, abort, out), daemon=True)
        for rank in range(settings.workers)]
    stack.callback(_stop_processes, processes, abort)
    for proc in processes:
        proc.start()

    def receive(kind: str, timeout: float) -> list[Any]:
        """Messages of ``kind`` from every worker; progress messages update the bars."""
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < settings.workers:
            try:
                message = out.get(timeout=0.1)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise DemoError(f"worker {dead[0].name} died (exit code "
                                    f"{dead[0].exitcode})", 6) from None
                if time.monotonic() >= deadline:
                    raise DemoError(f"workers made no progress for {timeout:g} s", 5) from None
                continue
            tag, rank, payload = message
            if tag == "error":
                code, text = payload
                raise DemoError(f"worker {rank}: {text}", code)
            if tag == "progress":
                display.advance(payload)
                deadline = time.monotonic() + timeout
            elif tag == kind:
                got.append(payload)
        return got

    if settings.metrics_port is not None:
        last = settings.metrics_port + settings.workers - 1
        display.note(f"metrics: http://127.0.0.1:{settings.metrics_port}/metrics"
                     + (f" .. :{last}" if last != settings.metrics_port else "")
                     + " (one port per worker)")
    receive("ready", READY_TIMEOUT)
    stall = settings.wait_timeout + 2 * settings.dial_timeout + 10.0
    phases: dict[str, Any] = {}
    with display:
        for index, mode in enumerate(MODES):
            before = _etcd_counts(etcd_info["metrics_url"])
            display.start(mode)
            started = time.perf_counter()
            go[index].set()
            results = receive("done", stall)
            wall = time.perf_counter() - started
            after = _settled_etcd_counts(etcd_info["metrics_url"], before)
            phases[mode] = _phase_summary(results, wall, before, after)
    for proc in processes:  # they exit on their own after the last phase
        proc.join(5.0)
    cached, uncached = phases["cached"], phases["uncached"]
    return {
        "workers": settings.workers,
        "rounds": settings.rounds,
        "hot_reads_per_round": settings.hot_reads,
        "etcd": {k: etcd_info[k] for k in ("endpoints", "embedded", "version")},
        "prefix": prefix,
        "cached": cached,
        "uncached": uncached,
        "reduction": {
            "etcd_requests_client": _ratio(uncached["etcd_requests_client"],
                                           cached["etcd_requests_client"]),
            "etcd_requests_server": _ratio(uncached["etcd_requests_server"],
                                           cached["etcd_requests_server"]),
            "hot_read_p50": _ratio(uncached["hot_read_p50_us"], cached["hot_read_p50_us"]),
            "wall_time": _ratio(uncached["wall_seconds"], cached["wall_seconds"]),
        },
        "uncached_means": UNCACHED_MEANS,
    }


# --------------------------------------------------------------------------- the table


def _fmt_seconds(value: float) -> str:
    """Three significant digits (one decimal at least below 10 µs): 0.8 µs, 657 µs, 3.30 ms."""
    for scale, unit in ((1e-6, "µs"), (1e-3, "ms"), (1.0, "s")):
        scaled = value / scale
        if scaled < 1000 or unit == "s":
            if unit == "µs" and scaled < 10:
                return f"{scaled:.1f} {unit}"
            digits = 0 if scaled >= 100 else 1 if scaled >= 10 else 2
            return f"{scaled:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}×"


def render_table(summary: dict[str, Any]) -> Any:
    """The summary as a rich renderable (a table with a footnote)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c, u, red = summary["cached"], summary["uncached"], summary["reduction"]
    title = (f"cachedstore demo: {summary['workers']} workers × {summary['rounds']} rounds × "
             f"{summary['hot_reads_per_round']} hot reads, etcd {summary['etcd']['version']}")
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("cached", justify="right")
    table.add_column("uncached", justify="right")
    table.add_column("reduction", justify="right")

    def pair(p: dict[str, Any], a: str, b: str, scale: float) -> str:
        return f"{_fmt_seconds(p[a] * scale)} / {_fmt_seconds(p[b] * scale)}"

    def count(value: int | None) -> str:
        return "n/a" if value is None else f"{value:,}"

    table.add_row("wall time", _fmt_seconds(c["wall_seconds"]),
                  _fmt_seconds(u["wall_seconds"]), _fmt_ratio(red["wall_time"]))
    table.add_row("operations", f"{c['operations']:,}", f"{u['operations']:,}", "")
    table.add_row("hit ratio (reads)", f"{c['hit_ratio']:.1%}", "— (no cache)", "")
    table.add_row("hot read p50 / p99", pair(c, "hot_read_p50_us", "hot_read_p99_us", 1e-6),
                  pair(u, "hot_read_p50_us", "hot_read_p99_us", 1e-6),
                  _fmt_ratio(red["hot_read_p50"]))
    table.add_row("all-gather p50 / p99",
                  pair(c, "all_gather_p50_ms", "all_gather_p99_ms", 1e-3),
                  pair(u, "all_gather_p50_ms", "all_gather_p99_ms", 1e-3), "")
    table.add_row("barrier p50 / p99", pair(c, "barrier_p50_ms", "barrier_p99_ms", 1e-3),
                  pair(u, "barrier_p50_ms", "barrier_p99_ms", 1e-3), "")
    table.add_row("etcd requests, client", count(c["etcd_requests_client"]),
                  count(u["etcd_requests_client"]), _fmt_ratio(red["etcd_requests_client"]))
    table.add_row("etcd requests, etcd", count(c["etcd_requests_server"]),
                  count(u["etcd_requests_server"]), _fmt_ratio(red["etcd_requests_server"]))
    notes = Text(
        f"{UNCACHED_MEANS}\nclient: unary RPCs + watch streams opened (the workers' "
        f"cachedstore_etcd_requests_total); etcd: grpc_server_handled_total on its /metrics"
        f" over the phase.\nOne run on this machine: orientation, not a benchmark "
        f"(see benchmarks/).", style="dim")
    return Group(table, notes)
