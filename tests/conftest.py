"""Shared pytest fixtures: throw-away etcd servers and per-test key prefixes."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks.fanout.etcd_metrics import SettledSampler
from cachedstore.server import LocalEtcd


@pytest.fixture(scope="session")
def etcd() -> Iterator[LocalEtcd]:
    """One etcd member shared by the whole session; use the ``prefix`` fixture for keys."""
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[LocalEtcd]:
    """An etcd for the requesting module alone: its /metrics count only that module's
    traffic."""
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def settled(own_etcd: LocalEtcd) -> Iterator[SettledSampler]:
    """Samples of ``own_etcd`` that count every proposal committed before them."""
    with SettledSampler(own_etcd.endpoint, own_etcd.metrics_url) as sampler:
        yield sampler


@pytest.fixture
def etcd_factory() -> Iterator[Callable[..., LocalEtcd]]:
    """A callable ``(**LocalEtcd kwargs) -> started LocalEtcd``; all are closed at teardown."""
    servers: list[LocalEtcd] = []

    def make(**kwargs: Any) -> LocalEtcd:
        server = LocalEtcd(**kwargs)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to this test, e.g. ``/t/test_get-1a2b3c4d/``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:60]
    return f"/t/{name}-{secrets.token_hex(4)}/"
