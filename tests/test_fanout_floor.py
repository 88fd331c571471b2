"""The fan-out benchmark's floor (issue 26, item 4): every pattern on one ``HashStore``.

``run_pattern(in_process=True)`` gives the ranks, threads of this process, views of one
``HashStore``: what the harness and torch's own Python cost a rank when the store costs
next to nothing. ``benchmarks.fanout.compare --floor`` puts it beside the two revisions, so
that a ratio's least reachable value is known. These tests check that each pattern really
runs there (a rank that never waited, or a pattern that stopped early, would make the floor
a fiction), that the floor cannot be asked of worker processes, and the table's columns.
"""

from __future__ import annotations

import pytest

from benchmarks.fanout.compare import table
from benchmarks.fanout.patterns import PATTERNS
from benchmarks.fanout.simulator import run_pattern

W = 4


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_every_pattern_runs_on_the_shared_hash_store(pattern: str) -> None:
    r = run_pattern(pattern, W, in_process=True, processes=0, budget=30)
    assert r.finished and not r.errors, r.errors
    assert r.backend == "hash" and r.counts is None
    assert r.breakdown["ranks"] == W * PATTERNS[pattern].steps(W)
    assert r.client_cpu_s > 0 and r.cpu_by_thread["rank"] > 0
    # (The barriers, the broadcast and the groups finish only if the ranks' stores are one:
    # a rank waits there for keys that the others write.)


def test_a_second_run_starts_from_an_empty_store() -> None:
    """Each run is its own job (prefix); the process forgets the job's store at the end."""
    from benchmarks.fanout import worker

    for _ in range(2):
        r = run_pattern("store_barrier", W, in_process=True, processes=0, budget=30)
        assert r.finished and not r.errors, r.errors
    assert not worker._hash_stores  # noqa: SLF001


@pytest.mark.parametrize("processes", [None, 2])
def test_the_floor_needs_the_ranks_in_this_process(processes: int | None) -> None:
    with pytest.raises(ValueError, match="processes=0"):
        run_pattern("store_barrier", W, in_process=True, processes=processes)


def test_one_backend_at_a_time() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        run_pattern("store_barrier", W, tcp_endpoint="127.0.0.1:1", in_process=True,
                    processes=0)
    with pytest.raises(ValueError, match="exactly one"):
        run_pattern("store_barrier", W)


def test_the_table_shows_the_floor_and_the_least_reachable_ratio() -> None:
    def run(cpu: float) -> dict[str, object]:
        return {"pattern": "p", "ok": True, "cpu": cpu, "rank": cpu, "watch": 0.0,
                "other": 0.0}

    before, now, floor = [run(4e-3)], [run(2e-3)], [run(1e-3), run(3e-3), run(2e-3)]
    text = table(before, now, "abc", ["p"], floor)
    header, rule, row = text.splitlines()
    assert header.endswith("| floor: CPU / rank | floor / abc |")
    assert rule.count("|---") == header.count(" | ") + 1
    assert row == ("| p | 4,000 µs | 4,000 / 0 / 0 | 2,000 µs | 2,000 / 0 / 0 | 0.50 |"
                   " 2,000 µs | 0.50 |")
    assert "floor" not in table(before, now, "abc", ["p"])
