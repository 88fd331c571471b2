"""Client CPU and wall time per unary etcd call: grpcio against cachedstore's own HTTP/2
transport (``StoreConfig.unary_transport``), side by side in one run.

Each variant runs in its own fresh process (so that one's threads cannot bill the other),
against the same throw-away etcd (or ``--endpoint``), alternating A/B for ``--rounds``
rounds; each figure is the median over rounds of (process CPU time, wall time) / calls.

Variants:

- ``grpcio stub``: etcd3's generated ``KVStub.Range`` on a grpcio channel (the floor of any
  grpcio client);
- ``wire channel``: :class:`cachedstore.unary.UnaryChannel` ``Range`` (the same floor, ours);
- ``store range, grpc`` / ``store range, wire``: ``Connection.call("range")`` of a store
  (retry policy, metrics, cluster check: what the store's reads pay);
- ``store set, grpc`` / ``store set, wire``: ``EtcdStore.set`` (a Txn, and the watch
  thread applying its event in the same process).

::

    python benchmarks/unary_cpu.py                 # 5 rounds of 2,000 calls
    python benchmarks/unary_cpu.py --json

Nothing here is part of the ``cachedstore`` package. Blocks for about a minute; every
process it starts is ended before it returns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

VARIANTS = ("grpcio stub", "wire channel", "store range, grpc", "store range, wire",
            "store set, grpc", "store set, wire")

_CHILD = r"""
import json, resource, sys, time
from etcd3 import etcdrpc
variant, endpoint, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = endpoint.split("://")[-1]
request = etcdrpc.RangeRequest(key=b"/unary-cpu/k")
store = None
if variant == "grpcio stub":
    import grpc
    stub = etcdrpc.KVStub(grpc.insecure_channel(target))
    call = lambda: stub.Range(request, timeout=5, metadata=(("hasleader", "true"),))
elif variant == "wire channel":
    from cachedstore.unary import UnaryChannel
    rng = UnaryChannel(target, None, 2.0).method("/etcdserverpb.KV/Range",
                                                 etcdrpc.RangeResponse.FromString)
    call = lambda: rng(request, timeout=5, metadata=(("hasleader", "true"),))
else:
    from cachedstore import EtcdStore
    transport = variant.rsplit(", ", 1)[1]
    store = EtcdStore(endpoints=[endpoint], prefix="/unary-cpu/", unary_transport=transport)
    conn = store._conn  # benchmark-only access: the store's own call path
    if variant.startswith("store range"):
        call = lambda: conn.call("range", request, deadline=conn.deadline(5))
    else:
        call = lambda: store.set("k", "v")
for _ in range(max(100, calls // 10)):
    call()
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu0, wall0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
for _ in range(calls):
    call()
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu = usage.ru_utime + usage.ru_stime - cpu0
print(json.dumps({"cpu_us": cpu / calls * 1e6,
                  "wall_us": (time.perf_counter() - wall0) / calls * 1e6}))
if store is not None:
    store.close()
"""


def measure(endpoint: str, rounds: int = 5, calls: int = 2_000,
            variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Per variant: median CPU and wall µs per call over ``rounds``, and every round's."""
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            done = subprocess.run([sys.executable, "-c", _CHILD, variant, endpoint, str(calls)],
                                  check=True, capture_output=True, text=True, timeout=300)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {}
    for variant, results in runs.items():
        out[variant] = {
            "cpu_us": statistics.median(r["cpu_us"] for r in results),
            "wall_us": statistics.median(r["wall_us"] for r in results),
            "rounds_cpu_us": [round(r["cpu_us"], 1) for r in results]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="an etcd to use (default: a throw-away one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.endpoint:
        result = measure(args.endpoint, args.rounds, args.calls)
    else:
        from cachedstore.server import LocalEtcd

        with LocalEtcd() as etcd:
            result = measure(etcd.endpoint, args.rounds, args.calls)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"per unary call, median of {args.rounds} rounds x {args.calls:,} calls "
          f"(each variant in its own process, interleaved):")
    for variant, figures in result.items():
        print(f"  {variant:20s} CPU {figures['cpu_us']:6.0f} µs   wall {figures['wall_us']:6.0f} µs"
              f"   rounds {figures['rounds_cpu_us']}")
    for what in ("store range", "store set"):
        grpc_cpu, wire_cpu = result[f"{what}, grpc"]["cpu_us"], result[f"{what}, wire"]["cpu_us"]
        print(f"  {what}: wire / grpc CPU = {wire_cpu / grpc_cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
