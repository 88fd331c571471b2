"""The watch stream's two sides without etcd or a network, the way etcd's ``cache/`` tests
its demux: scripted ``etcdrpc.WatchResponse`` messages fed to the watcher's response side
(``cachedstore/watcher.py``), and the request side (``cachedstore/watchstream.py``) on a
fake clock; the snapshot reads (``snapshot.py``) that open and resync the stream, on the
same scripted transport.

The transport is plugged in through ``cachedstore.connection.STUB_FACTORIES``, as
``tests/sim`` does: the watcher's Connection opens its stream on :class:`_Stubs`, whose
``Watch`` answers with the next :class:`ScriptedCall`. One stream runs on the test's thread
(``Watcher._stream_once``), which returns its restart reason; the cache (every
``apply_events`` call recorded), the metrics and the requests sent say what the responses
did. The restart loop itself runs on the watcher's thread, on a fake clock.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2
from prometheus_client import CollectorRegistry

from cachedstore import connection
from cachedstore.cache import NOT_SERVING, CoherentCache
from cachedstore.clock import FakeClock
from cachedstore.config import StoreConfig
from cachedstore.connection import Connection, Credentials
from cachedstore.errors import ClusterMismatchError, EtcdPermissionError
from cachedstore.keys import KeySpace
from cachedstore.metrics import StoreMetrics
from cachedstore.scoping import Scope
from cachedstore.watcher import Watcher
from cachedstore.watchstream import RequestSide, WatchStream
from cachedstore.wire import PONG, WireError
from tests.util import eventually, sample

pytestmark = pytest.mark.timeout(60)

PREFIX = "/w/"
CLUSTER = 0xC1
#: What a scripted stream does once its responses are out: etcd ends it cleanly (None),
#: it breaks (a grpc.RpcError), or it stays open until cancelled (HANG).
HANG = "hang"
_hosts = (f"watcher-test-{n}" for n in itertools.count(1))


# -- scripted responses ------------------------------------------------------------------
def _header(revision: int, cluster_id: int = CLUSTER) -> Any:
    return etcdrpc.ResponseHeader(cluster_id=cluster_id, revision=revision)


def created(watch_id: int = 0, revision: int = 10, cluster_id: int = CLUSTER) -> Any:
    return etcdrpc.WatchResponse(header=_header(revision, cluster_id), watch_id=watch_id,
                                 created=True)


def put(name: str, value: bytes, revision: int) -> Any:
    kv = kv_pb2.KeyValue(key=(PREFIX + name).encode(), value=value, mod_revision=revision)
    return kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv)


def delete(name: str, revision: int) -> Any:
    kv = kv_pb2.KeyValue(key=(PREFIX + name).encode(), mod_revision=revision)
    return kv_pb2.Event(type=kv_pb2.Event.DELETE, kv=kv)


def events(*changes: Any, watch_id: int = 0) -> Any:
    last = changes[-1].kv.mod_revision
    return etcdrpc.WatchResponse(header=_header(last), watch_id=watch_id, events=changes)


def progress(revision: int) -> Any:
    """A progress response: no events, addressed to the whole stream (watch id -1)."""
    return etcdrpc.WatchResponse(header=_header(revision), watch_id=-1)


def compacted(compact_revision: int, watch_id: int = 0) -> Any:
    return etcdrpc.WatchResponse(header=_header(compact_revision + 5), watch_id=watch_id,
                                 canceled=True, compact_revision=compact_revision)


def canceled(reason: str, watch_id: int = 0) -> Any:
    return etcdrpc.WatchResponse(header=_header(20), watch_id=watch_id, canceled=True,
                                 cancel_reason=reason)


# -- the transport -----------------------------------------------------------------------
_START = 1000.0  # a FakeClock's time at its start


class _StepClock(FakeClock):
    """A FakeClock that knows when the one thread waiting on it is due to wake (``due``)
    and counts the waits begun, so that a test moves time from one wake-up to the next."""

    def __init__(self) -> None:
        super().__init__(_START)
        self.waits = 0
        self.due = math.inf

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        self.due = math.inf if timeout is None else self.monotonic() + max(0.0, timeout)
        self.waits += 1
        return super().wait(event, timeout)


class ScriptedCall:
    """A watch call answering with a script. It takes the watcher's creates at once (the
    request side is iterated no further: it would wait on the clock) and keeps them in
    ``requests``; ``cancel`` ends it as grpcio does (CANCELLED at the next read)."""

    def __init__(self, requests: Iterator[Any], creates: int, script: tuple[Any, ...],
                 end: Any) -> None:
        self.requests = [next(requests) for _ in range(creates)]
        self._script = deque(script)
        self._end = end
        self.cancelled = threading.Event()

    def __iter__(self) -> ScriptedCall:
        return self

    def __next__(self) -> Any:
        if self._script and not self.cancelled.is_set():
            return self._script.popleft()
        if self._end is HANG:
            self.cancelled.wait(10)
        if self.cancelled.is_set():
            raise WireError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if self._end is None:
            raise StopIteration
        raise self._end

    def cancel(self) -> None:
        self.cancelled.set()


class _Unary:
    """A unary stub method: answers with ``answer`` (or raises it), counting calls."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.calls = 0

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None
                 ) -> Any:
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class _Stubs:
    """What stands in for an endpoint's channel (``connection._simulated``)."""

    def __init__(self, rig: Rig) -> None:
        self.kv = SimpleNamespace(Range=_Unary(etcdrpc.RangeResponse(header=_header(30))))
        self.maintenance = SimpleNamespace(
            Status=_Unary(etcdrpc.StatusResponse(header=_header(30))))
        self.auth = self.lease = None
        self.watch = self.watch_stream = self
        self._rig = rig

    def Watch(self, requests: Iterator[Any], metadata: Any = None) -> ScriptedCall:  # noqa: N802
        rig = self._rig
        script, end = rig.scripts.popleft()
        creates = len(rig.cache.watched_scopes()) + (1 if rig.cache.scoped else 0)  # anchor
        call = ScriptedCall(requests, creates, script, end)
        rig.calls.append(call)
        return call

    def close(self) -> None:
        pass


class Rig:
    """A Watcher on a scripted transport, a fake clock and a cache reset at revision 10."""

    def __init__(self, *, scoped: bool = False, credentials: Credentials | None = None,
                 **config: Any) -> None:
        self.clock = _StepClock()
        self.config = StoreConfig().with_overrides(**config)
        host = next(_hosts)
        self.stubs = _Stubs(self)
        connection.STUB_FACTORIES[f"{host}:1"] = lambda target: self.stubs
        self.registry = CollectorRegistry()
        self.metrics = StoreMetrics(self.registry)
        self.keys = KeySpace(PREFIX, self.config.max_request_bytes)
        self.cache = CoherentCache(16, self.metrics,
                                   scope_key=(lambda name: name) if scoped else None,
                                   root=(self.keys.range_start, self.keys.range_end))
        self.conn = Connection([(host, 1)], credentials or Credentials(), self.config,
                               self.metrics, self.clock)
        self.watcher = Watcher(self.conn, self.keys, self.cache, self.config, self.metrics,
                               "cachedstore-watch-test", clock=self.clock)
        self.scripts: deque[tuple[tuple[Any, ...], Any]] = deque()
        self.calls: list[ScriptedCall] = []
        #: Every ``apply_events`` of the cache: (batch, revision, scope key).
        self.applied: list[tuple[list[Any], int, str | None]] = []
        apply_events = self.cache.apply_events

        def recorded(events: Iterable[tuple[str, bytes | None, int]], revision: int,
                     scope: Scope | None = None) -> None:
            batch = list(events)
            self.applied.append((batch, revision, None if scope is None else scope.key))
            apply_events(batch, revision, scope)

        self.cache.apply_events = recorded  # type: ignore[method-assign]
        if not scoped:
            self.cache.reset(10, [])

    def stream(self, *responses: Any, end: Any = None) -> str:
        """Run one stream answered by ``responses``, then ``end``: its restart reason."""
        self.scripts.append((responses, end))
        return self.watcher._stream_once()

    def start_revisions(self, call: int = -1) -> list[int]:
        return [r.create_request.start_revision for r in self.calls[call].requests]

    def close(self) -> None:
        self.watcher.stop()
        self.conn.close()
        connection.STUB_FACTORIES.pop(self.conn.targets[0], None)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


# -- the response side ---------------------------------------------------------------------
def test_events_reach_the_cache_one_response_at_a_time(rig: Rig) -> None:
    """Each response is applied whole (a transaction's events together) up to its last
    revision; keys outside the prefix are left out; a clean end is a restart (ended)."""
    other = kv_pb2.Event(type=kv_pb2.Event.PUT,
                         kv=kv_pb2.KeyValue(key=b"/elsewhere", value=b"x", mod_revision=11))
    reason = rig.stream(created(revision=10),
                        events(put("a", b"1", 11), put("b", b"2", 11), other),
                        events(delete("a", 12)))
    assert reason == "ended" and rig.watcher.last_error is None
    assert rig.start_revisions() == [11]  # the root resumes after what it applied
    assert rig.applied == [([("a", b"1", 11), ("b", b"2", 11)], 11, None),
                           ([("a", None, 12)], 12, None)]
    assert rig.cache.peek("b") == (b"2", 11, 11)
    assert rig.cache.peek("a")[0] is None  # type: ignore[index]
    assert rig.cache.applied_revision == 12 and rig.cache.floor == 0
    assert rig.watcher.up and rig.watcher.ready.is_set()
    assert rig.watcher.last_contact == rig.clock.monotonic()  # caught up: confirmed
    assert sample(rig.registry, "cachedstore_watch_events_total", type="put") == 2
    assert sample(rig.registry, "cachedstore_watch_events_total", type="delete") == 1
    assert sample(rig.registry, "cachedstore_watch_revision") == 12


def test_a_progress_response_is_liveness_and_never_moves_the_resume_point(rig: Rig) -> None:
    """etcd < 3.5.8 may send a progress response ahead of events of its revision: it
    tells consistent reads to look again, and the next stream still resumes after the
    last event applied. A PING's acknowledgement is liveness alone."""
    answered: list[bool] = []
    progressed = rig.watcher.progress.progressed

    def told(revision: int) -> None:
        answered.append(rig.watcher._progress_answered)  # etcd itself is at the other end
        progressed(revision)

    rig.watcher.progress.progressed = told  # type: ignore[method-assign]
    assert not rig.watcher._progress_answered
    assert rig.stream(created(), events(put("a", b"1", 11)), progress(20), PONG) == "ended"
    assert answered == [True] and rig.watcher.progress.revision == 20
    assert sample(rig.registry, "cachedstore_watch_revision") == 20
    assert rig.cache.applied_revision == 11 and [r for _, r, _ in rig.applied] == [11]
    rig.stream(created(revision=20))
    assert rig.start_revisions() == [12]  # not 21


def test_a_create_answered_with_an_id_no_create_was_given_ends_the_stream(rig: Rig) -> None:
    """Its events would be lost: the stream restarts (error)."""
    assert rig.stream(created(watch_id=7)) == "error"
    assert "watch create with id 7" in str(rig.watcher.last_error)
    assert not rig.watcher.up


def test_a_compacted_revision_marks_the_scope_for_a_resync(rig: Rig) -> None:
    assert rig.stream(created(), compacted(15)) == "compacted"
    assert str(rig.watcher.last_error) == "revision 11 compacted (etcd compacted up to 15)"
    assert rig.watcher._needs_resync == set(rig.cache.watched_scopes())


@pytest.mark.parametrize(("reason", "restart", "revoked"), [
    ("etcdserver: permission denied", "auth", True),
    ("etcdserver: invalid auth token", "auth", False),
    ("etcdserver: mvcc: required revision has been compacted", "canceled", False),
    ("", "canceled", False),
])
def test_a_cancel_with_a_reason(rig: Rig, reason: str, restart: str, revoked: bool) -> None:
    assert rig.stream(created(), canceled(reason)) == restart
    assert str(rig.watcher.last_error) == (reason or "watch canceled by etcd")
    # Revoked access serves nothing more, not even under max_staleness.
    assert (rig.watcher.last_contact == float("-inf")) is revoked
    assert (rig.cache.floor == NOT_SERVING) is revoked


@pytest.mark.parametrize(("error", "restart"), [
    (None, "ended"),
    (WireError(grpc.StatusCode.UNAVAILABLE, "connection reset"), "disconnect"),
    (WireError(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader"), "disconnect"),
    (WireError(grpc.StatusCode.CANCELLED, "RST_STREAM from the server"), "canceled"),
    (WireError(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token"), "auth"),
    (WireError(grpc.StatusCode.INTERNAL, "something else"), "error"),
])
def test_a_stream_that_breaks(rig: Rig, error: Any, restart: str) -> None:
    assert rig.stream(created(), events(put("a", b"1", 11)), end=error) == restart
    assert rig.watcher.last_error is error
    assert rig.applied and rig.watcher._call is None and rig.watcher._stream is None
    assert all(call.cancelled.is_set() for call in rig.calls)


def test_a_stream_on_a_member_of_another_cluster_is_never_used(rig: Rig) -> None:
    rig.stream(created())
    with pytest.raises(ClusterMismatchError):
        rig.stream(created(revision=40, cluster_id=0xBAD), events(put("a", b"x", 41)))
    assert rig.applied == []


def test_a_proxy_created_answer_checks_the_member_once(rig: Rig) -> None:
    """etcd's grpc-proxy sends no cluster id: one Status call checks the member."""
    rig.stream(created(cluster_id=0))
    rig.stream(created(cluster_id=0))
    assert rig.stubs.maintenance.Status.calls == 1


def test_a_create_answered_after_the_cache_started_over_sets_nothing_up(rig: Rig) -> None:
    """Another thread's request found etcd's history going back (rule 10 of cache.py)
    between the stream's start and its create's answer: the create is of the root the
    rewind removed, the stream is ending (rescoped), and it is not set up (it made the
    watch up and ready for a moment, the constructor's wait included)."""
    rig.cache.on_rewind = rig.watcher.rewound
    went_back = rig.watcher._went_back

    def found_meanwhile(response: Any, stream: Any) -> bool:
        epoch, _ = rig.cache.known_revision
        assert rig.cache.answered((epoch, 10**9), 9)  # a request sent after 10**9
        return went_back(response, stream)

    rig.watcher._went_back = found_meanwhile  # type: ignore[method-assign]
    assert rig.stream(created(revision=10)) == "rewound"
    assert not rig.watcher.up and not rig.watcher.ready.is_set()
    assert sample(rig.registry, "cachedstore_watch_up") == 0


def test_a_rewind_whose_rescope_lands_on_the_next_stream_is_still_its_reason(rig: Rig
                                                                            ) -> None:
    """A rewind found by another thread is told to the watcher in two steps (the flag,
    then the rescope that cancels the stream). When the stream's own create check finds
    the same rewind in between, and the rescope lands on the next stream, that stream
    ends for the same rewind: its reason is ``rewound`` (not counted again: the loop
    counts rewinds from the cache), not a second restart counted as ``rescoped``."""
    went_back = rig.watcher._went_back

    def found_twice(response: Any, stream: Any) -> bool:
        rig.watcher._rewinding = True  # the other thread's rewound(), first step
        went_back(response, stream)
        return True

    rig.watcher._went_back = found_twice  # type: ignore[method-assign]
    assert rig.stream(created(revision=10)) == "rewound"
    rig.watcher._went_back = went_back  # type: ignore[method-assign]
    rig.watcher.rescope(rig.cache.collapse(rig.keys.range_start, rig.keys.range_end))
    assert rig.stream(created(revision=10)) == "rewound"


def test_creates_are_matched_to_their_answers_by_id_and_events_to_their_scope() -> None:
    """A store watching what it touched: the anchor and one watch per scope on one
    stream; the answers arrive out of order (grpc-proxy), and each scope's events apply
    to it alone. The anchor's watch starts at etcd's current revision."""
    rig = Rig(scoped=True)
    try:
        for name in ("a", "b"):
            scope = rig.cache.begin_scope(name, rig.keys.key(name), b"")
            rig.cache.open_scope(scope, 10, [])
        reason = rig.stream(created(2), created(0), created(1),
                            events(put("b", b"B", 11), watch_id=2),
                            events(put("a", b"A", 12), watch_id=0))  # the anchor's
        assert reason == "ended"
        assert rig.start_revisions() == [0, 11, 11]
        assert rig.applied == [([("b", b"B", 11)], 11, "b")]
        assert rig.cache.peek("b") == (b"B", 11, 11) and rig.cache.peek("a") is None
        assert rig.cache.floor == 0
    finally:
        rig.close()


def test_the_loop_resyncs_a_compacted_scope_from_a_fresh_revision(rig: Rig) -> None:
    """On the watcher's thread: a compaction is counted as a restart, the root is read
    afresh (etcd at 30) and the next stream resumes at 31, never at the compacted 11."""
    rig.scripts.extend([((created(), compacted(15)), None), ((created(revision=30),), HANG)])
    rig.watcher.start(10)

    def resumed() -> bool:
        rig.clock.advance(1.0)  # through the back-off
        return len(rig.calls) == 2 and rig.watcher.up

    eventually(resumed, what="the stream resumed")
    assert [rig.start_revisions(0), rig.start_revisions(1)] == [[11], [31]]
    assert rig.stubs.kv.Range.calls == 1  # the snapshot's count: nothing to load
    assert sample(rig.registry, "cachedstore_watch_restarts_total", reason="compacted") == 1
    assert rig.watcher.restarts == 1 and rig.cache.floor == 0
    rig.watcher.stop()
    assert not rig.watcher._thread.is_alive() and not rig.watcher.up


def test_a_create_sent_directly_never_overtakes_one_the_request_side_yielded() -> None:
    """With a transport whose calls take requests from any thread (the wire transport's
    ``send``), creates go out from where they are queued, in the order of their ids. A
    create the request side yielded and its transport has not taken yet holds that route
    shut: etcd numbers watches in the order creates arrive, so one sent meanwhile would
    get the other's id, and its scope the other's events."""
    rig = Rig(scoped=True)
    try:
        scopes = []
        for name in ("a", "b", "c"):
            scope = rig.cache.begin_scope(name, rig.keys.key(name), b"")
            rig.cache.open_scope(scope, 10, [])
            scopes.append(scope)
        a, b, c = scopes
        lock = threading.Lock()
        stream = WatchStream([a], rig.watcher._anchor)
        side = RequestSide(stream, lock, endpoint=rig.stubs, pinging=False, conn=rig.conn,
                           keyspace=rig.keys, cache=rig.cache, config=rig.config,
                           metrics=rig.metrics, clock=rig.clock, stopping=threading.Event(),
                           revoked=lambda error: None)
        wire: list[Any] = []  # what reached the transport, in order

        def send(request: Any) -> bool:
            wire.append(request)
            return True

        creates = side._creates()
        first = next(creates)  # a's create, yielded: in flight
        with lock:  # the watcher's add() of b, with the call's send known by now
            stream.send = send
            stream.on_stream.add(b)
            stream.to_send.append(b)
            assert not stream.send_queued()  # held back behind a's
        assert wire == []
        wire.append(first)  # the transport takes a's create, then asks for more ...
        with pytest.raises(StopIteration):
            next(creates)  # ... and b's is sent directly, behind it
        with lock:  # a later add() sends at once
            stream.to_send.append(c)
            assert stream.send_queued()
        assert [r.create_request.key for r in wire] == [rig.keys.key(n) for n in "abc"]
        assert [r.create_request.start_revision for r in wire] == [11, 11, 11]
        assert stream.awaiting == {0: a, 1: b, 2: c}
        assert not stream.to_send and not stream.kick.is_set()
    finally:
        rig.close()


# -- the request side ----------------------------------------------------------------------
class _Side:
    """A RequestSide of a one-scope stream, iterated on a thread of its own (as the
    transport does); ``sent`` collects what it yields."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.clock = rig.clock
        self.stream = WatchStream(rig.cache.watched_scopes(), rig.watcher._anchor)
        self.call = ScriptedCall(iter(()), 0, (), HANG)
        self.revoked: list[BaseException] = []
        self.side = RequestSide(
            self.stream, threading.Lock(), endpoint=rig.stubs,
            pinging=False, conn=rig.conn, keyspace=rig.keys, cache=rig.cache,
            config=rig.config, metrics=rig.metrics, clock=rig.clock,
            stopping=threading.Event(), revoked=self.revoked.append)
        self.side.call = self.call
        self.sent: list[Any] = []
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        self.sent.extend(self.side.requests())

    def kinds(self) -> list[str]:
        return [r.WhichOneof("request_union") for r in self.sent]

    def _parked(self) -> None:
        eventually(lambda: self.clock.waiting or not self.thread.is_alive(), timeout=5,
                   what="the request side parked")

    def at(self, t: float) -> None:
        """Move the clock to ``t`` seconds after the start, from one wake-up of the
        request side to the next, each run until it waits again (or returned)."""
        clock, goal = self.clock, _START + t
        self._parked()
        while self.thread.is_alive() and clock.due <= goal + 1e-6:
            waits = clock.waits

            def woken(waits: int = waits) -> bool:
                return clock.waits > waits or not self.thread.is_alive()

            clock.advance(max(0.0, clock.due - clock.monotonic()) + 1e-9)
            eventually(woken, timeout=5, what="the request side woken")
            self._parked()
        if clock.monotonic() < goal:
            clock.advance(goal - clock.monotonic())

    def end(self) -> None:
        self.side.ended.set()
        self.stream.kick.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_a_quiet_stream_asks_for_progress_and_stalls_at_the_bound() -> None:
    """Progress requests every progress_interval; nothing heard for stall_timeout and
    the channel not answering either: stop serving, cancel, end the request side."""
    rig = Rig(stall_timeout=8.0, progress_interval=2.0, ping_interval=0.0)
    try:
        rig.stubs.kv.Range.answer = WireError(grpc.StatusCode.UNAVAILABLE, "unreachable")
        rig.cache.watch_up(10)  # served
        side = _Side(rig)
        side.at(7.5)
        assert side.kinds() == ["create_request"] + ["progress_request"] * 3
        assert not side.call.cancelled.is_set() and rig.cache.floor == 0
        side.at(8.0)
        side.thread.join(5)
        assert side.side.stalled.is_set() and side.call.cancelled.is_set()
        assert rig.cache.floor == NOT_SERVING and rig.stubs.kv.Range.calls == 1  # the probe
        assert sample(rig.registry, "cachedstore_watch_liveness_requests_total",
                      kind="progress") == 3
    finally:
        rig.close()


def test_a_stream_whose_channel_answers_the_probe_is_quiet_not_stalled() -> None:
    """etcd's grpc-proxy ignores progress requests: its channel answers the probe."""
    rig = Rig(stall_timeout=8.0, progress_interval=2.0, ping_interval=0.0)
    try:
        side = _Side(rig)
        side.at(12.0)
        assert not side.side.stalled.is_set() and not side.call.cancelled.is_set()
        assert rig.stubs.kv.Range.calls == 1
        side.stream.progress_wanted = True  # as request_progress does on a live stream
        side.stream.kick.set()
        eventually(lambda: not side.stream.progress_wanted, what="the progress request")
        side.end()
        assert side.kinds()[-1] == "progress_request"
    finally:
        rig.close()


def test_revoked_access_ends_the_stream_within_the_check_interval() -> None:
    rig = Rig(stall_timeout=8.0, progress_interval=2.0, ping_interval=0.0,
              auth_check_interval=3.0, credentials=Credentials(user="u", password="p"))
    try:
        denied = WireError(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")
        side = _Side(rig)
        side.at(2.5)
        assert rig.stubs.kv.Range.calls == 0
        rig.stubs.kv.Range.answer = denied
        side.at(3.0)
        side.thread.join(5)
        assert side.side.denied.is_set() and side.call.cancelled.is_set()
        assert len(side.revoked) == 1 and isinstance(side.revoked[0], EtcdPermissionError)
        assert not side.side.stalled.is_set()
    finally:
        rig.close()
