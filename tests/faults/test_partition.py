"""A member cut off from its peers, its client port still reachable (issue 14, item 1).

Every peer link of a 3-member cluster runs through this test's proxies
(``LocalEtcdCluster(peer_proxy=...)``). Isolating member ``m`` = its own peer proxy resets
and refuses everything, and the other two drop every connection ``m`` opens (recognised by
etcd's ``X-Server-From`` header). ``m`` keeps answering clients from its own, now frozen,
state: serializable reads, and progress requests of a watch created on it.

The store must stop serving what ``m`` delivered and follow the majority within
:data:`BOUND` seconds (docs/guarantees.md, "A member cut off from its peers").
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cachedstore import EtcdStore
from cachedstore.testing import LocalEtcdCluster

from . import wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(90)

#: etcd's default election timeout (1 s) until ``m`` has no leader, 3 more before it ends
#: require-leader watches, then the failover and resume (measured: ~4.5 s).
BOUND = 8.0


@pytest.fixture
def proxies() -> Iterator[dict[str, FaultProxy]]:
    made: dict[str, FaultProxy] = {}
    yield made
    for proxy in made.values():
        proxy.close()


@pytest.fixture
def cluster(proxies: dict[str, FaultProxy]) -> Iterator[LocalEtcdCluster]:
    def peer_proxy(name: str, upstream: str) -> str:
        old = proxies.pop(name, None)
        if old is not None:  # a port clash restarted the launch with new ports
            old.close()
        proxies[name] = FaultProxy(upstream, max_lifetime=80).start()
        return proxies[name].endpoint

    with LocalEtcdCluster(3, peer_proxy=peer_proxy) as c:
        yield c


@pytest.mark.parametrize("role", ["follower", "leader"])
def test_member_cut_off_from_its_peers_is_abandoned(
        cluster: LocalEtcdCluster, proxies: dict[str, FaultProxy], prefix: str,
        role: str) -> None:
    """A follower cut off loses its leader after one election timeout; a leader steps down
    after one (check-quorum) while the majority elects a new one. Either way the store,
    connected to it, must fail over and serve the majority's writes."""
    leader = cluster.leader()
    cut = leader if role == "leader" else (leader + 1) % 3
    member = cluster.members[cut]
    majority = cluster.members[(cut + 1) % 3]
    member_id = format(int(member.status()["header"]["member_id"]), "x")
    endpoints = [member.endpoint] + [m.endpoint for i, m in enumerate(cluster.members)
                                     if i != cut]
    with EtcdStore(endpoints=endpoints, prefix=prefix, request_timeout=10.0,
                   connect_timeout=5.0) as store:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        assert store.stats()["watch_up"]

        proxies[member.name].reset(refuse=True)
        for name, proxy in proxies.items():
            if name != member.name:
                proxy.block_origin(member_id)
        started = time.monotonic()

        def put(name: str, value: str) -> bool:  # fails while the majority elects a leader
            return majority.etcdctl("--command-timeout=1s", "put", prefix + name, value,
                                    check=False).returncode == 0

        wait_until(lambda: put("k", "v2"), BOUND, "the majority to accept a write")
        assert put("new", "n1")
        # The cut member really is cut off: it still holds v1.
        stale = member.etcdctl("get", "--consistency=s", "--print-value-only", prefix + "k")
        assert stale.stdout.strip() == "v1"

        assert store.get("new", timeout=BOUND) == b"n1"  # a blocking get of a new key
        wait_until(lambda: store.get("k") == b"v2", BOUND - (time.monotonic() - started),
                   "the store to stop serving v1 and see v2")
        took = time.monotonic() - started
        print(f"partitioned {role} abandoned after {took:.2f} s")
        assert store.stats()["watch_up"]
