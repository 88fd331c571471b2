"""The etcd-v3 rendezvous backend's guards: reruns of an --rdzv-id never see the previous
run's store keys (issue 14 item 5), and every --rdzv-conf value and the run id are checked
at creation (item 8). Real etcd, real torch DynamicRendezvousHandler."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from util import raw_client

from cachedstore import EtcdStore
from cachedstore.server import free_port
from cachedstore.torch import EtcdV3RendezvousBackend, create_rdzv_handler
from cachedstore.torch.rendezvous import LIMITS

pytestmark = pytest.mark.timeout(120)


def _params(endpoint: str, run_id: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id,
                                min_nodes=1, max_nodes=1, **conf)


def _one_node_run(etcd, prefix: str, run_id: str, marker: str | None):
    """One agent's whole rendezvous: returns (instance, the worker store's view of
    ``marker`` before setting it). The handler is shut down and its store closed."""
    handler = create_rdzv_handler(_params(etcd.endpoint, run_id, prefix=prefix,
                                          store_timeout="5", join_timeout="30"))
    try:
        info = handler.next_rendezvous()
        store = info.store  # torch's PrefixStore("torch.rendezvous.<run>.<round>", ours)
        seen = store.check(["run-marker"])
        if marker is not None:
            store.set("run-marker", marker)
        value = raw_client(etcd).get(f"{prefix}{run_id}/state")[0]
        return value.split(b"\n", 1)[0].split(b" ", 1)[1].decode(), seen
    finally:
        handler.shutdown()
        handler._store.close()


def test_a_rerun_with_the_same_run_id_does_not_see_the_previous_runs_keys(etcd, prefix):
    run_prefix = f"{prefix}job/"
    first, seen = _one_node_run(etcd, prefix, "job", "from-run-1")
    assert not seen
    # The first run is over; its state expires with its lease (here: revoked at once).
    raw = raw_client(etcd)
    _, meta = raw.get(f"{run_prefix}state")
    raw.revoke_lease(meta.lease_id)
    assert raw.get(f"{run_prefix}state")[0] is None
    second, seen = _one_node_run(etcd, prefix, "job", None)
    assert second != first
    assert not seen  # round 0 again, yet run 1's keys are not this run's keys
    # They are still in etcd, under the first instance: scoping is what hides them.
    old = raw.get(f"{run_prefix}store/{first}/torch.rendezvous.job.0/run-marker")[0]
    assert old == b"from-run-1"


def test_the_instance_survives_every_write_of_one_rendezvous(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=f"{prefix}r/") as store:
        a = EtcdV3RendezvousBackend(store, "r", ttl=60)
        b = EtcdV3RendezvousBackend(store, "r", ttl=60)  # another agent, same run
        with pytest.raises(dist.DistStoreError, match="before a rendezvous"):
            a.store_scope()
        _, token, _ = a.set_state(b"s1")
        state, token_b = b.get_state()
        assert state == b"s1" and b.instance == a.instance
        _, token2, ok = b.set_state(b"s2", token_b)  # b's write carries a's instance
        assert ok and a.get_state() == (b"s2", token2)
        assert a.store_scope() == b.store_scope() == f"store/{a.instance}/"
        fresh = EtcdV3RendezvousBackend(store, "r", ttl=60)  # never read: token unknown
        assert fresh.set_state(b"s3", token2)[2] and fresh.instance == a.instance


# -- item 8: every value checked at creation, with the key named -------------------------
@pytest.mark.parametrize("key", sorted(LIMITS))
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-1", "1e300", "soon"])
def test_bad_time_values_are_refused_naming_the_key(key, value):
    dead = f"127.0.0.1:{free_port()}"  # nothing is contacted: validation comes first
    with pytest.raises(ValueError, match=f"--rdzv-conf {key}="):
        create_rdzv_handler(_params(dead, "job", **{key: value}))


def test_the_upper_bounds_are_accepted_and_finite():
    for default, upper in LIMITS.values():
        assert math.isfinite(upper) and (default is None or 0 < default <= upper)


def test_a_ttl_shorter_than_keep_alives_need_is_refused():
    """ttl ≥ 4 keep-alive intervals (the state key is rewritten at 3/4 × ttl left) and ≥
    torch's dead-node time (a node's heartbeat key must outlive it)."""
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=r"ttl=19 is below 20 s, the larger of 4 × "):
        create_rdzv_handler(_params(dead, "job", ttl="19"))  # torch's default: 5 s
    with pytest.raises(ValueError, match="ttl=60 is below 80 s"):
        create_rdzv_handler(_params(dead, "job", ttl="60", keep_alive_interval="20"))
    with pytest.raises(ValueError, match="ttl=40 is below 50 s"):
        create_rdzv_handler(_params(dead, "job", ttl="40", keep_alive_max_attempt="10"))
    with pytest.raises(ValueError, match="keep_alive_max_attempt='x' is not an integer"):
        create_rdzv_handler(_params(dead, "job", keep_alive_max_attempt="x"))


@pytest.mark.parametrize("run_id", ["a/b", "../x", "a\0b"])
def test_a_run_id_that_would_nest_in_another_runs_keys_is_refused(run_id):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match="--rdzv-id"):
        create_rdzv_handler(_params(dead, run_id))


def test_the_backend_refuses_an_infinite_ttl(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        for ttl in (math.inf, math.nan, 0.0, -5.0):
            with pytest.raises(ValueError, match="ttl"):
                EtcdV3RendezvousBackend(store, "r", ttl=ttl)


def test_the_backend_refuses_a_store_whose_txn_cannot_hold_a_guarded_write(etcd, prefix):
    with (EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, max_txn_ops=2) as store,
          pytest.raises(ValueError, match="max_txn_ops must be at least 3")):
        EtcdV3RendezvousBackend(store, "r")
