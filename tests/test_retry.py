"""The retry policy of ``Connection.call`` as a value, and the table from gRPC failures to
the errors a caller sees (``cachedstore/retry.py``): pure, no etcd, no clock, no sleeps.
Each decision is checked on fake gRPC errors: retry on the next endpoint, re-authenticate
once, give up at the deadline, unsent-only versus idempotent, TLS refused everywhere."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

import cachedstore
from cachedstore import errors, queues
from cachedstore.config import Backoff
from cachedstore.errors import (
    AuthenticationError,
    CachedStoreError,
    ClusterMismatchError,
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionError,
    InvalidInputError,
    KeyNotFoundError,
    LeaseNotFoundError,
    QueueEmptyError,
    TLSError,
)
from cachedstore.etcdapi import TRANSPORT_FAILURES, Failure, classify_rpc_error
from cachedstore.retry import IDEMPOTENT, UNSENT_ONLY, Action, Retry, translate_rpc_error
from tests.util import FakeRpcError

Code = grpc.StatusCode
#: Waits of 0.1, 0.2, 0.4, 0.4... s: no jitter, so every delay is known.
BACKOFF = Backoff(initial=0.1, maximum=0.4, multiplier=2.0, jitter=0.0)
NOW = 100.0

REFUSED = FakeRpcError(Code.UNAVAILABLE, "failed to connect to all addresses; last error: "
                                         "UNKNOWN: ipv4:127.0.0.1:2379: Connection refused")
DROPPED = FakeRpcError(Code.UNAVAILABLE, "Socket closed")
LATE = FakeRpcError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded")
NO_LEADER = FakeRpcError(Code.UNAVAILABLE, "etcdserver: no leader")
BAD_CERT = FakeRpcError(Code.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED")
EXPIRED = FakeRpcError(Code.UNAUTHENTICATED, "etcdserver: invalid auth token")
DENIED = FakeRpcError(Code.PERMISSION_DENIED, "etcdserver: permission denied")


def failure_of(error: grpc.RpcError) -> Failure:
    return classify_rpc_error(error)[0]


def policy(**fields: object) -> Retry:
    """A fresh call's policy: ``range``, 10 s to go, one endpoint, unless told otherwise."""
    values: dict[str, object] = {"method": "range", "deadline": NOW + 10.0,
                                 "backoff": BACKOFF}
    values.update(fields)
    return Retry(**values)  # type: ignore[arg-type]


def after(state: Retry, error: grpc.RpcError, now: float = NOW,
          foreign: tuple[str, ...] = ()) -> Retry:
    return state.increment(error, failure_of(error), now, foreign)


def give_up(state: Retry, error: grpc.RpcError, now: float = NOW,
            foreign: tuple[str, ...] = ()) -> CachedStoreError:
    """The error ``state`` gives up with after ``error``, checked to be chained from it."""
    with pytest.raises(CachedStoreError) as caught:
        after(state, error, now, foreign)
    assert caught.value.__cause__ is error
    return caught.value


def mismatch() -> ClusterMismatchError:
    return ClusterMismatchError("etcd endpoint b:2379 is a member of another cluster")


# -- before an attempt ------------------------------------------------------------------------
def test_the_deadline_is_exhausted_once_reached() -> None:
    state = policy()
    assert not state.is_exhausted(NOW)
    assert not state.is_exhausted(NOW + 9.999)
    assert state.is_exhausted(NOW + 10.0)
    assert state.is_exhausted(NOW + 11.0)


@pytest.mark.parametrize(("endpoints", "left", "timeout"), [
    (1, 10.0, 10.0),  # one endpoint: all the time left
    (1, 0.3, 0.3),
    (3, 10.0, 5.0),  # several: half of it, so that a black-holed member leaves time
    (3, 1.6, 1.0),  # ... but at least 1 s
    (3, 0.3, 0.3),  # ... and never more than is left
])
def test_an_attempt_gets_the_time_left_or_half_of_it_with_several_endpoints(
        endpoints: int, left: float, timeout: float) -> None:
    state = policy(endpoints=endpoints, deadline=NOW + left)
    assert state.attempt_timeout(NOW) == pytest.approx(timeout)


def test_out_of_time_without_a_retried_failure_says_no_answer() -> None:
    with pytest.raises(EtcdConnectionError) as caught:
        policy().raise_exhausted(["a:2379", "b:2379"], [])
    assert type(caught.value) is EtcdConnectionError
    assert str(caught.value) == ("etcd range: no answer from a:2379, b:2379 within the "
                                 "request timeout")


def test_out_of_time_after_a_retried_failure_reports_that_failure() -> None:
    retried = after(policy(), REFUSED)
    with pytest.raises(EtcdConnectionError, match="etcd range: etcd unreachable") as caught:
        retried.raise_exhausted(["a:2379"], [])
    assert caught.value.__cause__ is REFUSED
    assert "no answer" not in str(caught.value)


def test_out_of_time_after_a_tls_refusal_is_not_a_certificate_error() -> None:
    retried = after(policy(endpoints=2), BAD_CERT)
    with pytest.raises(EtcdConnectionError, match="TLS handshake") as caught:
        retried.raise_exhausted(["a:2379", "b:2379"], [])
    assert not isinstance(caught.value, TLSError)


def test_out_of_time_names_other_clusters_members() -> None:
    with pytest.raises(ClusterMismatchError) as caught:
        policy().raise_exhausted(["a:2379", "b:2379"], ["b:2379"])
    assert str(caught.value).endswith(
        "; and b:2379 is a member of another cluster and not used")
    met = policy().skip_foreign(mismatch(), applied=False)
    with pytest.raises(ClusterMismatchError) as caught:
        met.raise_exhausted(["a:2379", "b:2379"], ["b:2379"])
    assert str(caught.value).endswith(f"; and {mismatch()}")


def test_every_endpoint_foreign_gives_up_with_the_mismatch_met() -> None:
    with pytest.raises(ClusterMismatchError, match="every reachable endpoint is a member of "
                       r"another cluster than the store's \(a:2379, b:2379\)"):
        policy().raise_all_foreign(["a:2379", "b:2379"])
    met = mismatch()
    with pytest.raises(ClusterMismatchError) as caught:
        policy().skip_foreign(met, applied=False).raise_all_foreign(["b:2379"])
    assert caught.value is met


# -- after a failed attempt: fail over ----------------------------------------------------------
@pytest.mark.parametrize("error", [REFUSED, DROPPED, LATE, NO_LEADER])
def test_a_transport_failure_fails_over_after_a_back_off(error: grpc.RpcError) -> None:
    first = policy(endpoints=3)
    second = after(first, error)
    assert second.action is Action.FAIL_OVER
    assert (second.delay, second.attempts, second.retried) == (0.1, 1, error)
    third = after(second, error)
    assert (third.action, third.delay, third.attempts) == (Action.FAIL_OVER, 0.2, 2)
    assert (first.action, first.attempts, first.retried) == (None, 0, None)  # unchanged


def test_back_offs_grow_to_their_cap() -> None:
    state = policy()
    delays = []
    for _ in range(5):
        state = after(state, REFUSED)
        delays.append(state.delay)
    assert delays == [0.1, 0.2, 0.4, 0.4, 0.4]


def test_a_back_off_that_would_pass_the_deadline_gives_up() -> None:
    state = policy(deadline=NOW + 0.1)  # the first wait, 0.1 s, ends at the deadline
    error = give_up(state, REFUSED)
    assert type(error) is EtcdConnectionError
    assert str(error).startswith("etcd range: etcd unreachable (UNAVAILABLE: failed to")
    assert after(policy(deadline=NOW + 0.11), REFUSED).action is Action.FAIL_OVER


def test_giving_up_names_other_clusters_members() -> None:
    met = policy(deadline=NOW).skip_foreign(mismatch(), applied=False)
    error = give_up(met, REFUSED)
    assert type(error) is ClusterMismatchError
    assert str(error).endswith(f"; and {mismatch()}")
    error = give_up(policy(deadline=NOW), REFUSED, foreign=("b:2379", "c:2379"))
    assert str(error).endswith("; and b:2379, c:2379 are members of another cluster and "
                               "not used")


# -- unsent-only versus idempotent --------------------------------------------------------------
def test_an_unsent_only_request_is_retried_when_it_cannot_have_reached_etcd() -> None:
    state = after(policy(mode=UNSENT_ONLY), REFUSED)
    assert (state.action, state.delay) == (Action.FAIL_OVER, 0.1)


@pytest.mark.parametrize("error", [DROPPED, LATE, NO_LEADER])
def test_an_unsent_only_request_that_may_have_been_sent_is_not_retried(
        error: grpc.RpcError) -> None:
    assert policy(mode=UNSENT_ONLY).decide(failure_of(error)) is Action.GIVE_UP
    assert policy(mode=IDEMPOTENT).decide(failure_of(error)) is Action.FAIL_OVER
    given_up = give_up(policy(mode=UNSENT_ONLY, endpoints=3), error)
    assert type(given_up) is EtcdConnectionError
    assert str(given_up).endswith("; the request may or may not have been applied")


def test_an_unsent_only_request_out_of_time_was_not_applied() -> None:
    error = give_up(policy(mode=UNSENT_ONLY, deadline=NOW), REFUSED)
    assert "may or may not" not in str(error)


def test_an_unsent_only_request_draws_no_back_off_it_will_not_wait() -> None:
    class Counting(Backoff):
        draws = 0

        def delay(self, attempt: int, rng: object = None) -> float:
            type(self).draws += 1
            return 0.1

    give_up(policy(mode=UNSENT_ONLY, backoff=Counting()), DROPPED)
    assert Counting.draws == 0
    after(policy(mode=UNSENT_ONLY, backoff=Counting()), REFUSED)
    assert Counting.draws == 1


# -- re-authenticate once -----------------------------------------------------------------------
def test_an_invalid_token_re_authenticates_once() -> None:
    state = after(policy(reauthenticate=True), EXPIRED)
    assert (state.action, state.delay, state.reauthenticated) == (
        Action.REAUTHENTICATE, 0.0, True)
    assert state.attempts == 0  # no back-off: at once
    error = give_up(state, EXPIRED)
    assert type(error) is AuthenticationError
    assert str(error) == ("etcd range: etcdserver: invalid auth token (are user and password "
                          "set?)")


def test_an_invalid_token_without_credentials_gives_up() -> None:
    assert type(give_up(policy(reauthenticate=False), EXPIRED)) is AuthenticationError


def test_a_failover_does_not_spend_the_re_authentication() -> None:
    state = after(after(policy(reauthenticate=True), REFUSED), EXPIRED)
    assert state.action is Action.REAUTHENTICATE
    assert state.attempts == 1 and state.retried is REFUSED


# -- TLS ----------------------------------------------------------------------------------------
def test_a_tls_refusal_by_every_endpoint_gives_up_at_once() -> None:
    error = give_up(policy(), BAD_CERT)  # one endpoint, ten seconds left
    assert type(error) is TLSError
    state = after(policy(endpoints=2), BAD_CERT)
    assert (state.action, state.tls_refusals) == (Action.FAIL_OVER, 1)
    assert type(give_up(state, BAD_CERT)) is TLSError


def test_a_tls_refusal_by_some_endpoints_is_a_transport_failure() -> None:
    state = after(after(policy(endpoints=3), BAD_CERT), REFUSED)
    assert (state.action, state.tls_refusals) == (Action.FAIL_OVER, 1)
    error = give_up(dataclasses.replace(state, deadline=NOW), BAD_CERT)
    assert type(error) is EtcdConnectionError
    assert "TLS handshake with etcd failed" in str(error)


def test_a_tls_refusal_of_an_unsent_only_request_is_not_retried() -> None:
    # As before the policy became a value: only Failure.UNSENT counts as not sent.
    error = give_up(policy(mode=UNSENT_ONLY, endpoints=2), BAD_CERT)
    assert type(error) is EtcdConnectionError
    assert str(error).endswith("; the request may or may not have been applied")


# -- other failures -----------------------------------------------------------------------------
def test_any_other_failure_gives_up_at_once_with_its_translation() -> None:
    assert policy().decide(failure_of(DENIED)) is Action.GIVE_UP
    error = give_up(policy(), DENIED)
    assert type(error) is EtcdPermissionError
    assert str(error) == "etcd range: etcdserver: permission denied"


def test_every_transport_failure_fails_over_while_time_allows() -> None:
    for failure in Failure:
        decision = policy(endpoints=2).decide(failure)
        assert (decision is Action.FAIL_OVER) == (failure in TRANSPORT_FAILURES)


# -- members of another cluster -----------------------------------------------------------------
def test_a_member_of_another_cluster_is_skipped_at_once() -> None:
    met = mismatch()
    state = policy().skip_foreign(met, applied=False)
    assert (state.action, state.delay, state.mismatch, state.attempts) == (
        Action.RETRY_NOW, 0.0, met, 0)


def test_a_write_answered_by_a_member_of_another_cluster_gives_up() -> None:
    met = mismatch()
    with pytest.raises(ClusterMismatchError) as caught:
        policy(method="put").skip_foreign(met, applied=True)
    assert caught.value is met


def test_the_policy_is_a_value() -> None:
    state = policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.attempts = 3  # type: ignore[misc]
    assert after(state, REFUSED) == after(state, REFUSED)
    assert state == policy()


# -- the error table ------------------------------------------------------------------------------
class _CodelessError(grpc.RpcError):
    """A gRPC error without a status code (a channel failing under the call)."""


ROWS = [
    (Code.UNAVAILABLE, "Custom verification check failed with error: UNAUTHENTICATED: "
     "Hostname Verification Check failed.", Failure.TLS_HOSTNAME, TLSError,
     "etcd range: TLS handshake with etcd failed: the server's certificate is not valid for "
     "the host name or address the store connected to (hostname mismatch: Custom "
     "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check "
     "failed.); use a name listed in the certificate's subject alternative names"),
    (Code.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED", Failure.TLS,
     TLSError, "etcd range: TLS handshake with etcd failed (Ssl handshake failed: "
     "CERTIFICATE_VERIFY_FAILED); check ca_cert and the server's certificate"),
    (Code.UNAVAILABLE, "Handshake read failed (Socket closed)", Failure.HANDSHAKE_CUT,
     EtcdConnectionError, "etcd range: etcd unreachable: the TLS handshake did not complete "
     "(UNAVAILABLE: Handshake read failed (Socket closed)); is the server serving TLS on "
     "this port?"),
    (Code.UNAVAILABLE, "failed to connect to all addresses", Failure.UNSENT,
     EtcdConnectionError, "etcd range: etcd unreachable (UNAVAILABLE: failed to connect to "
     "all addresses)"),
    (Code.DEADLINE_EXCEEDED, "Deadline Exceeded", Failure.TRANSPORT, EtcdConnectionError,
     "etcd range: etcd unreachable (DEADLINE_EXCEEDED: Deadline Exceeded)"),
    (Code.UNKNOWN, "context deadline exceeded", Failure.TRANSPORT, EtcdConnectionError,
     "etcd range: etcd unreachable (UNKNOWN: context deadline exceeded)"),
    (Code.UNAVAILABLE, "etcdserver: no leader", Failure.NO_LEADER, EtcdConnectionError,
     "etcd range: etcd unreachable (UNAVAILABLE: etcdserver: no leader)"),
    (Code.PERMISSION_DENIED, "etcdserver: permission denied", Failure.PERMISSION,
     EtcdPermissionError, "etcd range: etcdserver: permission denied"),
    (Code.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password",
     Failure.AUTH_FAILED, AuthenticationError,
     "etcd range: etcdserver: authentication failed, invalid user ID or password"),
    (Code.FAILED_PRECONDITION, "etcdserver: authentication is not enabled",
     Failure.AUTH_NOT_ENABLED, AuthenticationError,
     "etcd range: credentials given but etcdserver: authentication is not enabled"),
    (Code.UNAUTHENTICATED, "etcdserver: invalid auth token", Failure.TOKEN,
     AuthenticationError,
     "etcd range: etcdserver: invalid auth token (are user and password set?)"),
    (Code.INVALID_ARGUMENT, "etcdserver: user name is empty", Failure.TOKEN,
     AuthenticationError, "etcd range: etcdserver: user name is empty (are user and password "
     "set?)"),
    (Code.INVALID_ARGUMENT, "etcdserver: request is too large", Failure.TOO_LARGE,
     InvalidInputError, "etcd range: etcdserver: request is too large"),
    (Code.RESOURCE_EXHAUSTED, "grpc: received message larger than max", Failure.TOO_LARGE,
     InvalidInputError, "etcd range: grpc: received message larger than max"),
    (Code.NOT_FOUND, "etcdserver: requested lease not found", Failure.LEASE_NOT_FOUND,
     LeaseNotFoundError, "etcd range: etcdserver: requested lease not found"),
    (Code.CANCELLED, "Received RST_STREAM with error code 8", Failure.CANCELLED,
     EtcdConnectionError, "etcd range: cancelled by etcd or a proxy (Received RST_STREAM "
     "with error code 8)"),
    (Code.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted",
     Failure.COMPACTED, EtcdError, "etcd range: OUT_OF_RANGE: etcdserver: mvcc: required "
     "revision has been compacted"),
    (Code.INTERNAL, "something odd", Failure.OTHER, EtcdError,
     "etcd range: INTERNAL: something odd"),
]


@pytest.mark.parametrize(("code", "details", "failure", "expected", "message"), ROWS)
def test_every_row_of_the_error_table(code: grpc.StatusCode, details: str, failure: Failure,
                                      expected: type, message: str) -> None:
    error = FakeRpcError(code, details)
    assert failure_of(error) is failure
    translated = translate_rpc_error(error, "range")
    assert type(translated) is expected
    assert str(translated) == message


def test_the_rows_cover_every_failure() -> None:
    assert {row[2] for row in ROWS} == set(Failure)


def test_an_error_without_a_status_code_is_named_by_its_type() -> None:
    translated = translate_rpc_error(_CodelessError(), "txn")
    assert type(translated) is EtcdError
    assert str(translated) == "etcd txn: _CodelessError: "


def test_details_with_braces_are_kept_as_they_are() -> None:
    translated = translate_rpc_error(FakeRpcError(Code.INTERNAL, "bad {key} {0}"), "put")
    assert str(translated) == "etcd put: INTERNAL: bad {key} {0}"


def test_the_connection_layer_still_exports_the_translation() -> None:
    from cachedstore import connection

    assert connection.translate_rpc_error is translate_rpc_error
    assert (connection.IDEMPOTENT, connection.UNSENT_ONLY) == (IDEMPOTENT, UNSENT_ONLY)


# -- QueueEmptyError in the tree ------------------------------------------------------------------
def test_queue_empty_error_is_in_the_error_tree() -> None:
    assert issubclass(QueueEmptyError, KeyNotFoundError)
    assert issubclass(QueueEmptyError, KeyError)
    assert issubclass(QueueEmptyError, CachedStoreError)
    assert queues.QueueEmptyError is QueueEmptyError is cachedstore.QueueEmptyError
    assert "QueueEmptyError" in errors.__all__
    assert str(QueueEmptyError("jobs")) == "queue is empty: 'jobs'"
