"""Findings of the adversarial review of consistent reads and of the fixes of the layers
that feed the coherence core: deterministic reproductions against a real etcd. Each failed
on the code as reviewed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cachedstore import EtcdStore
from cachedstore.server import LocalEtcd
from tests.util import eventually, held_watch, raw_client

pytestmark = pytest.mark.timeout(120)


def _store(server: LocalEtcd, prefix: str, **kwargs: Any) -> EtcdStore:
    return EtcdStore(endpoints=[server.endpoint], prefix=prefix, **kwargs)


# -- 1. a blocking consistent get serves the stale cached entry ---------------------------------
@pytest.mark.parametrize("front", ["get", "aget"])
def test_blocking_consistent_get_of_a_scope_behind_serves_the_stale_entry(
        etcd: LocalEtcd, prefix: str, front: str) -> None:
    """get(consistent=True, timeout=...) whose scope the watch has not brought to etcd's
    revision (held watch) skips the etcd read (deadline given) and goes to wait_for, whose
    lookup_or_absent serves the cached, older value."""
    writer = raw_client(etcd)
    writer.put(prefix + "k", "old")
    with _store(etcd, prefix) as store:
        assert store.get("k") == b"old"
        with held_watch(store):
            writer.put(prefix + "k", "new")  # acknowledged before the read begins
            if front == "get":
                got = store.get("k", timeout=5, consistent=True)
            else:
                got = asyncio.run(store.aget("k", timeout=5, consistent=True))
            assert got == b"new"


# -- 2. a quiet scope's refresh forgets the mark of a local write ahead of the watch ------------
def test_quiet_refresh_drops_the_mark_of_an_own_write_evicted_ahead_of_the_watch(
        etcd: LocalEtcd, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a reconnect with the prefix quiet (etcd's revision moved elsewhere), the root
    replays nothing; a progress interval later the watch thread re-reads it at X
    (``_refresh_quiet_scopes``) on the *live* stream. This store writes k at w > X while
    that read is in flight, and the entry (ahead of the watch) is evicted: its high-water
    mark is all that stops an older state. The reset at X clears every mark of the scope,
    installs the snapshot's k at X and sets the floor to 0: ``get`` returns the value this
    process overwrote (read-your-writes and monotonic reads broken) until the watch
    delivers w."""
    from cachedstore import watcher as watcher_module

    writer = raw_client(etcd)
    writer.put(prefix + "k", "old")
    with _store(etcd, prefix, cache_size=1, progress_interval=0.2) as store:
        assert store.get("k") == b"old"
        cache = store._cache
        armed, written, refreshed = threading.Event(), threading.Event(), threading.Event()
        real_read = watcher_module.read_scopes

        def read_scopes(*args: Any, **kwargs: Any) -> Any:
            answer = real_read(*args, **kwargs)
            if armed.is_set() and not written.is_set():
                store.set("k", "new")  # acknowledged here, at a revision past the read's
                store.set("other", "x")  # cache_size=1: k's entry (ahead) is evicted
                assert "k" in cache.marks()
                written.set()
            return answer

        monkeypatch.setattr(watcher_module, "read_scopes", read_scopes)
        real_reset = cache.reset

        def reset(*args: Any, **kwargs: Any) -> None:
            real_reset(*args, **kwargs)
            if written.is_set():
                refreshed.set()

        cache.reset = reset  # type: ignore[method-assign]
        with held_watch(store):  # the events of the two writes wait behind the refresh
            for i in range(3):  # etcd's revision moves elsewhere
                writer.put(prefix[:-1] + "-elsewhere/" + str(i), "x")
            restarts = store._watcher.restarts
            armed.set()
            store._watcher._call.cancel()  # the stream restarts: the root lags
            eventually(lambda: store._watcher.restarts > restarts, what="a restart")
            assert refreshed.wait(20), "the quiet root was not re-read"
            assert cache.floor == 0  # served
            assert store.get("k") == b"new"  # this process wrote it


# -- 3. a progress request asked for as a stream starts is never sent ----------------------------
class _AskingStub:
    """The endpoint's watch stub, asking for a progress response (as a consistent read
    does) between the stream's registration and the start of its request side."""

    def __init__(self, inner: Any, ask: Any) -> None:
        self._inner = inner
        self._ask = ask

    def Watch(self, requests: Any, **kwargs: Any) -> Any:  # noqa: N802 -- gRPC's name
        self._ask()
        return self._inner.Watch(requests, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_progress_request_asked_as_the_stream_starts_is_lost_for_the_streams_life(
        etcd: LocalEtcd, prefix: str) -> None:
    """``request_progress`` sets ``progress_wanted`` and kicks; the request side's first
    ``creates()`` (before its loop) clears the kick without looking at
    ``progress_wanted``. The request is never sent, and every later ``request_progress``
    on that stream returns early (already wanted): in prefix mode (nothing else kicks)
    no consistent read's progress request is sent for the stream's whole life."""
    with _store(etcd, prefix) as store:
        watcher = store._watcher
        _, endpoint = store._conn.endpoint()
        inner = endpoint.watch_stream
        endpoint.watch_stream = _AskingStub(inner, watcher.request_progress)
        try:
            restarts = watcher.restarts
            watcher._call.cancel()
            eventually(lambda: watcher.restarts > restarts and watcher.up
                       and store._cache.floor == 0, what="the new stream up")
        finally:
            endpoint.watch_stream = inner
        stream = watcher._stream
        assert stream is not None
        store.get("k", None, consistent=True)  # asks again: returns early
        eventually(lambda: not stream.progress_wanted, timeout=3,
                   what="the progress request sent")
