"""Side by side, in one run: a store-heavy torch workload on three c10d stores.

    python benchmarks/bench_torch_stores.py --workers 4 8 --rounds 5 --json out.json

Contenders, all driven through the same ``torch.distributed.Store`` calls:

- ``TorchEtcdStore`` (cachedstore.torch) on etcd v3;
- ``TCPStore``, its server in this (coordinating) process, the workers its clients;
- torch's own ``EtcdStore`` (``torch.distributed.elastic.rendezvous.etcd_store``) over the
  etcd v2 API via python-etcd. python-etcd is NOT a cachedstore dependency: install it in the
  benchmark environment (``pip install python-etcd``). Without it that column is skipped,
  with a note, and the script still exits 0.

The workload: W worker processes; each timed round, every worker sets its own key, then
``get``s all W keys of the round (blocking until each is published), then joins a barrier
(``add`` on a counter; the last to arrive sets a "done" key the others ``wait`` for). One
untimed warm-up round precedes the timed ones. The wall time of a round is from the first
worker starting it to the last one leaving its barrier (``time.perf_counter`` is the
system-wide monotonic clock, comparable across processes). Reported: the median over
rounds, and etcd's own count of the requests it handled during the rounds, from its
``/metrics`` endpoint -- ``grpc_server_handled_total`` (v3, by method) and
``etcd_http_received_total`` (the v2 HTTP API, watches included) -- read after all workers
have connected and again after the last round, so connection set-up is excluded.

One etcd member on loopback, started with ``--enable-v2`` so that every contender talks to
the same server. Not collected by pytest (its name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: Seconds any single worker or synchronisation step may take before the run is aborted.
STEP_TIMEOUT = 120.0
PAYLOAD = b"10.0.0.1:29500/" + b"x" * 49  # 64 bytes, an address-sized value

STORES = ("TorchEtcdStore", "TCPStore", "torch EtcdStore (v2)")


def _quiet_torch() -> None:
    logging.getLogger("torch.distributed.elastic.rendezvous.registry").setLevel(logging.ERROR)


def _have_python_etcd() -> bool:
    try:
        import etcd  # noqa: F401  (python-etcd)
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- workers


def _make_store(kind: str, spec: dict[str, Any]) -> Any:
    """The c10d store a worker uses (built in the worker process)."""
    if kind == "TorchEtcdStore":
        from cachedstore.torch import TorchEtcdStore

        return TorchEtcdStore(endpoints=[spec["endpoint"]], prefix=spec["prefix"],
                              timeout=timedelta(seconds=STEP_TIMEOUT))
    if kind == "TCPStore":
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", spec["port"], is_master=False,
                             wait_for_workers=False, timeout=timedelta(seconds=STEP_TIMEOUT))
    import etcd  # python-etcd
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as V2EtcdStore

    host, port = spec["endpoint"].rsplit(":", 1)
    client = etcd.Client(host=host, port=int(port), protocol="http", read_timeout=60)
    return V2EtcdStore(client, spec["prefix"], timeout=timedelta(seconds=STEP_TIMEOUT))


def _round(store: Any, rank: int, world: int, tag: str) -> tuple[float, float]:
    """One round of the workload; returns (start, end) on the monotonic clock."""
    start = time.perf_counter()
    store.set(f"{tag}/k{rank}", PAYLOAD)
    for j in range(world):
        if store.get(f"{tag}/k{j}") != PAYLOAD:
            raise AssertionError(f"round {tag}: wrong value for rank {j}")
    if store.add(f"{tag}/arrived", 1) == world:
        store.set(f"{tag}/done", b"1")
    else:
        store.wait([f"{tag}/done"])
    return start, time.perf_counter()


def _worker(kind: str, spec: dict[str, Any], rank: int, world: int, rounds: int,
            barrier: Any, results: Any) -> None:
    """A worker process: connect, warm up, then the timed rounds between barriers that let
    the coordinator read etcd's counters around them."""
    _quiet_torch()
    try:
        store = _make_store(kind, spec)
        _round(store, rank, world, "warmup")
        barrier.wait(STEP_TIMEOUT)  # connected and warm: the coordinator reads counters
        barrier.wait(STEP_TIMEOUT)
        times = [_round(store, rank, world, f"r{r}") for r in range(rounds)]
        barrier.wait(STEP_TIMEOUT)  # done: the coordinator reads counters again
        barrier.wait(STEP_TIMEOUT)
        results.put((rank, times, None))
        close = getattr(store, "close", None)
        if close is not None:
            close()
    except BaseException as exc:  # report, never hang the coordinator
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))
        barrier.abort()
        raise


# --------------------------------------------------------------------------- coordinator


def _etcd_counts(server: Any) -> dict[str, float]:
    """etcd's request counters: v3 by gRPC method, and v2 HTTP requests received."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{server.metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "grpc_server_handled_total":
                key = f"v3 {sample.labels.get('grpc_method')}"
                counts[key] = counts.get(key, 0.0) + sample.value
            elif sample.name == "etcd_http_received_total":
                key = f"v2 {sample.labels.get('method')}"
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    out = {k: int(after[k] - before.get(k, 0.0)) for k in after}
    return {k: v for k, v in sorted(out.items()) if v}


def _run_one(kind: str, spec: dict[str, Any], world: int, rounds: int,
             counts: Callable[[], dict[str, float]]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"bench-{kind}-{rank}",
                         args=(kind, spec, rank, world, rounds, barrier, results))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(STEP_TIMEOUT)
        before = counts()
        barrier.wait(STEP_TIMEOUT)
        barrier.wait(STEP_TIMEOUT)
        after = counts()
        barrier.wait(STEP_TIMEOUT)
        gathered = [results.get(timeout=STEP_TIMEOUT) for _ in range(world)]
    except BaseException:
        errors = []
        while not results.empty():
            errors.append(results.get_nowait())
        raise RuntimeError(f"{kind} with {world} workers failed: {errors}") from None
    finally:
        for proc in procs:
            proc.join(STEP_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = [err for _, _, err in gathered if err]
    if failures:
        raise RuntimeError(f"{kind} with {world} workers failed: {failures}")
    per_round = []
    for r in range(rounds):
        starts = [times[r][0] for _, times, _ in gathered]
        ends = [times[r][1] for _, times, _ in gathered]
        per_round.append(max(ends) - min(starts))
    requests = _delta(after, before)
    total = sum(requests.values())
    return {
        "store": kind, "workers": world, "rounds": rounds,
        "round_seconds": per_round,
        "median_round_seconds": statistics.median(per_round),
        "etcd_requests": requests,
        "etcd_requests_total": total,
        "etcd_requests_per_worker_round": total / (world * rounds),
    }


def run(workers: list[int], rounds: int) -> dict[str, Any]:
    """Every contender at every worker count, against one etcd; returns the results."""
    _quiet_torch()
    import torch
    import torch.distributed as dist

    from cachedstore.server import LocalEtcd

    notes = []
    kinds = list(STORES)
    if not _have_python_etcd():
        kinds.remove("torch EtcdStore (v2)")
        notes.append("python-etcd is not installed: torch's v2 EtcdStore was not measured "
                     "(pip install python-etcd in the benchmark environment to include it).")
    results = []
    with LocalEtcd(enable_v2=True) as server:
        for world in workers:
            for kind in kinds:
                spec: dict[str, Any] = {"endpoint": server.endpoint,
                                        "prefix": f"/bench/{uuid.uuid4().hex[:8]}/"}
                tcp = None
                if kind == "TCPStore":
                    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                        wait_for_workers=False,
                                        timeout=timedelta(seconds=STEP_TIMEOUT))
                    spec["port"] = tcp.port
                if kind == "torch EtcdStore (v2)":
                    spec["prefix"] = spec["prefix"].rstrip("/")
                result = _run_one(kind, spec, world, rounds, lambda: _etcd_counts(server))
                del tcp
                results.append(result)
                print(f"  W={world} {kind:22s} median {result['median_round_seconds'] * 1e3:8.2f} ms"
                      f"  etcd requests {result['etcd_requests_total']:6d}", flush=True)
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform(),
                    "load_average_1m_at_end": os.getloadavg()[0]},
        "workload": "per round: set own key, get all W keys, barrier (add + wait); "
                    "1 warm-up round, then `rounds` timed rounds",
        "notes": notes,
        "results": results,
    }


def table(report: dict[str, Any]) -> str:
    """A Markdown table of the medians, with ratios to TorchEtcdStore."""
    lines = ["| W | store | median round (ms) | vs TorchEtcdStore | etcd requests "
             "(per worker·round) | vs TorchEtcdStore |",
             "|---|---|---:|---:|---:|---:|"]
    by_world: dict[int, dict[str, Any]] = {}
    for r in report["results"]:
        by_world.setdefault(r["workers"], {})[r["store"]] = r
    for world, rows in by_world.items():
        ours = rows.get("TorchEtcdStore")
        for kind in STORES:
            r = rows.get(kind)
            if r is None:
                continue
            ms = r["median_round_seconds"] * 1e3
            req = r["etcd_requests_per_worker_round"]
            t_ratio = f"{r['median_round_seconds'] / ours['median_round_seconds']:.2f}×" \
                if ours else "-"
            if kind == "TCPStore":
                r_ratio = "(no etcd)"
            elif ours and ours["etcd_requests_per_worker_round"]:
                r_ratio = f"{req / ours['etcd_requests_per_worker_round']:.1f}×"
            else:
                r_ratio = "-"
            lines.append(f"| {world} | {kind} | {ms:.2f} | {t_ratio} | {req:.1f} | {r_ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4],
                        help="worker process counts to run (e.g. 4 8)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per run")
    parser.add_argument("--json", help="write the full results to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(w < 1 for w in args.workers):
        parser.error("--workers and --rounds must be >= 1")
    report = run(args.workers, args.rounds)
    print()
    for note in report["notes"]:
        print(f"NOTE: {note}")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
