"""What a failed call to etcd means for its caller: try again (and how), or which error.

:class:`Retry` is the retry policy of :meth:`Connection.call
<cachedstore.connection.Connection.call>` as a value (urllib3's ``Retry`` is the model):
made once per call, never changed; each failed attempt derives the next state with
:meth:`Retry.increment`, whose :class:`Action` tells the connection what to do before the
next attempt, or which raises the error the caller sees. It reads no clock and does no I/O:
the connection passes the time (from its injectable clock) and carries the decision out, so
every rule below is testable without etcd (``tests/test_retry.py``):

- A transport failure (:data:`etcdapi.TRANSPORT_FAILURES`) is retried on the next endpoint
  after a jittered back-off (:class:`~cachedstore.config.Backoff`) while the deadline
  allows: always in mode :data:`IDEMPOTENT`, and in mode :data:`UNSENT_ONLY` only when the
  request cannot have reached etcd (``Failure.UNSENT``). Otherwise the call gives up with an
  :class:`EtcdConnectionError` which, for an ``UNSENT_ONLY`` request that may have been
  sent, says that its outcome is unknown. The connection moves to the next endpoint after
  every transport failure, retried or not, so that the next call starts elsewhere.
- A TLS handshake refused by as many endpoints as there are gives up at once with the
  :class:`TLSError` (a certificate does not fix itself); refused by fewer, it is a transport
  failure like the others, reported as a plain EtcdConnectionError if time runs out.
- An invalid or expired auth token re-authenticates once per call (when the call carries a
  token and the connection has credentials), then tries again at once.
- A member of another cluster (the connection has marked it and moved off it) is skipped at
  once when it was found before the request was sent or answered a read; one that answered a
  write gives up with that :class:`ClusterMismatchError`.
- Any other failure gives up at once with :func:`translate_rpc_error`'s error.
- Before each attempt: with every endpoint left another cluster's, the call gives up with
  a ClusterMismatchError; past the deadline, with the failure it last retried after (a
  refused connection says "unreachable"), or "no answer" if none. A connection error of a
  call that met, or skipped, a member of another cluster becomes a ClusterMismatchError
  that says so.

:func:`translate_rpc_error` turns a gRPC failure into the cachedstore error a caller sees,
through one table (:data:`_ERRORS`) keyed by what :func:`etcdapi.classify` says it means.

A layer below the connection: it imports only :mod:`errors`, :mod:`config` and
:mod:`etcdapi`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NoReturn

import grpc

from . import errors, etcdapi
from .config import Backoff
from .errors import CachedStoreError, ClusterMismatchError, EtcdConnectionError, TLSError
from .etcdapi import TRANSPORT_FAILURES, Failure

__all__ = ["IDEMPOTENT", "UNSENT_ONLY", "Action", "Retry", "translate_rpc_error"]

#: Retry modes (``Connection.call``'s ``retry``): safe to send again after any transport
#: failure.
IDEMPOTENT = "idempotent"
#: Retried only when the request cannot have reached etcd (any mode but IDEMPOTENT is this).
UNSENT_ONLY = "unsent-only"

_TLS_FAILURES = frozenset({Failure.TLS, Failure.TLS_HOSTNAME})

# -- the error table ----------------------------------------------------------------------
_UNREACHABLE = "{where}: etcd unreachable ({name}: {details})"
#: What a caller sees for each kind of failure: the error class and its message, a format
#: string of ``where`` ("etcd <method>"), ``name`` (the gRPC status code's name) and
#: ``details`` (etcd's or gRPC's text). A failure not listed is an :data:`_OTHER`.
_ERRORS: dict[Failure, tuple[type[CachedStoreError], str]] = {
    Failure.TLS_HOSTNAME: (
        errors.TLSError,
        "{where}: TLS handshake with etcd failed: the server's certificate is not valid for "
        "the host name or address the store connected to (hostname mismatch: {details}); "
        "use a name listed in the certificate's subject alternative names"),
    Failure.TLS: (
        errors.TLSError,
        "{where}: TLS handshake with etcd failed ({details}); check ca_cert and the server's "
        "certificate"),
    Failure.HANDSHAKE_CUT: (  # too slow a link, or no TLS on the server
        errors.EtcdConnectionError,
        "{where}: etcd unreachable: the TLS handshake did not complete ({name}: {details}); "
        "is the server serving TLS on this port?"),
    Failure.UNSENT: (errors.EtcdConnectionError, _UNREACHABLE),
    Failure.TRANSPORT: (errors.EtcdConnectionError, _UNREACHABLE),
    Failure.NO_LEADER: (errors.EtcdConnectionError, _UNREACHABLE),
    Failure.PERMISSION: (errors.EtcdPermissionError, "{where}: {details}"),
    Failure.AUTH_FAILED: (errors.AuthenticationError, "{where}: {details}"),
    Failure.AUTH_NOT_ENABLED: (errors.AuthenticationError,
                               "{where}: credentials given but {details}"),
    Failure.TOKEN: (errors.AuthenticationError,
                    "{where}: {details} (are user and password set?)"),
    Failure.TOO_LARGE: (errors.InvalidInputError, "{where}: {details}"),
    Failure.LEASE_NOT_FOUND: (errors.LeaseNotFoundError, "{where}: {details}"),
    # Only close() ends a store (call() checks that first): a CANCELLED status from the
    # server or a proxy (RST_STREAM) is a transport failure like any other.
    Failure.CANCELLED: (errors.EtcdConnectionError,
                        "{where}: cancelled by etcd or a proxy ({details})"),
}
#: Any other failure (a compacted revision included): etcd's own words.
_OTHER: tuple[type[CachedStoreError], str] = (errors.EtcdError, "{where}: {name}: {details}")


def translate_rpc_error(exc: grpc.RpcError, method: str) -> CachedStoreError:
    """The cachedstore error for ``exc``, a gRPC error of a call of ``method`` (the caller
    chains ``exc``). What the error means comes from :func:`etcdapi.classify`'s table, which
    error that is from :data:`_ERRORS`. Pure; never raises."""
    failure, code, details = etcdapi.classify_rpc_error(exc)
    name = code.name if code is not None else type(exc).__name__
    error_type, message = _ERRORS.get(failure, _OTHER)
    return error_type(message.format(where=f"etcd {method}", name=name, details=details))


def _transient(error: CachedStoreError) -> CachedStoreError:
    """``error`` as a plain EtcdConnectionError if it is a TLSError: for a failure met
    before every endpoint refused the handshake, which may be one member's (TLSError says
    "waiting will not fix it")."""
    return EtcdConnectionError(str(error)) if isinstance(error, TLSError) else error


def _with_mismatch(error: CachedStoreError, mismatch: ClusterMismatchError | None,
                   foreign: Sequence[str]) -> CachedStoreError:
    """``error``, as a ClusterMismatchError naming the refused members when the call met a
    member of another cluster or some endpoints are known to be other clusters' (which is
    why they were not tried)."""
    if not isinstance(error, EtcdConnectionError) or (mismatch is None and not foreign):
        return error
    verb = "is a member" if len(foreign) == 1 else "are members"
    why = mismatch or f"{', '.join(foreign)} {verb} of another cluster and not used"
    return ClusterMismatchError(f"{error}; and {why}")


# -- the policy ---------------------------------------------------------------------------
class Action(enum.Enum):
    """What to do before the next attempt, as :meth:`Retry.increment` (or
    :meth:`Retry.skip_foreign`) decided after a failed one."""

    #: Try again at once, on the endpoint now current (the connection has already moved off
    #: the member of another cluster that was skipped).
    RETRY_NOW = "retry-now"
    #: A transport failure: the connection has moved to the next endpoint; wait
    #: :attr:`Retry.delay` on its clock, then try that one.
    FAIL_OVER = "fail-over"
    #: The auth token was refused: get a fresh one, then try again at once.
    REAUTHENTICATE = "reauthenticate"
    #: Stop (:meth:`Retry.decide` says so; :meth:`Retry.increment` raises the error the
    #: caller sees instead of returning it).
    GIVE_UP = "give-up"


@dataclass(frozen=True)
class Retry:
    """The retry state of one call: immutable, thread-confined to that call.

    The first six fields are the call's, fixed when it starts; the others are derived by
    :meth:`increment` and :meth:`skip_foreign`, each returning a new value.
    """

    #: The RPC's name (``range``, ``txn``...), for the error messages ("etcd <method>: ...").
    method: str
    #: When the call gives up, on the connection's clock (``Connection.deadline()``).
    deadline: float
    #: :data:`IDEMPOTENT` or :data:`UNSENT_ONLY`.
    mode: str = IDEMPOTENT
    #: How many endpoints the connection has: as many TLS refusals end the call, and one
    #: endpoint may take the whole remaining time per attempt (see :meth:`attempt_timeout`).
    endpoints: int = 1
    #: The waits between transport failures and the next attempt.
    backoff: Backoff = field(default_factory=Backoff)
    #: Whether an invalid token may be renewed: the call sends one and there are credentials.
    reauthenticate: bool = False
    #: Back-off waits drawn so far (``Backoff.delay``'s ``attempt`` for the next one).
    attempts: int = 0
    #: Whether the call has already re-authenticated (it does at most once).
    reauthenticated: bool = False
    #: TLS handshakes refused so far.
    tls_refusals: int = 0
    #: The transport failure last retried after: the cause reported if time runs out.
    retried: grpc.RpcError | None = None
    #: The last member of another cluster met (skipped), named in connection errors.
    mismatch: ClusterMismatchError | None = None
    #: What the last step decided (None before the first attempt).
    action: Action | None = None
    #: Seconds to wait before the next attempt (0 unless ``action`` is FAIL_OVER).
    delay: float = 0.0

    # -- before an attempt -------------------------------------------------------------
    def is_exhausted(self, now: float) -> bool:
        """Whether the deadline has passed at ``now`` (no attempt may start then)."""
        return self.deadline - now <= 0

    def attempt_timeout(self, now: float) -> float:
        """The timeout of an attempt started at ``now``: the time left, but with several
        endpoints at most half of it (at least 1 s), so that one black-holed member does not
        eat the whole budget."""
        remaining = self.deadline - now
        if self.endpoints == 1:
            return remaining
        return max(min(remaining, 1.0), remaining / 2)

    def raise_exhausted(self, targets: Sequence[str], foreign: Sequence[str]) -> NoReturn:
        """Give up, out of time (:meth:`is_exhausted`): raise the translation of the failure
        last retried after (chained), or "no answer from ``targets``" if none; a
        ClusterMismatchError if the call met or skipped (``foreign``) another cluster's
        member."""
        if self.retried is None:
            raise _with_mismatch(EtcdConnectionError(
                f"etcd {self.method}: no answer from {', '.join(targets)} within the request "
                f"timeout"), self.mismatch, foreign)
        raise _with_mismatch(_transient(translate_rpc_error(self.retried, self.method)),
                             self.mismatch, foreign) from self.retried

    def raise_all_foreign(self, foreign: Sequence[str]) -> NoReturn:
        """Give up, every endpoint left being another cluster's (``foreign``): raise the
        last mismatch met, or a ClusterMismatchError naming them."""
        raise self.mismatch or ClusterMismatchError(
            f"etcd {self.method}: every reachable endpoint is a member of another cluster "
            f"than the store's ({', '.join(foreign)})")

    # -- after a failed attempt ----------------------------------------------------------
    def decide(self, failure: Failure) -> Action:
        """What the rules say about ``failure`` before the clock has its say: FAIL_OVER may
        still become GIVE_UP in :meth:`increment` when the back-off would pass the deadline.
        Pure."""
        if failure is Failure.TOKEN and self.reauthenticate and not self.reauthenticated:
            return Action.REAUTHENTICATE
        if failure not in TRANSPORT_FAILURES or self._refused_everywhere(failure):
            return Action.GIVE_UP
        if self.mode == IDEMPOTENT or failure is Failure.UNSENT:
            return Action.FAIL_OVER
        return Action.GIVE_UP

    def increment(self, error: grpc.RpcError, failure: Failure, now: float,
                  foreign: Sequence[str] = ()) -> Retry:
        """The state after an attempt failed with ``error`` (which means ``failure``, as
        :func:`etcdapi.classify_rpc_error` says) at ``now``: its ``action`` is REAUTHENTICATE
        or FAIL_OVER (with the ``delay`` drawn from the back-off, which ends before the
        deadline). Giving up, raises the error the caller sees, chained from ``error``;
        ``foreign`` (the endpoints known to be other clusters') is named in a connection
        error."""
        action = self.decide(failure)
        if action is Action.REAUTHENTICATE:
            return replace(self, reauthenticated=True, action=action, delay=0.0)
        if action is Action.FAIL_OVER:
            delay = self.backoff.delay(self.attempts)
            if not self.is_exhausted(now + delay):
                return replace(self, attempts=self.attempts + 1, retried=error, action=action,
                               delay=delay, tls_refusals=self.tls_refusals + (
                                   failure in _TLS_FAILURES))
        raise self._final_error(error, failure, foreign) from error

    def skip_foreign(self, mismatch: ClusterMismatchError, *, applied: bool) -> Retry:
        """The state after a member of another cluster was met (``Connection.check_cluster``
        has marked it and moved off it): RETRY_NOW, remembering ``mismatch``. Raises
        ``mismatch`` if that member has ``applied`` the request (it answered a write)."""
        if applied:
            raise mismatch
        return replace(self, mismatch=mismatch, action=Action.RETRY_NOW, delay=0.0)

    def _refused_everywhere(self, failure: Failure) -> bool:
        """Whether ``failure`` is the TLS refusal that makes every endpoint's."""
        return failure in _TLS_FAILURES and self.tls_refusals + 1 >= self.endpoints

    def _final_error(self, error: grpc.RpcError, failure: Failure,
                     foreign: Sequence[str]) -> CachedStoreError:
        """The error to give up with after ``error``: its translation, for a transport
        failure told apart from a certificate problem, with the outcome said unknown for
        an UNSENT_ONLY request that may have been sent, and naming other clusters' members."""
        translated = translate_rpc_error(error, self.method)
        if failure not in TRANSPORT_FAILURES or self._refused_everywhere(failure):
            return translated
        # Out of time (or not retried) before every endpoint refused the handshake: not
        # (yet) a certificate problem.
        translated = _transient(translated)
        if self.mode != IDEMPOTENT and failure is not Failure.UNSENT:
            translated = EtcdConnectionError(
                f"{translated}; the request may or may not have been applied")
        return _with_mismatch(translated, self.mismatch, foreign)
