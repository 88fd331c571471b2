"""The simulated training ranks: the worker processes' entry point and their rounds.

:func:`worker_main` is the target of each spawned worker process, so it must stay a
module-level function of ``cachedstore.demo.workload`` (``spawn`` imports it by that path).
Messages to the parent are tuples ``(tag, rank, payload)`` on its queue: ``("ready", rank,
None)``, ``("progress", rank, mode)`` after each round, ``("done", rank, result)`` after each
phase and ``("error", rank, (exit_code, one_line))``.
"""

from __future__ import annotations

import array
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from ..console import exit_code_for, one_line
from ..server.process import die_with_parent
from .figures import client_counts, increments
from .settings import MODES, DemoSettings


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs to know; pickled to it by ``spawn``."""

    rank: int
    settings: DemoSettings
    endpoints: tuple[str, ...]
    prefix: str
    parent_pid: int


def run_phase(mode: str, spec: WorkerSpec, registry: CollectorRegistry,
              report: Callable[[tuple[Any, ...]], None]) -> dict[str, Any]:
    """One worker's share of one phase; returns its counts and latency samples.

    Blocks for the whole phase (its waits are bounded by ``wait_timeout``); calls
    ``report`` after each round; raises what the client raises.
    """
    s = spec.settings
    rank, workers, wait = spec.rank, s.workers, s.wait_timeout
    prefix = f"{spec.prefix}{mode}/"
    before = client_counts(registry)
    started = time.perf_counter()
    client: Any
    if mode == "cached":
        from ..store import EtcdStore

        client = EtcdStore(endpoints=list(spec.endpoints), prefix=prefix, registry=registry,
                           config=s.store_config(), ca_cert=s.ca_cert, cert_key=s.cert_key,
                           cert_cert=s.cert_cert, user=s.user, password=s.password)
    else:
        client = s.uncached_client(spec.endpoints, prefix, registry)
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
    after = client_counts(registry)
    counted = increments(before, after, "")
    rpcs = increments(before, after, "rpc:")
    if mode == "cached":  # the store's own watch stream is not a unary RPC: count it here
        rpcs["watch"] = rpcs.get("watch", 0.0) + watch_streams
    # latency samples under the keys of figures.LATENCIES
    return {
        "rank": rank, "mode": mode, "wall": wall, "ops": ops, "reads": reads,
        "hits": counted.get("hits", 0.0), "misses": counted.get("misses", 0.0), "rpcs": rpcs,
        "hot_read": hot.tobytes(), "all_gather": gather.tobytes(),
        "barrier": barrier.tobytes(),
    }


def worker_main(spec: WorkerSpec, go: Sequence[Any], abort: Any, out: Any) -> None:
    """Entry point of a worker process (spawned): wait for each phase's go, run it.

    Ignores SIGINT and SIGHUP (the parent's to handle) and is SIGKILLed by the kernel when
    the parent dies; returns when ``abort`` is set or the parent is gone; reports any
    exception to the parent as one ``error`` message. Unless both phases finished, exits
    without waiting for the queue's feeder to flush (nobody may be reading).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # so is a closed terminal
    die_with_parent(spec.parent_pid)  # SIGKILLed when the parent dies, however it dies
    server = None
    finished = False
    try:
        registry = CollectorRegistry()
        if spec.settings.metrics_port is not None:
            from ..exposition import start_metrics_server

            server = start_metrics_server(spec.settings.metrics_port + spec.rank,
                                          registry=registry)
        out.put(("ready", spec.rank, None))
        for index, mode in enumerate(MODES):
            while not go[index].wait(0.2):
                if abort.is_set() or os.getppid() != spec.parent_pid:
                    return
            out.put(("done", spec.rank, run_phase(mode, spec, registry, out.put)))
        finished = True
    except BaseException as exc:  # reported to the parent, which prints one line
        out.put(("error", spec.rank, (exit_code_for(exc), one_line(exc))))
    finally:
        if server is not None:
            server.close()
        if not finished:
            # The parent may have stopped reading (it stops us after an error, or is
            # gone): exiting must not block joining the queue's feeder thread on a full
            # pipe. After the last phase the parent reads everything: flush then.
            out.cancel_join_thread()
