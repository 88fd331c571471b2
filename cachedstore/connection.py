"""gRPC channels to etcd: endpoints and failover, TLS, auth tokens, and error translation.

The store talks to etcd through :class:`Connection` only. It drives python3-etcd3's
generated stubs (``etcd3.etcdrpc``) directly, not its client class: that class marks an
endpoint as failed after one timeout and then refuses it (``ValueError("Trying to use a
failed node")``) for minutes, and never refreshes an expired auth token. Here every call
has a deadline, retries on the next endpoint with jittered back-off while the deadline
allows, re-authenticates once when etcd says the token is invalid, and raises only
cachedstore errors.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from etcd3 import etcdrpc

from . import etcdapi
from .clock import SYSTEM_CLOCK, Clock
from .config import KEEPALIVE_TIME, KEEPALIVE_TIMEOUT, StoreConfig
from .errors import (
    AuthenticationError,
    CachedStoreError,
    ClusterMismatchError,
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionError,
    InvalidInputError,
    LeaseNotFoundError,
    StoreClosedError,
    TLSError,
)
from .etcdapi import TRANSPORT_FAILURES, Failure
from .metrics import NullMetrics, StoreMetrics
from .wire import WireError, WireStub

log = logging.getLogger("cachedstore.connection")

__all__ = ["Connection", "Credentials", "parse_endpoint", "translate_rpc_error"]

#: Retry modes of :meth:`Connection.call`.
IDEMPOTENT = "idempotent"  # safe to send again after any transport failure
UNSENT_ONLY = "unsent-only"  # retried only when the request cannot have reached etcd

#: Tests only (``tests/sim``): endpoint target -> factory of an in-process transport used
#: instead of a gRPC channel (see :func:`_simulated`). Empty in production.
STUB_FACTORIES: dict[str, Callable[[str], Any]] = {}
#: Methods that change nothing: sent to an unchecked member, their answer's header checks it.
_READS = frozenset({"range", "status", "lease_time_to_live"})
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


def _transient(error: CachedStoreError) -> CachedStoreError:
    """``error`` as a plain EtcdConnectionError if it is a TLSError: for a failure met
    before every endpoint refused the handshake, which may be one member's (TLSError says
    "waiting will not fix it")."""
    return EtcdConnectionError(str(error)) if isinstance(error, TLSError) else error


def translate_rpc_error(exc: grpc.RpcError, method: str) -> CachedStoreError:
    """A cachedstore error for a gRPC error from etcd (the caller chains ``exc``); what
    the error means comes from :func:`etcdapi.classify`'s table."""
    failure, code, details = etcdapi.classify_rpc_error(exc)
    where = f"etcd {method}"
    name = code.name if code is not None else type(exc).__name__
    if failure is Failure.TLS_HOSTNAME:
        return TLSError(f"{where}: TLS handshake with etcd failed: the server's "
                        f"certificate is not valid for the host name or address the "
                        f"store connected to (hostname mismatch: {details}); use a name "
                        f"listed in the certificate's subject alternative names")
    if failure is Failure.TLS:
        return TLSError(f"{where}: TLS handshake with etcd failed ({details}); check "
                        f"ca_cert and the server's certificate")
    if failure is Failure.HANDSHAKE_CUT:  # too slow a link, or no TLS on the server
        return EtcdConnectionError(
            f"{where}: etcd unreachable: the TLS handshake did not complete "
            f"({name}: {details}); is the server serving TLS on this port?")
    if failure in (Failure.UNSENT, Failure.TRANSPORT, Failure.NO_LEADER):
        return EtcdConnectionError(f"{where}: etcd unreachable ({name}: {details})")
    if failure is Failure.PERMISSION:
        return EtcdPermissionError(f"{where}: {details}")
    if failure is Failure.AUTH_FAILED:
        return AuthenticationError(f"{where}: {details}")
    if failure is Failure.AUTH_NOT_ENABLED:
        return AuthenticationError(f"{where}: credentials given but {details}")
    if failure is Failure.TOKEN:
        return AuthenticationError(f"{where}: {details} (are user and password set?)")
    if failure is Failure.TOO_LARGE:
        return InvalidInputError(f"{where}: {details}")
    if failure is Failure.LEASE_NOT_FOUND:
        return LeaseNotFoundError(f"{where}: {details}")
    if failure is Failure.CANCELLED:
        # Only close() ends a store (call() checks that first): a CANCELLED status from
        # the server or a proxy (RST_STREAM) is a transport failure like any other.
        return EtcdConnectionError(f"{where}: cancelled by etcd or a proxy ({details})")
    return EtcdError(f"{where}: {name}: {details}")


class _Endpoint:
    """One etcd endpoint: its lazily created channel and the stubs on it, whether the
    member behind it was checked to belong to the store's cluster, and the id of the other
    cluster it belongs to if it does not (it is then never used again)."""

    __slots__ = ("target", "channel", "kv", "maintenance", "auth", "watch", "lease",
                 "watch_stream", "checked", "foreign")
    kv: Any
    maintenance: Any
    auth: Any
    watch: Any
    lease: Any
    #: What the store's watch stream is opened with: ``watch`` (grpcio), or a WireStub.
    watch_stream: Any

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel: grpc.Channel | None = None
        self.checked = False
        self.foreign: int | None = None


class Connection:
    """Channels to one etcd cluster. Thread-safe; every method may block up to its deadline.

    ``call`` sends one unary RPC, failing over between endpoints and re-authenticating as
    needed until it succeeds or its deadline passes; it raises only cachedstore errors.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], credentials: Credentials,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        if not endpoints:
            raise InvalidInputError("at least one endpoint is required")
        self._endpoints = [
            _Endpoint(f"[{h}]:{p}" if ":" in h else f"{h}:{p}") for h, p in endpoints]
        self._credentials = credentials
        self._channel_credentials = credentials.channel_credentials()
        self._ssl_context = credentials.ssl_context() \
            if config.watch_transport == "wire" else None
        self._config = config
        self._metrics = metrics
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
            if ep.channel is None and ep.target in STUB_FACTORIES:
                _simulated(ep, STUB_FACTORIES[ep.target])
            if ep.channel is None:
                if self._channel_credentials is not None:
                    ep.channel = grpc.secure_channel(
                        ep.target, self._channel_credentials, options=self._options)
                else:
                    ep.channel = grpc.insecure_channel(ep.target, options=self._options)
                ep.kv = etcdrpc.KVStub(ep.channel)
                ep.maintenance = etcdrpc.MaintenanceStub(ep.channel)
                ep.auth = etcdrpc.AuthStub(ep.channel)
                ep.watch = etcdrpc.WatchStub(ep.channel)
                ep.lease = etcdrpc.LeaseStub(ep.channel)
                ep.watch_stream = ep.watch if self._config.watch_transport == "grpc" \
                    else WireStub(ep.target, self._ssl_context,
                                  self._attempt_timeout,
                                  etcdrpc.WatchResponse.FromString, "cachedstore-watch-send")
            return index, ep

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
        of several names, a scope opening): its answer is waited for that long, but the
        RPC is not cancelled when it is late. etcd before 3.5.5 panics (and exits) when a
        read-only Txn is cancelled while it executes (etcd-io/etcd#14110): one overloaded
        client could take the member down. The RPC runs on, with ``request_timeout`` as
        its deadline (which etcd enforces on its side too: a read still running then can
        still trip the bug), and its answer is dropped. Raises grpc.RpcError
        (DEADLINE_EXCEEDED when late)."""
        future = _rpc(ep, "txn").future(request, timeout=self._config.request_timeout,
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
        """
        backoff = self._config.backoff
        attempt = 0
        reauthenticated = False
        tls_failures = 0
        n_endpoints = len(self._endpoints)
        mismatch: ClusterMismatchError | None = None
        retried: grpc.RpcError | None = None  # the transport failure last retried after
        while True:
            index, ep = self.endpoint()
            if ep.foreign is not None:  # every endpoint left is another cluster's
                raise mismatch or ClusterMismatchError(
                    f"etcd {method}: every reachable endpoint is a member of another "
                    f"cluster than the store's ({', '.join(self.foreign_endpoints)})")
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                # Out of time after a retried failure: that failure is the cause to report
                # (a refused connection says "unreachable", not merely "no answer").
                if retried is None:
                    raise _with_mismatch(EtcdConnectionError(
                        f"etcd {method}: no answer from {', '.join(self.targets)} within "
                        f"the request timeout"), mismatch, self.foreign_endpoints)
                raise _with_mismatch(_transient(translate_rpc_error(retried, method)),
                                     mismatch, self.foreign_endpoints) from retried
            # With several endpoints, one black-holed member must not eat the whole budget.
            per_attempt = remaining if n_endpoints == 1 else max(
                min(remaining, 1.0), remaining / 2)
            token = self._token if authenticated else None
            metadata = _metadata(token)
            started = time.perf_counter()
            try:
                if not ep.checked and method not in _READS:
                    # Never send a write to a member before it is known to be ours (a read
                    # is checked by its answer's header, below, and discarded if foreign).
                    status = self._status(ep, per_attempt, metadata, started)
                    try:
                        self.check_cluster(index, status.header)
                    except ClusterMismatchError as exc:
                        mismatch = exc
                        continue
                    if method == "status":
                        return status
                    started = time.perf_counter()
                if (method == "txn" and per_attempt < _SHORT * self._config.request_timeout
                        and _read_only(request)):
                    response = self._txn_not_cancelled(ep, request, per_attempt, metadata)
                else:
                    response = _rpc(ep, method)(request, timeout=per_attempt,
                                                metadata=metadata)
            except grpc.RpcError as exc:
                failure = self._count_failure(method, exc, started)
                if self._closed:
                    raise StoreClosedError("the store is closed") from None
                if (authenticated and self.has_credentials and not reauthenticated
                        and failure is Failure.TOKEN):
                    reauthenticated = True
                    self.authenticate(deadline, stale_token=token)
                    continue
                if failure in TRANSPORT_FAILURES:  # the next endpoint, as deadline and mode allow
                    unsent = failure is Failure.UNSENT
                    self.failover(index)
                    if failure in (Failure.TLS, Failure.TLS_HOSTNAME):
                        # A certificate does not fix itself: give up once every endpoint
                        # has refused the handshake, instead of retrying until the deadline.
                        tls_failures += 1
                        if tls_failures >= n_endpoints:
                            raise translate_rpc_error(exc, method) from exc
                    if retry == IDEMPOTENT or unsent:
                        delay = backoff.delay(attempt)
                        attempt += 1
                        if self._clock.monotonic() + delay < deadline:
                            self._clock.sleep(delay)
                            retried = exc
                            continue
                    # Out of time before every endpoint refused the handshake: not (yet)
                    # a certificate problem.
                    error = _transient(translate_rpc_error(exc, method))
                    if retry != IDEMPOTENT and not unsent and not isinstance(error, TLSError):
                        error = EtcdConnectionError(
                            f"{error}; the request may or may not have been applied")
                    raise _with_mismatch(error, mismatch, self.foreign_endpoints) from exc
                raise translate_rpc_error(exc, method) from exc
            except ValueError as exc:  # grpc raises it for a channel closed under us
                if self._closed:
                    raise StoreClosedError("the store is closed") from None
                raise EtcdError(f"etcd {method}: {exc}") from exc
            self._metrics.rpc(method, "ok", time.perf_counter() - started)
            if not ep.checked or response.header.cluster_id != self._cluster_id:
                # A read's answer checks an unchecked member; and the member behind a
                # checked endpoint may have been replaced by another cluster's (same
                # address, new data). Either way a foreign answer is not used.
                try:
                    self.check_cluster(index, response.header)
                except ClusterMismatchError as exc:
                    if method not in _READS:
                        raise
                    mismatch = exc  # a read: ask the next member
                    continue
            return response

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
        with self._lock:
            self._closed = True
            channels = [ep.channel for ep in self._endpoints if ep.channel is not None]
            for ep in self._endpoints:
                ep.channel = None
        for channel in channels:
            channel.close()

    @property
    def closed(self) -> bool:
        return self._closed


def _with_mismatch(error: CachedStoreError, mismatch: ClusterMismatchError | None,
                   foreign: list[str]) -> CachedStoreError:
    """``error``, as a ClusterMismatchError naming the refused members when the call met a
    member of another cluster or some endpoints are known to be other clusters' (which is
    why they were not tried)."""
    if not isinstance(error, EtcdConnectionError) or (mismatch is None and not foreign):
        return error
    verb = "is a member" if len(foreign) == 1 else "are members"
    why = mismatch or f"{', '.join(foreign)} {verb} of another cluster and not used"
    return ClusterMismatchError(f"{error}; and {why}")


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


def _simulated(ep: _Endpoint, factory: Callable[[str], Any]) -> None:
    """Give ``ep`` the stubs of a simulated transport (``STUB_FACTORIES``): an object with
    ``kv``, ``maintenance``, ``auth``, ``watch``, ``lease``, ``watch_stream`` and
    ``close()``, which stands in for the channel."""
    stubs = factory(ep.target)
    ep.channel = stubs
    ep.kv, ep.maintenance, ep.auth = stubs.kv, stubs.maintenance, stubs.auth
    ep.watch, ep.lease, ep.watch_stream = stubs.watch, stubs.lease, stubs.watch_stream


def _rpc(ep: _Endpoint, method: str) -> Any:
    """The grpcio multi-callable of ``method`` on ``ep`` (call it, or its ``future``)."""
    stub_name, rpc_name = _METHODS[method]
    return getattr(getattr(ep, stub_name), rpc_name)
