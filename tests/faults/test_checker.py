"""The randomized consistency checker: a short seeded run in CI, a long one by hand.

Reproduce a failure with the seed it prints: ``CHECKER_SEED=<seed> pytest
tests/faults/test_checker.py``, or ``cd tests && python -m faults.checker --seed <seed>``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from cachedstore.server import LocalEtcd

from .checker import COUNTER, CheckerConfig, EtcdCrashed, Report, check, make_plan, run


def _seed() -> int:
    return int(os.environ.get("CHECKER_SEED") or random.SystemRandom().randrange(10**6))


def _run_on_new_etcd(etcd_factory: Callable[..., LocalEtcd], workdir: Path,
                     config: CheckerConfig, crash_first: bool = False) -> Report:
    """``run`` on a new etcd; once more, on another, if that etcd crashed by itself
    (:class:`EtcdCrashed`: etcd's failure, reported as a warning with its log's tail).
    ``crash_first``: SIGKILL the first etcd as its run starts (the test of this)."""
    for attempt in range(2):
        server = etcd_factory()
        (workdir / f"etcd-{attempt}").mkdir()
        try:
            return run(config, server.endpoint, workdir / f"etcd-{attempt}", servers=server,
                       during=server.kill if crash_first and not attempt else None)
        except EtcdCrashed as crash:
            if attempt:
                raise
            warnings.warn(f"etcd crashed under the checker (seed {config.seed}); the run "
                          f"is repeated on a new etcd:\n{crash}", stacklevel=2)
    raise AssertionError("unreachable")


def _run(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path, config: CheckerConfig
         ) -> Report:
    report = _run_on_new_etcd(etcd_factory, tmp_path, config)
    print("\n" + report.summary())
    assert not report.violations, (
        f"{report.summary()}\nreproduce: CHECKER_SEED={config.seed} pytest "
        f"tests/faults/test_checker.py")
    return report


def _rechecked(report: Report, mutate: Callable[[Report], None]) -> list[str]:
    doctored = copy.deepcopy(report)
    doctored.violations, doctored.figures = [], {}
    mutate(doctored)
    return check(doctored)


@pytest.mark.timeout(150)  # time for a repeat on a new etcd (_run_on_new_etcd)
def test_short_run_under_faults(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path
                                ) -> None:
    """3 processes, 12 s of operations under resets, cuts, stalls and compactions."""
    config = CheckerConfig(seed=_seed(), processes=3, duration=12.0)
    report = _run(etcd_factory, tmp_path, config)
    outcomes = report.figures["outcomes"]
    for op in ("get", "set", "delete", "cas", "add"):
        assert outcomes.get(f"{op}:ok", 0) > 0, f"no successful {op}"
    assert {"reset", "cut", "stall", "compact"} <= set(report.figures["faults"])
    assert sum(outcomes.get(k, 0) for k in outcomes if k.endswith((":conn", ":maybe"))) > 0, \
        "the faults never reached the stores"

    # The checker is not vacuous: doctored copies of this very history are rejected.
    def go_back_in_time(r: Report) -> None:
        for history in r.histories.values():
            reads: dict[str, int] = {}
            for i, rec in enumerate(history):
                if rec[0] == "get" and rec[3] == "ok" and rec[4] is not None:
                    j = reads.get(rec[1])
                    if j is not None and history[j][4] != rec[4]:
                        history[j][4], rec[4] = rec[4], history[j][4]  # newer first
                        return
                    reads[rec[1]] = i
        raise AssertionError("no pair of distinct reads to swap")

    def duplicate_add(r: Report) -> None:
        for history in r.histories.values():
            for rec in history:
                if rec[0] == "add" and rec[3] == "ok":
                    history.append(list(rec))
                    return
        raise AssertionError("no add")

    def stale_after_quiescence(r: Report) -> None:
        for history in r.histories.values():
            for rec in reversed(history):
                if rec[7] == "settle" and rec[1] == COUNTER:
                    rec[4] = "1"
                    return
        raise AssertionError("no settle read")

    assert any("monotonic" in v for v in _rechecked(report, go_back_in_time))
    assert any("same counter value twice" in v for v in _rechecked(report, duplicate_add))
    assert any("converge" in v for v in _rechecked(report, stale_after_quiescence))


def _hard(config: CheckerConfig) -> CheckerConfig:
    """``config`` in the adversarial modes together: 6 names (5 keys and the counter) in
    caches of 2 entries, watch applies and etcd answers held up to 20 ms a quarter of the
    time, a compaction in the middle of every cut and stall, and every key read back at
    once after each operation."""
    return dataclasses.replace(config, cache_size=2, apply_delay=0.02,
                               compact_every_fault=True, reread=True)


@pytest.mark.timeout(150)  # time for a repeat on a new etcd (_run_on_new_etcd)
def test_short_run_small_cache_delayed_applies_compaction_resyncs(
        etcd_factory: Callable[..., LocalEtcd], tmp_path: Path) -> None:
    """3 processes, 10 s: the stores evict all the time, their watch applies and their etcd
    answers reach the cache late, and their watches resync after compactions."""
    config = _hard(CheckerConfig(seed=_seed(), processes=3, duration=10.0))
    report = _run(etcd_factory, tmp_path, config)
    counters = report.figures["store counters"]
    # Each mechanism of the mode really happened (else this test proves nothing new).
    assert counters.get("cache_evictions_total", 0) > 100, counters
    assert counters.get("watch_restarts_total{compacted}", 0) > 0, counters
    for where in ("apply", "read", "write"):
        assert counters.get(f"delays{{{where}}}", 0) > 0, counters
    assert report.figures["outcomes"].get("get:ok", 0) > 1000

    # The coherence check is not vacuous: a read that claims its store had already applied
    # the newest revision, though it returned an older value, is rejected.
    def read_after_applying_everything(r: Report) -> None:
        final = {key: value for _, key, value, _ in sorted(r.events)}
        last = max(revision for revision, *_ in r.events)
        for history in r.histories.values():
            for rec in history:
                if rec[0] == "get" and rec[3] == "ok" and rec[4] != final.get(rec[1]):
                    rec[8] = last  # as if its store's watch had applied every revision
                    return
        raise AssertionError("no read of a value that was replaced later")

    assert any("(coherence)" in v
               for v in _rechecked(report, read_after_applying_everything))


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("sabotage", "processes", "seconds"),
                         [("no-marks", 3, 6.0), ("no-gate", 3, 8.0), ("no-catch-up", 3, 6.0)])
def test_the_modes_catch_a_reverted_fix(etcd_factory: Callable[..., LocalEtcd],
                                        tmp_path: Path, sabotage: str, processes: int,
                                        seconds: float) -> None:
    """With a fix of ``cache.py`` reverted in the workers, the modes find violations within
    seconds. ``no-marks`` (rule 2: an evicted entry ahead of the watch leaves no mark): an
    older event re-installs a key after the process wrote or read something newer.
    ``no-gate`` (rule 3: a fill or write in flight is never refused): a read or write
    installs a state older than an event applied meanwhile, once the key was evicted in
    between (measured: 6 to 16 violations per 8 s run in 4 seeds). ``no-catch-up``
    (consistent reads answer from the cache without waiting for the watch to apply etcd's
    current revision): a consistent read returns a value older than a write another
    process saw acknowledged before the read began (33 in one 8 s run). Detection is a matter of
    the schedule a seed draws (about 1 run in 10 of 6 s finds nothing): up to 3 seeds are
    tried, and the test fails only if none of them finds the violation."""
    first = _seed()
    summaries = []
    for attempt in range(3):
        config = _hard(CheckerConfig(seed=first + attempt, processes=processes,
                                     duration=seconds, sabotage=sabotage,
                                     consistent_reads=0.5 if sabotage == "no-catch-up"
                                     else 0.0))
        workdir = tmp_path / str(attempt)
        workdir.mkdir()
        report = _run_on_new_etcd(etcd_factory, workdir, config)
        print("\n" + report.summary())
        summaries.append(report.summary())
        if report.violations:
            break
    assert report.violations, "the reverted fix went unnoticed in 3 runs:\n" + \
        "\n".join(summaries)
    assert all("monotonic" in v or "coherence" in v or "read-your-writes" in v
               or "linearizability" in v for v in report.violations), report.summary()
    if sabotage == "no-catch-up":
        assert any("linearizability" in v for v in report.violations), report.summary()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_short_run_kill_restart_queues_and_both_watch_scopes(
        etcd_factory: Callable[..., LocalEtcd], tmp_path: Path) -> None:
    """3 processes, 10 s: etcd SIGKILLed and restarted on its data, besides the proxies'
    faults and compactions; queue pushes and pops; one process in two watching only what
    it touched; a fifth of the reads through ``aget``. One checker judges it all.

    By hand (``pytest -m slow``), not in CI: a single etcd 3.5.1 SIGKILLed under load can
    lose a write it had already answered (etcd#14370, "Durability API guarantee broken in
    single node cluster", fixed in 3.5.5: a lone member applies and answers an entry
    before its WAL holds it), which the checker rightly reports. Seen 2026-12-05, seed 13,
    with the oracle's recording of before 67dca59 (which touches only the counter): a
    ``compare_set`` answered within a millisecond of the kill was not in etcd's history
    after the restart, and nothing else was missing. That recording failed 3 runs
    of seed 13 in 10 (the other two were not kept); with today's, seed 13 passed 10 runs of
    10 and seeds 101-112 once each. The CI run of seed 997650 that first failed here
    (acknowledged ``add``s the oracle never saw) was most likely the recording that
    67dca59 fixed: its kill, at +4.59 s, made the oracle resume and read a backlog. The
    kill and restart of a member runs in CI on a cluster, where a quorum holds every
    acknowledged entry (``test_short_run_on_a_cluster_that_loses_its_leader``)."""
    server = etcd_factory()
    config = CheckerConfig(seed=_seed(), processes=3, duration=10.0, kill=True, queues=True,
                           watch_scopes="mixed", async_reads=0.2)
    report = run(config, server.endpoint, tmp_path, servers=server)
    print("\n" + report.summary())
    assert not report.violations, (
        f"{report.summary()}\nreproduce: CHECKER_SEED={config.seed} pytest "
        f"tests/faults/test_checker.py")
    outcomes = report.figures["outcomes"]
    for op in ("get", "set", "cas", "add", "push", "pop"):
        assert outcomes.get(f"{op}:ok", 0) > 0, f"no successful {op}"
    assert report.figures["faults"].get("kill", 0) >= 1
    assert report.oracle_restarts > 0  # the kill reached etcd (and its oracle)

    # The queue check is not vacuous: an item popped twice, or lost, is reported.
    def pop_twice(r: Report) -> None:
        for history in r.histories.values():
            for rec in history:
                if rec[0] == "pop" and rec[3] == "ok" and rec[4] is not None:
                    history.append(list(rec))
                    return
        raise AssertionError("no pop")

    # More items gone than pops of unknown outcome could have taken.
    uncertain = report.figures["outcomes"].get("pop:maybe", 0)

    def lose_some(r: Report) -> None:
        r.queue_left = r.queue_left[uncertain + 1:]

    assert any("duplicated" in v for v in _rechecked(report, pop_twice))
    if len(report.queue_left) > uncertain:
        assert any("lost" in v for v in _rechecked(report, lose_some))


@pytest.mark.timeout(150)
def test_short_run_on_a_cluster_that_loses_its_leader(tmp_path: Path) -> None:
    """3 processes on a 3-member cluster, 10 s: the leader is SIGKILLed (an election) and
    restarted, besides the proxies' faults and compactions; queues, both watch scopes, a
    fifth of the reads through ``aget`` (what the single-member kill run above covers,
    without etcd#14370's lost writes)."""
    from cachedstore.testing import LocalEtcdCluster

    config = CheckerConfig(seed=_seed(), processes=3, duration=10.0, kill=True, queues=True,
                           watch_scopes="mixed", async_reads=0.2)
    with LocalEtcdCluster(3) as cluster:
        report = run(config, cluster.endpoints[0], tmp_path, servers=cluster)
    print("\n" + report.summary())
    assert not report.violations, (
        f"{report.summary()}\nreproduce: CHECKER_SEED={config.seed} pytest "
        f"tests/faults/test_checker.py")
    assert report.figures["faults"].get("kill", 0) >= 1
    assert report.figures["outcomes"].get("set:ok", 0) > 0


@pytest.mark.timeout(150)  # time for a repeat on a new etcd (_run_on_new_etcd)
def test_short_run_consistent_reads_are_linearizable(
        etcd_factory: Callable[..., LocalEtcd], tmp_path: Path) -> None:
    """3 processes, 8 s, the adversarial modes, half the reads ``consistent=True`` in
    both watch layouts: no consistent read returns a state older than a write of its key
    acknowledged (to any process) before it began."""
    config = _hard(CheckerConfig(seed=_seed(), processes=3, duration=8.0,
                                 consistent_reads=0.5, watch_scopes="mixed"))
    report = _run(etcd_factory, tmp_path, config)
    assert report.figures["outcomes"].get("cget:ok", 0) > 100


@pytest.mark.timeout(120)
def test_an_etcd_that_crashes_by_itself_is_reported_and_the_run_repeated(
        etcd_factory: Callable[..., LocalEtcd], tmp_path: Path) -> None:
    """An etcd that ends during a run without kill faults (a crash of etcd 3.5.1's own) is
    not taken for a finding about the stores: the run stops with EtcdCrashed as soon as
    its processes finish, quoting the exit code and the log, and the tests repeat it on a
    new etcd once."""
    config = CheckerConfig(seed=_seed(), processes=1, duration=6.0)
    with pytest.warns(UserWarning, match=r"etcd crashed under the checker") as warned:
        report = _run_on_new_etcd(etcd_factory, tmp_path, config, crash_first=True)
    assert not report.violations, report.summary()
    (crash,) = [str(w.message) for w in warned if "etcd crashed" in str(w.message)]
    assert "an etcd process ended during the run" in crash
    assert "running False, exit code -9" in crash


def _staleness_report(*, deleted: bool) -> Report:
    """p1 puts ``k0`` ("a", revision 2, over the absence since revision 0) at t=1 and, if
    ``deleted``, deletes it (revision 3) at t=10; p0 reads "absent" at t=10.01, its watch
    having applied revision 2 (3 if ``deleted``). The oracle's watch saw the delete at
    t=10.5, after the read returned (a loaded machine)."""
    config = CheckerConfig(seed=1, processes=2, keys=1)
    applied = 3 if deleted else 0
    reader = [["get", "k0", None, "ok", None, 10.01, 10.01, "run", applied],
              ["get", "k0", None, "ok", None, 20.0, 20.0, "settle", applied]]
    writer = [["set", "k0", "a", "ok", None, 0.9, 1.0, "run", 0]]
    events = [(2, "k0", "a", 1.0)]
    if deleted:
        writer.append(["delete", "k0", None, "ok", True, 10.0, 10.0, "run", 2])
        events.append((3, "k0", None, 10.5))
    writer.append(["get", "k0", None, "ok", None if deleted else "a", 20.0, 20.0, "settle",
                   applied])
    if not deleted:
        reader[1][4] = "a"
    return Report(config, "/p/", [], {0: reader, 1: writer}, {0: {}, 1: {}}, events, 0.0)


def test_staleness_is_judged_at_the_reads_latest_placement() -> None:
    """A read of "absent" just after a delete is current, even when the oracle's watch saw
    that delete later than the read returned: it is not judged by the older absence that a
    put replaced 9 s before (a CI failure: "read None 3.582 s after etcd replaced it")."""
    report = _staleness_report(deleted=True)
    check(report)
    assert not [v for v in report.violations if "after etcd replaced it" in v], \
        report.violations
    assert report.figures["reads older than etcd (count, max s)"] == (0, 0.0)


def test_staleness_bound_catches_an_old_absence() -> None:
    """The same read with no delete -- its only placement is the absence the put replaced
    9 s earlier -- is reported against the bound."""
    report = _staleness_report(deleted=False)
    check(report)
    assert [v for v in report.violations if "after etcd replaced it" in v] == [
        "p0 get(k0) at +10.010s: read None 9.010 s after etcd replaced it (bound 3.5 s)"], \
        report.violations


def test_the_oracle_records_the_counter_after_every_revision_of_a_response() -> None:
    """A watch response can carry many revisions (the backlog etcd sends a watch that
    resumed on another member after its leader was killed): the counter's value after
    each of them is in the oracle's history, not only the last one's (a CI run reported
    16 adds and 15 reads of ctr as "not in etcd's history" right after a resume). Two
    changes at one revision (a Txn) are one state."""
    from etcd3.etcdrpc import kv_pb2, rpc_pb2

    from cachedstore.counters import MARK

    from .checker import _Oracle

    prefix = b"/oracle/"
    ones = prefix + b"\xff\xffcounter/" + COUNTER.encode() + b"/ones"
    key = prefix + COUNTER.encode()

    def put(k: bytes, value: bytes, revision: int, version: int = 1) -> object:
        return kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv_pb2.KeyValue(
            key=k, value=value, mod_revision=revision, version=version))

    oracle = _Oracle([], prefix, 10, watch=False)
    oracle.apply(rpc_pb2.WatchResponse(events=[
        put(key, MARK + b"0", 10), put(ones, b"", 10, version=1),  # one Txn: one state
        put(ones, b"", 11, version=2), put(prefix + b"k0", b"x", 12),
        put(ones, b"", 13, version=3), put(ones, b"", 14, version=4)]), now=1.0)
    assert [(r, v) for r, name, v, _ in oracle.events if name == COUNTER] == [
        (10, "1"), (11, "2"), (13, "3"), (14, "4")]
    assert oracle.revision == 14


def test_plan_is_reproducible() -> None:
    config = CheckerConfig(seed=1234)
    assert make_plan(config) == make_plan(CheckerConfig(seed=1234))
    assert make_plan(config) != make_plan(CheckerConfig(seed=1235))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [lambda c: c, _hard],
                         ids=["plain", "small-cache-delays-compactions"])
def test_long_run_under_faults(etcd_factory: Callable[..., LocalEtcd], tmp_path: Path,
                               mode: Callable[[CheckerConfig], CheckerConfig]) -> None:
    """By hand: ``pytest -m slow tests/faults/test_checker.py -s`` (4 processes, 120 s each
    mode; ``CHECKER_DURATION=<s>`` to change, ``CHECKER_SEED=<n>`` to reproduce)."""
    seconds = float(os.environ.get("CHECKER_DURATION", "120"))
    _run(etcd_factory, tmp_path, mode(CheckerConfig(seed=_seed(), processes=4,
                                                    duration=seconds)))
