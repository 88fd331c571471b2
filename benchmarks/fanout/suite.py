"""The whole fan-out run for one W: every pattern on etcd and on TCPStore, side by side.

:func:`run_world` starts nothing itself but the TCPStore server; it measures against the
etcd it is given. Per pattern: :func:`~benchmarks.fanout.simulator.run_pattern` on etcd,
then the same pattern on TCPStore (one server, W clients) in the same run. A run stops
starting patterns once ``max_seconds`` have passed (the rest are listed as skipped), and
each pattern has ``budget`` seconds for its steps. :func:`run_extras` measures goals 5
and 6 (host sharing through a grpc-proxy, client CPU per watch event). Blocking; not
thread-safe.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from typing import Any

from .patterns import PATTERNS, elastic_barrier_impl
from .simulator import default_processes, run_pattern
from .tcp_server import TCPStoreServer

__all__ = ["DEFAULT_PATTERNS", "implementation_notes", "run_extras", "run_world"]

DEFAULT_PATTERNS = tuple(PATTERNS)


def implementation_notes(runs: Sequence[dict[str, Any]] = ()) -> list[str]:
    """Which implementation each barrier pattern exercised with this cachedstore and torch,
    from what the ranks' stores saw in ``runs`` (``PatternResult.as_dict()``s): no
    assumption about torch's version (a torch without ``Store.barrier`` skips that
    pattern; see :meth:`~benchmarks.fanout.patterns.Pattern.unsupported`)."""
    notes = []
    api = [r for r in runs if r["pattern"] == "store_api_barrier" and r["backend"] == "etcd"]
    if api:
        forwarded = sum(r.get("extras", {}).get("barrier_forwarded", 0) for r in api)
        notes.append("store_api_barrier: " + (
            "TorchEtcdStore's own Store.barrier (PrefixStore forwarded it)" if forwarded else
            "torch's default Store.barrier (the C++ PrefixStore does not forward barrier to "
            "the store below: add(k/num_members, 1), the last rank sets k/last_member, all "
            "wait, on TorchEtcdStore)"))
    impl = elastic_barrier_impl()
    notes.append("elastic_barrier: " + (impl if impl != "torch elastic barrier" else
                                        "EtcdStore has no barrier: torch.distributed.elastic."
                                        "utils.store.barrier ran (add, last sets a key, wait)"))
    return notes


def machine() -> dict[str, Any]:
    """The machine a run ran on, as the report names it."""
    import torch

    return {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": str(torch.__version__),
            "node": platform.node()}


def run_world(world: int, etcd_endpoint: str, metrics_url: str, *,
              patterns: Sequence[str] = DEFAULT_PATTERNS, budget: float = 120.0,
              max_seconds: float = 540.0, processes: int | None = None,
              log: Any = print, checkpoint: Any = None) -> dict[str, Any]:
    """Every pattern at ``world`` ranks on etcd and on TCPStore; a JSON-able dict.

    ``checkpoint``, if given, is called with the dict so far after every pattern (a run
    killed from outside keeps what finished)."""
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    unsupported: dict[str, str] = {}
    with TCPStoreServer() as tcp:
        for name in patterns:
            reason = PATTERNS[name].unsupported(world)
            if reason is not None:
                unsupported[name] = reason
                log(f"[fanout] W={world} {name}: not run: {reason}")
                continue
            if time.monotonic() - started > max_seconds:
                skipped.append(name)
                continue
            for kind in ("etcd", "tcp"):
                kwargs: dict[str, Any] = (
                    {"etcd_endpoint": etcd_endpoint, "metrics_url": metrics_url}
                    if kind == "etcd" else {"tcp_endpoint": f"{tcp.host}:{tcp.port}"})
                t = time.monotonic()
                result = run_pattern(name, world, processes=processes, budget=budget,
                                     **kwargs)
                runs.append(result.as_dict())
                if checkpoint is not None and kind == "tcp":
                    checkpoint(_world_dict(world, processes, budget, runs, skipped,
                                           unsupported, started))
                per = result.counts.per_rank(world) if result.counts else {}
                log(f"[fanout] W={world} {name} {kind}: wall {result.wall_s:.3f} s, client "
                    f"CPU {result.client_cpu_s / world * 1e6:,.0f} µs/rank"
                    f"{'' if result.finished else ' (DID NOT FINISH)'}"
                    + (f", per rank {per['requests']:.2f} req, {per['proposals']:.2f} "
                       f"proposals, {per['watch_msgs_sent']:.1f} watch msgs" if per else "")
                    + f" [{time.monotonic() - t:.0f} s]")
    return _world_dict(world, processes, budget, runs, skipped, unsupported, started)


def _world_dict(world: int, processes: int | None, budget: float,
                runs: list[dict[str, Any]], skipped: list[str], unsupported: dict[str, str],
                started: float) -> dict[str, Any]:
    return {"world": world, "processes": default_processes(world) if processes is None
            else processes, "budget_s": budget, "runs": list(runs), "skipped": list(skipped),
            "unsupported": dict(unsupported), "notes": implementation_notes(runs),
            "machine": machine(), "elapsed_s": time.monotonic() - started}


def run_extras(etcd_endpoint: str, metrics_url: str, *, log: Any = print) -> dict[str, Any]:
    """Goals 5 and 6: host sharing behind a grpc-proxy; CPU per watch event."""
    from .host_sharing import measure_host_sharing
    from .watch_cpu import compare_transports

    sharing = measure_host_sharing(etcd_endpoint, metrics_url)
    log(f"[fanout] host sharing: direct {sharing['direct']['watch_event_msgs']} vs proxy "
        f"{sharing['proxy']['watch_event_msgs']} watch msgs")
    cpu = compare_transports(etcd_endpoint)
    log("[fanout] watch CPU per event: " + ", ".join(
        f"{t} {r['cpu_per_event_s'] * 1e6:.0f} µs (lag p50 "
        f"{r.get('lag_p50_s', float('nan')) * 1e3:.2f} ms)" for t, r in cpu.items()))
    return {"host_sharing": sharing, "watch_cpu_by_transport": cpu}
