"""Workload 5: all-gather + barrier across W worker processes, W = 2 … 32.

A round has two steps, started by the coordinator one after the other: *gather* (every
worker writes its own key and reads all W keys) and *barrier* (every worker ``add``s to a
counter; the one that brings it to W writes "done"; everyone waits for "done"). Per step
we record the wall time (coordinator's go → last worker finished) and etcd's own count of
the requests it served (its ``/metrics``: unary gRPC calls, watch-stream messages, v2 HTTP
requests). Store construction is counted separately ("setup").

Contenders: cachedstore (cache filled by each store's watch), twice more with another
barrier — one arrival key per worker + ``wait`` (public API), and a benchmark-only
prototype of ``add`` with a jittered back-off after a failed compare-and-swap — a raw etcd3 client (uncached:
each worker gets every key; phases sequenced by the coordinator, so nobody polls), torch's
v2 EtcdStore, and TCPStore (wall time only; it has no etcd). Workers are forked from a
forkserver that preloaded ``allgather_worker`` (imports paid once; no gRPC state crosses a
fork) and idle between rounds blocked on their pipe, so W = 32 fits on 2 cores.

The last test fits the log-log slope of etcd requests per round against W.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from typing import Any

import harness
import pytest

SCALE = harness.scale()
_TORCH_V2, _ = harness.torch_v2_available()
CONTENDERS = ["cachedstore", "cachedstore, barrier by arrival keys",
              "cachedstore, add with back-off (prototype)", "etcd3 (uncached)", "TCPStore"]
if _TORCH_V2:
    CONTENDERS.insert(2, "torch v2 EtcdStore")
REPLY_TIMEOUT = 120.0
_ROUNDS: dict[str, dict[int, dict[str, Any]]] = {}


class Pool:
    """``size`` worker processes forked from a preloading forkserver, one pipe each."""

    def __init__(self, size: int) -> None:
        import allgather_worker

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["allgather_worker"])
        self.conns = []
        self.procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=allgather_worker.serve, args=(child, rank),
                            name=f"bench-allgather-{rank}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def ask(self, world: int, msg: tuple[Any, ...]) -> list[Any]:
        """Send ``msg`` to workers 0..world-1 at once; return their answers in rank order."""
        for c in self.conns[:world]:
            c.send(msg)
        answers, errors = [], []
        deadline = time.monotonic() + REPLY_TIMEOUT
        for rank, c in enumerate(self.conns[:world]):
            # Read every answer even after a failure, so the next command starts in step.
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise TimeoutError(f"worker {rank} did not answer {msg[0]!r} in time")
            status, payload = c.recv()
            if status != "ok":
                errors.append(f"worker {rank} failed on {msg!r}:\n{payload}")
            answers.append(payload)
        if errors:
            raise RuntimeError(errors[0])
        return answers

    def close(self) -> None:
        """Ask every worker to exit; kill those that do not. Idempotent."""
        for c in self.conns:
            try:
                c.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(max(SCALE.allgather_ws))
    try:
        yield p
    finally:
        p.close()


def _round(pool: Pool, env: harness.Env, world: int, phases: tuple[str, ...], r: int
           ) -> dict[str, tuple[float, dict[str, int]]]:
    """Run round ``r`` phase by phase; per step ("gather", "barrier"): wall seconds (from
    the coordinator's go to the last worker done) and etcd's counters."""
    steps: dict[str, tuple[float, dict[str, int]]] = {}
    for step in dict.fromkeys(phases):
        before = env.counters()
        t0 = time.perf_counter()
        for k, name in enumerate(phases):
            if name == step:
                answers = pool.ask(world, ("phase", r, k))
        wall = max(end for _, end in answers) - t0
        steps[step] = (wall, harness.counter_delta(before, env.counters()))
    return steps


@pytest.mark.parametrize("world", SCALE.allgather_ws, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("contender", CONTENDERS)
def test_allgather(benchmark: Any, env: harness.Env, record: Any, pool: Pool,
                   contender: str, world: int) -> None:
    prefix = env.unique(f"ag-W{world}")
    if contender == "TCPStore":
        host, port = "127.0.0.1", env.tcp_remote_port()
    else:
        host, port = env.host, env.port
    before = env.counters()
    phases = pool.ask(world, ("setup", contender, world, prefix, host, port))[0]
    setup = harness.counter_delta(before, env.counters())
    rounds: list[dict[str, tuple[float, dict[str, int]]]] = []
    counter = iter(range(1_000))

    def one_round() -> None:
        rounds.append(_round(pool, env, world, tuple(phases), next(counter)))

    try:
        harness.bench_rounds(benchmark, one_round, rounds=SCALE.allgather_rounds)
    finally:
        pool.ask(world, ("teardown",))
    etcd = contender != "TCPStore"
    result: dict[str, Any] = {"contender": contender, "world": world, "rounds": len(rounds),
                              "setup_requests": harness.total_requests(setup),
                              "setup_by_method": setup}
    totals = []
    for step in ("gather", "barrier"):
        walls = [r[step][0] for r in rounds]
        reqs = [harness.total_requests(r[step][1]) for r in rounds]
        mid = sorted(range(len(reqs)), key=reqs.__getitem__)[len(reqs) // 2]
        result[f"{step}_wall_s"] = statistics.median(walls)
        result[f"{step}_requests"] = reqs[mid] if etcd else None
        result[f"{step}_by_method"] = rounds[mid][step][1]
    for r in rounds:
        totals.append((sum(w for w, _ in r.values()),
                       sum(harness.total_requests(d) for _, d in r.values())))
    result["wall_s"] = statistics.median(t[0] for t in totals)
    result["etcd_requests"] = statistics.median(t[1] for t in totals) if etcd else None
    result["requests_all_rounds"] = [t[1] for t in totals]
    _ROUNDS.setdefault(contender, {})[world] = result
    record(f"allgather/{contender}/W{world}", **result)
    if etcd:
        assert result["gather_requests"] >= world  # at least every worker's own write


def slope(points: dict[int, float]) -> float | None:
    """Least-squares slope of log(y) against log(x); None with fewer than two points."""
    xs = [math.log(w) for w, y in points.items() if y and y > 0]
    ys = [math.log(y) for y in points.values() if y and y > 0]
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def test_allgather_scaling(record: Any) -> None:
    """The exponent of etcd requests per round vs W, and the ratio to torch v2 at the top W."""
    fits: dict[str, Any] = {}
    for contender, by_world in _ROUNDS.items():
        fit = {}
        for what in ("etcd_requests", "gather_requests", "barrier_requests", "wall_s",
                     "gather_wall_s"):
            fit[what] = slope({w: r[what] for w, r in by_world.items() if r[what]})
        fits[contender] = fit
    assert "cachedstore" in fits, "the all-gather rounds did not run"
    top = max(SCALE.allgather_ws)
    ratios: dict[str, Any] = {}
    for w in (16, top):
        for mine in [c for c in _ROUNDS if c.startswith("cachedstore")]:
            cs = _ROUNDS[mine].get(w)
            for other in ("torch v2 EtcdStore", "etcd3 (uncached)"):
                ot = _ROUNDS.get(other, {}).get(w)
                if cs and ot:
                    ratios[f"{other} / {mine} at W={w}"] = {
                        step: ot[step] / cs[step]
                        for step in ("etcd_requests", "gather_requests", "barrier_requests")
                        if cs[step]}
    record("allgather_scaling", fits=fits, top_world=top, ratios=ratios)
    assert fits["cachedstore"]["etcd_requests"] is not None
