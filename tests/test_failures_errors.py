"""How gRPC failures of a connection attempt are classified (pure translation, no etcd):
a handshake cut short is a transport failure to retry, a failed verification a TLSError."""

from __future__ import annotations

import grpc
import pytest

from cachedstore.connection import translate_rpc_error
from cachedstore.errors import EtcdConnectionError, TLSError
from tests.util import FakeRpcError

_PREFIX = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "


@pytest.mark.parametrize(("details", "expected"), [
    # gRPC 1.85's texts, as seen against etcd 3.5 (tests/faults/test_tls_faults.py)
    ("Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
     "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", TLSError),
    ("Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:10000412:SSL "
     "routines:OPENSSL_internal:SSLV3_ALERT_BAD_CERTIFICATE", TLSError),
    ("Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification "
     "Check failed.", TLSError),
    # cut short by the connect deadline over a slow link, or by a closing socket
    ("Handshake read failed (Endpoint closing)", EtcdConnectionError),
    ("Handshake read failed (Socket closed)", EtcdConnectionError),
    ("Failed to connect to remote host: Connection refused", EtcdConnectionError),
])
def test_connect_failures_are_classified(details: str, expected: type) -> None:
    error = translate_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, _PREFIX + details),
                                "range")
    assert type(error) is expected
    if "Hostname" in details:
        assert "hostname mismatch" in str(error)
