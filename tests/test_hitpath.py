"""``benchmarks/hitpath.py`` runs and measures what it says (no timing assertions here:
the figures belong in the report of a hand run, not in CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "hitpath.py"


@pytest.mark.timeout(120)
def test_hitpath_compares_two_trees_side_by_side() -> None:
    """``--compare HEAD``: this checkout (A) and a temporary worktree of HEAD (B), each
    measured in its own process importing its own tree, with the dict and locked-LRU
    baselines and the zipf hit ratio of each side, and the worktree removed after."""
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], check=True,
                            capture_output=True, text=True).stdout
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--number", "200", "--repeat", "3", "--compare",
         "HEAD", "--rounds", "1", "--json"],
        check=True, capture_output=True, text=True, timeout=110)
    result = json.loads(done.stdout)
    assert set(result["figures"]) == {"A", "B"}
    for side, runs in result["runs"].items():
        (run,) = runs
        assert run["metrics on"]["samples"] == 3 and run["metrics on"]["calls_per_sample"] == 200
        for label in ("metrics on", "metrics=False", "dict[k] (baseline)",
                      "locked LRU (baseline)", "empty call (harness)"):
            assert 0 < result["figures"][side][label] < 1e6  # ns per call
            assert result["ratios_to_dict"][side][label] > 0
        assert result["ratios_to_dict"][side]["dict[k] (baseline)"] == 1.0
        assert 0 < result["hit_ratio"][side]["hit_ratio"] < 1  # a zipf workload, evicting
        tree = Path(run["cachedstore"]).parent
        assert (tree == ROOT) == (side == "A"), run["cachedstore"]
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], check=True,
                           capture_output=True, text=True).stdout
    assert after == before, "the temporary worktree was left behind"
