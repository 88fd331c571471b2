"""Client CPU per rank, this tree against an earlier revision, side by side in one run.

``python -m benchmarks.fanout.compare --against REV [--ws 16] [--reps 5] [--rounds 2]
[--processes N] [--floor]`` checks ``REV`` out into a temporary git worktree and, round by round, runs
the same fan-out patterns (:func:`~benchmarks.fanout.simulator.run_pattern`, fresh stores
each time) once on that tree and once on this one, each in a child process with its own
throw-away etcd, alternating which goes first. The ranks are threads of that child
(``--processes 0``, the default) or are spread over ``N`` spawned worker processes
(``--processes W``: one rank per process, as a job places them; each run then pays the
workers' start, not measured, so it is slower). The placement changes what a rank pays:
threads of one process hand one GIL to each other at every system call, which separate
processes do not, while a process of its own runs its code cold once. It prints a markdown
table: per pattern, each side's median client CPU per rank (process CPU over W, during the
measured steps) over every run of every round, split by thread (the ranks', the watches',
the rest: other Python threads and threads Python did not start, i.e. gRPC's core), and
the ratio. The fan-out suite itself measures each pattern once per W; these repetitions
are what a ratio between two revisions needs on a noisy 2-core machine.

``--floor`` (threads only) also runs each pattern, in a third child (this tree, in the
same rounds, no etcd), on one ``HashStore`` the ranks share (``run_pattern(in_process=True)``): what the harness and
torch's own Python cost a rank with a store that costs next to nothing. No store over a
network goes below it, so ``floor / REV`` is the least ratio any change could reach.

Bounds: every child has ``--budget`` seconds per run of a pattern and is killed after
``--child-timeout`` seconds; the worktree is removed at the end. Blocking; not thread-safe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PATTERNS = ("nccl_broadcast", "store_barrier", "store_api_barrier", "elastic_barrier",
            "groups", "heartbeat", "heartbeat_uncached", "keepalive")
KINDS = ("rank", "watch", "other")


def _child(world: int, reps: int, patterns: list[str], budget: float,
           processes: int, floor: bool) -> None:
    """In a child process: one etcd (none with ``floor``: the ranks share one
    ``HashStore``), each pattern ``reps`` times; a JSON line per run."""
    import logging

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    from benchmarks.fanout.simulator import run_pattern
    from cachedstore.server import LocalEtcd

    with contextlib.nullcontext() if floor else LocalEtcd() as etcd:
        for pattern in patterns:
            for _ in range(reps):
                if etcd is None:
                    r = run_pattern(pattern, world, in_process=True, processes=0, budget=budget)
                else:
                    r = run_pattern(pattern, world, etcd.endpoint.split("://")[-1],
                                    etcd.metrics_url, processes=processes, budget=budget)
                by = r.cpu_by_thread
                print(json.dumps({
                    "pattern": pattern, "ok": r.finished and not r.errors,
                    "cpu": r.client_cpu_s / world,
                    "rank": by.get("rank", 0.0) / world, "watch": by.get("watch", 0.0) / world,
                    "other": (by.get("python", 0.0) + by.get("native", 0.0)) / world}),
                    flush=True)


def _run_side(tree: str, args: argparse.Namespace, floor: bool = False
              ) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--ws", str(args.ws),
           "--reps", str(args.reps), "--patterns", ",".join(args.patterns),
           "--budget", str(args.budget), "--processes", str(args.processes)]
    if floor:
        cmd.append("--floor")
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True,
                         timeout=args.child_timeout, check=False)
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not runs:
        raise RuntimeError(f"the run on {tree} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return runs


def _median(runs: list[dict[str, Any]], pattern: str, key: str) -> float:
    values = [r[key] for r in runs if r["pattern"] == pattern and r["ok"]]
    return statistics.median(values) * 1e6 if values else float("nan")


def table(before: list[dict[str, Any]], now: list[dict[str, Any]], against: str,
          patterns: list[str], floor: list[dict[str, Any]] | None = None) -> str:
    """The markdown table of medians (µs) and ratios; with ``floor`` runs, two more
    columns: the floor's CPU per rank and ``floor / against``."""
    head = f"| pattern | {against}: CPU / rank | rank / watch / other | now: CPU / rank | " \
        f"rank / watch / other | now / {against} |"
    if floor:
        head += f" floor: CPU / rank | floor / {against} |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for p in patterns:
        b, n = _median(before, p, "cpu"), _median(now, p, "cpu")
        parts = [" / ".join(f"{_median(side, p, k):,.0f}" for k in KINDS)
                 for side in (before, now)]
        line = f"| {p} | {b:,.0f} µs | {parts[0]} | {n:,.0f} µs | {parts[1]} | {n / b:.2f} |"
        if floor:
            f = _median(floor, p, "cpu")
            line += f" {f:,.0f} µs | {f / b:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="the git revision to compare with")
    parser.add_argument("--ws", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5, help="runs per pattern per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--patterns", type=lambda s: s.split(","), default=list(PATTERNS))
    parser.add_argument("--processes", type=int, default=0,
                        help="0: ranks as threads of one process; N: over N processes")
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--floor", action="store_true",
                        help="also run each pattern on one shared HashStore (threads only)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.ws, args.reps, args.patterns, args.budget, args.processes, args.floor)
        return
    if not args.against:
        parser.error("--against REV is required")
    if args.floor and args.processes:
        parser.error("--floor needs the ranks as threads of one process (--processes 0)")
    with tempfile.TemporaryDirectory(prefix="fanout-compare-") as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree,
                        args.against], check=True)
        try:
            before: list[dict[str, Any]] = []
            now: list[dict[str, Any]] = []
            floor: list[dict[str, Any]] = []
            for round_ in range(args.rounds):
                sides = [(tree, before, False), (ROOT, now, False)]
                if args.floor:
                    sides.append((ROOT, floor, True))
                for where, runs, on_floor in sides if round_ % 2 == 0 else sides[::-1]:
                    runs += _run_side(where, args, on_floor)
                    print(f"[compare] round {round_ + 1}: {where}{' (floor)' * on_floor} "
                          "done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree],
                           check=False)
    placement = "threads of one process" if not args.processes \
        else f"{args.processes} processes"
    print(f"W = {args.ws}, ranks as {placement}; {args.rounds} rounds of {args.reps} runs "
          f"per pattern and side; medians\n")
    print(table(before, now, args.against, args.patterns, floor))


if __name__ == "__main__":
    main()
