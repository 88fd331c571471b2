"""Tests of cachedstore.testing (a cluster, a grpc-proxy, throw-away TLS files) against real
etcd processes, and of its place: the installed library never imports it."""

from __future__ import annotations

import json
import stat
from contextlib import closing
from pathlib import Path

import psutil
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

import cachedstore.server
from cachedstore.testing import GrpcProxy, LocalEtcdCluster, make_tls_files
from tests.test_console import _imports, _imports_of
from tests.util import raw_client

pytestmark = pytest.mark.timeout(60)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_cluster_survives_member_loss() -> None:
    with LocalEtcdCluster(3) as cluster:
        assert len(cluster) == 3 and len(set(cluster.endpoints)) == 3
        leader = cluster.leader()
        assert 0 <= leader < 3
        cluster.members[leader].kill()
        new_leader = cluster.leader(timeout=15)
        assert new_leader != leader
        survivor = cluster.members[(leader + 1) % 3]
        with closing(raw_client(survivor)) as client:
            client.put("/cluster/k", "v")
            assert client.get("/cluster/k")[0] == b"v"
        restarted = cluster.members[leader].restart()
        with closing(raw_client(restarted)) as client:
            assert client.get("/cluster/k")[0] == b"v"
        members = json.loads(cluster.etcdctl("member", "list", "-w", "json").stdout)
        assert len(members["members"]) == 3
    assert all(not m.running for m in cluster.members)


def test_grpc_proxy(etcd, prefix) -> None:
    with GrpcProxy(etcd.endpoints) as proxy:
        assert proxy.endpoint != etcd.endpoint
        with closing(raw_client(proxy)) as client:
            client.put(prefix + "via-proxy", "1")
            assert client.get(prefix + "via-proxy")[0] == b"1"
        with closing(raw_client(etcd)) as direct:
            assert direct.get(prefix + "via-proxy")[0] == b"1"
        assert proxy.etcd_metric("etcd_grpc_proxy_cache_keys_total") >= 0.0
        pid = proxy.pid
    assert pid is not None and _gone(pid)


def test_make_tls_files_writes_a_ca_and_private_keys(tmp_path: Path) -> None:
    files = make_tls_files(tmp_path / "pki", client_cert_auth=True, client_common_name="alice")
    assert files.client_cert_auth and files.ssl_context() is not None
    for key in (files.server_key, files.client_key):
        assert stat.S_IMODE(Path(key).stat().st_mode) == 0o600
    assert files.client_cert is not None
    client = x509.load_pem_x509_certificate(Path(files.client_cert).read_bytes())
    cn = client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert [a.value for a in cn] == ["alice"]
    bare = make_tls_files(tmp_path / "bare")
    assert not bare.client_cert_auth and bare.ca_cert != files.ca_cert


def test_nothing_in_the_library_imports_the_testing_package() -> None:
    graph = _imports()
    assert "cachedstore.testing.cluster" in graph
    importers = {m for m in graph if _imports_of(graph, m, "cachedstore.testing")}
    assert all(m.startswith("cachedstore.testing") for m in importers), importers
    assert not {"GrpcProxy", "LocalEtcdCluster", "make_tls_files"} & set(dir(cachedstore.server))
