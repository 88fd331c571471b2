"""Run every benchmark in one go and rewrite ``benchmarks/RESULTS.md`` and ``plots/``.

    python benchmarks/run.py            # the full set (< 10 minutes on 2 cores)
    python benchmarks/run.py --quick    # smaller sizes, fewer rounds

Runs ``pytest benchmarks`` (pytest-benchmark) in a child process against one throw-away
etcd, writes ``benchmarks/out/results.json`` (every workload's numbers and the machine) and
``benchmarks/out/pytest-benchmark.json`` (pytest-benchmark's raw statistics), then draws the
plots and the tables. ``--fanout 16,64`` also runs issue 11's fan-out benchmark
(``python -m benchmarks.fanout``: W simulated ranks, each with its own store) and rewrites
``benchmarks/FANOUT.md`` and ``plots/fanout_*.png``; ``--fanout-only`` runs just that.
torch's v2 EtcdStore is measured when ``python-etcd`` is installed
(``pip install python-etcd``); without it that contender is left out, with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import harness  # noqa: E402
import report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    parser.add_argument("--scale", choices=sorted(harness.SCALES), help="overrides --quick")
    parser.add_argument("--out", default=os.path.join(HERE, "out"), help="JSON directory")
    parser.add_argument("--no-report", action="store_true",
                        help="do not rewrite RESULTS.md and plots/")
    parser.add_argument("-k", dest="keyword", help="only benchmarks matching (pytest -k)")
    parser.add_argument("--fanout", metavar="WS",
                        help="also run the fan-out benchmark for these W (e.g. 16,64)")
    parser.add_argument("--fanout-only", action="store_true",
                        help="run only the fan-out benchmark (--fanout, default 16,64)")
    args = parser.parse_args(argv)
    if args.fanout_only:
        return fanout(args.fanout or "16,64")
    scale = args.scale or ("quick" if args.quick else "full")
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.json")
    bench_path = os.path.join(args.out, "pytest-benchmark.json")
    for path in (results_path, bench_path):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, **{harness.SCALE_ENV: scale, harness.RESULTS_ENV: results_path})
    max_time = "0.5" if scale == "full" else "0.2"
    cmd = [sys.executable, "-m", "pytest", HERE, "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "-o", "timeout=600", "-W", "ignore::DeprecationWarning",
           f"--benchmark-json={bench_path}", "--benchmark-min-time=0.0002",
           f"--benchmark-max-time={max_time}", "--benchmark-min-rounds=10",
           "--benchmark-warmup=on", "--benchmark-columns=median,iqr,rounds",
           "--benchmark-sort=name"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    started = time.monotonic()
    print(f"$ {' '.join(cmd)}  ({harness.SCALE_ENV}={scale})", flush=True)
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    elapsed = time.monotonic() - started
    if not os.path.exists(results_path):
        print("no results were written", file=sys.stderr)
        return code or 1
    with open(results_path) as f:
        results = json.load(f)
    results["elapsed_s"] = elapsed
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    if not args.no_report:
        made = report.build(results, os.path.join(HERE, "RESULTS.md"),
                            os.path.join(HERE, "plots"), elapsed)
        print(f"wrote {os.path.join(HERE, 'RESULTS.md')} and plots/{', plots/'.join(made)}")
    print()
    print(report.table(["target", "measured", ""], report.targets(results)))
    print(f"\nbenchmarks took {elapsed:.0f} s (pytest exit code {code})")
    if args.fanout:
        code = fanout(args.fanout) or code
    return code


def fanout(ws: str) -> int:
    """The fan-out section: ``python -m benchmarks.fanout --ws WS`` in a child process."""
    cmd = [sys.executable, "-m", "benchmarks.fanout", "--ws", ws]
    print(f"$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.call(cmd, cwd=ROOT, env=env, timeout=3600)


if __name__ == "__main__":
    sys.exit(main())
