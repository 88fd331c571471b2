"""Goal 6, client CPU per watch event, measured as ``benchmarks/RESULTS.md`` section 3 does.

Another process puts ``events`` keys one by one (one revision, one watch message each) while
one ``EtcdStore`` in this process applies them. CPU is this process's user + system time
(``getrusage``) from the writer's first put until the store's watch applied the writer's
last revision, divided by the events; the store's watch thread is split out from
``/proc/self/task``. The writer is started and connected before the window opens and
reports its last revision itself, so the window holds the store's work only (no process
start, no ``/metrics`` scrape). Blocks for the measurement (bounded by ``timeout``); the
writer process is killed if it overruns.

With ``lag=True`` the round also times, per event, the span from just before the writer's
put to the store's cache having applied it: what a non-blocking reader can see. That needs
a timestamp per applied batch (benchmark-only instrumentation of the store's cache, as
``benchmarks/test_coherence.py`` instruments ``Watcher._handle``), so those rounds are
separate from the CPU rounds.

:func:`compare_transports` runs each configuration (watch transport, pacing) in turn, round
by round, and keeps each one's median round.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_CONFIGS", "compare_transports", "measure_watch_cpu"]

#: (watch_transport, watch_pacing) pairs compared by default: grpcio, the wire transport
#: reading every event as it comes, and the wire transport pacing at 2, 5 (the default)
#: and 10 ms: the CPU it saves against the lag it adds.
DEFAULT_CONFIGS: tuple[tuple[str, float], ...] = (
    ("grpc", 0.0), ("wire", 0.0), ("wire", 0.002), ("wire", 0.005), ("wire", 0.010))

_WRITER = """
import json, sys, time, etcd3
c = etcd3.client(sys.argv[1], int(sys.argv[2]))
c.get(sys.argv[3] + "warm-up")
sys.stdin.readline()
started, revision = [], 0
for i in range(int(sys.argv[4])):
    started.append(time.monotonic())
    revision = c.put(f"{sys.argv[3]}k{i}", b"w" * 64).header.revision
print(json.dumps({"revision": revision, "started": started}), flush=True)
"""


def _thread_cpu(native_id: int) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / tick


def measure_watch_cpu(etcd_endpoint: str, *, events: int = 2_000, timeout: float = 120.0,
                      watch_transport: str = "grpc", watch_pacing: float = 0.0,
                      lag: bool = False) -> dict[str, Any]:
    """CPU seconds per watch event of one store (total, watch thread, other threads); with
    ``lag``, also the put-to-applied lag per event (p50, p99, max)."""
    from cachedstore import EtcdStore

    host, _, port = etcd_endpoint.rpartition(":")
    prefix = f"/fanout-cpu/{uuid.uuid4().hex[:8]}/"
    store = EtcdStore(host, int(port), prefix=prefix, cache_size=2 * events,
                      watch_transport=watch_transport, watch_pacing=watch_pacing)
    applied: list[tuple[float, int]] = []
    if lag:
        cache = store._cache  # benchmark-only instrumentation (see the module docstring)
        apply = cache.apply_events

        def timed_apply(batch: Any, revision: int, scope: Any = None) -> None:
            apply(batch, revision, scope)
            applied.append((time.monotonic(), revision))

        cache.apply_events = timed_apply  # type: ignore[method-assign]
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, host, port, prefix,
                               str(events)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        watch = store._watcher._thread if store._watcher else None  # benchmark-only access
        watch_id = watch.native_id if watch is not None and watch.native_id else 0
        r0, w0, t0 = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu(watch_id), \
            time.perf_counter()
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
        timer = threading.Timer(timeout, writer.kill)
        timer.start()
        try:
            report = json.loads(writer.stdout.readline() or "null")
        finally:
            timer.cancel()
        if report is None:
            raise RuntimeError(f"the writer did not finish within {timeout} s")
        deadline = time.monotonic() + timeout
        while store.watch_revision < report["revision"] and time.monotonic() < deadline:
            time.sleep(0.005)
        r1, w1, t1 = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu(watch_id), \
            time.perf_counter()
        caught_up = store.watch_revision >= report["revision"]
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
        store.close()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out = {"events": events, "watch_transport": watch_transport,
           "watch_pacing": watch_pacing, "caught_up": caught_up,
           "wall_s": t1 - t0, "cpu_s": cpu,
           "cpu_per_event_s": cpu / events,
           "watch_thread_cpu_per_event_s": (w1 - w0) / events,
           "other_threads_cpu_per_event_s": (cpu - (w1 - w0)) / events}
    if lag:
        out.update(_lags(report["started"], report["revision"], applied))
    return out


def _lags(started: list[float], last_revision: int, applied: list[tuple[float, int]]
          ) -> dict[str, Any]:
    """Per put (revision ``last_revision - len(started) + 1 + i``): seconds from just
    before it was sent to the first applied batch reaching its revision."""
    first = last_revision - len(started) + 1
    lags, at = [], 0
    for i, t in enumerate(started):
        while at < len(applied) and applied[at][1] < first + i:
            at += 1
        if at == len(applied):
            break
        lags.append(applied[at][0] - t)
    lags.sort()
    if not lags:
        return {"lag_events": 0}
    return {"lag_events": len(lags), "lag_p50_s": statistics.median(lags),
            "lag_p99_s": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
            "lag_max_s": lags[-1]}


def _name(transport: str, pacing: float) -> str:
    from cachedstore import StoreConfig

    if transport == "grpc":  # grpcio's threads read every message whatever the pacing
        return transport
    default = " (default)" if pacing == StoreConfig.watch_pacing else ""
    return f"{transport}, pacing {pacing * 1e3:g} ms{default}" if pacing else \
        f"{transport}, no pacing"


def compare_transports(etcd_endpoint: str, *, rounds: int = 5,
                       configs: Sequence[tuple[str, float]] = DEFAULT_CONFIGS,
                       **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`measure_watch_cpu` of each (transport, pacing), interleaved for ``rounds``
    rounds, then one lag round of each; name -> its median CPU round (by CPU per event),
    with every round's figure and the lag round's figures."""
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(rounds):
        for transport, pacing in configs:
            runs[(transport, pacing)].append(measure_watch_cpu(
                etcd_endpoint, watch_transport=transport, watch_pacing=pacing, **kwargs))
    out = {}
    for (transport, pacing), results in runs.items():
        ordered = sorted(results, key=lambda r: r["cpu_per_event_s"])
        median = dict(ordered[len(ordered) // 2])
        median["rounds_cpu_per_event_s"] = [r["cpu_per_event_s"] for r in results]
        timed = measure_watch_cpu(etcd_endpoint, watch_transport=transport,
                                  watch_pacing=pacing, lag=True, **kwargs)
        median.update({k: v for k, v in timed.items() if k.startswith("lag_")})
        out[_name(transport, pacing)] = median
    return out
