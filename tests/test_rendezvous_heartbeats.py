"""torchrun keep-alives without contention: the etcd-v3 backend's heartbeat keys
(``cachedstore/torch/heartbeats.py``, ``rendezvous.py``), driven through torch's own state
holder (``_BackendRendezvousStateHolder``: pickling, sanitising dead nodes) on a real etcd.

The races are forced deterministically: every agent reads the state first, then all write
with what they read, the worst case for one compare-and-swap key. etcd's own ``/metrics``
count the Txns and raft proposals (an etcd of this module's own).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)
from util import raw_client

from benchmarks.fanout.etcd_metrics import SettledSampler
from cachedstore import EtcdStore
from cachedstore.server import LocalEtcd
from cachedstore.torch import EtcdV3RendezvousBackend, heartbeats

pytestmark = pytest.mark.timeout(120)

AGENTS = 64
NOW = datetime.now(timezone.utc)


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def settled(own_etcd: LocalEtcd) -> Iterator[SettledSampler]:
    with SettledSampler(own_etcd.endpoint, own_etcd.metrics_url) as sampler:
        yield sampler


@pytest.fixture
def store(own_etcd: LocalEtcd, prefix: str) -> Iterator[EtcdStore]:
    with EtcdStore(endpoints=[own_etcd.endpoint], prefix=prefix) as s:
        yield s


def _node(i: int) -> _NodeDesc:
    return _NodeDesc(f"host-{i}.example", 1000 + i, 0)


def _holder(store: EtcdStore, *, dead_after: float = 3600.0
            ) -> _BackendRendezvousStateHolder:
    """torch's state holder on a backend of its own; nodes whose heartbeat is older than
    ``dead_after`` seconds are dropped when it syncs (torch's sanitiser)."""
    settings = RendezvousSettings(
        run_id="hb", min_nodes=1, max_nodes=AGENTS, timeout=RendezvousTimeout(),
        keep_alive_interval=timedelta(seconds=dead_after / 3), keep_alive_max_attempt=3)
    return _BackendRendezvousStateHolder(EtcdV3RendezvousBackend(store, "hb", ttl=600),
                                         settings, cache_duration=0)


def _create(store: EtcdStore, nodes: list[_NodeDesc], at: datetime
            ) -> _BackendRendezvousStateHolder:
    """A complete round with ``nodes`` as participants, last heard of at ``at``."""
    holder = _holder(store)
    assert holder.sync() is None
    for rank, node in enumerate(nodes):
        holder.state.participants[node] = rank
        holder.state.last_heartbeats[node] = at
    holder.state.round, holder.state.complete = 1, True
    holder.mark_dirty()
    assert holder.sync() is True
    return holder


def _keep_alive(holder: _BackendRendezvousStateHolder, node: _NodeDesc,
                at: datetime) -> bool | None:
    """torch's ``_keep_alive`` and the sync after it."""
    holder.state.last_heartbeats[node] = at
    holder.mark_dirty()
    return holder.sync()


def _drop(holder: _BackendRendezvousStateHolder, node: _NodeDesc) -> bool | None:
    """What torch's sanitiser does to a node it finds dead, then a sync."""
    del holder.state.last_heartbeats[node]
    del holder.state.participants[node]
    holder.mark_dirty()
    return holder.sync()


def test_keep_alives_of_64_agents_read_before_any_write_never_retry(store, settled):
    nodes = [_node(i) for i in range(AGENTS)]
    _create(store, nodes, NOW)
    agents = [_holder(store) for _ in nodes]
    for holder in agents:
        holder.sync()
    for holder, node in zip(agents, nodes, strict=True):  # each backend takes its lease
        assert _keep_alive(holder, node, NOW + timedelta(seconds=1))
    for holder in agents:
        holder.sync()  # every agent reads; then all keep alive with what they read
    times = [NOW + timedelta(seconds=2, microseconds=i) for i in range(AGENTS)]
    before = settled()
    outcomes = [_keep_alive(h, n, t) for h, n, t in zip(agents, nodes, times, strict=True)]
    counts = settled().minus(before)
    assert outcomes == [True] * AGENTS  # one compare-and-swap key: all but the first lose
    assert counts.requests == {"Txn": AGENTS}
    assert counts.proposals == AGENTS
    # Every agent's state and a fresh reader see every keep-alive.
    fresh = _holder(store)
    fresh.sync()
    assert fresh.state.last_heartbeats == dict(zip(nodes, times, strict=True))
    assert agents[-1].state.last_heartbeats == fresh.state.last_heartbeats


def test_a_heartbeat_key_is_documented_json_a_plain_client_can_read(store, own_etcd, prefix):
    node = _node(7)
    holder = _create(store, [node], NOW)
    at = NOW + timedelta(seconds=3)
    assert _keep_alive(holder, node, at)
    instance = holder._backend.instance
    value, _ = raw_client(own_etcd).get(f"{prefix}heartbeats/{instance}/host-7.example_1007_0")
    assert json.loads(value) == {"node": {"addr": "host-7.example", "pid": 1007,
                                          "local_id": 0},
                                 "last_heartbeat": at.isoformat()}


def test_nodes_alive_only_in_their_heartbeat_keys_are_not_declared_dead(store):
    nodes = [_node(i) for i in range(8)]
    old = NOW - timedelta(minutes=30)  # the state key: half an hour since anyone was heard
    _create(store, nodes, old)
    for node in nodes:
        writer = _holder(store)
        writer.sync()
        assert _keep_alive(writer, node, datetime.now(timezone.utc))
    judge = _holder(store, dead_after=60)  # drops nodes silent for a minute when it syncs
    judge.sync()
    assert set(judge.state.participants) == set(nodes)
    assert min(judge.state.last_heartbeats.values()) > old


def test_dropping_a_node_fails_if_it_heartbeat_after_the_writer_read(store, own_etcd,
                                                                     prefix):
    victim, other = _node(1), _node(2)
    _create(store, [victim, other], NOW)
    judge, alive = _holder(store), _holder(store)
    judge.sync()
    alive.sync()
    late = NOW + timedelta(seconds=30)
    assert _keep_alive(alive, victim, late)  # after the judge read
    assert _drop(judge, victim) is False  # torch's CAS on one key would fail here too
    assert judge.state.last_heartbeats[victim] == late and victim in judge.state.participants
    # Another backend handed the judge's token (it never saw it) decides the same way.
    token_before = alive._backend.get_state()[1]
    assert _keep_alive(alive, victim, late + timedelta(seconds=1))
    state = pickle.loads(alive._backend.get_state()[0])
    del state.last_heartbeats[victim], state.participants[victim]
    stranger = EtcdV3RendezvousBackend(store, "hb", ttl=600)
    assert stranger.set_state(pickle.dumps(state), token_before)[2] is False
    # Silent since the judge's read: dropped, and its heartbeat key deleted.
    judge.sync()
    key = f"{prefix}heartbeats/{judge._backend.instance}/host-1.example_1001_0"
    assert raw_client(own_etcd).get(key)[0] is not None
    assert _drop(judge, victim) is True
    assert raw_client(own_etcd).get(key)[0] is None
    reader = _holder(store)
    reader.sync()
    assert set(reader.state.participants) == {other}


def test_other_changes_do_not_race_keep_alives_and_keep_their_times(store):
    nodes = [_node(i) for i in range(10)]
    _create(store, nodes, NOW)
    leader = _holder(store)
    leader.sync()
    times = {}
    for node in nodes:
        peer = _holder(store)
        peer.sync()
        times[node] = NOW + timedelta(seconds=5)
        assert _keep_alive(peer, node, times[node])
    leader.state.round += 1  # a change of the round, with heartbeat times read before
    leader.mark_dirty()
    assert leader.sync() is True
    assert leader.state.round == 2 and leader.state.last_heartbeats == times
    # A keep-alive read before the round changed is stale: it gets the new state.
    stale = _holder(store)
    stale._state, stale._token = pickle.loads(pickle.dumps(leader.state)), None
    behind = _holder(store)
    behind.sync()
    leader.state.complete = False
    leader.mark_dirty()
    assert leader.sync() is True
    assert _keep_alive(behind, nodes[0], NOW + timedelta(seconds=9)) is False
    assert behind.state.complete is False  # the new state, to retry on
    assert _keep_alive(behind, nodes[0], NOW + timedelta(seconds=9)) is True


def test_a_state_the_backend_does_not_understand_is_one_compare_and_swap(store, own_etcd,
                                                                         prefix):
    backend = EtcdV3RendezvousBackend(store, "hb", ttl=600)
    opaque = pickle.dumps({"not": "torch's state"})
    bits, token, ok = backend.set_state(opaque)
    assert ok and bits == opaque
    opaque2 = pickle.dumps({"not": "torch's state either"})
    bits, token2, ok = backend.set_state(opaque2, token)
    assert ok and bits == opaque2 and token2[0] > token[0]
    assert backend.set_state(opaque, token) == (opaque2, token2, False)
    assert list(raw_client(own_etcd).get_prefix(f"{prefix}heartbeats/")) == []


# --------------------------------------------------------------------------- pure parts


def test_decode_takes_torchs_state_and_nothing_else():
    state = _RendezvousState()
    state.last_heartbeats[_node(0)] = NOW
    assert heartbeats.decode(pickle.dumps(state)).last_heartbeats == {_node(0): NOW}
    assert heartbeats.decode(b"s1") is None
    assert heartbeats.decode(pickle.dumps({"last_heartbeats": {}})) is None
    assert heartbeats.decode(b"\x80\x04garbage") is None
    naive = _RendezvousState()
    naive.last_heartbeats[_node(0)] = datetime(2026, 1, 1)  # noqa: DTZ001
    assert heartbeats.decode(pickle.dumps(naive)) is None


def test_structure_ignores_heartbeat_times_but_not_which_nodes():
    a, b = _RendezvousState(), _RendezvousState()
    a.last_heartbeats[_node(0)] = NOW
    b.last_heartbeats[_node(0)] = NOW + timedelta(seconds=1)
    assert heartbeats.structure(a) == heartbeats.structure(b)
    b.last_heartbeats[_node(1)] = NOW
    assert heartbeats.structure(a) != heartbeats.structure(b)
    del b.last_heartbeats[_node(1)]
    b.wait_list.add(_node(1))
    assert heartbeats.structure(a) != heartbeats.structure(b)


def test_merge_keeps_the_later_time_and_brings_no_removed_node_back():
    state = _RendezvousState()
    state.last_heartbeats = {_node(0): NOW, _node(1): NOW}
    later, earlier = NOW + timedelta(seconds=1), NOW - timedelta(seconds=1)
    assert heartbeats.merge(state, {heartbeats.node_name(_node(0)): later,
                                    heartbeats.node_name(_node(1)): earlier,
                                    heartbeats.node_name(_node(2)): later})
    assert state.last_heartbeats == {_node(0): later, _node(1): NOW}
    assert not heartbeats.merge(state, {})


def test_node_names_are_one_path_segment_and_values_round_trip():
    node = _NodeDesc("fe80::1/64 odd", 5, 2)
    assert heartbeats.node_name(node) == "fe80%3A%3A1%2F64%20odd_5_2"
    value = heartbeats.heartbeat_value(node, NOW)
    assert heartbeats.parse_heartbeat(value) == NOW
    for bad in (b"", b"{}", b'{"last_heartbeat": 5}', b'{"last_heartbeat": "2026-01-01"}',
                b"\xff"):
        assert heartbeats.parse_heartbeat(bad) is None
