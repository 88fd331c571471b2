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
from util import eventually, raw_client

from cachedstore import EtcdConnectionError, EtcdStore
from cachedstore.clock import FakeClock
from cachedstore.server import LocalEtcd
from cachedstore.torch import EtcdV3RendezvousBackend, heartbeats

pytestmark = pytest.mark.timeout(120)

AGENTS = 64
NOW = datetime.now(timezone.utc)


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


def _solo(store: EtcdStore, node: _NodeDesc, clock: FakeClock
          ) -> _BackendRendezvousStateHolder:
    """A state with ``node`` alone, written by a backend of ttl 20 on ``clock`` (its lease
    of 30 s granted at the clock's time)."""
    holder = _holder(store)
    holder._backend = EtcdV3RendezvousBackend(store, "hb", ttl=20, clock=clock)
    assert holder.sync() is None
    holder.state.participants[node], holder.state.last_heartbeats[node] = 0, NOW
    holder.mark_dirty()
    assert holder.sync() is True
    return holder


def _lose_the_next_request(store: EtcdStore) -> None:
    """The store's next write fails before etcd sees it, with the error of a request whose
    outcome the client cannot know."""
    writes = store._writes
    sent = writes._sent

    def never_sent(*args: object, **kwargs: object) -> None:
        writes._sent = sent  # type: ignore[method-assign]
        raise EtcdConnectionError("lost before etcd saw it, the client cannot tell (test)")

    writes._sent = never_sent  # type: ignore[method-assign]


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
    for holder, node in zip(agents, nodes, strict=True):
        # Each backend takes its lease and asks how long the state key's lease lasts.
        assert _keep_alive(holder, node, NOW + timedelta(seconds=1))
    for holder in agents:
        holder.sync()  # every agent reads; then all keep alive with what they read
    times = [NOW + timedelta(seconds=2, microseconds=i) for i in range(AGENTS)]
    before = settled()
    outcomes = [_keep_alive(h, n, t) for h, n, t in zip(agents, nodes, times, strict=True)]
    counts = settled().minus(before)
    assert outcomes == [True] * AGENTS  # on one compare-and-swap key all but one would lose
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


def test_keep_alives_rewrite_the_state_key_before_its_lease_runs_out(store, own_etcd,
                                                                     prefix):
    """Keep-alives leave the state key alone, so its lease would run out 1.5 × ttl after
    the last other change, in the middle of a run: a keep-alive rewrites it (the state
    torch set, on the backend's current lease) once that lease has 3/4 × ttl or less left,
    counted from when the lease was granted, not from when the key was written."""
    clock = FakeClock()
    node = _node(0)
    holder = _solo(store, node, clock)  # the lease (30 s) granted at 0
    raw = raw_client(own_etcd)
    first = raw.get(f"{prefix}state")[1]
    clock.advance(9)
    holder.state.round = 1  # a change at 9, still on the lease granted at 0
    holder.mark_dirty()
    assert holder.sync() is True
    meta = raw.get(f"{prefix}state")[1]
    assert meta.lease_id == first.lease_id
    clock.advance(5.9)  # 14.9: 15.1 s left
    assert _keep_alive(holder, node, NOW + timedelta(seconds=1))
    assert raw.get(f"{prefix}state")[1].mod_revision == meta.mod_revision  # left alone
    clock.advance(0.1)  # 15: 3/4 × ttl left, 6 s after the write
    assert _keep_alive(holder, node, NOW + timedelta(seconds=2))
    value2, meta2 = raw.get(f"{prefix}state")
    assert meta2.mod_revision > meta.mod_revision
    stored = pickle.loads(value2[value2.index(b"\n") + 1:])
    assert stored.round == 1 and stored.last_heartbeats == {node: NOW + timedelta(seconds=2)}
    assert meta2.lease_id != meta.lease_id  # the lease granted anew at ttl / 2
    assert raw.get_lease_info(meta2.lease_id).TTL > 20  # 1.5 × ttl from now
    clock.advance(4.9)
    assert _keep_alive(holder, node, NOW + timedelta(seconds=3))
    assert raw.get(f"{prefix}state")[1].mod_revision == meta2.mod_revision


def test_an_agent_that_never_wrote_the_state_keeps_it_alive(store, own_etcd, prefix,
                                                            settled):
    """A backend that did not write the state does not know its lease: its first
    keep-alive asks etcd once (LeaseTimeToLive), and it rewrites the key once 3/4 × ttl or
    less is left, after the writer is gone."""
    node, writer_node = _node(0), _node(1)
    writer = _holder(store)
    writer._backend = EtcdV3RendezvousBackend(store, "hb", ttl=40)  # a lease of 60 s
    assert writer.sync() is None
    for rank, n in enumerate([node, writer_node]):
        writer.state.participants[n], writer.state.last_heartbeats[n] = rank, NOW
    writer.mark_dirty()
    assert writer.sync() is True
    raw = raw_client(own_etcd)
    meta = raw.get(f"{prefix}state")[1]
    del writer  # the writer left
    clock = FakeClock()
    agent = _holder(store)
    agent._backend = EtcdV3RendezvousBackend(store, "hb", ttl=40, clock=clock)
    agent.sync()
    before = settled()
    assert _keep_alive(agent, node, NOW + timedelta(seconds=1))
    clock.advance(19)  # etcd said at most 60 s left at 0: at least 37 left (slow CI: 3 s)
    assert _keep_alive(agent, node, NOW + timedelta(seconds=2))
    counts = settled().minus(before)
    assert counts.requests == {"LeaseGrant": 1, "LeaseTimeToLive": 1, "Txn": 2}
    assert raw.get(f"{prefix}state")[1].mod_revision == meta.mod_revision  # left alone
    clock.advance(21)  # at most 20 s left: rewritten, on the agent's (new) lease
    assert _keep_alive(agent, node, NOW + timedelta(seconds=3))
    after = raw.get(f"{prefix}state")[1]
    assert after.mod_revision > meta.mod_revision and after.lease_id != meta.lease_id
    assert raw.get_lease_info(after.lease_id).TTL > 50


def test_a_keep_alive_rewrites_when_etcd_cannot_say_how_long_the_lease_lasts(store,
                                                                             own_etcd,
                                                                             prefix):
    node = _node(0)
    _create(store, [node], NOW)  # ttl 600: 900 s left, no rewrite due
    meta = raw_client(own_etcd).get(f"{prefix}state")[1]
    agent = _holder(store)
    agent.sync()

    def unanswered(lease: int) -> None:
        raise EtcdConnectionError("no answer (test)")

    store.leases.time_to_live = unanswered  # type: ignore[method-assign]
    assert _keep_alive(agent, node, NOW + timedelta(seconds=1))
    after = raw_client(own_etcd).get(f"{prefix}state")[1]
    assert after.mod_revision > meta.mod_revision  # rewritten rather than risked


def test_a_change_dropping_a_dead_host_is_not_failed_by_survivors_keep_alives(
        own_etcd, prefix):
    """Dropped nodes are guarded by key ranges that cover no surviving node's heartbeat
    key (one range per dead host): a survivor's keep-alive after the writer read does not
    fail the change, a dropped node's does. More ranges than a Txn compares: the whole
    directory guards, and then any keep-alive fails the change."""
    with EtcdStore(endpoints=[own_etcd.endpoint], prefix=prefix, max_txn_ops=8) as small:
        dead = [_NodeDesc("dead-host", 100 + i, 0) for i in range(11)]
        live = [_node(i) for i in range(4)]  # sorts after "dead-host_*"
        _create(small, dead + live, NOW)
        for node in dead[:2] + live:  # some of them have heartbeat keys
            peer = _holder(small)
            peer.sync()
            assert _keep_alive(peer, node, NOW + timedelta(seconds=1))
        judge, alive = _holder(small), _holder(small)
        judge.sync()
        alive.sync()
        assert _keep_alive(alive, live[0], NOW + timedelta(seconds=2))  # after the read
        for node in dead:  # the judge drops 11 nodes it read as silent
            del judge.state.last_heartbeats[node]
            del judge.state.participants[node]
        judge.mark_dirty()
        assert judge.sync() is True
        assert set(judge.state.participants) == set(live)
        # The dropped nodes' keys are deleted with the change; the survivors' stay.
        names = {m.key.decode().rsplit("/", 1)[1]
                 for _, m in raw_client(own_etcd).get_prefix(f"{prefix}heartbeats/")}
        assert names == {heartbeats.node_name(n) for n in live}

    with EtcdStore(endpoints=[own_etcd.endpoint], prefix=prefix + "b/",
                   max_txn_ops=8) as small:
        nodes = [_node(i) for i in range(16)]
        _create(small, nodes, NOW)
        judge, alive = _holder(small), _holder(small)
        judge.sync()
        alive.sync()
        dropped = nodes[1::2]  # interleaved with survivors in key order: 8 runs
        names = [heartbeats.node_name(n) for n in nodes]
        runs = heartbeats.runs(names[1::2], names[::2], 7)  # max_txn_ops 8: 7 ranges
        assert len(heartbeats.runs(names[1::2], names[::2], 8)) == 8 and len(runs) == 7
        covered = [n for n, name in zip(nodes[::2], names[::2], strict=True)
                   if any(first <= name <= last for first, last in runs)]
        assert len(covered) == 1  # joined across one survivor
        spared = next(n for n in nodes[::2] if n not in covered)
        assert _keep_alive(alive, covered[0], NOW + timedelta(seconds=2))
        for node in dropped:
            del judge.state.last_heartbeats[node]
            del judge.state.participants[node]
        judge.mark_dirty()
        assert judge.sync() is False  # a covered survivor heartbeat since the read
        for node in dropped:
            del judge.state.last_heartbeats[node]
            del judge.state.participants[node]
        alive.sync()
        assert _keep_alive(alive, spared, NOW + timedelta(seconds=3))  # not covered
        judge.mark_dirty()
        assert judge.sync() is True


def test_a_change_dropping_a_node_that_heartbeat_fails_within_a_range(own_etcd, prefix):
    with EtcdStore(endpoints=[own_etcd.endpoint], prefix=prefix, max_txn_ops=8) as small:
        nodes = [_node(i) for i in range(12)]
        _create(small, nodes, NOW)
        judge, alive = _holder(small), _holder(small)
        judge.sync()
        alive.sync()
        assert _keep_alive(alive, nodes[5], NOW + timedelta(seconds=1))  # after the read
        for node in nodes[1:]:
            del judge.state.last_heartbeats[node]
            del judge.state.participants[node]
        judge.mark_dirty()
        assert judge.sync() is False
        assert set(judge.state.participants) == set(nodes)
        # Ranges between survivors: host-2 sorts between host-11 and host-3, both
        # dropped; its keep-alive after the read does not fail the change.
        dropped = [nodes[1], nodes[10], nodes[11], nodes[3]]
        assert len(heartbeats.runs([heartbeats.node_name(n) for n in dropped],
                                   [heartbeats.node_name(nodes[2])], 7)) == 2
        judge.sync()
        alive.sync()
        assert _keep_alive(alive, nodes[2], NOW + timedelta(seconds=2))
        for node in dropped:
            del judge.state.last_heartbeats[node]
            del judge.state.participants[node]
        judge.mark_dirty()
        assert judge.sync() is True
        assert nodes[2] in judge.state.participants and nodes[3] not in judge.state.participants


def test_structural_changes_delete_left_over_keys_as_many_as_a_txn_takes(own_etcd, prefix):
    """Heartbeat keys of nodes the state does not have (a change that could not delete
    them all, or written by hand) go with the next changes, (max_txn_ops - 3) // 2 each."""
    with EtcdStore(endpoints=[own_etcd.endpoint], prefix=prefix, max_txn_ops=8) as small:
        node = _node(0)
        holder = _create(small, [node], NOW)
        directory = f"{prefix}heartbeats/{holder._backend.instance}/"
        raw = raw_client(own_etcd)
        for i in range(5):
            raw.put(f"{directory}ghost_{i}_0", b"{}")
        holder.sync()
        left = []
        for round_ in range(2, 5):
            holder.state.round = round_
            holder.mark_dirty()
            assert holder.sync() is True
            left.append(len(list(raw.get_prefix(directory))))
        assert left == [3, 1, 0]  # 2 deleted per change (max_txn_ops 8)


def test_a_keep_alive_whose_answer_was_lost_is_found_by_reading_back(store):
    node, other = _node(0), _node(1)
    holder = _create(store, [node, other], NOW)
    writes = store._writes

    def lose_answer(names):
        writes.after_write = None
        raise EtcdConnectionError("the answer was lost (test)")

    writes.after_write = lose_answer
    at = NOW + timedelta(seconds=1)
    assert _keep_alive(holder, node, at) is True  # it landed: read back, recognised
    del holder.state.last_heartbeats[other], holder.state.participants[other]
    writes.after_write = lose_answer
    holder.mark_dirty()
    assert holder.sync() is True  # a change of the state: recognised by its bytes
    fresh = _holder(store)
    fresh.sync()
    assert fresh.state.last_heartbeats == {node: at}


def test_a_rewrite_whose_answer_was_lost_is_judged_by_its_heartbeat_keys(store, own_etcd,
                                                                        prefix):
    """A keep-alive that also rewrites the state key, whose answer is lost: judged by its
    heartbeat key, written in the same Txn, whether or not it reached etcd."""
    clock = FakeClock()
    node = _node(0)
    holder = _solo(store, node, clock)
    meta = raw_client(own_etcd).get(f"{prefix}state")[1]
    clock.advance(15)  # a rewrite is due
    writes = store._writes
    _lose_the_next_request(store)
    assert _keep_alive(holder, node, NOW + timedelta(seconds=1)) is False
    assert raw_client(own_etcd).get(f"{prefix}state")[1].mod_revision == meta.mod_revision
    clock.advance(0.1)

    def answer_lost(names):
        writes.after_write = None
        raise EtcdConnectionError("the answer was lost (test)")

    writes.after_write = answer_lost  # etcd applied it; the client cannot tell
    assert _keep_alive(holder, node, NOW + timedelta(seconds=1)) is True  # torch retries
    assert raw_client(own_etcd).get(f"{prefix}state")[1].mod_revision > meta.mod_revision


def test_an_unchanged_opaque_state_whose_answer_was_lost_is_judged_by_its_revision(
        store, own_etcd, prefix):
    """A state the backend does not understand, set again with the same bytes: read back,
    the bytes match whether or not the write landed; the key's mod_revision tells."""
    backend = EtcdV3RendezvousBackend(store, "hb", ttl=600)
    opaque = pickle.dumps({"not": "torch's state"})
    bits, token, ok = backend.set_state(opaque)
    _lose_the_next_request(store)
    assert backend.set_state(opaque, token)[2] is False
    assert backend.set_state(opaque, token)[2] is True


def test_a_drop_judged_without_the_heartbeat_keys_is_refused(store):
    """A view whose heartbeat keys were not read (the instance changed under each of its
    reads) has the state key's old times only: a node alive in its heartbeat key looks
    dead. The change is refused, and torch gets the state read anew, keys merged."""
    victim, other = _node(1), _node(2)
    _create(store, [victim, other], NOW - timedelta(minutes=30))
    peer = _holder(store)
    peer.sync()
    assert _keep_alive(peer, victim, datetime.now(timezone.utc))  # alive in its key
    judge = _holder(store, dead_after=60)
    backend = judge._backend
    remember = backend._remember

    def keys_unread(found, snap, beats_read):
        backend._remember = remember
        return remember(found, snap, beats_read=False)

    backend._remember = keys_unread
    judge.sync()  # sees both silent for 30 minutes: torch's sanitiser drops both
    assert judge.state.participants == {}
    judge.mark_dirty()
    assert judge.sync() is False  # refused, and the state read again, keys merged
    assert set(judge.state.participants) == {victim}  # sanitised again: other only
    judge.mark_dirty()
    assert judge.sync() is True
    reader = _holder(store)
    reader.sync()
    assert set(reader.state.participants) == {victim}


def test_a_lease_that_aged_is_judged_by_what_etcd_says_is_left(store, own_etcd, prefix):
    """Another agent's lease: what is left, not what was granted."""
    node = _node(0)
    writer = _holder(store)
    writer._backend = EtcdV3RendezvousBackend(store, "hb", ttl=4)  # a lease of 6 s
    assert writer.sync() is None
    writer.state.participants[node], writer.state.last_heartbeats[node] = 0, NOW
    writer.mark_dirty()
    assert writer.sync() is True
    raw = raw_client(own_etcd)
    meta = raw.get(f"{prefix}state")[1]
    eventually(lambda: raw.get_lease_info(meta.lease_id).TTL <= 3, timeout=10,
               what="the state key's lease down to 3/4 × ttl")
    agent = _holder(store)
    agent._backend = EtcdV3RendezvousBackend(store, "hb", ttl=4, clock=FakeClock())
    agent.sync()
    assert _keep_alive(agent, node, NOW + timedelta(seconds=1))
    after = raw.get(f"{prefix}state")[1]
    assert after.mod_revision > meta.mod_revision and after.lease_id != meta.lease_id


def test_a_backend_remembers_32_lease_expiries(store, settled):
    backend = EtcdV3RendezvousBackend(store, "hb", ttl=600)
    leases = [store.leases.grant(900) for _ in range(40)]
    before = settled()
    assert not any(backend._leases.expiring(lease) for lease in leases)
    assert not any(backend._leases.expiring(lease) for lease in leases[8:])  # remembered
    assert not backend._leases.expiring(leases[0])  # forgotten: asked again
    counts = settled().minus(before)
    assert counts.requests == {"LeaseTimeToLive": 41}
    for lease in leases:
        store.leases.revoke(lease)


def test_a_keep_alive_on_a_replaced_rendezvous_gets_the_new_instance(store):
    node = _node(0)
    holder = _create(store, [node], NOW)
    first = holder._backend.instance
    assert store.delete("state")  # the state expired; another run creates it anew
    other = _holder(store)
    assert other.sync() is None
    other.state.round = 7
    other.mark_dirty()
    assert other.sync() is True
    assert _keep_alive(holder, node, NOW + timedelta(seconds=1)) is False
    assert holder.state.round == 7 and node not in holder.state.last_heartbeats
    assert holder._backend.instance == other._backend.instance != first


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


def test_runs_cover_dropped_names_and_never_a_survivor():
    assert heartbeats.runs([], ["a"], 4) == []
    assert heartbeats.runs(["b", "a"], [], 4) == [("a", "b")]
    assert heartbeats.runs(["a", "c", "d"], ["b", "e"], 4) == [("a", "a"), ("c", "d")]
    assert heartbeats.runs(["a", "b"], ["b"], 4) == [("a", "a")]  # in both: a survivor
    # Past the limit, joined across the gaps with the fewest survivors.
    dropped, alive = ["b", "d", "f", "h"], ["a", "c", "c2", "e", "g", "i"]
    assert heartbeats.runs(dropped, alive, 2) == [("b", "b"), ("d", "h")]
    assert heartbeats.runs(dropped, alive, 1) == [("b", "h")]
    # One host's nodes sort together, also when an address holds "_" or extends another.
    host = [heartbeats.node_name(_NodeDesc("h_1", pid, 0)) for pid in (9, 10, 11)]
    others = [heartbeats.node_name(_NodeDesc(addr, 5, 0))
              for addr in ("h", "h_10", "h_1x", "h_1_2")]
    assert heartbeats.runs(host, others, 4) == [(host[1], host[0])]  # "_10_" < "_9_"
