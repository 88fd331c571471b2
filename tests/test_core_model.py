"""Model-based test of the coherence core against a reference model of etcd's history.

A hypothesis ``RuleBasedStateMachine`` drives :class:`cachedstore.cache.CoherentCache` with
no network: a simulated etcd (puts, deletes, multi-key Txns, compaction), a watch that
delivers late and in batches (never splitting a revision), stream restarts and compaction
resyncs, local writes whose answers are recorded late, read-through fills racing events,
evictions from a tiny cache, and stale reads while the watch is down. After every step it
checks the guarantees of docs/design.md against the model:

- coherence: a served entry holds etcd's state as of max(its revision, the applied one);
- read-your-writes: after a local write returned, nothing older than it is served;
- monotonic reads: no read returns an older version than one returned before;
- a complete, caught-up cache's "absent" is true as of the applied revision;
- at most ``cache_size`` entries; high-water marks only for keys ahead of the watch;
- convergence: once the watch has delivered everything, every served entry is current.

Every value is unique (``v<revision>``), so a value names its version. The same machine is
run against the core with rule 2 (marks) or rule 3 (writes in flight) removed, and must
find each violation: the test that would pass without its mechanism is no test.

``CACHEDSTORE_MODEL_EXAMPLES`` raises the example budget for long runs by hand.
"""

from __future__ import annotations

import bisect
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cachedstore.cache import NOT_SERVING, CoherentCache
from cachedstore.metrics import NullMetrics

KEYS = ["a", "b", "c", "d"]
CACHE_SIZE = 2
PRELOAD_LIMIT = 3
EXAMPLES = int(os.environ.get("CACHEDSTORE_MODEL_EXAMPLES", "800"))

keys = st.sampled_from(KEYS)
key_sets = st.lists(keys, min_size=1, max_size=3, unique=True)


class Etcd:
    """The reference: etcd's history of revisions, each a list of (key, value or None)."""

    def __init__(self) -> None:
        self.revision = 1
        self.history: list[tuple[int, list[tuple[str, bytes | None]]]] = []
        self.compacted = 0
        self._changes: dict[str, tuple[list[int], list[bytes | None]]] = {
            k: ([], []) for k in KEYS}

    def commit(self, changes: list[tuple[str, bytes | None]]) -> int:
        self.revision += 1
        rev = self.revision
        applied = [(k, None if v is None else b"v%d" % rev) for k, v in changes]
        self.history.append((rev, applied))
        for k, v in applied:
            revs, values = self._changes[k]
            revs.append(rev)
            values.append(v)
        return rev

    def state_at(self, key: str, revision: int) -> tuple[bytes | None, int]:
        """(value, revision of the key's last change) as of ``revision``."""
        revs, values = self._changes[key]
        i = bisect.bisect_right(revs, revision)
        return (values[i - 1], revs[i - 1]) if i else (None, 0)

    def events_after(self, revision: int, limit: int) -> list[tuple[int, list]]:
        """The first ``limit`` revisions after ``revision`` (each revision has events)."""
        start = bisect.bisect_right(self.history, revision, key=lambda item: item[0])
        return self.history[start:start + limit]


class CoreMachine(RuleBasedStateMachine):
    """Drives one core; ``core_class`` and ``unregistered_writes`` select the variant."""

    core_class: type[CoherentCache] = CoherentCache
    unregistered_writes = False
    instances = 0  # state machines run so far
    first_failure = 0  # how many had run when the first violation was seen

    def __init__(self) -> None:
        super().__init__()
        type(self).instances += 1
        self.etcd = Etcd()
        self.core = self.core_class(CACHE_SIZE, NullMetrics())
        self.delivered = 0  # revision of the last event the watch applied
        self.up = False
        self.pending_writes: list[tuple[list[tuple[str, bytes | None]], int, int]] = []
        self.pending_fills: list[tuple[list[str], int, dict, int]] = []
        self.written: dict[str, int] = {}  # key -> revision of our last returned write
        self.observed: dict[str, int] = {}  # key -> version of the newest value read

    @initialize()
    def start(self) -> None:
        self.reset_cache()
        self.watch_up()

    # -- helpers -------------------------------------------------------------------------
    def reset_cache(self) -> None:
        rev = self.etcd.revision
        present = [(k, *self.etcd.state_at(k, rev)) for k in KEYS]
        present = [(k, v, m) for k, v, m in present if v is not None]
        snapshot = present if len(present) <= PRELOAD_LIMIT else None
        self.core.reset(rev, snapshot)
        self.delivered = rev

    def watch_up(self) -> None:
        self.core.watch_up(self.etcd.revision)
        self.up = True

    def effective(self, entry: tuple) -> int:
        return max(entry[1], self.core.applied_revision)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            if not type(self).first_failure:
                type(self).first_failure = type(self).instances
            raise AssertionError(message)

    def raw_entries(self) -> dict:
        return dict(self.core._lru.data)  # no LRU reordering

    def observe(self, key: str, value: bytes | None, revision: int) -> None:
        """Record what a read returned, checking monotonic reads."""
        version = int(value[1:]) if value is not None else self.etcd.state_at(key, revision)[1]
        self.check(version >= self.observed.get(key, 0),
                   f"monotonic reads: {key} went back from version "
                   f"{self.observed.get(key)} to {version}")
        self.check(version >= self.written.get(key, 0),
                   f"read-your-writes: {key} read version {version} after our write at "
                   f"{self.written.get(key)}")
        self.observed[key] = version

    # -- other clients ---------------------------------------------------------------------
    @rule(key=keys)
    def other_put(self, key: str) -> None:
        self.etcd.commit([(key, b"")])

    @rule(key=keys)
    def other_delete(self, key: str) -> None:
        self.etcd.commit([(key, None)])

    @rule(puts=key_sets, delete=st.booleans())
    def other_txn(self, puts: list[str], delete: bool) -> None:
        changes = [(k, None if delete and i == 0 else b"") for i, k in enumerate(puts)]
        self.etcd.commit(changes)

    # -- the watch ---------------------------------------------------------------------------
    @precondition(lambda self: self.up)
    @rule(n=st.integers(1, 3))
    def deliver(self, n: int) -> None:
        """One watch response: the next ``n`` revisions that have events, whole."""
        pending = self.etcd.events_after(self.delivered, n)
        if not pending:
            return
        batch = [(k, v, rev) for rev, changes in pending for k, v in changes]
        last = pending[-1][0]
        self.core.apply_events(batch, last)
        self.delivered = last

    @precondition(lambda self: self.up)
    @rule()
    def stream_breaks(self) -> None:
        self.core.watch_down()
        self.up = False

    @precondition(lambda self: not self.up)
    @rule()
    def stream_resumes(self) -> None:
        if self.delivered < self.etcd.compacted:  # etcd cancels: compacted
            self.reset_cache()
        self.watch_up()

    @rule()
    def compact(self) -> None:
        self.etcd.compacted = self.etcd.revision
        if self.up and self.delivered < self.etcd.compacted:
            # The watch is cancelled with a compact revision: resync from a fresh one.
            self.core.watch_down()
            self.reset_cache()
            self.watch_up()

    # -- local writes, answered now and recorded later ---------------------------------------------
    @rule(names=key_sets, delete=st.booleans())
    def write_sent(self, names: list[str], delete: bool) -> None:
        ticket = (0, 0) if self.unregistered_writes else self.core.begin(names)
        rev = self.etcd.commit([(k, None if delete else b"") for k in names])
        changes = [(k, None if delete else b"v%d" % rev) for k in names]
        self.pending_writes.append((changes, ticket, rev))

    @precondition(lambda self: self.pending_writes)
    @rule(data=st.data())
    def write_returns(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.pending_writes) - 1))
        changes, ticket, rev = self.pending_writes.pop(i)
        if self.unregistered_writes:
            for name, value in changes:
                self.core.apply_write(name, value, rev)
        else:
            self.core.end_write(changes, ticket, rev)
        for name, _ in changes:
            self.written[name] = max(self.written.get(name, 0), rev)

    # -- read-through fills, read now and inserted later ---------------------------------------------
    @rule(names=key_sets)
    def fill_sent(self, names: list[str]) -> None:
        ticket = self.core.begin(names)
        rev = self.etcd.revision
        results = {}
        for k in names:
            value, changed = self.etcd.state_at(k, rev)
            if value is not None:
                results[k] = (value, changed)
        self.pending_fills.append((names, ticket, results, rev))

    @precondition(lambda self: self.pending_fills)
    @rule(data=st.data(), failed=st.booleans())
    def fill_returns(self, data: st.DataObject, failed: bool) -> None:
        i = data.draw(st.integers(0, len(self.pending_fills) - 1))
        names, ticket, results, rev = self.pending_fills.pop(i)
        self.core.end_fill(names, ticket, None if failed else results, rev)

    # -- reads as the store does them ---------------------------------------------------------------
    @rule(key=keys, blocking=st.booleans())
    def get(self, key: str, blocking: bool) -> None:
        core = self.core
        entry = core.lookup_or_absent(key) if blocking else core.lookup(key)
        if entry is not None:
            self.observe(key, entry[0], self.effective(entry))
            return
        # A miss reads through: one fill, answered at once.
        ticket = core.begin([key])
        rev = self.etcd.revision
        value, changed = self.etcd.state_at(key, rev)
        dropped = core.end_fill([key], ticket, {key: (value, changed)} if value else {}, rev)
        if dropped:
            newer = core.peek(key)
            if newer is not None and newer[1] > rev:
                value, rev = newer[0], newer[1]
        self.observe(key, value, rev)

    @precondition(lambda self: not self.up)
    @rule(key=keys)
    def stale_read(self, key: str) -> None:
        """max_staleness: the entry, served although the watch is down, is a real state."""
        entry = self.core.peek(key)
        if entry is not None:
            self.check(entry[0] == self.etcd.state_at(key, entry[1])[0],
                       f"stale read of {key} is no state etcd ever held")

    @rule()
    def catch_up(self) -> None:
        """Convergence: the watch delivers everything; every served entry is current."""
        if not self.up:
            self.stream_resumes()
        self.deliver(10**6)
        rev = self.etcd.revision
        for key in KEYS:
            entry = self.core.lookup(key)
            if entry is not None:
                self.check(entry[0] == self.etcd.state_at(key, rev)[0],
                           f"no convergence: {key} serves {entry[0]!r}, etcd holds "
                           f"{self.etcd.state_at(key, rev)[0]!r}")

    # -- invariants ----------------------------------------------------------------------------------
    @invariant()
    def served_entries_are_coherent(self) -> None:
        core = self.core
        applied = core.applied_revision
        for key, entry in self.raw_entries().items():
            if entry[1] < core.floor:
                continue  # not served
            effective = max(entry[1], applied)
            expected, _ = self.etcd.state_at(key, effective)
            self.check(entry[0] == expected,
                       f"coherence: {key} serves {entry[0]!r} (as of {entry[1]}), etcd "
                       f"held {expected!r} at {effective} (applied {applied})")
            self.check(effective >= self.written.get(key, 0),
                       f"read-your-writes: {key} serves a state as of {effective} after "
                       f"our write at {self.written.get(key)}")
            version = int(entry[0][1:]) if entry[0] else self.etcd.state_at(key, effective)[1]
            self.check(version >= self.observed.get(key, 0),
                       f"monotonic reads broken for {key}")

    @invariant()
    def complete_cache_knows_absence(self) -> None:
        core = self.core
        if core.complete and core.floor == 0:
            entries = self.raw_entries()
            for key in KEYS:
                if key not in entries:
                    self.check(self.etcd.state_at(key, core.applied_revision)[0] is None,
                               f"complete cache says {key} is absent, etcd holds it")

    @invariant()
    def bounded(self) -> None:
        assert len(self.core) <= CACHE_SIZE
        applied = self.core.applied_revision
        assert all(rev > applied for rev in self.core.marks().values())
        assert self.core.n_marks <= len(KEYS)

    @invariant()
    def not_served_while_down(self) -> None:
        if not self.up:
            assert self.core.floor == NOT_SERVING


def run(machine: type[CoreMachine], examples: int, shrink: bool = True) -> None:
    phases = list(Phase) if shrink else [Phase.generate]
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=40, deadline=None, phases=phases,
        suppress_health_check=list(HealthCheck), database=None))


def test_core_keeps_every_guarantee():
    run(CoreMachine, EXAMPLES)


class _NoMarks(CoherentCache):
    """Rule 2 removed: eviction forgets an entry that is ahead of the watch."""

    def _evicted(self, name, entry):
        scope = self._scope_of(name)
        if scope is not None:
            scope.complete = False


class _NoMarksMachine(CoreMachine):
    core_class = _NoMarks


class _UnregisteredWritesMachine(CoreMachine):
    """Rule 3 removed for writes: recorded late, without in-flight registration."""

    unregistered_writes = True


class _NoEpoch(CoherentCache):
    """Rule 4 removed: a result that predates a reset is installed after it."""

    def _finish(self, name, ticket, revision):
        return super()._finish(name, (self._epoch, ticket[1]), revision)


class _NoEpochMachine(CoreMachine):
    core_class = _NoEpoch


class _NoInflight(CoherentCache):
    """Rule 3 removed altogether: updates during a fill or write are not recorded."""

    def _update(self, name, value, revision, mod_revision, woken):
        self._install(name, value, revision, mod_revision, woken)


class _NoInflightMachine(CoreMachine):
    core_class = _NoInflight


@pytest.mark.parametrize(
    "machine", [_NoMarksMachine, _UnregisteredWritesMachine, _NoEpochMachine,
                _NoInflightMachine],
    ids=["eviction-ahead-of-watch", "late-local-write", "no-epoch", "no-inflight-record"])
def test_model_finds_the_violation_when_its_fix_is_removed(machine, capsys):
    machine.instances = machine.first_failure = 0
    with pytest.raises(Exception) as caught:  # noqa: PT011 -- checked just below
        run(machine, 5000, shrink=False)  # the first failure is proof enough
    failure = caught.value
    while hasattr(failure, "exceptions"):  # an exception group: several failures found
        failure = failure.exceptions[0]
    assert isinstance(failure, AssertionError), repr(failure)
    with capsys.disabled():
        print(f"\n{machine.__name__}: first violation in state machine "
              f"#{machine.first_failure}")
    assert machine.first_failure
