"""What opening a scope costs a store that watches what it touches, against the size of its
cache: the caller's CPU time per first read of a key (one Range, one watch create, the
scope's reset in the coherence core), with N entries already cached under a directory.

A key scope covers one name, so its opening should not depend on N; it did (every cached
entry was scanned), which this benchmark shows when run on an earlier revision::

    python benchmarks/scope_open.py                      # N = 0, 1,000, 10,000
    python benchmarks/scope_open.py --sizes 0,10000 --opens 200 --json

One throw-away etcd for the whole run (``cachedstore.server.LocalEtcd``); per N, one store
reads N keys in batches of 100 (a directory scope), then the medians over ``--opens`` first
reads of top-level keys, each followed by a short pause (a rank's reads are sporadic).
Nothing here is part of the ``cachedstore`` package. Blocks for a minute or so; the etcd it
starts is ended before it returns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from cachedstore import EtcdStore
from cachedstore.server import LocalEtcd

BATCH = 100


def measure(endpoint: str, size: int, opens: int, pause: float) -> dict[str, float]:
    """Median caller CPU and wall time (seconds) of a key scope's opening with ``size``
    entries cached."""
    prefix = f"/scope-open/{size}/"
    names = [f"big/k{i}" for i in range(size)]
    with EtcdStore(endpoints=[endpoint], prefix=prefix) as writer:
        for i in range(0, size, BATCH):
            writer.mset(dict.fromkeys(names[i:i + BATCH], b"v"))
        writer.mset({f"top{i}": b"v" for i in range(opens)})
    cpu, wall = [], []
    with EtcdStore(endpoints=[endpoint], prefix=prefix, watch_scope="touched",
                   cache_size=max(1_000, 2 * size), max_watches=opens + 8) as store:
        for i in range(0, size, BATCH):
            store.mget(names[i:i + BATCH])
        for i in range(opens):
            c, t = time.thread_time(), time.perf_counter()
            store.get(f"top{i}")
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - t)
            time.sleep(pause)
    return {"cpu_s": statistics.median(cpu),
            "wall_s": statistics.median(wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,1000,10000",
                        help="comma-separated numbers of cached entries")
    parser.add_argument("--opens", type=int, default=300)
    parser.add_argument("--pause", type=float, default=0.002, help="seconds between reads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    with LocalEtcd() as etcd:
        for size in (int(s) for s in args.sizes.split(",")):
            results.append({"size": size, **measure(etcd.endpoint, size, args.opens,
                                                    args.pause)})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| entries cached | CPU per key scope opened (median) | wall (median) |")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['size']:,} | {r['cpu_s'] * 1e6:,.0f} µs | {r['wall_s'] * 1e6:,.0f} µs |")


if __name__ == "__main__":
    main()
