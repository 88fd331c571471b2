"""TorchEtcdStore: torch's c10d Store on etcd v3, driven by torch's own C++ where possible."""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from faults.proxy import FaultProxy
from util import eventually, raw_client, rpc_count

from cachedstore import EtcdStore
from cachedstore.clock import FakeClock
from cachedstore.server import free_port
from cachedstore.torch import TorchEtcdStore

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def tstore(etcd, prefix):
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                        timeout=timedelta(seconds=10)) as store:
        yield store


def _another(etcd, prefix, **kwargs) -> TorchEtcdStore:
    """A second store on the same prefix: "another process" as far as etcd can tell (its
    own connection, cache and watch)."""
    return TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **kwargs)


def test_torch_cpp_self_test_of_a_python_store(tstore, etcd, prefix):
    # torch's C++ drives the store through its trampoline: add, set, get, clone + get.
    dist._test_python_store(tstore)
    raw = raw_client(etcd)
    # Counters: the key holds the documented marker; the store reads the decimal value.
    assert raw.get(prefix + "key")[0].startswith(b"\x00cachedstore:counter\x00")
    assert tstore.get("key") == b"6"
    assert tstore.get("key3") == b"15"
    assert raw.get(prefix + "foo")[0] == b"bar"  # set on the store, read through the clone


def test_every_trampoline_method_under_cpp_prefix_store(tstore, etcd, prefix):
    p = dist.PrefixStore("pg", tstore)  # C++: each call below crosses into Python
    p.set("a", "1")
    assert p.get("a") == b"1"
    assert p.add("n", 3) == 3 and p.add("n", -1) == 2
    assert p.compare_set("a", "1", "2") == b"2"
    assert p.compare_set("a", "1", "3") == b"2"  # mismatch: the current value, unchanged
    assert p.compare_set("fresh", "", "v") == b"v"  # absent + empty expected: created
    assert p.compare_set("absent", "x", "y") == b"x"  # absent: expected, nothing created
    assert p.check(["a", "n"]) and not p.check(["a", "absent"])
    p.wait(["a"])
    p.wait(["a", "n"], timedelta(seconds=1))
    p.append("log", "x")
    p.append("log", b"y")
    assert p.get("log") == b"xy"
    assert p.has_extended_api()
    p.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert p.multi_get(["m1", "m2", "a"]) == [b"v1", b"v2", b"2"]
    assert p.num_keys() == 6  # a n fresh log m1 m2: nothing else under the prefix
    assert p.delete_key("fresh") and not p.delete_key("fresh")
    p.barrier("b", 1)  # torch's C++ barrier on top of add/wait
    raw = raw_client(etcd)
    assert raw.get(prefix + "pg/a")[0] == b"2"
    assert raw.get(prefix + "pg/log")[0] == b"xy"
    assert raw.get(prefix + "pg/fresh")[0] is None


def test_python_and_cpp_method_names(tstore):
    tstore.set("k", "v")
    assert tstore.num_keys() == tstore.getNumKeys() == 1
    assert tstore.delete_key("k") and not tstore.deleteKey("k")


def test_store_only_held_by_cpp_stays_callable(etcd, prefix):
    # The one-line swap hands the store to C++ and drops the Python reference.
    p = dist.PrefixStore("x", _another(etcd, prefix))
    gc.collect()
    p.set("k", "v")
    assert p.get("k") == b"v"
    inner = p.underlying_store
    assert isinstance(inner, TorchEtcdStore)
    inner.close()
    assert inner.etcd_store.closed


def test_get_of_absent_key_blocks_on_the_watch_until_another_process_sets_it(
        tstore, etcd, prefix):
    other = _another(etcd, prefix)
    results: list[bytes] = []
    reader = threading.Thread(target=lambda: results.append(tstore.get("late")),
                              name="test-blocked-get")
    reader.start()
    try:
        eventually(lambda: tstore.etcd_store.stats()["waiters"] >= 1, what="waiter registered")
        ranges = rpc_count(tstore.etcd_store.registry, "range")
        other.set("late", "here")
        reader.join(10)
        assert results == [b"here"]
        # Woken by the watch event: at most the one re-check read, no polling.
        assert rpc_count(tstore.etcd_store.registry, "range") - ranges <= 1
    finally:
        other.close()
        reader.join(10)


def test_a_blocking_get_answers_with_the_look_that_finds_the_key(etcd, prefix):
    """A torch ``get`` of an absent key looks it up once after registering its waiter
    (a put in between wakes it) and once per wake: the look that finds the key returns
    its value. No ``wait`` of the store in between, nor a read after the wake."""
    with TorchEtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as tstore:
        other = _another(etcd, prefix)
        store = tstore.etcd_store
        calls: list[str] = []
        for method in ("get", "mget", "wait"):
            original = getattr(store, method)

            def counted(*args, _original=original, _method=method, **kwargs):
                calls.append(_method)
                return _original(*args, **kwargs)

            setattr(store, method, counted)
        results: list[bytes] = []
        reader = threading.Thread(target=lambda: results.append(tstore.get("late")),
                                  name="test-blocked-get")
        reader.start()
        try:
            eventually(lambda: store.stats()["waiters"] >= 1 and len(calls) >= 2,
                       what="the waiter registered, then the key looked up")
            looked = list(calls)
            other.set("late", "here")
            reader.join(10)
            assert results == [b"here"]
            assert looked == ["get", "mget"], looked  # the get, the look after registering
            assert calls[len(looked):] and set(calls[len(looked):]) == {"mget"}, calls
        finally:
            other.close()
            reader.join(10)


def test_timeouts_raise_dist_store_error(tstore):
    tstore.set_timeout(timedelta(milliseconds=200))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout") as info:
        tstore.get("never")
    assert time.monotonic() - started < 5
    assert isinstance(info.value, RuntimeError)  # what torch's barrier retry loops catch
    with pytest.raises(dist.DistStoreError, match="timeout"):
        tstore.wait(["never"], timedelta(milliseconds=100))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        tstore.multi_get(["never"])
    # Through C++ (PrefixStore), the Python exception comes back as itself.
    p = dist.PrefixStore("p", tstore)
    with pytest.raises(dist.DistStoreError, match="timeout"):
        p.get("never")
    with pytest.raises(dist.DistStoreError, match="timeout"):
        p.wait(["never"], timedelta(milliseconds=100))


def test_get_takes_bytes_names_and_rejects_others_with_torchs_error(tstore):
    """Called from Python, ``get`` may be given bytes (also unhashable ``bytearray``): read
    as the str key they encode, cached or not; a name of another type raises torch's
    ``DistStoreError`` (the store's InvalidTypeError), never a bare TypeError."""
    tstore.set("k", "v")
    for name in (b"k", bytearray(b"k"), bytearray(b"k")):  # the second bytearray: cached
        assert tstore.get(name) == b"v"  # type: ignore[arg-type]
    with pytest.raises(dist.DistStoreError, match="key name must be str or bytes"):
        tstore.get(["k"])  # type: ignore[arg-type]


def test_unreachable_etcd_raises_dist_network_error(prefix):
    with pytest.raises(dist.DistNetworkError):
        TorchEtcdStore(endpoints=[f"127.0.0.1:{free_port()}"], prefix=prefix,
                       connect_timeout=0.5)


def test_counters_compare_set_append_delete_are_atomic_across_stores(tstore, etcd, prefix):
    stores = [tstore] + [_another(etcd, prefix) for _ in range(3)]
    adds: list[int] = []
    winners: list[int] = []
    deleted: list[bool] = []
    tstore.set("victim", "x")
    lock = threading.Lock()

    def work(i: int, store: TorchEtcdStore) -> None:
        mine = [store.add("counter", 1) for _ in range(20)]
        for j in range(10):
            store.append("log", f"<{i}.{j}>")
        if store.compare_set("leader", "", str(i)) == str(i).encode():
            with lock:
                winners.append(i)
        gone = store.delete_key("victim")
        with lock:
            adds.extend(mine)
            deleted.append(gone)

    threads = [threading.Thread(target=work, args=(i, s), name=f"test-atomic-{i}")
               for i, s in enumerate(stores)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(adds) == list(range(1, 81))  # every add saw a distinct value
        log = tstore.get("log").decode()
        tokens = sorted(log.strip("<>").split("><"))
        assert tokens == sorted(f"{i}.{j}" for i in range(4) for j in range(10))
        assert len(winners) == 1
        assert tstore.get("leader") == str(winners[0]).encode()
        assert deleted.count(True) == 1
        assert tstore.get("counter") == b"80"
        assert raw_client(etcd).get(prefix + "counter")[0].startswith(
            b"\x00cachedstore:counter\x00")
    finally:
        for s in stores[1:]:
            s.close()


def test_etcd_store_append_never_trusts_a_stale_cache_entry(etcd, prefix, monkeypatch):
    # EtcdStore.append (added for torch's append) swaps on mod_revision: a stale guess from
    # the cache costs one failed compare, never a lost or doubled append.
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        raw_client(etcd).put(prefix + "k", "fresh")
        monkeypatch.setattr(store._cache, "peek", lambda name: (b"stale", 1, 1))
        txns = rpc_count(store.registry, "txn")
        assert store.append("k", "+1") == b"fresh+1"
        assert rpc_count(store.registry, "txn") - txns == 2  # the failed compare, the put
        assert raw_client(etcd).get(prefix + "k")[0] == b"fresh+1"
        monkeypatch.undo()
        assert store.get("k") == b"fresh+1"  # read-your-writes
        assert store.append("new", b"\x00") == b"\x00"


def test_clone_shares_the_connection_and_works_from_another_thread(etcd, prefix):
    origin = _another(etcd, prefix, timeout=timedelta(seconds=7))
    clone = origin.clone()
    assert isinstance(clone, TorchEtcdStore)
    assert clone.etcd_store is origin.etcd_store
    assert clone.timeout == timedelta(seconds=7)
    seen: list[bytes] = []
    t = threading.Thread(target=lambda: (clone.set("c", "1"), seen.append(clone.get("c"))),
                         name="test-clone")
    t.start()
    t.join(10)
    assert seen == [b"1"] and origin.get("c") == b"1"
    clone.close()  # a clone does not own the connection
    assert not origin.etcd_store.closed
    again = origin.clone()
    origin.close()  # the owner does: its clones are closed with it
    with pytest.raises(dist.DistStoreError, match="closed"):
        again.get("c")


def test_pickle_rebuilds_the_store_from_its_settings(tstore, etcd, prefix):
    tstore.set("k", "v")
    copy = pickle.loads(pickle.dumps(tstore))
    try:
        assert copy.etcd_store is not tstore.etcd_store
        assert copy.prefix == tstore.prefix and copy.timeout == tstore.timeout
        assert copy.get("k") == b"v"
    finally:
        copy.close()
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as etcd_store:
        wrapped = TorchEtcdStore(store=etcd_store)
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(wrapped)
        wrapped.close()
        assert not etcd_store.closed  # built around it: not ours to close


_WORKER = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from cachedstore.torch import TorchEtcdStore

    endpoint, prefix, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), 4
    store = TorchEtcdStore(endpoints=[endpoint], prefix=prefix, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    dist.barrier()
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    sub = torch.tensor([float(rank + 1)])
    dist.all_reduce(sub, group=low if rank < 2 else high)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "total": total.item(), "sub": sub.item()}), flush=True)
    store.close()
""")


def test_four_processes_init_process_group_all_reduce_barrier_new_group(
        etcd, prefix, tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), etcd.endpoint, prefix, str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True) for r in range(4)]
    outputs = []
    try:
        deadline = time.monotonic() + 75
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert sorted(o["rank"] for o in outputs) == [0, 1, 2, 3]
    assert all(o["total"] == 10.0 for o in outputs)
    assert {o["rank"]: o["sub"] for o in outputs} == {0: 3.0, 1: 3.0, 2: 7.0, 3: 7.0}
    # The process group's bootstrap went through etcd, under the store's prefix.
    assert raw_client(etcd).get_prefix(prefix, keys_only=True)


# --------------------------------------------------- issue 14 item 4: outages inside a wait
def _run(errors: dict[str, BaseException], name: str, fn) -> threading.Thread:
    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            errors[name] = exc
    t = threading.Thread(target=body, name=f"test-{name}")
    t.start()
    return t


def test_waits_that_end_in_an_outage_raise_torchs_timeout_error(etcd_factory, prefix):
    server = etcd_factory()
    store = TorchEtcdStore(endpoints=[server.endpoint], prefix=prefix, request_timeout=1,
                           timeout=timedelta(seconds=2))
    errors: dict[str, BaseException] = {}
    try:
        threads = [_run(errors, "wait", lambda: store.wait(["never"], timedelta(seconds=2))),
                   _run(errors, "get", lambda: store.get("never-either")),
                   _run(errors, "multi_get", lambda: store.multi_get(["nor-this"]))]
        eventually(lambda: store.etcd_store.stats()["waiters"] >= 3, what="3 waiters")
        server.kill()  # etcd gone mid-wait: each wait runs into its deadline in the outage
        for t in threads:
            t.join(60)
        assert sorted(errors) == ["get", "multi_get", "wait"]
        for name, exc in errors.items():
            # torch's barrier loops catch DistStoreError; DistNetworkError is not one.
            assert isinstance(exc, dist.DistStoreError), (name, exc)
            assert not isinstance(exc, dist.DistNetworkError), name
            assert "timeout" in str(exc), (name, exc)
    finally:
        store.close()


def test_a_wait_in_an_outage_ends_at_its_deadline_without_another_etcd_read(
        etcd_factory, prefix):
    server = etcd_factory()
    clock = FakeClock()
    store = TorchEtcdStore(endpoints=[server.endpoint], prefix=prefix, request_timeout=1,
                           timeout=timedelta(seconds=5), clock=clock)
    registry = store.etcd_store.registry
    errors: dict[str, BaseException] = {}
    try:
        threads = [_run(errors, "get", lambda: store.get("never")),
                   _run(errors, "wait", lambda: store.wait(["nor"], timedelta(seconds=5)))]
        clock.wait_for_waiters(2)  # both parked on the watch, on the fake clock
        server.kill()
        reads = rpc_count(registry, "range") + rpc_count(registry, "txn")
        clock.advance(5)  # the deadline passes during the outage
        for t in threads:
            t.join(30)
        assert sorted(errors) == ["get", "wait"]
        for exc in errors.values():
            assert isinstance(exc, dist.DistStoreError) and "timeout" in str(exc)
        # Raised at the deadline: no read-through (which would wait out request_timeout).
        assert rpc_count(registry, "range") + rpc_count(registry, "txn") == reads
    finally:
        store.close()


@pytest.mark.parametrize("failing", ["every read", "a look's second read"])
def test_check_raises_a_network_error_when_etcd_cannot_be_asked(tstore, monkeypatch,
                                                                failing):
    """A ``check`` whose look at one key cannot reach etcd raises torch's network error:
    the key's existence is unknown, not false, even where the queues' remembered
    emptiness would answer the rest without etcd. Staged: the keys' own read answered
    "not all present" just before reads started failing (the watch stays healthy), and
    the cache cannot answer the looks, so each look reads etcd twice (the first read
    finds the key absent, the look reads it again); either every read fails, or only
    the second (the look then times out for the outage)."""
    from cachedstore import EtcdConnectionError

    tstore.set("present", "1")
    assert not tstore.check(["present", "absent"])  # scopes open, the queues known empty
    etcd_store = tstore._etcd
    reads: list[list[str]] = []

    def staged(names, deadline=None):
        reads.append(list(names))
        if failing != "every read" and len(reads) % 2:
            return dict.fromkeys(names)  # absent
        raise EtcdConnectionError("etcd range: etcd unreachable (staged)")

    monkeypatch.setattr(etcd_store, "check", lambda names: False)
    monkeypatch.setattr(etcd_store._cache, "lookup_or_absent", lambda name: None)
    monkeypatch.setattr(etcd_store._reads, "fetch", staged)
    with pytest.raises(dist.DistNetworkError, match="staged"):
        tstore.check(["present", "absent"])
    assert len(reads) == (1 if failing == "every read" else 2)


@pytest.mark.parametrize("scope", ["prefix", "touched"])
def test_get_and_multi_get_of_a_present_key_outlast_a_short_outage(etcd, prefix, scope):
    """``get`` and ``multi_get`` of a key that exists, begun while etcd refuses every
    connection: once a read of theirs has failed, etcd comes back (the watch resumes), and
    they return the value when their back-off ends -- not a timeout after waiting for a
    watch event that a key written before never sends. Time (back-off, waits) is a fake
    clock's, moved by the test once each call is parked on it."""
    from cachedstore import EtcdConnectionError

    clock = FakeClock()
    with FaultProxy(etcd.endpoint) as proxy, \
            TorchEtcdStore(endpoints=[proxy.endpoint], prefix=prefix, request_timeout=1,
                           watch_scope=scope, timeout=timedelta(seconds=30),
                           clock=clock) as store:
        store.set("k", "v")
        assert store.get("k") == b"v"  # cached, its scope open
        conn = store._etcd._reads._conn
        call, failed = conn.call, threading.Event()

        def noting(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except EtcdConnectionError:
                if threading.current_thread().name.startswith("test-"):
                    failed.set()
                raise

        conn.call = noting
        for name, read in (("get", lambda: store.get("k")),
                           ("multi_get", lambda: store.multi_get(["k"]))):
            proxy.reset(refuse=True)
            eventually(lambda: not store.etcd_store.watch_healthy, what="the watch down")
            failed.clear()
            results: dict[str, object] = {}
            errors: dict[str, BaseException] = {}
            t = _run(errors, name, lambda read=read, name=name, results=results:
                     results.update({name: read()}))
            assert failed.wait(20), f"{name}: no read failed"
            clock.wait_for_waiters(1)  # parked: in its back-off
            proxy.heal()
            eventually(lambda: store.etcd_store.watch_healthy, what="the watch back")
            clock.advance(1.5)  # past the longest back-off (1 s), far from the deadline
            t.join(10)
            if t.is_alive():  # parked for good: release it (its deadline) before failing
                clock.advance(60)
                t.join(10)
            assert not errors and results.get(name) in (b"v", [b"v"]), (name, errors)


def test_a_wait_begun_during_an_outage_succeeds_once_etcd_is_back(etcd_factory, prefix):
    server = etcd_factory()
    store = TorchEtcdStore(endpoints=[server.endpoint], prefix=prefix, request_timeout=1)
    errors: dict[str, BaseException] = {}
    try:
        server.kill()
        registry = store.etcd_store.registry
        t = _run(errors, "wait", lambda: store.wait(["late"], timedelta(seconds=60)))
        # The wait's first look at etcd failed; it is retrying, not raising.
        eventually(lambda: sum(s.value for f in registry.collect() if
                               f.name == "cachedstore_etcd_requests" for s in f.samples
                               if s.name.endswith("_total")
                               and s.labels.get("code", "OK") != "OK") >= 1,
                   timeout=30, what="a failed request")
        server.restart()
        raw_client(server).put(prefix + "late", "here")
        t.join(60)
        assert not t.is_alive() and errors == {}
    finally:
        store.close()


# ------------------------------------------------------ issue 14 item 9: pickles and secrets
def test_pickles_never_carry_the_password(etcd_factory, prefix, tmp_path, monkeypatch):
    server = etcd_factory()
    server.enable_auth("s3cret")
    endpoint = [server.endpoint]
    inline = TorchEtcdStore(endpoints=endpoint, prefix=prefix, user="root", password="s3cret")
    try:
        with pytest.raises(TypeError, match="password_file= or set \\$CACHEDSTORE_PASSWORD"):
            pickle.dumps(inline)
        with pytest.raises(TypeError, match="password"):
            pickle.dumps(inline.clone())
        inline.set("k", "v")
    finally:
        inline.close()
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    monkeypatch.delenv("CACHEDSTORE_PASSWORD", raising=False)
    with TorchEtcdStore(endpoints=endpoint, prefix=prefix, user="root",
                        password_file=str(secret)) as from_file:
        data = pickle.dumps(from_file)
        assert b"s3cret" not in data and str(secret).encode() in data
        assert b"s3cret" not in pickle.dumps(from_file.clone())
        copy = pickle.loads(data)  # reads the file again
        assert copy.get("k") == b"v"
        copy.close()
    monkeypatch.setenv("CACHEDSTORE_PASSWORD", "s3cret")
    with TorchEtcdStore(endpoints=endpoint, prefix=prefix, user="root") as from_env:
        data = pickle.dumps(from_env)
        assert b"s3cret" not in data
        monkeypatch.delenv("CACHEDSTORE_PASSWORD")
        with pytest.raises(ValueError, match="CACHEDSTORE_PASSWORD"):
            pickle.loads(data)  # the other process has no password: a clear error
        monkeypatch.setenv("CACHEDSTORE_PASSWORD", "s3cret")
        copy = pickle.loads(data)
        assert copy.get("k") == b"v"
        copy.close()


def test_a_wait_whose_probe_etcd_timed_out_still_waits(tstore, etcd, prefix, monkeypatch):
    """Under load etcd can end a read's deadline on its side (UNKNOWN "context deadline
    exceeded": the 250 ms probe of a torch wait, one run of the W=256 fan-out). That is
    a timeout like any other: the wait goes on and returns when the key is set, instead
    of failing the rank (and every rank waiting for its keys)."""
    import grpc

    from cachedstore import connection as connection_module
    from tests.util import FakeRpcError

    real_rpc = connection_module._rpc
    waiting_thread = threading.current_thread()
    fired = threading.Event()

    def rpc(ep, method):
        call = real_rpc(ep, method)
        if method not in ("range", "txn") or fired.is_set() \
                or threading.current_thread() is not waiting_thread:
            return call

        def timed_out_at_etcd(*args, **kwargs):
            fired.set()
            raise FakeRpcError(grpc.StatusCode.UNKNOWN, "context deadline exceeded")

        class _Failed:  # a read-only Txn's short wait goes through .future(...).result()
            def result(self, timeout=None):
                timed_out_at_etcd()

        timed_out_at_etcd.future = lambda *args, **kwargs: _Failed()
        return timed_out_at_etcd

    monkeypatch.setattr(connection_module, "_rpc", rpc)
    other = _another(etcd, prefix)
    try:
        threading.Timer(0.5, lambda: other.set("late", b"v")).start()
        tstore.wait(["late"], timedelta(seconds=30))
        assert fired.is_set() and tstore.get("late") == b"v"
    finally:
        other.close()


def test_a_set_of_the_value_a_key_holds_makes_no_event(tstore, etcd, prefix):
    """torch's store-based barrier has every rank that sees the count complete set
    ``last_worker`` to the same value. Each such set after the first writes nothing: no
    new revision, so no watch event to every waiting rank (W² events at worst, which
    overloaded etcd in the W = 1,024 fan-out run). Fails with a plain put (version 17)."""
    raw = raw_client(etcd)
    others = [_another(etcd, prefix, timeout=timedelta(seconds=10)) for _ in range(3)]
    try:
        stores = [tstore, *others]
        threads = [threading.Thread(target=lambda s=s: [s.set("k:last_worker", "1")
                                                        for _ in range(4)],
                                    name=f"setter-{i}") for i, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        value, meta = raw.get(prefix + "k:last_worker")
        assert value == b"1" and meta.version == 1  # 16 sets, one write
        for store in stores:
            assert store.get("k:last_worker") == b"1"
            store.wait(["k:last_worker"], timedelta(seconds=5))
        tstore.set("k:last_worker", "2")  # a different value is written
        assert raw.get(prefix + "k:last_worker")[1].version == 2
        eventually(lambda: all(s.check(["k:last_worker"]) and s.get("k:last_worker") == b"2"
                               for s in stores), what="every store to see the new value")
    finally:
        for store in others:
            store.close()
        raw.close()


# -- add(k, 0) creates an absent key, and writes nothing when the key exists -------------
def test_add_zero_writes_only_when_the_key_is_absent(own_etcd, settled, prefix):
    """etcd's /metrics: ``add(k, 0)`` on an existing key (the counter poll of torch's
    store-based barrier) is one read-only Txn, no proposal, no revision; on an absent key
    one more Txn creates it (1 proposal); the adds that follow take the counter's one-Txn
    path (no conversion of a plain "0")."""
    store = _another(own_etcd, prefix)
    other = _another(own_etcd, prefix)
    try:
        store.add("n", 5)
        store.set("plain", "7")
        before = settled()
        assert store.add("fresh", 0) == 0
        created = settled()
        counts = created.minus(before)
        assert (counts.requests, counts.proposals, counts.revisions) == ({"Txn": 2}, 1, 1)
        # Exists now (created here, by a counter add, by a set): read, never written.
        assert [s.add(k, 0) for s in (store, other) for k in ("fresh", "n", "plain")] == \
            [0, 5, 7] * 2
        read = settled()
        counts = read.minus(created)
        assert (counts.requests, counts.proposals, counts.revisions) == ({"Txn": 6}, 0, 0)
        assert other.add("fresh", 1) == 1 and other.add("fresh", 4) == 5
        counts = settled().minus(read)
        assert (counts.requests, counts.proposals) == ({"Txn": 2}, 2)
        assert store.get("fresh") == b"5" and other.get("fresh") == b"5"
    finally:
        store.close()
        other.close()


def test_add_zero_racing_a_creation_returns_the_creators_value(tstore, etcd, prefix):
    """The create is conditional: a key created between the read that found it absent and
    the create Txn is read back in that Txn, not overwritten."""
    other = _another(etcd, prefix)
    raw = raw_client(etcd)
    reads = tstore.etcd_store._reads
    try:
        for name, create, value in [("counter", lambda: other.add("counter", 3), 3),
                                    ("plain", lambda: raw.put(prefix + "plain", "9"), 9)]:
            def meanwhile(chunk, create=create) -> None:
                reads.after_read = None
                create()

            reads.after_read = meanwhile
            assert tstore.add(name, 0) == value
            assert reads.after_read is None  # the race happened
            assert tstore.get(name) == str(value).encode()
            assert raw.get(prefix + name)[1].version == 1  # written once, by the creator
    finally:
        reads.after_read = None
        other.close()
        raw.close()


def test_add_zero_keeps_every_stores_cache_coherent(tstore, etcd, prefix):
    other = _another(etcd, prefix)
    try:
        assert not tstore.check(["k"])  # now cached as absent, and watched
        assert other.add("k", 0) == 0
        eventually(lambda: tstore.check(["k"]), what="the creation to reach the watch")
        assert tstore.get("k") == b"0"
        other.add("k", 2)  # increments reach no watch; a counter's get reads etcd
        assert tstore.get("k") == b"2" and tstore.add("k", 0) == 2
        assert other.delete_key("k")
        eventually(lambda: not tstore.check(["k"]), what="the delete to reach the watch")
        assert tstore.add("k", 0) == 0 and other.get("k") == b"0"  # created anew, at 0
    finally:
        other.close()
