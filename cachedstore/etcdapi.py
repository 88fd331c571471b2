"""The etcd v3 request vocabulary: every request cachedstore sends is built here.

The store (reads, writes, queues), the rendezvous backend (through the store's CAS/lease
API), the CLI and the plain client (:mod:`cachedstore.client`, the demo's uncached
contender) build their requests with these functions instead of assembling ``etcdrpc``
messages themselves, so that a compare, a range or a watch means the same thing everywhere.
``tests/test_etcdapi.py`` keeps it so: no other module builds an ``etcdrpc`` request.

Keys and values are ``bytes`` (whole etcd keys: the caller applies its prefix).

It also says what etcd's answers mean: :func:`classify` turns a failed call (gRPC status
code and details) or a watch's cancel reason into a :class:`Failure`, from one table, so
that the connection layer, the watch and the plain client agree on what a failure is.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import grpc
from etcd3 import etcdrpc

__all__ = [
    "EVENT_PUT",
    "Failure",
    "TRANSPORT_FAILURES",
    "classify",
    "classify_rpc_error",
    "absent",
    "authenticate",
    "delete",
    "lease_grant",
    "lease_revoke",
    "lease_time_to_live",
    "never_put",
    "op_delete",
    "op_put",
    "op_range",
    "op_txn",
    "put",
    "range_key",
    "range_prefix",
    "status",
    "txn",
    "unmodified",
    "unmodified_since",
    "value_between",
    "value_equals",
    "watch_create",
    "watch_progress",
]

#: ``Event.type`` of a put (a delete is 1).
EVENT_PUT = 0


# -- compares ---------------------------------------------------------------------------
def absent(key: bytes) -> Any:
    """A Txn compare: ``key`` does not exist."""
    return etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                           target=etcdrpc.Compare.CREATE, create_revision=0)


def unmodified(key: bytes, mod_revision: int) -> Any:
    """A Txn compare: ``key`` was last modified at ``mod_revision``."""
    return etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                           target=etcdrpc.Compare.MOD, mod_revision=mod_revision)


def value_equals(key: bytes, value: bytes) -> Any:
    """A Txn compare: ``key`` exists and holds exactly ``value``."""
    return etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                           target=etcdrpc.Compare.VALUE, value=value)


def value_between(key: bytes, low: bytes, high: bytes) -> list[Any]:
    """Txn compares: ``key`` exists and ``low < value < high`` (bytewise; a missing key
    fails a value compare in etcd)."""
    return [etcdrpc.Compare(key=key, result=etcdrpc.Compare.GREATER,
                            target=etcdrpc.Compare.VALUE, value=low),
            etcdrpc.Compare(key=key, result=etcdrpc.Compare.LESS,
                            target=etcdrpc.Compare.VALUE, value=high)]


def never_put(key: bytes) -> Any:
    """A Txn compare: ``key`` does not exist (its version is 0)."""
    return etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                           target=etcdrpc.Compare.VERSION, version=0)


def unmodified_since(start: bytes, end: bytes, revision: int) -> Any:
    """A Txn compare: no key in ``[start, end)`` was modified after ``revision`` (true for
    an empty range; a key deleted since is not seen, so pair it with a compare on a key
    that every deletion rewrites)."""
    return etcdrpc.Compare(key=start, range_end=end, result=etcdrpc.Compare.LESS,
                           target=etcdrpc.Compare.MOD, mod_revision=revision + 1)


# -- KV requests ------------------------------------------------------------------------
def range_key(key: bytes, *, revision: int = 0, serializable: bool = False) -> Any:
    """A linearizable (unless ``serializable``) read of one key."""
    return etcdrpc.RangeRequest(key=key, revision=revision, serializable=serializable)


def range_prefix(start: bytes, end: bytes, *, revision: int = 0, count_only: bool = False,
                 keys_only: bool = False, limit: int = 0, oldest_first: bool = False) -> Any:
    """A read of every key in ``[start, end)``; ``oldest_first`` sorts by creation revision."""
    request = etcdrpc.RangeRequest(key=start, range_end=end, revision=revision,
                                   count_only=count_only, keys_only=keys_only, limit=limit)
    if oldest_first:
        request.sort_order = etcdrpc.RangeRequest.ASCEND
        request.sort_target = etcdrpc.RangeRequest.CREATE
    return request


def put(key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> Any:
    return etcdrpc.PutRequest(key=key, value=value, lease=lease, prev_kv=prev_kv)


def delete(key: bytes, *, range_end: bytes = b"", prev_kv: bool = False) -> Any:
    return etcdrpc.DeleteRangeRequest(key=key, range_end=range_end, prev_kv=prev_kv)


def op_range(request: Any) -> Any:
    return etcdrpc.RequestOp(request_range=request)


def op_put(request: Any) -> Any:
    return etcdrpc.RequestOp(request_put=request)


def op_delete(request: Any) -> Any:
    return etcdrpc.RequestOp(request_delete_range=request)


def op_txn(request: Any) -> Any:
    """A nested Txn as one operation of another (etcd ≥ 3.3)."""
    return etcdrpc.RequestOp(request_txn=request)


def txn(compare: Sequence[Any] = (), success: Sequence[Any] = (),
        failure: Sequence[Any] = ()) -> Any:
    return etcdrpc.TxnRequest(compare=list(compare), success=list(success),
                              failure=list(failure))


# -- leases -----------------------------------------------------------------------------
def lease_grant(ttl_seconds: int) -> Any:
    return etcdrpc.LeaseGrantRequest(TTL=int(ttl_seconds), ID=0)


def lease_revoke(lease_id: int) -> Any:
    return etcdrpc.LeaseRevokeRequest(ID=lease_id)


def lease_time_to_live(lease_id: int) -> Any:
    return etcdrpc.LeaseTimeToLiveRequest(ID=lease_id, keys=False)


# -- auth -------------------------------------------------------------------------------
def authenticate(user: str, password: str) -> Any:
    """An ``AuthenticateRequest`` (answered with a simple token for the request metadata)."""
    return etcdrpc.AuthenticateRequest(name=user, password=password)


# -- maintenance ------------------------------------------------------------------------
def status() -> Any:
    """A Maintenance ``StatusRequest`` (version, db size, leader, raft term of a member)."""
    return etcdrpc.StatusRequest()


# -- watch ------------------------------------------------------------------------------
def watch_create(start: bytes, end: bytes, start_revision: int, *,
                 progress_notify: bool = False) -> Any:
    """A ``WatchRequest`` creating a watch of ``[start, end)`` from ``start_revision``.

    Never asks for fragments: a large Txn then arrives as one response, applied whole.
    (python3-etcd3's stubs predate client-chosen watch ids: etcd assigns them in order.)"""
    return etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
        key=start, range_end=end, start_revision=start_revision,
        progress_notify=progress_notify))


def watch_progress() -> Any:
    """A ``WatchRequest`` asking etcd for a progress response (answered with watch id -1)."""
    return etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())


# -- what a failure means ----------------------------------------------------------------------
class Failure(enum.Enum):
    """What went wrong with a call to etcd (or why etcd cancelled a watch)."""

    #: A TLS handshake that failed verification: a certificate, a TLS alert. Permanent.
    TLS = "tls"
    #: The server's certificate does not name the host connected to. Permanent.
    TLS_HOSTNAME = "tls-hostname"
    #: A TLS handshake cut short (a slow link, no TLS on the port): a transport failure.
    HANDSHAKE_CUT = "handshake-cut"
    #: The connection could not be made: the request never reached etcd.
    UNSENT = "unsent"
    #: A transport failure: the request may or may not have reached etcd.
    TRANSPORT = "transport"
    #: The member has no leader (cut off from its peers) or lost it: try another member.
    NO_LEADER = "no-leader"
    #: The auth token is invalid or expired: authenticate again.
    TOKEN = "token"
    #: A wrong user name or password.
    AUTH_FAILED = "auth-failed"
    #: Credentials given to an etcd without auth.
    AUTH_NOT_ENABLED = "auth-not-enabled"
    #: The user may not do this (RBAC), or access was revoked.
    PERMISSION = "permission"
    #: A request over etcd's size or operation limits.
    TOO_LARGE = "too-large"
    #: The lease does not exist (expired or revoked).
    LEASE_NOT_FOUND = "lease-not-found"
    #: The revision asked for was compacted.
    COMPACTED = "compacted"
    #: Cancelled by the server or a proxy (RST_STREAM), not by us.
    CANCELLED = "cancelled"
    #: Anything else.
    OTHER = "other"


#: Failures of the path to one member, not of the request: another member may answer.
TRANSPORT_FAILURES = frozenset({Failure.TLS, Failure.TLS_HOSTNAME, Failure.HANDSHAKE_CUT,
                                Failure.UNSENT, Failure.TRANSPORT, Failure.NO_LEADER})

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_TRANSPORT_CODES = frozenset({_UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

#: The table: the first row whose codes (None: any) include the call's code and one of
#: whose markers (None: none needed) occurs in its lower-cased details decides.
_TABLE: tuple[tuple[Failure, frozenset[Any] | None, tuple[str, ...] | None], ...] = (
    (Failure.TLS_HOSTNAME, _TRANSPORT_CODES, ("hostname verification",)),
    (Failure.TLS, _TRANSPORT_CODES, ("ssl_error", "tsi_protocol_failure", "certificate",
                                     "tls handshake failed", "ssl handshake failed")),
    (Failure.HANDSHAKE_CUT, _TRANSPORT_CODES, ("handshake",)),
    (Failure.UNSENT, frozenset({_UNAVAILABLE}), (
        "failed to connect", "connection refused", "connect failed", "dns resolution",
        "no route to host", "name resolution")),
    (Failure.NO_LEADER, None, ("no leader", "leader changed")),
    (Failure.TRANSPORT, _TRANSPORT_CODES, None),
    # etcd's own end of the call's deadline (a read waiting for its read index when the
    # grpc-timeout ran out): the same as the client's DEADLINE_EXCEEDED, sent as UNKNOWN.
    (Failure.TRANSPORT, frozenset({grpc.StatusCode.UNKNOWN}), ("context deadline exceeded",)),
    (Failure.PERMISSION, frozenset({grpc.StatusCode.PERMISSION_DENIED}), None),
    (Failure.PERMISSION, None, ("permission denied",)),
    (Failure.AUTH_FAILED, None, ("authentication failed", "invalid user")),
    (Failure.AUTH_NOT_ENABLED, None, ("authentication is not enabled",)),
    (Failure.TOKEN, frozenset({grpc.StatusCode.UNAUTHENTICATED}), None),
    (Failure.TOKEN, None, ("invalid auth token", "auth token is expired",
                           "user name is empty", "auth token")),
    (Failure.TOO_LARGE, frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED}), None),
    (Failure.TOO_LARGE, None, ("too large", "too many operations")),
    (Failure.LEASE_NOT_FOUND, None, ("lease not found",)),
    (Failure.COMPACTED, None, ("compacted",)),
    (Failure.CANCELLED, frozenset({grpc.StatusCode.CANCELLED}), None),
)


def classify(code: Any, details: str) -> Failure:
    """What a failure means: ``code`` is the gRPC status code (None for a watch's cancel
    reason, which has none), ``details`` its text. Pure; the table is :data:`_TABLE`."""
    lowered = details.lower()
    for failure, codes, markers in _TABLE:
        if codes is not None and code not in codes:
            continue
        if markers is None or any(m in lowered for m in markers):
            return failure
    return Failure.OTHER


def classify_rpc_error(exc: BaseException) -> tuple[Failure, Any, str]:
    """:func:`classify` of a ``grpc.RpcError``: (failure, status code or None, details)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return classify(code, details), code, details
