"""Goal 6: client CPU per watch event, by transport. ``python -m benchmarks.fanout.watch_transport``

Starts its own etcd on free loopback ports. For every candidate and round, a fresh consumer
process opens one watch on a fresh prefix and says it is ready; a writer process (already
connected) then puts ``--events`` keys one by one (one revision, one watch message each).
The consumer decodes every event into ``(type, key, value, mod_revision)`` and stops its
clock when it has the last one. CPU is the consumer process's whole ``time.process_time()``
(every thread) from "ready" to the last event, per event; ``main`` is the consuming thread's
own ``time.thread_time()``, ``other`` the rest (grpcio's threads). ``etcd`` is etcd's CPU over
the same interval per event (it includes serving the writer's puts, the same for every
candidate). Candidates run interleaved, round by round; the table shows medians.

Candidates (each in its own process, so environment variables apply from the start):

* ``store``: cachedstore's ``EtcdStore`` (public API; polls ``watch_revision`` every 5 ms);
* ``grpc-bidi*``: grpcio sync bidi stream as the store's watcher drives it, with poll
  strategy, optimization target, fork support and switch interval variations;
* ``grpc-ustream``: the same RPC called as unary-stream (one request, then half-close:
  etcd keeps the watch); ``-st``: with grpcio's ``SingleThreadedUnaryStream`` option, the
  consuming thread drives the completion queue itself (no channel spin thread);
* ``aio-*``: grpc.aio, default loop or uvloop (when installed);
* ``gateway-*``: etcd's JSON gateway over one plain socket (``benchmarks.fanout.gateway_stream``);
  ``recv only`` reads the same stream without parsing it: the cost of waking up per message;
* ``grpc-batched``: a watch re-created from (last revision + 1) after every batch, so that
  etcd delivers the events as an unsynced watcher's catch-up, many revisions per message
  (adds up to ~100 ms of lag: a measure of the per-message floor, not a drop-in option).

Bounded: every consumer and writer is killed if it overruns ``--timeout``; etcd is closed
at the end (and by cachedstore.server's atexit hook on any exit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_WRITER = """
import sys, etcd3
c = etcd3.client(sys.argv[1], int(sys.argv[2]))
c.get("/warm-up")
print("ready", flush=True)
sys.stdin.readline()
for i in range(int(sys.argv[4])):
    c.put(f"{sys.argv[3]}k{i:06d}", b"w" * 64)
"""

_BASE_OPTIONS: list[tuple[str, Any]] = [  # what cachedstore.connection sets
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]

#: name -> (consumer kind, extra environment, extra channel options, switch interval)
CANDIDATES: dict[str, tuple[str, dict[str, str], list[tuple[str, Any]], float | None]] = {
    "store": ("store", {}, [], None),
    "grpc-bidi": ("bidi", {}, [], None),
    "grpc-bidi poll": ("bidi", {"GRPC_POLL_STRATEGY": "poll"}, [], None),
    "grpc-bidi opt=latency": ("bidi", {}, [("grpc.optimization_target", "latency")], None),
    "grpc-bidi opt=throughput": ("bidi", {}, [("grpc.optimization_target", "throughput")],
                                 None),
    "grpc-bidi fork=0": ("bidi", {"GRPC_ENABLE_FORK_SUPPORT": "0"}, [], None),
    "grpc-bidi switch=50ms": ("bidi", {}, [], 0.05),
    "grpc-ustream": ("ustream", {}, [], None),
    "grpc-ustream-st": ("ustream", {}, [("SingleThreadedUnaryStream", 1)],
                        None),
    "aio-bidi": ("aio-bidi", {}, [], None),
    "aio-bidi uvloop": ("aio-bidi", {"WT_UVLOOP": "1"}, [], None),
    "aio-ustream uvloop": ("aio-ustream", {"WT_UVLOOP": "1"}, [], None),
    "gateway orjson": ("gateway", {}, [], None),
    "gateway json": ("gateway", {"WT_JSON": "1"}, [], None),
    "gateway recv only (floor)": ("gateway-recv", {}, [], None),
    "grpc-batched-st": ("batched", {}, [("SingleThreadedUnaryStream", 1)],
                        None),
}


# ---------------------------------------------------------------------------- consumer side
def _threads_cpu() -> dict[str, float]:
    """``"tid:name"`` -> CPU seconds of every thread of this process (clock-tick precision)."""
    tick = os.sysconf("SC_CLK_TCK")
    result = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = "main" if int(tid) == os.getpid() else text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        result[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / tick
    return result


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    key = prefix.encode()
    return key, key[:-1] + bytes([key[-1] + 1])


def _consume(kind: str, host: str, port: int, prefix: str, events: int,
             options: list[tuple[str, Any]]) -> dict[str, Any]:
    """Run in the consumer process: watch, print "ready", take ``events`` events."""
    key, end = _prefix_range(prefix)
    metadata = (("hasleader", "true"),)
    out: dict[str, Any] = {}

    threads0: dict[str, float] = {}

    def ready() -> tuple[float, float]:
        print("ready", flush=True)
        threads0.update(_threads_cpu())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out.update(user=-usage.ru_utime, sys=-usage.ru_stime)
        return time.process_time(), time.thread_time()

    def done(c0: tuple[float, float], seen: int) -> None:
        out.update(cpu=time.process_time() - c0[0], main=time.thread_time() - c0[1],
                   seen=seen)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["user"] += usage.ru_utime
        out["sys"] += usage.ru_stime
        by_name: dict[str, float] = {}
        for tid_name, cpu in _threads_cpu().items():
            name = tid_name.split(":", 1)[1]
            by_name[name] = by_name.get(name, 0.0) + cpu - threads0.get(tid_name, 0.0)
        out["threads"] = {k: round(v, 3) for k, v in by_name.items() if v > 0}

    if kind == "store":
        from cachedstore import EtcdStore
        store = EtcdStore(host, port, prefix=prefix, cache_size=2 * events)
        try:
            rev0 = store.watch_revision
            c0 = ready()
            while store.watch_revision < rev0 + events:
                time.sleep(0.005)
            done(c0, store.watch_revision - rev0)
        finally:
            store.close()
        return out

    if kind == "gateway-recv":  # the floor: wake up and recv, no parsing at all
        from benchmarks.fanout.gateway_stream import GatewayWatchStream
        stream = GatewayWatchStream(host, port, key=key, range_end=end)
        next(iter(stream))  # headers and the created response (nothing else is sent yet)
        recv = stream._sock.recv
        c0 = ready()
        seen = 0
        while seen < events:
            seen += recv(65536).count(b'"mod_revision"')
        done(c0, seen)
        stream.close()
        return out

    if kind == "gateway":
        if os.environ.get("WT_JSON"):
            import benchmarks.fanout.gateway_stream as gs
            gs._loads = json.loads
        from benchmarks.fanout.gateway_stream import GatewayWatchStream
        stream = GatewayWatchStream(host, port, key=key, range_end=end)
        it = iter(stream)
        next(it)  # created
        c0 = ready()
        seen = 0
        decoded = []
        for resp in it:
            for ev in resp.events:
                decoded.append(ev)
            seen += len(resp.events)
            if seen >= events:
                break
        done(c0, seen)
        stream.close()
        return out

    import grpc
    from etcd3.etcdrpc import rpc_pb2 as pb

    def decode(resp: Any, sink: list[Any]) -> int:
        for ev in resp.events:
            kv = ev.kv
            sink.append((ev.type, kv.key, kv.value, kv.mod_revision))
        return len(resp.events)

    create = pb.WatchRequest(create_request=pb.WatchCreateRequest(key=key, range_end=end))
    target = f"{host}:{port}"
    opts = _BASE_OPTIONS + options

    if kind in ("aio-bidi", "aio-ustream"):
        import asyncio

        async def run() -> None:
            channel = grpc.aio.insecure_channel(target, options=opts)
            stop = asyncio.Event()
            if kind == "aio-bidi":
                async def requests() -> Any:
                    yield create
                    await stop.wait()
                call = channel.stream_stream(
                    "/etcdserverpb.Watch/Watch",
                    request_serializer=pb.WatchRequest.SerializeToString,
                    response_deserializer=pb.WatchResponse.FromString)(
                        requests(), metadata=metadata)
            else:
                call = channel.unary_stream(
                    "/etcdserverpb.Watch/Watch",
                    request_serializer=pb.WatchRequest.SerializeToString,
                    response_deserializer=pb.WatchResponse.FromString)(
                        create, metadata=metadata)
            it = call.__aiter__()
            await it.__anext__()  # created
            c0 = ready()
            seen = 0
            sink: list[Any] = []
            async for resp in it:
                seen += decode(resp, sink)
                if seen >= events:
                    break
            done(c0, seen)
            stop.set()
            call.cancel()
            await channel.close()

        if os.environ.get("WT_UVLOOP"):
            import uvloop
            uvloop.run(run())
        else:
            asyncio.run(run())
        return out

    channel = grpc.insecure_channel(target, options=opts)
    unary_stream = channel.unary_stream(
        "/etcdserverpb.Watch/Watch", request_serializer=pb.WatchRequest.SerializeToString,
        response_deserializer=pb.WatchResponse.FromString)
    sink: list[Any] = []

    def consume(call: Any) -> None:
        """Skip the created answer, then time the stream until ``events`` arrived."""
        next(call)
        c0 = ready()
        seen = 0
        for resp in call:
            seen += decode(resp, sink)
            if seen >= events:
                break
        done(c0, seen)

    if kind == "bidi":
        import threading
        stop = threading.Event()

        def requests() -> Any:
            yield create
            stop.wait()

        call = channel.stream_stream(
            "/etcdserverpb.Watch/Watch", request_serializer=pb.WatchRequest.SerializeToString,
            response_deserializer=pb.WatchResponse.FromString)(requests(), metadata=metadata)
        consume(call)
        stop.set()
        call.cancel()
    elif kind == "ustream":
        call = unary_stream(create, metadata=metadata)
        consume(call)
        call.cancel()
    elif kind == "batched":
        call = unary_stream(create, metadata=metadata)
        created = next(call)
        next_rev = created.header.revision + 1
        call.cancel()
        c0 = ready()
        seen = messages = 0
        while seen < events:
            request = pb.WatchRequest(create_request=pb.WatchCreateRequest(
                key=key, range_end=end, start_revision=next_rev))
            call = unary_stream(request, metadata=metadata)
            for resp in call:
                messages += 1
                if resp.canceled:
                    raise RuntimeError(f"watch canceled: {resp}")
                if resp.events:
                    seen += decode(resp, sink)
                    next_rev = resp.events[-1].kv.mod_revision + 1
                    break
            call.cancel()
        done(c0, seen)
        out["messages"] = messages
    else:
        raise ValueError(kind)
    channel.close()
    return out


def _consumer_main(argv: list[str]) -> None:
    kind, host, port, prefix, events, options = argv
    interval = os.environ.get("WT_SWITCH")
    if interval:
        sys.setswitchinterval(float(interval))
    result = _consume(kind, host, int(port), prefix, int(events),
                      [tuple(o) for o in json.loads(options)])  # type: ignore[misc]
    print("result " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- driver side
def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _readline(proc: subprocess.Popen[str], deadline: float, what: str) -> str:
    import selectors
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"{what} did not answer in time")
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{what} exited (code {proc.wait()})")
            if line.strip():
                return line.strip()


def _kill(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def run_one(name: str, host: str, port: int, etcd_pid: int, events: int,
            timeout: float) -> dict[str, Any]:
    kind, env_extra, options, interval = CANDIDATES[name]
    prefix = f"/wt/{uuid.uuid4().hex[:8]}/"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    if interval is not None:
        env["WT_SWITCH"] = str(interval)
    deadline = time.monotonic() + timeout
    writer = consumer = None
    try:
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, host, str(port), prefix, str(events)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        _readline(writer, deadline, "writer")
        consumer = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fanout.watch_transport", "--consume", kind,
             host, str(port), prefix, str(events), json.dumps(options)],
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        _readline(consumer, deadline, f"consumer {name}")
        e0, t0 = _proc_cpu(etcd_pid), time.perf_counter()
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
        line = _readline(consumer, deadline, f"consumer {name}")
        e1, t1 = _proc_cpu(etcd_pid), time.perf_counter()
        if not line.startswith("result "):
            raise RuntimeError(f"consumer {name}: {line}")
        result: dict[str, Any] = json.loads(line[len("result "):])
        consumer.wait(max(0.1, deadline - time.monotonic()))
        writer.wait(max(0.1, deadline - time.monotonic()))
    finally:
        _kill(consumer)
        _kill(writer)
    result.update(name=name, etcd=e1 - e0, wall=t1 - t0)
    return result


def _available(name: str) -> bool:
    env = CANDIDATES[name][1]
    if env.get("WT_UVLOOP"):
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return False
    if name.startswith("gateway orjson"):
        try:
            import orjson  # noqa: F401
        except ImportError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=30.0, help="per run, seconds")
    parser.add_argument("--budget", type=float, default=170.0,
                        help="stop starting new rounds after this many seconds")
    parser.add_argument("--only", nargs="*", help="candidate names (default: all)")
    parser.add_argument("--json", help="also write every run to this file")
    args = parser.parse_args(argv)

    from cachedstore.server import LocalEtcd

    names = [n for n in (args.only or CANDIDATES) if _available(n)]
    skipped = [n for n in (args.only or CANDIDATES) if n not in names]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    started = time.monotonic()
    with LocalEtcd() as etcd:
        host, _, port = etcd.endpoint.rpartition(":")
        pid = etcd.pid
        assert pid is not None
        for round_no in range(args.rounds):
            # a round takes about as long as the last one did; stay inside the budget
            if round_no and (time.monotonic() - started) * (round_no + 1) / round_no \
                    > args.budget:
                print(f"budget: stopping after {round_no} rounds", file=sys.stderr)
                break
            for name in names:
                try:
                    runs[name].append(run_one(name, host, int(port), pid, args.events,
                                              args.timeout))
                except (RuntimeError, TimeoutError) as exc:
                    print(f"{name}: {exc}", file=sys.stderr)
    elapsed = time.monotonic() - started

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    print(f"\nclient CPU per watch event, {args.events} single-put events, median of "
          f"{max((len(r) for r in runs.values()), default=0)} runs ({elapsed:.0f} s)\n")
    print(f"| {'candidate':<26} | total µs | main µs | other µs | etcd µs | runs |")
    print(f"|{'-' * 28}|---------:|--------:|---------:|--------:|-----:|")
    for name in names:
        r = runs[name]
        ok = [x for x in r if x["seen"] >= args.events]
        per = [1e6 * x["cpu"] / args.events for x in ok]
        main_ = [1e6 * x["main"] / args.events for x in ok]
        other = [max(0.0, 1e6 * (x["cpu"] - x["main"]) / args.events) for x in ok]
        etcd_ = [1e6 * x["etcd"] / args.events for x in ok]
        extra = ""
        if ok and "messages" in ok[0]:
            extra = f" {args.events / med([x['messages'] for x in ok]):.0f} events/message"
        print(f"| {name:<26} | {med(per):8.1f} | {med(main_):7.1f} | {med(other):8.1f} | "
              f"{med(etcd_):7.1f} | {len(ok):4d} |{extra}")
    for name in skipped:
        print(f"| {name:<26} | not available (package missing) |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--consume":
        _consumer_main(sys.argv[2:])
    else:
        sys.exit(main())
