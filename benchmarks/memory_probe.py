"""Measure the resident memory a cachedstore cache needs per entry (run as a subprocess).

``python memory_probe.py HOST PORT PREFIX N CHECKPOINTS`` reads keys ``PREFIX k0000000`` …
into one store's cache in ``CHECKPOINTS`` equal steps (``mget``, i.e. the read-through
path) and prints one JSON object: the RSS after constructing the store and after each step
(after ``gc.collect()`` and glibc's ``malloc_trim(0)``, so that freed gRPC buffers are not
counted), and the least-squares slope in bytes per cached entry. A fresh process, so that
nothing else the benchmarks did is in its heap.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys


def rss() -> int:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return rss()


def main(argv: list[str]) -> dict[str, object]:
    from cachedstore import EtcdStore, StoreConfig

    # The read-through path, even where this version of cachedstore preloads small prefixes.
    kwargs = {"preload_limit": 0} if "preload_limit" in StoreConfig.__dataclass_fields__ else {}

    host, port, prefix, n, steps = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    names = [f"k{i:07d}" for i in range(n)]
    with EtcdStore(host, port, prefix=prefix, cache_size=n + 1024, **kwargs) as store:
        store.mget(names[:64])  # warm the channel and the code paths
        points = [(64, settle())]
        per_step = max(1, n // steps)
        for start in range(64, n, per_step):
            chunk = names[start:start + per_step]
            for i in range(0, len(chunk), 1024):
                store.mget(chunk[i:i + 1024])
            points.append((min(n, start + per_step), settle()))
        entries = store.stats()["entries"]
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
    return {"entries": entries, "points": points, "bytes_per_entry": slope,
            "rss_growth": ys[-1] - ys[0]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
