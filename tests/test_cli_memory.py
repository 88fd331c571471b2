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
    proc = subprocess.Popen([sys.executable, "-m", "cachedstore", "get", "small",
                             "--endpoints", server.endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    try:
        # wait4: the rusage of this pid alone (its output is far below a pipe's buffer)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
        proc.communicate()
    assert (proc.returncode, out, err) == (0, b"tiny value\n", b"")
    peak_rss = usage.ru_maxrss * 1024  # kilobytes on Linux
    assert peak_rss < RSS_LIMIT_BYTES, f"peak RSS {peak_rss / 2**20:.0f} MiB"
    # etcd's view: exactly one Range for the get, no preload, no watch stream
    after = _handled(server)
    assert {m: after[m] - before[m] for m in before} == {
        "Range": 1.0, "Txn": 0.0, "Watch": 0.0, "Put": 0.0}
