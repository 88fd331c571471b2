"""One worker process of the all-gather / barrier benchmark.

Workers are forked from a forkserver that has preloaded this module (so cachedstore, etcd3,
python-etcd and torch are imported once, not once per worker) and are driven over a pipe by
``test_allgather.py``:

- ``("setup", contender, world, prefix, host, port)``: create this worker's client;
- ``("phase", r, k)``: run phase ``k`` of round ``r`` and answer ``(t_start, t_end)`` on
  the shared ``time.perf_counter`` clock. Each worker class names its phases
  (``"gather"`` or ``"barrier"``); the coordinator starts a phase only when every worker
  has finished the previous one;
- ``("teardown",)``, ``("exit",)``.

Every answer is ``("ok", payload)`` or ``("error", traceback)``. Every blocking call has a
timeout, so a lost peer cannot hang a worker for more than ``TIMEOUT`` seconds.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from typing import Any

logging.getLogger("torch.distributed.elastic.rendezvous.registry").setLevel(logging.ERROR)

import etcd3  # noqa: E402

import cachedstore  # noqa: E402

try:  # optional contender
    import etcd  # noqa: F401,E402  (python-etcd)
    import torch.distributed.elastic.rendezvous.etcd_store  # noqa: F401,E402
except ImportError:
    pass
try:
    import torch.distributed  # noqa: F401,E402
except ImportError:
    pass

TIMEOUT = 90.0
PAYLOAD = b"p" * 64


class CachedStoreWorker:
    """cachedstore: set own key and ``mget`` all (blocking through the watch); then add +
    wait."""

    phases = ("gather", "barrier")

    def __init__(self, host: str, port: int, prefix: str, world: int, rank: int) -> None:
        self.store = cachedstore.EtcdStore(host, port, prefix=prefix, timeout=TIMEOUT)
        self.world, self.rank = world, rank

    def run(self, r: int, phase: int) -> None:
        s, w = self.store, self.world
        if phase == 0:
            s.set(f"r{r}/{self.rank}", PAYLOAD)
            values = s.mget([f"r{r}/{i}" for i in range(w)], timeout=TIMEOUT)
            assert len(values) == w and all(v == PAYLOAD for v in values)
        else:
            if s.add(f"r{r}/count") == w:
                s.set(f"r{r}/done", b"1")
            s.wait([f"r{r}/done"], timeout=TIMEOUT)

    def close(self) -> None:
        self.store.close()


class CachedStoreArrivalWorker(CachedStoreWorker):
    """cachedstore with a barrier made of one arrival key per worker and ``wait`` on all of
    them (public API only): the barrier becomes another O(W) gather."""

    def run(self, r: int, phase: int) -> None:
        if phase == 0:
            return super().run(r, phase)
        s = self.store
        s.set(f"r{r}/arrived/{self.rank}", b"1")
        s.wait([f"r{r}/arrived/{i}" for i in range(self.world)], timeout=TIMEOUT)


class CachedStoreBackoffWorker(CachedStoreWorker):
    """PROTOTYPE, benchmark only, public APIs only: a counter increment like
    ``EtcdStore.add`` (compare-and-swap Txn, first guess from the store's watch-fed cache)
    plus a jittered back-off after each failed attempt, retrying with the freshest value
    known (the failed Txn's answer or the cache's, whichever is larger: the counter only
    grows, so comparing on the value is safe). It measures what back-off would save."""

    def __init__(self, host: str, port: int, prefix: str, world: int, rank: int) -> None:
        super().__init__(host, port, prefix, world, rank)
        self.client = etcd3.client(host, port, timeout=TIMEOUT)
        self.prefix = prefix

    def _add(self, name: str, amount: int = 1) -> int:
        c, key = self.client, self.prefix + name
        cached = self.store.get(name, default=None)
        current = None if cached is None else int(cached)
        for attempt in range(1_000):
            if current is None:
                new, compare = amount, [c.transactions.create(key) == 0]
            else:
                new, compare = current + amount, [c.transactions.value(key) == str(current)]
            ok, responses = c.transaction(compare=compare,
                                          success=[c.transactions.put(key, str(new))],
                                          failure=[c.transactions.get(key)])
            if ok:
                return new
            found = responses[0][0][0] if responses and responses[0] else None
            time.sleep(random.uniform(0, min(0.0005 * 2 ** attempt, 0.02)))
            cached = self.store.get(name, default=None)  # the watch may know more by now
            values = [int(v) for v in (found, cached) if v is not None]
            current = max(values) if values else None
        raise RuntimeError("add: too many attempts")

    def run(self, r: int, phase: int) -> None:
        if phase == 0:
            return super().run(r, phase)
        s = self.store
        if self._add(f"r{r}/count") == self.world:
            s.set(f"r{r}/done", b"1")
        s.wait([f"r{r}/done"], timeout=TIMEOUT)

    def close(self) -> None:
        super().close()
        self.client.close()


class Etcd3Worker:
    """A raw etcd3 client, uncached: phase 0 puts the own key; phase 1 (once every worker
    has put) gets every key; phase 2 adds to the counter by compare-and-swap; phase 3 reads
    "done". The coordinator sequences the phases, so nobody polls."""

    phases = ("gather", "gather", "barrier", "barrier")

    def __init__(self, host: str, port: int, prefix: str, world: int, rank: int) -> None:
        self.client = etcd3.client(host, port, timeout=TIMEOUT)
        self.prefix, self.world, self.rank = prefix, world, rank

    def _add(self, key: str) -> int:
        c = self.client
        while True:
            value, meta = c.get(key)
            if value is None:
                new = 1
                compare = [c.transactions.create(key) == 0]
            else:
                new = int(value) + 1
                compare = [c.transactions.mod(key) == meta.mod_revision]
            ok, _ = c.transaction(compare=compare,
                                  success=[c.transactions.put(key, str(new))], failure=[])
            if ok:
                return new

    def run(self, r: int, phase: int) -> None:
        p = f"{self.prefix}r{r}/"
        if phase == 0:
            self.client.put(f"{p}{self.rank}", PAYLOAD)
        elif phase == 1:
            values = [self.client.get(f"{p}{i}")[0] for i in range(self.world)]
            assert all(v == PAYLOAD for v in values)
        elif phase == 2:
            if self._add(f"{p}count") == self.world:
                self.client.put(f"{p}done", b"1")
        else:
            assert self.client.get(f"{p}done")[0] == b"1"

    def close(self) -> None:
        self.client.close()


class TorchV2Worker:
    """torch.distributed.elastic's v2 EtcdStore: set own key, get every key (each blocks
    until present); then add + wait, as torch's store-based collectives do."""

    phases = ("gather", "barrier")

    def __init__(self, host: str, port: int, prefix: str, world: int, rank: int) -> None:
        self.host, self.port, self.prefix, self.world, self.rank = host, port, prefix, world, rank

    def run(self, r: int, phase: int) -> None:
        import datetime

        import etcd as python_etcd
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        if phase == 0:
            client = python_etcd.Client(host=self.host, port=self.port, protocol="http",
                                        read_timeout=TIMEOUT + 5)
            self.store = s = EtcdStore(client, f"{self.prefix}r{r}",
                                       timeout=datetime.timedelta(seconds=TIMEOUT))
            s.set(str(self.rank), PAYLOAD)
            values = [s.get(str(i)) for i in range(self.world)]
            assert all(v == PAYLOAD for v in values)
        else:
            s = self.store
            if s.add("count", 1) == self.world:
                s.set("done", b"1")
            s.wait(["done"])

    def close(self) -> None:
        pass


class TCPStoreWorker:
    """torch TCPStore (server in another process): set, wait + multi_get; then add + wait."""

    phases = ("gather", "barrier")

    def __init__(self, host: str, port: int, prefix: str, world: int, rank: int) -> None:
        import datetime

        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=TIMEOUT))
        self.prefix, self.world, self.rank = prefix, world, rank

    def run(self, r: int, phase: int) -> None:
        s, p = self.store, f"{self.prefix}r{r}/"
        if phase == 0:
            s.set(f"{p}{self.rank}", PAYLOAD)
            keys = [f"{p}{i}" for i in range(self.world)]
            s.wait(keys)
            assert all(v == PAYLOAD for v in s.multi_get(keys))
        else:
            if s.add(f"{p}count", 1) == self.world:
                s.set(f"{p}done", b"1")
            s.wait([f"{p}done"])

    def close(self) -> None:
        pass


WORKERS: dict[str, Any] = {
    "cachedstore": CachedStoreWorker,
    "cachedstore, barrier by arrival keys": CachedStoreArrivalWorker,
    "cachedstore, add with back-off (prototype)": CachedStoreBackoffWorker,
    "etcd3 (uncached)": Etcd3Worker,
    "torch v2 EtcdStore": TorchV2Worker,
    "TCPStore": TCPStoreWorker,
}


def serve(conn: Any, rank: int) -> None:
    """The worker's loop: answer the coordinator's commands until ``exit`` or EOF."""
    worker: Any = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        cmd = msg[0]
        try:
            if cmd == "exit":
                break
            if cmd == "setup":
                _, contender, world, prefix, host, port = msg
                worker = WORKERS[contender](host, port, prefix, world, rank)
                conn.send(("ok", worker.phases))
            elif cmd == "phase":
                r, phase = msg[1], msg[2]
                t0 = time.perf_counter()
                worker.run(r, phase)
                conn.send(("ok", (t0, time.perf_counter())))
            elif cmd == "teardown":
                if worker is not None:
                    worker.close()
                worker = None
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    if worker is not None:
        worker.close()
