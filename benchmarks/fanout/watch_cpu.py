"""Goal 6, client CPU per watch event, measured as ``benchmarks/RESULTS.md`` section 3 does.

Another process puts ``events`` keys one by one (one revision, one watch message each) while
one ``EtcdStore`` in this process applies them. CPU is this process's user + system time
(``getrusage``) from the writer's start until the store's watch applied etcd's last
revision, divided by the events; the store's watch thread (found by its name,
``cachedstore-watch-*``) is split out from ``/proc/self/task``. Public API only. Blocks
for the measurement (bounded by ``timeout``); the writer process is killed if it overruns.

:func:`compare_transports` runs the store with each ``watch_transport`` in turn, round by
round, and keeps each one's median round.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from .etcd_metrics import sample

__all__ = ["compare_transports", "measure_watch_cpu"]

_WRITER = """
import sys, etcd3
c = etcd3.client(sys.argv[1], int(sys.argv[2]))
for i in range(int(sys.argv[4])):
    c.put(f"{sys.argv[3]}k{i}", b"w" * 64)
"""


def _thread_cpu(native_id: int) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / tick


def measure_watch_cpu(etcd_endpoint: str, metrics_url: str, *, events: int = 2_000,
                      timeout: float = 120.0, watch_transport: str = "grpc"
                      ) -> dict[str, Any]:
    """CPU seconds per watch event of one store (total, watch thread, other threads)."""
    from cachedstore import EtcdStore

    host, _, port = etcd_endpoint.rpartition(":")
    prefix = f"/fanout-cpu/{uuid.uuid4().hex[:8]}/"
    before_threads = {t.ident for t in threading.enumerate()}
    store = EtcdStore(host, int(port), prefix=prefix, cache_size=2 * events,
                      watch_transport=watch_transport)
    try:
        watch = [t for t in threading.enumerate()
                 if t.ident not in before_threads and t.name.startswith("cachedstore-watch")
                 and not t.name.endswith("-send")]
        watch_id = watch[0].native_id if watch and watch[0].native_id else 0
        r0, w0, t0 = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu(watch_id), \
            time.perf_counter()
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, host, port, prefix,
                                   str(events)])
        try:
            writer.wait(timeout)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
            raise
        revision = sample(metrics_url).revision
        deadline = time.monotonic() + timeout
        while store.watch_revision < revision and time.monotonic() < deadline:
            time.sleep(0.005)
        r1, w1, t1 = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu(watch_id), \
            time.perf_counter()
        caught_up = store.watch_revision >= revision
    finally:
        store.close()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"events": events, "watch_transport": watch_transport, "caught_up": caught_up,
            "wall_s": t1 - t0, "cpu_s": cpu,
            "cpu_per_event_s": cpu / events,
            "watch_thread_cpu_per_event_s": (w1 - w0) / events,
            "other_threads_cpu_per_event_s": (cpu - (w1 - w0)) / events}


def compare_transports(etcd_endpoint: str, metrics_url: str, *, rounds: int = 3,
                       transports: tuple[str, ...] = ("grpc", "wire"), **kwargs: Any
                       ) -> dict[str, dict[str, Any]]:
    """:func:`measure_watch_cpu` of each transport, interleaved for ``rounds`` rounds;
    transport -> its median round (by CPU per event), with every round's figure."""
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
    for _ in range(rounds):
        for transport in transports:
            runs[transport].append(measure_watch_cpu(etcd_endpoint, metrics_url,
                                                     watch_transport=transport, **kwargs))
    out = {}
    for transport, results in runs.items():
        ordered = sorted(results, key=lambda r: r["cpu_per_event_s"])
        median = dict(ordered[len(ordered) // 2])
        median["rounds_cpu_per_event_s"] = [r["cpu_per_event_s"] for r in results]
        out[transport] = median
    return out
