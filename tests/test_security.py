"""Security: TLS (CA bundle, client certificates), etcd RBAC confined to a prefix, wrong
credentials, untrusted servers -- and no credential, key name or value leaking into logs,
exceptions, ``repr`` or metrics."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faults import follows_by_watch, restarts, wait_until
from faults.proxy import FaultProxy
from prometheus_client import generate_latest

from cachedstore import (
    AuthenticationError,
    EtcdConnectionError,
    EtcdPermissionError,
    EtcdStore,
    TLSError,
)
from cachedstore.server import LocalEtcd, TLSFiles
from cachedstore.testing import make_tls_files

pytestmark = pytest.mark.timeout(90)

ROOT_PASSWORD = "R00t-only-for-setup-q8"
ALICE_PASSWORD = "Al1ce-S3cret-zq7W"  # distinctive, so a leak anywhere is found by search


def _exercise(store: EtcdStore, put: Callable[[str], object]) -> None:
    """Reads, writes, CAS, counters, deletes, blocking waits, and the watch."""
    store.set("k", "v1")
    assert store.get("k") == b"v1" and store.mget(["k", "none"], default=None) == [b"v1", None]
    assert store.add("n", 5) == 5 and store.add("n", 1) == 6
    assert store.compare_set("k", "v1", "v2") == b"v2"
    assert store.check(["k", "n"]) and store.num_keys() == 2
    store.wait(["k"], timeout=5)
    follows_by_watch(store, put, "k", b"v2", "from-another-client")
    assert store.delete("n") and store.get("n", None) is None


# ------------------------------------------------------------------------------ TLS


@pytest.fixture
def tls_server(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path,
               request: pytest.FixtureRequest) -> tuple[LocalEtcd, TLSFiles]:
    files = make_tls_files(tmp_path / "pki", client_cert_auth=request.param)
    return etcd_factory(tls=files), files


@pytest.mark.parametrize("tls_server", [False, True], ids=["ca-bundle", "client-cert"],
                         indirect=True)
def test_tls(tls_server: tuple[LocalEtcd, TLSFiles], prefix: str) -> None:
    server, files = tls_server
    client_cert = {"cert_key": files.client_key, "cert_cert": files.client_cert} \
        if files.client_cert_auth else {}

    def put(value: str) -> None:
        server.etcdctl("put", prefix + "k", value)

    with EtcdStore(endpoints=[server.endpoint], prefix=prefix, ca_cert=files.ca_cert,
                   **client_cert) as store:  # type: ignore[arg-type]
        _exercise(store, put)
    if files.client_cert_auth:  # the same CA, but no client certificate: refused, promptly
        started = time.monotonic()
        with pytest.raises(EtcdConnectionError):
            EtcdStore(endpoints=[server.endpoint], prefix=prefix, ca_cert=files.ca_cert,
                      connect_timeout=2.0)
        assert time.monotonic() - started < 2.0 + 1.0


def test_untrusted_server_certificate(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path,
                                      prefix: str) -> None:
    """A server whose certificate is not signed by the CA we trust: a clear TLSError (an
    EtcdConnectionError) within connect_timeout, never a connection."""
    server = etcd_factory(tls=make_tls_files(tmp_path / "server-pki"))
    stranger = make_tls_files(tmp_path / "other-pki")
    started = time.monotonic()
    with pytest.raises(EtcdConnectionError) as info:
        EtcdStore(endpoints=[server.endpoint], prefix=prefix, ca_cert=stranger.ca_cert,
                  connect_timeout=10.0)
    elapsed = time.monotonic() - started
    assert elapsed < 5.0  # a refused handshake is not retried until the deadline
    assert isinstance(info.value, TLSError), repr(info.value)
    message = str(info.value).lower()
    assert "tls" in message and ("certificate" in message or "ca_cert" in message)
    # Plain text to a TLS port fails too, just as promptly.
    with pytest.raises(EtcdConnectionError):
        EtcdStore(endpoints=[server.endpoint], prefix=prefix, connect_timeout=2.0)


# ------------------------------------------------------------------------------ RBAC


@pytest.fixture
def rbac_server(etcd_factory: Callable[..., LocalEtcd]) -> Iterator[LocalEtcd]:
    """etcd with auth on: user ``alice`` whose only role, ``jobA``, covers ``/jobA/``."""
    server = etcd_factory()
    server.etcdctl("role", "add", "jobA")
    server.etcdctl("role", "grant-permission", "jobA", "--prefix=true", "readwrite", "/jobA/")
    server.etcdctl("user", "add", "alice", "--interactive=false", input=ALICE_PASSWORD + "\n")
    server.etcdctl("user", "grant-role", "alice", "jobA")
    server.enable_auth(ROOT_PASSWORD)
    yield server


def _root_put(server: LocalEtcd, key: str) -> Callable[[str], object]:
    return lambda value: server.etcdctl("put", key, value, user="root",
                                        password=ROOT_PASSWORD)


def test_rbac_user_confined_to_its_prefix(rbac_server: LocalEtcd) -> None:
    server = rbac_server
    with EtcdStore(endpoints=[server.endpoint], prefix="/jobA/", user="alice",
                   password=ALICE_PASSWORD) as store:
        _exercise(store, _root_put(server, "/jobA/k"))
        assert store.watch_healthy and restarts(store, "auth") == 0
    for other in ("/jobB/", "", "/job", "/jobA"):  # /jobA (no slash) also covers /jobAB...
        with pytest.raises(PermissionError) as info:
            EtcdStore(endpoints=[server.endpoint], prefix=other, user="alice",
                      password=ALICE_PASSWORD)
        assert isinstance(info.value, EtcdPermissionError)


@pytest.mark.parametrize("user,password", [("alice", "wrong-password"),
                                           ("mallory", ALICE_PASSWORD)])
def test_wrong_credentials_fail_promptly(rbac_server: LocalEtcd, user: str, password: str
                                         ) -> None:
    request_timeout = 5.0
    started = time.monotonic()
    with pytest.raises(AuthenticationError) as info:
        EtcdStore(endpoints=[rbac_server.endpoint], prefix="/jobA/", user=user,
                  password=password, request_timeout=request_timeout)
    assert time.monotonic() - started < request_timeout
    assert isinstance(info.value, PermissionError)
    with pytest.raises(AuthenticationError):  # no credentials at all on an auth cluster
        EtcdStore(endpoints=[rbac_server.endpoint], prefix="/jobA/")


# ------------------------------------------------------------------------------ leaks


def test_no_secret_or_key_leaks(rbac_server: LocalEtcd, caplog: pytest.LogCaptureFixture,
                                capfd: pytest.CaptureFixture[str]) -> None:
    """The password and the auth token appear in no log record (DEBUG, any logger), no
    output of the process (gRPC's C core included), no exception (with its chain), no
    repr, no stats and no metric; key names, values and the prefix never in metrics."""
    caplog.set_level(logging.DEBUG)
    server = rbac_server
    texts: list[str] = []

    def record(exc: BaseException) -> None:
        texts.append("".join(traceback.format_exception(exc)))
        texts.append(repr(exc))

    # Failures that carry server messages.
    for password in ("wrong-" + ALICE_PASSWORD[::-1], ALICE_PASSWORD):
        for prefix in ("/jobA/", "/jobB/"):
            try:
                EtcdStore(endpoints=[server.endpoint], prefix=prefix, user="alice",
                          password=password, request_timeout=3)
            except PermissionError as exc:
                record(exc)
    assert len(texts) == 6  # three refusals (the good password on /jobA/ succeeded)
    # A working store, a watch restart (logged), metrics with distinctive keys and values.
    secret_name, secret_value = "leak-name-Xq1", "leak-value-Vz2"
    with FaultProxy(server.endpoint) as proxy, EtcdStore(
            endpoints=[proxy.endpoint], prefix="/jobA/", user="alice",
            password=ALICE_PASSWORD) as store:
        store.set(secret_name, secret_value)
        assert store.get(secret_name) == secret_value.encode()
        assert store.mget([secret_name, secret_name + "-absent"], default=None)[0]
        store.add(secret_name + "-n", 3)
        store.compare_set(secret_name, secret_value, secret_value + "2")
        store.delete(secret_name + "-n")
        proxy.reset()
        wait_until(lambda: restarts(store, "disconnect") >= 1 and store.watch_healthy, 10,
                   "a logged watch restart")
        try:
            store.get(secret_name + "-later", timeout=0.05)
        except TimeoutError as exc:
            record(exc)
        token = store._conn.metadata()
        assert token, "the store should hold an auth token"
        secrets = [ALICE_PASSWORD, token[0][1]]
        texts += [repr(store), str(store.stats()), repr(store.config), repr(store._conn._credentials)]
        registry = store.registry
        assert registry is not None
        metrics = generate_latest(registry).decode()
    out, err = capfd.readouterr()
    texts += [caplog.text, out, err, metrics]
    texts += [r.getMessage() for r in caplog.records]
    assert any("restarting" in r.getMessage() for r in caplog.records)  # logs were captured
    for text in texts:
        for secret in secrets:
            assert secret not in text
    for leak in (secret_name, secret_value, "/jobA/", "jobA"):
        assert leak not in metrics, f"{leak!r} in a metric"
