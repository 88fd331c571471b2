"""gRPC channels to etcd: endpoints and failover, TLS, auth tokens; calls that retry.

The store talks to etcd through :class:`Connection` only. It drives python3-etcd3's
generated stubs (``etcd3.etcdrpc``) directly, not its client class: that class marks an
endpoint as failed after one timeout and then refuses it (``ValueError("Trying to use a
failed node")``) for minutes, and never refreshes an expired auth token. Here every call
has a deadline, retries on the next endpoint with jittered back-off while the deadline
allows, re-authenticates once when etcd says the token is invalid, and raises only
cachedstore errors. What to do after a failure, and which error a gRPC failure is, are
decided by :mod:`cachedstore.retry` (the policy value, and the error table).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from etcd3 import etcdrpc

from . import etcdapi
from .clock import SYSTEM_CLOCK, Clock
from .config import KEEPALIVE_TIME, KEEPALIVE_TIMEOUT, StoreConfig
from .errors import ClusterMismatchError, EtcdError, InvalidInputError, StoreClosedError
from .etcdapi import TRANSPORT_FAILURES, Failure
from .metrics import NullMetrics, StoreMetrics
from .retry import IDEMPOTENT, UNSENT_ONLY, Action, Retry, translate_rpc_error
from .unary import UnaryChannel
from .wire import WireError, WireStub

log = logging.getLogger("cachedstore.connection")

# IDEMPOTENT and UNSENT_ONLY, the retry modes of Connection.call, and translate_rpc_error
# live with the retry policy (.retry); imported from here by the layers above.
__all__ = ["IDEMPOTENT", "UNSENT_ONLY", "Connection", "Credentials", "parse_endpoint",
           "translate_rpc_error"]

#: Tests only (``tests/sim``): endpoint target -> factory of an in-process transport used
#: instead of a gRPC channel (see :func:`_simulated`). Empty in production.
STUB_FACTORIES: dict[str, Callable[[str], Any]] = {}
#: Methods that change nothing: sent to an unchecked member, their answer's header checks it.
_READS = frozenset({"range", "status", "lease_time_to_live"})
#: Calls whose answer's header revision is etcd's at a point after the request was sent
#: (every range this library sends is linearizable): what rule 10 of cache.py checks.
_KEY_VALUE = frozenset({"range", "txn", "put", "delete_range"})
#: etcd's require-leader metadata (what etcd's own clients send on watches). A member that
#: has lost its leader (cut off from its peers) refuses such a request with "no leader"
#: (Unavailable) instead of answering from its frozen state, and ends such a watch stream
#: once it has been leaderless for about three election timeouts. Sent on every request,
#: so that reads fail over at once and watches within that bound.
REQUIRE_LEADER = ("hasleader", "true")


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("token", token), REQUIRE_LEADER) if token else (REQUIRE_LEADER,)


def parse_endpoint(endpoint: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6addr]:port"``, a URL or a ``(host, port)`` → ``(host, port)``."""
    if isinstance(endpoint, tuple):
        given_host, given_port = endpoint
        return str(given_host), int(given_port)
    if not isinstance(endpoint, str) or not endpoint:
        raise InvalidInputError(f"endpoint must be 'host:port', got {endpoint!r}")
    text = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidInputError(f"endpoint must be 'host:port', got {endpoint!r}")
    return host.strip("[]"), int(port)


class Credentials:
    """TLS material and etcd user credentials. Never printed: ``repr`` hides the password."""

    __slots__ = ("ca_cert", "cert_key", "cert_cert", "user", "_password")

    def __init__(self, ca_cert: str | None = None, cert_key: str | None = None,
                 cert_cert: str | None = None, user: str | None = None,
                 password: str | None = None) -> None:
        if (user is None) != (password is None):
            raise InvalidInputError("give both user and password, or neither")
        if (cert_key is None) != (cert_cert is None):
            raise InvalidInputError("give both cert_key and cert_cert, or neither")
        self.ca_cert, self.cert_key, self.cert_cert = ca_cert, cert_key, cert_cert
        self.user, self._password = user, password

    @property
    def password(self) -> str | None:
        return self._password

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None or self.cert_cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.secure:
            return None

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise InvalidInputError(f"cannot read TLS file {path!r}: {exc.strerror}") from None

        return grpc.ssl_channel_credentials(
            read(self.ca_cert), read(self.cert_key), read(self.cert_cert))

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same TLS material as an ``ssl`` client context speaking HTTP/2 (for the
        ``wire`` watch transport); None for plaintext."""
        if not self.secure:
            return None
        try:
            context = ssl.create_default_context(cafile=self.ca_cert)
            if self.cert_cert is not None:
                context.load_cert_chain(self.cert_cert, self.cert_key)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidInputError(f"cannot load the TLS files: {exc}") from None
        context.set_alpn_protocols(["h2"])
        return context

    def __repr__(self) -> str:
        return (f"Credentials(tls={self.secure}, client_cert={self.cert_cert is not None}, "
                f"user={self.user!r}, password={'***' if self._password else None})")


class _Endpoint:
    """One etcd endpoint: the stubs the store calls it through, whether the member behind
    it was checked to belong to the store's cluster, and the id of the other cluster it
    belongs to if it does not (it is then never used again).

    grpcio's channel is opened on first use of a stub that needs it (``watch``,
    ``grpc_kv``, or every stub with both transports ``"grpc"``): a store whose unary
    calls and watch both go over the wire transport never opens one (a channel and its
    stubs cost ~0.3 ms of CPU to make, and grpc-core's threads once it connects)."""

    __slots__ = ("target", "channel", "kv", "maintenance", "auth", "lease", "watch_stream",
                 "unary", "checked", "foreign", "ready", "open_channel", "_grpc",
                 "_grpc_lock")
    kv: Any
    maintenance: Any
    auth: Any
    lease: Any
    #: What the store's watch stream is opened with: ``watch`` (grpcio), or a WireStub.
    watch_stream: Any

    def __init__(self, target: str) -> None:
        self.target = target
        #: Whether :meth:`Connection.endpoint` gave it its stubs.
        self.ready = False
        #: grpcio's channel once opened (or a simulated transport's stand-in).
        self.channel: Any = None
        #: Opens grpcio's channel (set with the stubs; raises once the store is closed).
        self.open_channel: Callable[[], Any] | None = None
        self._grpc: Any = None  # grpcio's stubs on ``channel``, once made
        self._grpc_lock = threading.Lock()
        #: With ``unary_transport="wire"``: the pool that kv, maintenance, auth and lease
        #: call through.
        self.unary: UnaryChannel | None = None
        self.checked = False
        self.foreign: int | None = None

    @property
    def watch(self) -> Any:
        """grpcio's Watch stub (the channel is opened on first use)."""
        return self.grpcio().watch

    @property
    def grpc_kv(self) -> Any:
        """grpcio's KV stub, whatever ``kv`` is (the channel is opened on first use)."""
        return self.grpcio().kv

    def grpcio(self) -> Any:
        """grpcio's stubs (``kv``, ``maintenance``, ``auth``, ``watch``, ``lease``),
        opening the channel if none is open yet. Thread-safe."""
        stubs = self._grpc
        if stubs is None:
            with self._grpc_lock:
                stubs = self._grpc
                if stubs is None:
                    if self.open_channel is None:
                        raise StoreClosedError("the store is closed")
                    channel = self.channel = self.open_channel()
                    stubs = self._grpc = _GrpcStubs(
                        kv=etcdrpc.KVStub(channel),
                        maintenance=etcdrpc.MaintenanceStub(channel),
                        auth=etcdrpc.AuthStub(channel), watch=etcdrpc.WatchStub(channel),
                        lease=etcdrpc.LeaseStub(channel))
        return stubs

    def simulated(self, stubs: Any) -> None:
        """Use ``stubs`` (a simulated transport's, see :func:`_simulated`) for every call."""
        self.channel = self._grpc = stubs

    def release(self) -> list[Any]:
        """Forget the channels (no stub opens one again); return those to close."""
        with self._grpc_lock:
            channels = [c for c in (self.channel, self.unary) if c is not None]
            self.channel = self.unary = self.open_channel = self._grpc = None
        return channels


@dataclass(frozen=True)
class _GrpcStubs:
    kv: Any
    maintenance: Any
    auth: Any
    watch: Any
    lease: Any


class Connection:
    """Channels to one etcd cluster. Thread-safe; every method may block up to its deadline.

    ``call`` sends one unary RPC, failing over between endpoints and re-authenticating as
    needed until it succeeds or its deadline passes; it raises only cachedstore errors.
    ``name`` (a store's id) ends the names of the threads the connection starts
    (``cachedstore-watch-send-3``, ``cachedstore-unary-finish-3``), as the store's own
    threads' names do.

    Longer than this project's classes usually are: channels, endpoint failover, cluster
    identity checks and auth tokens are the state every call reads; the retry decisions are
    a value of their own (``retry.py``).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], credentials: Credentials,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics,
                 clock: Clock = SYSTEM_CLOCK, name: str = "") -> None:
        if not endpoints:
            raise InvalidInputError("at least one endpoint is required")
        self._endpoints = [
            _Endpoint(f"[{h}]:{p}" if ":" in h else f"{h}:{p}") for h, p in endpoints]
        self._credentials = credentials
        self._channel_credentials = credentials.channel_credentials()
        self._ssl_context = credentials.ssl_context() \
            if "wire" in (config.watch_transport, config.unary_transport) else None
        self._config = config
        self._metrics = metrics
        self._name = f"-{name}" if name else ""  # ends the names of this connection's threads
        #: Deadlines and back-off waits (gRPC's own timeouts are real seconds).
        self._clock = clock
        self._lock = threading.Lock()
        self._auth_lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self._closed = False
        #: Read-only Txns whose caller stopped waiting, left to finish (_txn_not_cancelled).
        self._unfinished: set[Any] = set()
        #: The ``cluster_id`` of the first member that answered: the store's cluster.
        self._cluster_id: int | None = None
        #: Rule 10 of cache.py, wired by the store (the cache's ``known_revision`` and
        #: ``answered``): every key-value call takes a ticket before it is sent, and its
        #: answer's revision is checked against it, so no answer of etcd's (a queue's
        #: count, a refused guard, a consistent read's revision) goes unchecked. A rewind
        #: found there is handled on the calling thread (the cache's ``on_rewind``: it
        #: takes only short locks, never waits for etcd) before the answer is returned.
        self.history: tuple[Callable[[], Any], Callable[[Any, int], object]] | None = None
        # gRPC takes the minimum reconnect back-off as the time one connection attempt
        # (TCP, TLS and HTTP/2 handshakes) may take: 100 ms failed every TLS handshake over
        # a link slower than ~25 ms one-way. An attempt may take up to connect_timeout
        # (at least 1 s, at most gRPC's own 20 s); retries still start 100 ms apart.
        #: How long one connection attempt may take (the wire watch stream's too).
        self._attempt_timeout = min(max(config.connect_timeout, 1.0), 20.0)
        connect_ms = int(self._attempt_timeout * 1000)
        self._options = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
            # gRPC's default reconnect back-off grows to 120 s: a restarted etcd would stay
            # unused for minutes. Our own back-off paces the retries instead.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", connect_ms),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.enable_retries", 0),
        ]

    # -- endpoints ---------------------------------------------------------------------
    @property
    def targets(self) -> list[str]:
        return [e.target for e in self._endpoints]

    def endpoint(self) -> tuple[int, _Endpoint]:
        """The endpoint in use (index, endpoint with stubs), creating its channel if needed."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            index = self._current
            ep = self._endpoints[index]
            if not ep.ready:
                self._stub(ep)
            return index, ep

    def _stub(self, ep: _Endpoint) -> None:
        """Give ``ep`` its stubs (under the lock); grpcio's channel is opened only if a
        transport needs it now."""
        ep.ready = True
        if ep.target in STUB_FACTORIES:
            _simulated(ep, STUB_FACTORIES[ep.target])
            return
        target = ep.target
        ep.open_channel = lambda: self._open_channel(target)
        if self._config.unary_transport == "wire":
            _wire_stubs(ep, UnaryChannel(ep.target, self._ssl_context,
                                         self._attempt_timeout, self._clock.monotonic,
                                         f"cachedstore-unary-finish{self._name}"))
        else:
            grpcio = ep.grpcio()
            ep.kv, ep.maintenance = grpcio.kv, grpcio.maintenance
            ep.auth, ep.lease = grpcio.auth, grpcio.lease
        ep.watch_stream = ep.watch if self._config.watch_transport == "grpc" \
            else WireStub(ep.target, self._ssl_context, self._attempt_timeout,
                          etcdrpc.WatchResponse.FromString,
                          f"cachedstore-watch-send{self._name}")

    def _open_channel(self, target: str) -> grpc.Channel:
        """A new grpcio channel to ``target``. Raises StoreClosedError once closed."""
        if self._closed:
            raise StoreClosedError("the store is closed")
        if self._channel_credentials is not None:
            return grpc.secure_channel(target, self._channel_credentials,
                                       options=self._options)
        return grpc.insecure_channel(target, options=self._options)

    def failover(self, failed_index: int) -> None:
        """Move to the next endpoint not known to belong to another cluster, unless another
        thread already moved off ``failed_index``."""
        with self._lock:
            n = len(self._endpoints)
            if self._current == failed_index and n > 1:
                for step in range(1, n):
                    candidate = (failed_index + step) % n
                    if self._endpoints[candidate].foreign is None:
                        break
                else:
                    return  # every other endpoint is another cluster's: stay
                self._current = candidate
                log.info("cachedstore: etcd endpoint %s failed; failing over to %s",
                         self._endpoints[failed_index].target,
                         self._endpoints[self._current].target)

    # -- cluster identity ------------------------------------------------------------------
    @property
    def cluster_id(self) -> int | None:
        """The id of the store's etcd cluster, once a member has answered."""
        return self._cluster_id

    @property
    def foreign_endpoints(self) -> list[str]:
        """Endpoints refused because they answered as members of another cluster."""
        return [ep.target for ep in self._endpoints if ep.foreign is not None]

    def check_cluster(self, index: int, header: Any) -> None:
        """Check a response header from endpoint ``index``: the first one seen fixes the
        store's cluster; one from another cluster marks the endpoint foreign (never used
        again), fails over and raises ClusterMismatchError. A header without a cluster id
        (0: etcd's grpc-proxy sends its watch responses so) says nothing either way."""
        cluster_id = int(header.cluster_id)
        if cluster_id == 0:
            return
        with self._lock:
            if self._cluster_id is None:
                self._cluster_id = cluster_id
            expected = self._cluster_id
            ep = self._endpoints[index]
            if cluster_id == expected:
                ep.checked = True
                return
            first = ep.foreign is None
            ep.foreign = cluster_id
        if first:
            log.error("cachedstore: etcd endpoint %s belongs to another cluster (id %x, "
                      "expected %x); it will not be used", ep.target, cluster_id, expected)
        self.failover(index)
        raise ClusterMismatchError(
            f"etcd endpoint {ep.target} is a member of another cluster (cluster id "
            f"{cluster_id:x}, the store's is {expected:x}); it is not used")

    def _txn_not_cancelled(self, ep: _Endpoint, request: Any, wait: float,
                           metadata: tuple[tuple[str, str], ...]) -> Any:
        """A read-only Txn whose caller gives it ``wait`` seconds, clearly less than
        ``request_timeout`` (a blocking read near its deadline: torch's ``wait``/``check``
        of several names, a scope opening), on grpcio (the wire transport does the same
        itself: ``UnaryChannel.method``'s ``patience``): its answer is waited for that
        long, but the RPC is not cancelled when it is late. etcd before 3.5.5 panics (and
        exits) when a read-only Txn is cancelled while it executes (etcd-io/etcd#14110):
        one overloaded client could take the member down. The RPC runs on, with
        ``request_timeout`` as its deadline (which etcd enforces on its side too: a read
        still running then can still trip the bug), and its answer is dropped. Raises
        grpc.RpcError (DEADLINE_EXCEEDED when late)."""
        future = ep.grpc_kv.Txn.future(request, timeout=self._config.request_timeout,
                                        metadata=metadata)
        try:
            return future.result(timeout=wait)
        except grpc.RpcError:
            raise  # the call's own failure
        except BaseException as exc:  # late (or interrupted): the call is left running
            # grpcio cancels a call whose future is garbage-collected: keep it until done.
            self._unfinished.add(future)
            future.add_done_callback(self._unfinished.discard)
            if not isinstance(exc, grpc.FutureTimeoutError):
                raise
            raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "Deadline Exceeded (the read-only Txn was left to finish)"
                            ) from None

    def check_member(self, index: int, deadline: float) -> None:
        """Make sure endpoint ``index`` is a member of the store's cluster: nothing if it
        is known to be, else one ``Status`` call on it. For a watch stream whose created
        answer carried no cluster id (etcd's grpc-proxy). Raises ClusterMismatchError
        (after failing over), grpc.RpcError if the member does not answer by
        ``deadline``."""
        ep = self._endpoints[index]
        if ep.checked:
            return
        started = time.perf_counter()
        try:
            status = self._status(ep, max(0.001, deadline - self._clock.monotonic()),
                                  self.metadata(), started)
        except grpc.RpcError as exc:
            self._count_failure("status", exc, started)
            raise
        self.check_cluster(index, status.header)

    def _count_failure(self, method: str, exc: grpc.RpcError, started: float) -> Failure:
        """Count a failed call of ``method`` (begun at perf-counter time ``started``) by
        its status code; return what the failure means."""
        failure, code, _ = etcdapi.classify_rpc_error(exc)
        self._metrics.rpc(method, code.name if code else "UNKNOWN",
                          time.perf_counter() - started)
        return failure

    def _status(self, ep: _Endpoint, timeout: float, metadata: tuple[tuple[str, str], ...],
                started: float) -> Any:
        """One ``Status`` call on ``ep`` (begun at perf-counter time ``started``), counted
        when it succeeds; raises grpc.RpcError (the caller counts failures)."""
        status = ep.maintenance.Status(etcdapi.status(), timeout=timeout, metadata=metadata)
        self._metrics.rpc("status", "ok", time.perf_counter() - started)
        return status

    def checked_endpoint(self, deadline: float) -> tuple[int, _Endpoint]:
        """Like :meth:`endpoint`, once the member behind it is known to belong to the
        store's cluster (one ``Status`` call the first time). Blocks up to ``deadline``;
        raises what :meth:`call` raises."""
        while True:
            index, ep = self.endpoint()
            if ep.checked:
                return index, ep
            self.call("status", etcdapi.status(), deadline=deadline)

    # -- auth ----------------------------------------------------------------------------
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata of every request: the auth token if any, and etcd's require-leader
        flag (see :data:`REQUIRE_LEADER`)."""
        return _metadata(self._token)

    @property
    def token(self) -> str | None:
        """The current etcd auth token (None without credentials or before authenticating)."""
        return self._token

    @property
    def has_credentials(self) -> bool:
        return self._credentials.user is not None

    @property
    def has_identity(self) -> bool:
        """Whether etcd can tell who this store is (a user, or a client certificate whose
        common name etcd's auth takes as the user): access that can be revoked."""
        return self._credentials.user is not None or self._credentials.cert_cert is not None

    def authenticate(self, deadline: float, stale_token: str | None = None) -> None:
        """Get a fresh auth token (no-op without credentials, or if another thread already
        replaced ``stale_token``). Raises AuthenticationError for a wrong password."""
        if not self.has_credentials:
            return
        with self._auth_lock:
            if stale_token is not None and self._token != stale_token:
                return
            request = etcdapi.authenticate(self._credentials.user or "",
                                           self._credentials.password or "")
            response = self.call("authenticate", request, deadline=deadline,
                                 retry=IDEMPOTENT, authenticated=False)
            if self._token is not None:
                log.info("cachedstore: etcd auth token renewed")
            self._token = response.token

    # -- calls ---------------------------------------------------------------------------
    def warm(self, deadline: float) -> None:
        """With ``unary_transport="wire"``: open a pooled connection to the endpoint in use
        now, by ``deadline``, so that the first call does not pay for it (with ``"grpc"``,
        grpcio connects on its own). Best effort: a failure is left for the first call to
        meet, retry and report."""
        try:
            _, ep = self.endpoint()
            if ep.unary is not None:
                ep.unary.warm(max(0.0, deadline - self._clock.monotonic()))
        except (WireError, StoreClosedError) as exc:
            log.debug("cachedstore: no unary connection to %s opened ahead: %s",
                      self.targets, exc)

    def deadline(self, timeout: float | None = None) -> float:
        """The deadline (on the connection's clock) ``timeout`` seconds from now; default
        ``request_timeout``."""
        return self._clock.monotonic() + (
            self._config.request_timeout if timeout is None else timeout)

    def call(self, method: str, request: Any, *, deadline: float, retry: str = IDEMPOTENT,
             authenticated: bool = True) -> Any:
        """Send one unary RPC (``range``, ``txn``, ``put``, ``delete_range``, ``status``,
        ``authenticate``, ``lease_grant``, ``lease_revoke``...) and return its response.

        Blocks until the response or ``deadline`` (a value of the connection's clock, as
        :meth:`deadline` returns). Transport
        failures move to the next endpoint and retry after a jittered back-off: always for
        ``IDEMPOTENT`` calls, and for ``UNSENT_ONLY`` calls only while the failure shows the
        request never reached etcd. Raises EtcdConnectionError (outcome unknown for
        UNSENT_ONLY calls that may have been sent), EtcdPermissionError, InvalidInputError...
        Each rule is the policy's, :class:`~cachedstore.retry.Retry`: this loop asks it
        before each attempt and after each failure, and does what it decides.
        """
        policy = Retry(method, deadline, retry, len(self._endpoints), self._config.backoff,
                       reauthenticate=authenticated and self.has_credentials)
        history = self.history if method in _KEY_VALUE else None
        ticket = history[0]() if history is not None else None
        while True:
            index, ep = self.endpoint()
            if ep.foreign is not None:  # every endpoint left is another cluster's
                policy.raise_all_foreign(self.foreign_endpoints)
            now = self._clock.monotonic()
            if policy.is_exhausted(now):
                policy.raise_exhausted(self.targets, self.foreign_endpoints)
            token = self._token if authenticated else None
            timeout, metadata = policy.attempt_timeout(now), _metadata(token)
            started = time.perf_counter()
            try:
                if not ep.checked and method not in _READS:
                    started = self._check_before_write(index, ep, timeout, metadata, started)
                response = self._send(ep, method, request, timeout, metadata)
            except ClusterMismatchError as exc:  # met before the request was sent
                policy = policy.skip_foreign(exc, applied=False)
                continue
            except grpc.RpcError as exc:
                failure = self._count_failure(method, exc, started)
                self._raise_if_closed()
                if failure in TRANSPORT_FAILURES:  # the next call starts elsewhere, too
                    self.failover(index)
                policy = policy.increment(exc, failure, self._clock.monotonic(),
                                          self.foreign_endpoints)  # or raises: give up
                if policy.action is Action.REAUTHENTICATE:
                    self.authenticate(deadline, stale_token=token)
                elif policy.action is Action.FAIL_OVER:
                    self._clock.sleep(policy.delay)
                continue
            except ValueError as exc:  # grpc raises it for a channel closed under us
                self._raise_if_closed()
                raise EtcdError(f"etcd {method}: {exc}") from exc
            self._metrics.rpc(method, "ok", time.perf_counter() - started)
            mismatch = self._foreign_answer(index, ep, response)
            if mismatch is None:
                if history is not None:  # linearizable: sent after ticket, answered after
                    history[1](ticket, response.header.revision)
                return response
            policy = policy.skip_foreign(mismatch, applied=method not in _READS)

    def _check_before_write(self, index: int, ep: _Endpoint, timeout: float,
                            metadata: tuple[tuple[str, str], ...], started: float) -> float:
        """Never send a write to a member before it is known to be ours: one ``Status``
        call on endpoint ``index`` (begun at perf-counter time ``started``), whose header
        :meth:`check_cluster` checks. (A read is checked by its answer's header instead,
        and discarded if foreign.) Returns the perf-counter time it ended, from which the
        write is timed. Raises grpc.RpcError (uncounted), ClusterMismatchError."""
        status = self._status(ep, timeout, metadata, started)
        self.check_cluster(index, status.header)
        return time.perf_counter()

    def _send(self, ep: _Endpoint, method: str, request: Any, timeout: float,
              metadata: tuple[tuple[str, str], ...]) -> Any:
        """One RPC of :meth:`call` on ``ep``; a read-only Txn given clearly less than
        ``request_timeout`` is left to finish when late (:meth:`_txn_not_cancelled`).
        Raises grpc.RpcError, or ValueError for a closed channel."""
        if (method == "txn" and timeout < _SHORT * self._config.request_timeout
                and _read_only(request)):
            if ep.unary is not None:  # the wire transport leaves it running itself
                return ep.kv.Txn(request, timeout=self._config.request_timeout,
                                 metadata=metadata, patience=timeout)
            return self._txn_not_cancelled(ep, request, timeout, metadata)
        return _rpc(ep, method)(request, timeout=timeout, metadata=metadata)

    def _foreign_answer(self, index: int, ep: _Endpoint, response: Any
                        ) -> ClusterMismatchError | None:
        """None if ``response`` (from endpoint ``index``) may be used, else the
        ClusterMismatchError of :meth:`check_cluster`, which has marked the member and
        failed over. A read's answer checks an unchecked member; and the member behind a
        checked endpoint may have been replaced by another cluster's (same address, new
        data). Either way a foreign answer is not used."""
        if ep.checked and response.header.cluster_id == self._cluster_id:
            return None
        try:
            self.check_cluster(index, response.header)
        except ClusterMismatchError as exc:
            return exc
        return None

    def _raise_if_closed(self) -> None:
        """Raise StoreClosedError (context suppressed) if :meth:`close` was called: a call
        failing because of it fails so, whatever else it met."""
        if self._closed:
            raise StoreClosedError("the store is closed") from None

    def close(self) -> None:
        """Close every channel; calls in flight fail with StoreClosedError. Idempotent.
        Blocks up to ``_DRAIN`` (1 s) for read-only Txns left to finish (see
        :meth:`_txn_not_cancelled`): closing a channel cancels them."""
        drain_until = time.monotonic() + _DRAIN
        for future in list(self._unfinished):
            left = drain_until - time.monotonic()
            if left <= 0:
                break
            try:
                future.exception(timeout=left)
            except Exception:  # FutureTimeoutError, or cancelled: closing anyway
                break
        for ep in list(self._endpoints):
            unary = ep.unary
            if unary is not None:
                unary.drain(max(0.0, drain_until - time.monotonic()))
        with self._lock:
            self._closed = True
            channels = [c for ep in self._endpoints for c in ep.release()]
        for channel in channels:
            channel.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def reads_left_running(self) -> int:
        """Read-only Txns left to finish after their callers stopped waiting (see
        :meth:`_txn_not_cancelled`), still running."""
        return len(self._unfinished) + sum(
            ep.unary.unfinished for ep in list(self._endpoints) if ep.unary is not None)


_METHODS: dict[str, tuple[str, str]] = {
    "range": ("kv", "Range"),
    "txn": ("kv", "Txn"),
    "put": ("kv", "Put"),
    "delete_range": ("kv", "DeleteRange"),
    "status": ("maintenance", "Status"),
    "authenticate": ("auth", "Authenticate"),
    "lease_grant": ("lease", "LeaseGrant"),
    "lease_revoke": ("lease", "LeaseRevoke"),
    "lease_time_to_live": ("lease", "LeaseTimeToLive"),
}


#: A read-only Txn whose attempt is given less than this fraction of ``request_timeout`` is
#: left to finish when late (``Connection._txn_not_cancelled``).
_SHORT = 0.9
#: ``Connection.close`` waits at most this long (seconds) for such reads to finish.
_DRAIN = 1.0


def _read_only(request: Any) -> bool:
    """Whether a TxnRequest only reads (every operation of both branches a range)."""
    return all(op.HasField("request_range") for op in request.success) and all(
        op.HasField("request_range") for op in request.failure)


#: The unary methods of etcd's services that :func:`_wire_stubs` provides, by stub.
_WIRE_METHODS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "kv": ("etcdserverpb.KV", (("Range", etcdrpc.RangeResponse), ("Txn", etcdrpc.TxnResponse),
                               ("Put", etcdrpc.PutResponse),
                               ("DeleteRange", etcdrpc.DeleteRangeResponse))),
    "maintenance": ("etcdserverpb.Maintenance", (("Status", etcdrpc.StatusResponse),)),
    "auth": ("etcdserverpb.Auth", (("Authenticate", etcdrpc.AuthenticateResponse),)),
    "lease": ("etcdserverpb.Lease", (("LeaseGrant", etcdrpc.LeaseGrantResponse),
                                     ("LeaseRevoke", etcdrpc.LeaseRevokeResponse),
                                     ("LeaseTimeToLive", etcdrpc.LeaseTimeToLiveResponse))),
}


class _Methods:
    """A stub of unary methods as attributes (grpcio's call signature)."""

    def __init__(self, methods: dict[str, Callable[..., Any]]) -> None:
        self.__dict__.update(methods)


def _wire_stubs(ep: _Endpoint, channel: UnaryChannel) -> None:
    """Route ``ep``'s unary stubs through ``channel`` (``unary_transport="wire"``)."""
    ep.unary = channel
    for stub, (service, methods) in _WIRE_METHODS.items():
        setattr(ep, stub, _Methods({
            name: channel.method(f"/{service}/{name}", response.FromString)
            for name, response in methods}))


def _simulated(ep: _Endpoint, factory: Callable[[str], Any]) -> None:
    """Give ``ep`` the stubs of a simulated transport (``STUB_FACTORIES``): an object with
    ``kv``, ``maintenance``, ``auth``, ``watch``, ``lease``, ``watch_stream`` and
    ``close()``, which stands in for the channel."""
    stubs = factory(ep.target)
    ep.simulated(stubs)
    ep.kv, ep.maintenance, ep.auth = stubs.kv, stubs.maintenance, stubs.auth
    ep.lease, ep.watch_stream = stubs.lease, stubs.watch_stream


def _rpc(ep: _Endpoint, method: str) -> Any:
    """The grpcio multi-callable of ``method`` on ``ep`` (call it, or its ``future``)."""
    stub_name, rpc_name = _METHODS[method]
    return getattr(getattr(ep, stub_name), rpc_name)
