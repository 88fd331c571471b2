"""Fixtures of the benchmarks (``pytest benchmarks``; not part of the normal test run).

- ``env``: the session's :class:`harness.Env` (one etcd with v2 enabled, TCPStore servers).
- ``record``: ``record(key, **numbers)`` stores a workload's numbers in pytest-benchmark's
  ``extra_info`` and in the session's results JSON (``$CACHEDSTORE_BENCH_RESULTS``, default
  ``benchmarks/out/results.json``), which ``run.py`` turns into tables and plots.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

_RESULTS: dict[str, Any] = {}


@pytest.fixture(scope="session")
def env() -> Iterator[harness.Env]:
    _RESULTS["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    e = harness.Env()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(autouse=True)
def _close_test_clients(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "env" in request.fixturenames:
        request.getfixturevalue("env").end_test()


@pytest.fixture(scope="session")
def scale() -> harness.Scale:
    return harness.scale()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``record(key, **data)``: keep ``data`` under ``key`` in the session's results."""

    def _record(key: str, **data: Any) -> None:
        _RESULTS.setdefault("workloads", {})[key] = data
        bench = request.node.funcargs.get("benchmark")
        if bench is not None:
            bench.extra_info.update({k: v for k, v in data.items()
                                     if isinstance(v, (int, float, str, bool, type(None)))})

    return _record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for message in harness.NOTES:
        terminalreporter.write_line(f"[bench] note: {message}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "workloads" not in _RESULTS:
        return
    for message in harness.NOTES:
        if message not in _RESULTS.setdefault("notes", []):
            _RESULTS["notes"].append(message)
    path = os.environ.get(harness.RESULTS_ENV) or os.path.join(harness.HERE, "out",
                                                                "results.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _RESULTS["machine"] = harness.machine()
    with open(path, "w") as f:
        json.dump(_RESULTS, f, indent=1, sort_keys=True, default=str)
