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

__all__ = ["DEFAULT_CONFIGS", "PACING_CONFIGS", "compare_pacing", "compare_transports",
           "measure_watch_cpu"]

#: (watch_transport, watch_pacing) pairs compared by default: grpcio, the wire transport
#: reading every event as it comes, and the wire transport pacing at 2, 5 (the default)
#: and 10 ms: the CPU it saves against the lag it adds.
DEFAULT_CONFIGS: tuple[tuple[str, float], ...] = (
    ("grpc", 0.0), ("wire", 0.0), ("wire", 0.002), ("wire", 0.005), ("wire", 0.010))

_WRITER = """
import json, random, sys, threading, time, etcd3
host, port, prefix, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
rate, threads, poisson = float(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "poisson"
clients = [etcd3.client(host, port) for _ in range(threads)]
for c in clients:
    c.get(prefix + "warm-up")
sys.stdin.readline()
puts = [[] for _ in range(threads)]

def write(t):
    c, rng, gap = clients[t], random.Random(t), threads / rate if rate else 0.0
    due = time.monotonic()
    for i in range(t, n, threads):
        if gap:
            due += rng.expovariate(1 / gap) if poisson else gap
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        started = time.monotonic()
        revision = c.put(f"{prefix}k{i}", b"w" * 64).header.revision
        puts[t].append((started, revision, time.monotonic()))

writers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
for w in writers:
    w.start()
for w in writers:
    w.join()
by_revision = sorted((r, s, a) for ps in puts for s, r, a in ps)
print(json.dumps({"revision": by_revision[-1][0], "started": [s for _, s, _ in by_revision],
                  "acked": [a for _, _, a in by_revision],
                  "revisions": [r for r, _, _ in by_revision]}), flush=True)
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
                      lag: bool = False, rate: float = 0.0, writers: int = 1,
                      poisson: bool = False, busy: int | None = None,
                      spell: int | None = None) -> dict[str, Any]:
    """CPU seconds per watch event of one store (total, watch thread, other threads); with
    ``lag``, also the put-to-applied lag per event (p50, p99, max).

    The writer puts one key at a time as fast as it can, or ``rate`` puts a second in all
    (regularly spaced, or with random exponential gaps: ``poisson``), from ``writers``
    threads (each its own connection). ``busy``: the wire transport's busy-spell size for
    this store (``cachedstore.wire.BUSY``; 1 is the rule before busy spells: pace after
    any read); ``spell``: within how many pacing intervals (``cachedstore.wire.SPELL``)."""
    from cachedstore import EtcdStore, wire

    host, _, port = etcd_endpoint.rpartition(":")
    prefix = f"/fanout-cpu/{uuid.uuid4().hex[:8]}/"
    default_busy, default_spell = wire.BUSY, wire.SPELL
    wire.BUSY = default_busy if busy is None else busy  # read by each call it creates
    wire.SPELL = default_spell if spell is None else spell
    try:
        store = EtcdStore(host, int(port), prefix=prefix, cache_size=2 * events,
                          watch_transport=watch_transport, watch_pacing=watch_pacing)
    except BaseException:
        wire.BUSY, wire.SPELL = default_busy, default_spell
        raise
    applied: list[tuple[float, int]] = []
    if lag:
        cache = store._cache  # benchmark-only instrumentation (see the module docstring)
        apply = cache.apply_events

        def timed_apply(batch: Any, revision: int, scope: Any = None) -> None:
            apply(batch, revision, scope)
            applied.append((time.monotonic(), revision))

        cache.apply_events = timed_apply  # type: ignore[method-assign]
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, host, port, prefix,
                               str(events), str(rate), str(writers),
                               "poisson" if poisson else "regular"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
        call = getattr(store._watcher, "_call", None) if store._watcher else None
        paced = getattr(call, "paced", None)
    finally:
        wire.BUSY, wire.SPELL = default_busy, default_spell
        if writer.poll() is None:
            writer.kill()
        writer.wait()
        store.close()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out = {"events": events, "watch_transport": watch_transport,
           "watch_pacing": watch_pacing, "caught_up": caught_up,
           "wall_s": t1 - t0, "cpu_s": cpu, "events_per_s": events / (t1 - t0),
           "pacing_waits": paced,
           "cpu_per_event_s": cpu / events,
           "watch_thread_cpu_per_event_s": (w1 - w0) / events,
           "other_threads_cpu_per_event_s": (cpu - (w1 - w0)) / events}
    if lag:
        out.update(_lags(report["started"], report["revision"], applied,
                         report.get("revisions")))
        acked = report.get("acked")
        if acked:  # the same, from the put's acknowledgement (what a rank told of it knows)
            out.update({f"acked_{k}": v for k, v in _lags(
                acked, report["revision"], applied, report.get("revisions")).items()})
            rtts = sorted(a - s for s, a in zip(report["started"], acked, strict=True))
            out.update({"put_p50_s": statistics.median(rtts),
                        "put_p99_s": rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))]})
    return out


def _lags(started: list[float], last_revision: int, applied: list[tuple[float, int]],
          revisions: list[int] | None = None) -> dict[str, Any]:
    """Per put (its revision ``revisions[i]``, else ``last_revision - len(started) + 1 +
    i``; in revision order): seconds from just before it was sent to the first applied
    batch reaching its revision."""
    first = last_revision - len(started) + 1
    lags, at = [], 0
    for i, t in enumerate(started):
        revision = revisions[i] if revisions is not None else first + i
        while at < len(applied) and applied[at][1] < revision:
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


#: What :func:`compare_pacing` compares: (name, watch_pacing, busy-spell size, within how
#: many pacing intervals).
PACING_CONFIGS: tuple[tuple[str, float, int, int], ...] = (
    ("wire, no pacing", 0.0, 1, 1),
    ("wire, pacing 5 ms after any read", 0.005, 1, 1),
    ("wire, pacing 5 ms, spells of 5 in 5 ms (before)", 0.005, 5, 1),
    ("wire, pacing 5 ms, spells of 10 in 10 ms (now)", 0.005, 10, 2),
)


def compare_pacing(etcd_endpoint: str, *, rounds: int = 3, lag_rate: float = 200.0,
                   lag_events: int = 1_000, load_events: int = 20_000, load_writers: int = 8,
                   configs: Sequence[tuple[str, float, int, int]] = PACING_CONFIGS
                   ) -> dict[str, dict[str, Any]]:
    """Issue 26, item 3, in one run: per configuration (wire transport; pacing off, the
    rule before busy spells, busy spells), interleaved round by round, (a) the
    put-to-applied lag of a polling reader (what a non-blocking read can see) at
    ``lag_rate`` puts a second with random (exponential) gaps, and (b) CPU per event under
    load: ``load_writers`` threads putting as fast as they can. Each configuration's median
    round of each (by lag p99, by CPU per event), every round's figures kept."""
    lag_runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    cpu_runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for _ in range(rounds):
        for name, pacing, busy, spell in configs:
            lag_runs[name].append(measure_watch_cpu(
                etcd_endpoint, events=lag_events, watch_transport="wire",
                watch_pacing=pacing, busy=busy, spell=spell, lag=True, rate=lag_rate,
                poisson=True))
            cpu_runs[name].append(measure_watch_cpu(
                etcd_endpoint, events=load_events, watch_transport="wire",
                watch_pacing=pacing, busy=busy, spell=spell, writers=load_writers))
    out: dict[str, dict[str, Any]] = {}
    for name, *_ in configs:
        lags = sorted(lag_runs[name], key=lambda r: r.get("lag_p99_s", float("inf")))
        cpus = sorted(cpu_runs[name], key=lambda r: r["cpu_per_event_s"])
        lag, cpu = lags[len(lags) // 2], cpus[len(cpus) // 2]
        out[name] = {
            "lag_rate_per_s": lag_rate, "lag_events": lag.get("lag_events"),
            "lag_p50_s": lag.get("lag_p50_s"), "lag_p99_s": lag.get("lag_p99_s"),
            "lag_max_s": lag.get("lag_max_s"), "lag_pacing_waits": lag["pacing_waits"],
            "acked_lag_p50_s": lag.get("acked_lag_p50_s"),
            "acked_lag_p99_s": lag.get("acked_lag_p99_s"),
            "put_p50_s": lag.get("put_p50_s"), "put_p99_s": lag.get("put_p99_s"),
            "lag_cpu_per_event_s": lag["cpu_per_event_s"],
            "rounds_lag_p99_s": [r.get("lag_p99_s") for r in lag_runs[name]],
            "load_events_per_s": cpu["events_per_s"],
            "cpu_per_event_s": cpu["cpu_per_event_s"],
            "watch_thread_cpu_per_event_s": cpu["watch_thread_cpu_per_event_s"],
            "load_pacing_waits": cpu["pacing_waits"],
            "rounds_cpu_per_event_s": [r["cpu_per_event_s"] for r in cpu_runs[name]],
            "rounds_events_per_s": [r["events_per_s"] for r in cpu_runs[name]],
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.fanout.watch_cpu``: :func:`compare_pacing` against a
    throw-away etcd, as a table (``--json`` for the figures)."""
    import argparse

    parser = argparse.ArgumentParser(description=compare_pacing.__doc__)
    parser.add_argument("--endpoint", help="an etcd to use (default: a throw-away one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lag-rate", type=float, default=200.0)
    parser.add_argument("--lag-events", type=int, default=1_000)
    parser.add_argument("--load-events", type=int, default=20_000)
    parser.add_argument("--load-writers", type=int, default=8)
    parser.add_argument("--data-dir", help="the throw-away etcd's data directory, e.g. on "
                        "/dev/shm, where etcd's fsync costs nothing: what is left of the "
                        "lag is the store's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    def run(endpoint: str) -> dict[str, dict[str, Any]]:
        return compare_pacing(endpoint, rounds=args.rounds, lag_rate=args.lag_rate,
                              lag_events=args.lag_events, load_events=args.load_events,
                              load_writers=args.load_writers)

    if args.endpoint:
        out = run(args.endpoint)
    else:
        from cachedstore.server import LocalEtcd

        with LocalEtcd(data_dir=args.data_dir) as server:
            out = run(server.endpoint)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    def ms(r: dict[str, Any], key: str) -> str:
        return "–" if r.get(key) is None else f"{r[key] * 1e3:.2f}"

    print("| configuration | lag p50 ms | lag p99 ms | from the put's ack: p50, p99 ms "
          "| put round trip: p50, p99 ms | pacing waits | µs CPU per event "
          "| events/s under load | every round (µs) |\n|---|---|---|---|---|---|---|---|---|")
    for name, r in out.items():
        rounds_us = ", ".join(f"{x * 1e6:.0f}" for x in r["rounds_cpu_per_event_s"])
        print(f"| {name} | {r['lag_p50_s'] * 1e3:.2f} | {r['lag_p99_s'] * 1e3:.2f} | "
              f"{ms(r, 'acked_lag_p50_s')}, {ms(r, 'acked_lag_p99_s')} | "
              f"{ms(r, 'put_p50_s')}, {ms(r, 'put_p99_s')} | "
              f"{r['lag_pacing_waits']} / {r['load_pacing_waits']} | "
              f"**{r['cpu_per_event_s'] * 1e6:.0f}** | {r['load_events_per_s']:,.0f} | "
              f"{rounds_us} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
