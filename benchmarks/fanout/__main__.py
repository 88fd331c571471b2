"""``python -m benchmarks.fanout``: run the fan-out benchmark and write ``FANOUT.md``.

    python -m benchmarks.fanout --ws 16,64            # development sizes
    nice -n 15 python -m benchmarks.fanout --ws 256 --budget 90 --no-extras
    python -m benchmarks.fanout --report-only         # redraw from saved results

Each W runs against a fresh single-member etcd and writes ``results/W<w>.json`` in
``--results`` (default: ``benchmarks/fanout/results``); ``--extras`` (default on) measures
host sharing and CPU per watch event into ``extras.json``. Then ``benchmarks/FANOUT.md`` and
``benchmarks/plots/fanout_*.png`` are rebuilt from every saved W.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .patterns import PATTERNS
from .report import build
from .suite import run_extras, run_world
from .worker import STORE_OPTIONS_ENV

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fanout",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ws", default="16,64", help="comma-separated W values")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--budget", type=float, default=120.0,
                        help="seconds per pattern before it is aborted (DNF)")
    parser.add_argument("--max-seconds", type=float, default=540.0,
                        help="per W: start no pattern after this many seconds")
    parser.add_argument("--processes", type=int, default=None,
                        help="worker processes (default: 0 up to W=64, else 4)")
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--extras", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--machine", default="",
                        help="how FANOUT.md names the machine of this run's rows, e.g. "
                             "'16-core device machine' (cores and torch are added)")
    parser.add_argument("--output", default=os.path.join(BENCH, "FANOUT.md"),
                        help="the markdown report to write (plots go beside it, in plots/)")
    parser.add_argument("--store-options", default="{}",
                        help="JSON object of EtcdStore keywords for every rank's store, e.g. "
                             "'{\"stall_timeout\": 30}' where so many stores share 2 cores "
                             "that their watch threads starve past the stall timeout")
    args = parser.parse_args(argv)
    store_options = json.loads(args.store_options)
    if not isinstance(store_options, dict):
        parser.error("--store-options must be a JSON object")
    os.environ[STORE_OPTIONS_ENV] = json.dumps(store_options)  # worker processes too
    from cachedstore.server import LocalEtcd

    os.makedirs(args.results, exist_ok=True)
    command = "python -m benchmarks.fanout " + " ".join(argv if argv is not None
                                                        else sys.argv[1:])
    if not args.report_only:
        patterns = [p for p in args.patterns.split(",") if p]
        for w in (int(x) for x in args.ws.split(",") if x):
            path = os.path.join(args.results, f"W{w}.json")

            def save(run: dict[str, object], path: str = path) -> None:
                run["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
                run["loadavg"] = [round(x, 1) for x in os.getloadavg()]
                run["command"] = command
                run["store_options"] = store_options
                if args.machine and isinstance(run.get("machine"), dict):
                    run["machine"]["label"] = args.machine  # type: ignore[index]
                with open(path + ".tmp", "w") as f:
                    json.dump(run, f, indent=1, sort_keys=True)
                os.replace(path + ".tmp", path)

            with LocalEtcd() as etcd:
                save(run_world(w, etcd.endpoint, etcd.metrics_url, patterns=patterns,
                               budget=args.budget, max_seconds=args.max_seconds,
                               processes=args.processes, checkpoint=save))
        if args.extras:
            with LocalEtcd() as etcd:
                extras = run_extras(etcd.endpoint, etcd.metrics_url)
            extras["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
            with open(os.path.join(args.results, "extras.json"), "w") as f:
                json.dump(extras, f, indent=1, sort_keys=True)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    made = build(args.results, args.output, os.path.join(out_dir, "plots"),
                 "python -m benchmarks.fanout")
    print(f"wrote {args.output} and plots/{', plots/'.join(made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
