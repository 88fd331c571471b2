"""The CLI's one-shot commands use a plain client: a large keyspace costs them nothing.

200 values of 512 KiB (100 MiB) sit in etcd outside any prefix; ``cachedstore get small``
with the default prefix (the whole keyspace) must read one key, not preload the 100 MiB
nor watch them. Checked two ways: the command's peak RSS (``wait4``'s rusage of that very
process) and etcd's own count of the requests it handled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachedstore.client import EtcdClient
from cachedstore.config import StoreConfig
from cachedstore.connection import Credentials
from cachedstore.metrics import NullMetrics
from cachedstore.server import LocalEtcd

pytestmark = pytest.mark.timeout(120)

VALUES = 200
VALUE_BYTES = 512 * 1024
#: Generous: the interpreter with cachedstore imported is ~45 MB; the cached store that
#: preloaded the whole keyspace peaked at ~355 MB.
RSS_LIMIT_BYTES = 150 * 1024 * 1024
#: Big enough for 100 MiB of values plus etcd's own overhead.
QUOTA_BYTES = 1024 * 1024 * 1024


def _handled(server: LocalEtcd) -> dict[str, float]:
    return {method: server.etcd_metric("grpc_server_handled_total",
                                       {"grpc_method": method})
            for method in ("Range", "Txn", "Watch", "Put")}


def test_get_with_the_default_prefix_reads_one_key(etcd_factory) -> None:
    server = etcd_factory(extra_args=[f"--quota-backend-bytes={QUOTA_BYTES}"])
    with EtcdClient([server.endpoint], Credentials(), StoreConfig(), NullMetrics(),
                    "") as client:
        for i in range(VALUES):
            client.set(f"/big/{i:03d}", os.urandom(VALUE_BYTES))
        client.set("small", "tiny value")
        assert client.count() == VALUES + 1
    before = _handled(server)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEDSTORE_")}
    # Linux keeps a process's peak RSS across exec, so a child forked from this (large)
    # test process would report our size: measure it from a small launcher instead, as
    # the peak RSS of the launcher's only child.
    launcher = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True)\n"
        "sys.stdout.buffer.write(done.stdout)\n"
        "sys.stderr.buffer.write(done.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(done.returncode)\n")
    proc = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "cachedstore",
                           "get", "small", "--endpoints", server.endpoint],
                          capture_output=True, env=env, timeout=60)
    out, err_lines = proc.stdout, proc.stderr.splitlines()
    err = b"\n".join(err_lines[:-1])
    peak_rss = int(err_lines[-1]) * 1024  # kilobytes on Linux
    assert (proc.returncode, out, err) == (0, b"tiny value\n", b"")
    assert peak_rss < RSS_LIMIT_BYTES, f"peak RSS {peak_rss / 2**20:.0f} MiB"
    # etcd's view: exactly one Range for the get, no preload, no watch stream
    after = _handled(server)
    assert {m: after[m] - before[m] for m in before} == {
        "Range": 1.0, "Txn": 0.0, "Watch": 0.0, "Put": 0.0}
