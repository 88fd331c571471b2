"""The etcd-v3 torchrun rendezvous backend: its CAS semantics on a real etcd, the entry
point, TLS/auth/endpoint parameters, and real ``torchrun`` agents rendezvousing through it."""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous import (
    rendezvous_handler_registry as handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from util import raw_client

from cachedstore import EtcdStore
from cachedstore.server import free_port
from cachedstore.testing import make_tls_files
from cachedstore.torch import (
    EtcdV3RendezvousBackend,
    TorchEtcdStore,
    create_backend,
    create_rdzv_handler,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def etcd_store(etcd, prefix):
    """The EtcdStore of run "run": its prefix is the run's, ``<prefix>run/``."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=f"{prefix}run/") as store:
        yield store


def _instance_of(etcd, run_prefix: str) -> str:
    """The rendezvous instance named in the header of a run's stored state."""
    value = raw_client(etcd).get(f"{run_prefix}state")[0]
    assert value is not None and value.startswith(b"cachedstore-rdzv/1 ")
    return value.split(b"\n", 1)[0].split(b" ", 1)[1].decode()


def _lease_of(etcd, key: str) -> tuple[int, int]:
    """(lease id, granted TTL) of ``key``, read by another client."""
    raw = raw_client(etcd)
    _, meta = raw.get(key)
    info = raw.get_lease_info(meta.lease_id)
    return meta.lease_id, info.grantedTTL


# --------------------------------------------------------------------------- the backend


def test_set_state_is_a_compare_and_swap_on_mod_revision(etcd_store, etcd, prefix):
    backend = EtcdV3RendezvousBackend(etcd_store, "run", ttl=100)
    assert backend.name == "etcd-v3" and backend.key == f"{prefix}run/state".encode()
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"s1")  # no token: only if absent
    assert (state, ok) == (b"s1", True)
    assert backend.set_state(b"other") == (b"s1", token, False)
    state2, token2, ok = backend.set_state(b"s2", token)
    assert ok and state2 == b"s2" and token2 > token
    assert backend.set_state(b"s3", token) == (b"s2", token2, False)  # stale token
    assert backend.set_state(b"s3", "not-a-token") == (b"s2", token2, False)
    assert backend.get_state() == (b"s2", token2)
    # Another agent's write moves the token: ours is stale.
    other = EtcdV3RendezvousBackend(etcd_store, "run", ttl=100)
    assert other.set_state(b"theirs", other.get_state()[1])[2] is True
    value, token3 = backend.get_state()
    assert value == b"theirs" and token3 > token2
    assert backend.set_state(b"mine", token2)[2] is False
    # A value no agent of this backend wrote is torch's RendezvousStateError, left as is.
    raw_client(etcd).put(f"{prefix}run/state", "theirs")
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_state_key_has_a_lease_reused_between_writes_and_regranted_when_lost(
        etcd_store, etcd, prefix):
    backend = EtcdV3RendezvousBackend(etcd_store, "run", ttl=100)
    _, token, _ = backend.set_state(b"s1")
    key = f"{prefix}run/state"
    lease, granted = _lease_of(etcd, key)
    assert granted == math.ceil(1.5 * 100)  # expires ttl..1.5 ttl after the last write
    _, token, _ = backend.set_state(b"s2", token)
    assert _lease_of(etcd, key)[0] == lease  # a heartbeat does not grant a new lease
    raw_client(etcd).revoke_lease(lease)  # the lease vanishes (and the key with it)
    assert backend.get_state() is None
    state, _, ok = backend.set_state(b"s3")
    assert ok and state == b"s3"
    assert _lease_of(etcd, key)[0] not in (0, lease)


def test_default_ttl_is_two_hours_like_torchs_etcd_backend(etcd_store, etcd, prefix):
    backend = EtcdV3RendezvousBackend(etcd_store, "run")
    backend.set_state(b"s")
    assert backend.ttl == 7200
    assert _lease_of(etcd, f"{prefix}run/state")[1] == 3 * 3600


def _params(endpoint: str, run_id: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id,
                                min_nodes=1, max_nodes=2, **conf)


def test_entry_point_registers_the_handler_creator(etcd, prefix, monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    # torchrun registers entry_point.load()(): called bare, the function returns itself.
    assert create_rdzv_handler() is create_rdzv_handler
    run_id = f"job-{secrets.token_hex(4)}"
    handler = handler_registry.create_handler(_params(etcd.endpoint, run_id, prefix=prefix))
    try:
        assert isinstance(handler, DynamicRendezvousHandler)
        assert handler.get_backend() == "etcd-v3"
        assert handler.get_run_id() == run_id
    finally:
        handler.shutdown()
        handler._store.close()  # the agent's store lives until exit otherwise
    assert os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"


def test_rdzv_conf_tls_auth_and_several_endpoints(etcd_factory, tmp_path: Path,
                                                   monkeypatch):
    tls = make_tls_files(tmp_path, client_cert_auth=True)
    server = etcd_factory(tls=tls)
    server.enable_auth("s3cret")
    dead = f"127.0.0.1:{free_port()}"  # first endpoint refuses: the store fails over
    conf = dict(cacert=tls.ca_cert, cert=tls.client_cert, key=tls.client_key, user="root",
                prefix="/secure/rdzv", ttl="60", store_timeout="7", connect_timeout="5")
    endpoints = f"{dead},{server.endpoint}"
    # The password never comes from --rdzv-conf (ps and torchrun's INFO log show it).
    monkeypatch.delenv("CACHEDSTORE_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="CACHEDSTORE_PASSWORD"):
        create_backend(_params(endpoints, "tlsjob", password="s3cret", **conf))
    with pytest.raises(ValueError, match="needs a password"):
        create_backend(_params(endpoints, "tlsjob", **conf))
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    backend, store = create_backend(_params(endpoints, "tlsjob", password_file=str(secret),
                                            **conf))
    store.close()
    monkeypatch.setenv("CACHEDSTORE_PASSWORD", "s3cret")
    backend, store = create_backend(_params(endpoints, "tlsjob", **conf))
    try:
        assert isinstance(store, TorchEtcdStore)
        assert store.prefix == b"/secure/rdzv/tlsjob/"  # run-scoped
        assert store.timeout.total_seconds() == 7
        assert backend.set_state(b"state")[2]
        store.set("MASTER_ADDR", "127.0.0.1")
        got = server.etcdctl("get", "/secure/rdzv/tlsjob/state", "--print-value-only",
                             user="root", password="s3cret").stdout.strip()
        assert got.endswith("\nstate")  # torch's bytes, behind the instance header
        key = f"/secure/rdzv/tlsjob/store/{backend.instance}/MASTER_ADDR"
        assert server.etcdctl("get", key, "--print-value-only", user="root",
                              password="s3cret").stdout.strip() == "127.0.0.1"
    finally:
        store.close()
    assert store.etcd_store.closed  # the rendezvous store owns its connection


# --------------------------------------------------------------------------- torchrun

_WORKER = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist

    marker = sys.argv[1] if len(sys.argv) > 1 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if marker and rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        print("FAILING on purpose", flush=True)
        os._exit(3)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"OK rank={rank} world={world} sum={total.item():g} restart={restart}", flush=True)
    dist.destroy_process_group()
""")


def _run_agents(tmp_path: Path, endpoint: str, run_id: str, rdzv_prefix: str,
                extra: list[str], worker_args: list[str], timeout: float) -> list[str]:
    """Two torchrun agents × two workers on loopback; returns each agent's output. Every
    process is killed if the agents have not exited within ``timeout``."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the handler's own default
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc-per-node=2", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}",
               f"--rdzv-id={run_id}", f"--rdzv-conf=prefix={rdzv_prefix},join_timeout=60",
               "--local-addr=127.0.0.1", "--monitor-interval=0.2", *extra, str(script),
               *worker_args]
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    procs = []
    try:
        for log in logs:
            with open(log, "w") as out:
                procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = [log.read_text() for log in logs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-4000:]
    return outputs


def _ok_lines(outputs: list[str]) -> dict[int, str]:
    found = {}
    # Two workers share their agent's log file, and an unbuffered print() writes its text
    # and its newline separately: one worker's line can land right after another's.
    for m in re.finditer(r"OK rank=(\d) world=4 sum=10 restart=(\d)", "".join(outputs)):
        found[int(m.group(1))] = m.group(2)
    return found


def test_two_agents_two_workers_rendezvous_and_all_reduce(etcd, prefix, tmp_path: Path):
    run_id = f"job-{secrets.token_hex(4)}"
    outputs = _run_agents(tmp_path, etcd.endpoint, run_id, prefix, [], [], timeout=90)
    assert _ok_lines(outputs) == {0: "0", 1: "0", 2: "0", 3: "0"}
    raw = raw_client(etcd)
    state, meta = raw.get(f"{prefix}{run_id}/state")
    assert state and meta.lease_id  # the rendezvous state, on a lease
    # The agents exchanged the workers' master address through the run-scoped store.
    instance = _instance_of(etcd, f"{prefix}{run_id}/")
    master = raw.get(
        f"{prefix}{run_id}/store/{instance}/torch.rendezvous.{run_id}.0/MASTER_ADDR")[0]
    assert master == b"127.0.0.1"


def test_a_failed_worker_restarts_the_group_which_completes(etcd, prefix, tmp_path: Path):
    run_id = f"job-{secrets.token_hex(4)}"
    marker = tmp_path / "failed-once"
    outputs = _run_agents(tmp_path, etcd.endpoint, run_id, prefix, ["--max-restarts=1"],
                          [str(marker)], timeout=100)
    assert marker.exists()
    assert "".join(outputs).count("FAILING on purpose") == 1
    done = _ok_lines(outputs)
    assert sorted(done) == [0, 1, 2, 3]
    assert "1" in done.values()  # the failed agent's workers completed in a restart
    # Round 0 failed, round 1 completed: both went through the etcd store.
    raw = raw_client(etcd)
    instance = _instance_of(etcd, f"{prefix}{run_id}/")
    assert raw.get(
        f"{prefix}{run_id}/store/{instance}/torch.rendezvous.{run_id}.1/MASTER_ADDR")[0]
