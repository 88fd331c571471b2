"""Workload 3, coherence lag: another client's put → visible through this store.

Each trial uses a fresh key. The writer is a raw etcd3 client (another client than the
store); ``t0`` is taken just before its ``put``.

- "blocked get": this store's ``get(key, timeout=…)`` is already waiting (the store reports
  the waiter) when the put starts; lag = return of the get − t0. The watch thread's
  ``apply_events`` is timed too (benchmark-only wrapper on the cache instance), which
  splits the lag into etcd → watch delivery and the wake-up of the blocked thread.
- "polling get": a thread reads ``get(key, default=None)`` in a tight loop (the key's
  absence is cached, so each read is a cache lookup) until the value shows; once with
  CPython's default GIL switch interval (5 ms) and once with 0.5 ms.

The same blocked-get wake-up is measured for TCPStore (server in another process) and
torch's v2 EtcdStore, where the reader is given 2 ms to block before the write (and, for
torch v2, the directory is created first: see the comment in ``test_wake_up_others``).
"""

from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from typing import Any

import harness
import pytest

VALUE = b"c" * 32
_TORCH_V2, _ = harness.torch_v2_available()


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "trials": len(samples),
        "p50_s": harness.percentile(samples, 50),
        "p90_s": harness.percentile(samples, 90),
        "p99_s": harness.percentile(samples, 99),
        "max_s": max(samples) if samples else float("nan"),
        "mean_s": statistics.fmean(samples) if samples else float("nan"),
    }


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the reader did not block in time")
        time.sleep(0.00005)


def test_coherence_blocked_get(benchmark: Any, env: harness.Env, record: Any,
                               scale: harness.Scale) -> None:
    store = env.store(prefix=env.unique("lag"))
    writer = env.etcd3()
    applied: list[float] = []
    apply_events = store._cache.apply_events

    def timed_apply(events: Any, revision: int, scope: Any = None) -> None:
        applied.append(time.perf_counter())
        apply_events(events, revision, scope)

    store._cache.apply_events = timed_apply  # benchmark-only instrumentation
    keys: queue.Queue[str | None] = queue.Queue()
    seen: queue.Queue[float] = queue.Queue()

    def reader() -> None:
        while (key := keys.get()) is not None:
            store.get(key, timeout=10)
            seen.put(time.perf_counter())

    thread = threading.Thread(target=reader, name="bench-lag-reader", daemon=True)
    thread.start()
    lag, after_ack, delivery, wake = [], [], [], []

    def trials() -> None:
        for i in range(scale.coherence_trials):
            key = f"k{i}"
            keys.put(key)
            _wait_for(lambda: store._cache.n_waiters >= 1)
            applied.clear()
            t0 = time.perf_counter()
            writer.put(store.prefix.decode() + key, VALUE)
            t_ack = time.perf_counter()
            t_seen = seen.get(timeout=10)
            lag.append(t_seen - t0)
            after_ack.append(t_seen - t_ack)
            if applied:
                delivery.append(applied[0] - t0)
                wake.append(t_seen - applied[0])

    try:
        harness.bench_rounds(benchmark, trials, rounds=1)
    finally:
        keys.put(None)
        thread.join(10)
    assert len(lag) == scale.coherence_trials
    record("coherence/cachedstore blocked get", contender="cachedstore blocked get",
           lag=_summary(lag), after_put_ack=_summary(after_ack),
           watch_delivery=_summary(delivery), wake_up=_summary(wake),
           p50_s=harness.percentile(lag, 50), p99_s=harness.percentile(lag, 99))


@pytest.mark.parametrize("switch_interval", [None, 0.0005], ids=["default", "0.5ms"])
def test_coherence_polling_get(benchmark: Any, env: harness.Env, record: Any,
                               scale: harness.Scale, switch_interval: float | None) -> None:
    """A spinning reader holds the GIL; with ``sys.setswitchinterval(0.0005)`` (instead of
    5 ms) the watch thread gets it back sooner, which shows where the lag comes from."""
    store = env.store(prefix=env.unique("lagpoll"))
    writer = env.etcd3()
    lag = []

    def trials() -> None:
        for i in range(scale.coherence_trials):
            key = f"k{i}"
            assert store.get(key, default=None) is None  # absence now cached
            ready = threading.Event()
            out: list[float] = []

            def poll(key: str = key, ready: threading.Event = ready, out: list = out) -> None:
                get = store.get
                deadline = time.perf_counter() + 10
                ready.set()
                while get(key, default=None) is None:
                    if time.perf_counter() > deadline:
                        return
                out.append(time.perf_counter())

            t = threading.Thread(target=poll, name="bench-lag-poller", daemon=True)
            t.start()
            ready.wait(5)
            t0 = time.perf_counter()
            writer.put(store.prefix.decode() + key, VALUE)
            t.join(15)
            assert out, "the polling reader never saw the put"
            lag.append(out[0] - t0)

    old = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        harness.bench_rounds(benchmark, trials, rounds=1)
    finally:
        sys.setswitchinterval(old)
    name = "cachedstore polling get" + (
        "" if switch_interval is None else f", switch interval {switch_interval * 1e3:g} ms")
    record(f"coherence/{name}", contender=name, switch_interval_s=switch_interval or old,
           lag=_summary(lag), p50_s=harness.percentile(lag, 50),
           p99_s=harness.percentile(lag, 99))


OTHERS = ["TCPStore blocked get (server in another process)"]
if _TORCH_V2:
    OTHERS.append("torch v2 EtcdStore blocked get")


@pytest.mark.parametrize("contender", OTHERS)
def test_wake_up_others(benchmark: Any, env: harness.Env, record: Any, scale: harness.Scale,
                        contender: str) -> None:
    prefix = env.unique("wake")
    if contender.startswith("TCPStore"):
        reader_store, writer_store = env.tcp_store(True), env.tcp_store(True)
        prefix_for: Any = lambda i: f"{prefix}k{i}"  # noqa: E731
    else:
        reader_store = writer_store = None
        prefix_for = lambda i: "k"  # noqa: E731
    lag = []

    def trials() -> None:
        for i in range(scale.other_coherence_trials):
            if contender.startswith("torch v2"):  # a fresh directory per trial
                r = env.torch_v2_store(f"{prefix}t{i}")
                w = env.torch_v2_store(f"{prefix}t{i}")
                # The directory must exist before the reader looks: when it does not, torch's
                # store watches from index 0 ("from now") after its read and misses a write
                # that lands in between, then blocks until its timeout.
                w.set("present", VALUE)
            else:
                r, w = reader_store, writer_store
            key = prefix_for(i)
            out: list[float] = []

            def read(r: Any = r, key: str = key, out: list = out) -> None:
                r.get(key)
                out.append(time.perf_counter())

            t = threading.Thread(target=read, name="bench-wake-reader", daemon=True)
            t.start()
            time.sleep(0.002)  # let the reader block (benchmark only)
            t0 = time.perf_counter()
            w.set(key, VALUE)
            t.join(30)
            assert out, f"{contender}: the reader never woke"
            lag.append(out[0] - t0)

    harness.bench_rounds(benchmark, trials, rounds=1)
    record(f"coherence/{contender}", contender=contender, lag=_summary(lag),
           p50_s=harness.percentile(lag, 50), p99_s=harness.percentile(lag, 99))


_WRITER = """
import sys, etcd3
c = etcd3.client(sys.argv[1], int(sys.argv[2]))
for i in range(int(sys.argv[4])):
    c.put(f"{sys.argv[3]}k{i}", b"w" * 64)
"""


def _thread_cpu() -> dict[int, float]:
    """CPU seconds used so far by each thread of this process (Linux ``/proc``)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def test_watch_cpu_per_event(benchmark: Any, env: harness.Env, record: Any,
                             scale: harness.Scale) -> None:
    """CPU this process spends per watch event: another process puts N keys one by one (N
    revisions, N watch responses) while one store here applies them. Split by thread: the
    store's watch thread (and, within it, the store's own ``Watcher._handle``) and all other
    threads (gRPC's). Explains the all-gather wall times: every store sees every write."""
    import resource
    import subprocess

    n = max(50, scale.coherence_trials * 2)
    prefix = env.unique("watchcpu")
    store = env.store(prefix=prefix, cache_size=2 * n)
    watcher = store._watcher
    handle = watcher._handle
    own = [0.0]

    def timed_handle(*args: Any) -> Any:  # benchmark-only instrumentation
        t = time.thread_time()
        try:
            return handle(*args)
        finally:
            own[0] += time.thread_time() - t

    watcher._handle = timed_handle
    watch_tid = watcher._thread.native_id
    out: dict[str, float] = {}

    def run() -> None:
        r0, t0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), _thread_cpu()
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, env.host, str(env.port),
                                   prefix, str(n)])
        deadline = time.monotonic() + 120
        while len(store._cache) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        r1, t1, c1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), _thread_cpu()
        writer.wait(60)
        out["cpu"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        out["wall"] = t1 - t0
        out["watch_thread"] = c1.get(watch_tid, 0.0) - c0.get(watch_tid, 0.0)

    harness.bench_rounds(benchmark, run, rounds=1)
    assert len(store._cache) >= n
    record("watch_cpu_per_event", events=n, cpu_s=out["cpu"], wall_s=out["wall"],
           cpu_per_event_s=out["cpu"] / n, events_per_s=n / out["wall"],
           watch_thread_cpu_per_event_s=out["watch_thread"] / n,
           handle_cpu_per_event_s=own[0] / n,
           other_threads_cpu_per_event_s=(out["cpu"] - out["watch_thread"]) / n)
