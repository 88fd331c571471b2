"""What the CLI and the demo share (``cachedstore.console``), and the layering around it:
``cli`` → ``demo`` → ``console``/``client`` → the library, never upwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from util import import_graph

import cachedstore
from cachedstore import errors
from cachedstore.console import (
    EXIT_ETCD_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_PERMISSION,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CommandError,
    exit_code_for,
    one_line,
)
from cachedstore.demo import DemoError
from cachedstore.server import EtcdStartError

PACKAGE = Path(cachedstore.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Every cachedstore module → the cachedstore modules it imports, at any depth of
    the file (function-level imports count: they are imports too)."""
    return import_graph(PACKAGE)


def _imports_of(graph: dict[str, set[str]], module: str, target: str) -> bool:
    return any(t == target or t.startswith(target + ".") for t in graph[module])


def test_nothing_below_the_cli_imports_it_and_the_demo_imports_no_cli() -> None:
    graph = _imports()
    assert "cachedstore.cli" in graph and "cachedstore.demo.workload" in graph
    importers = {m for m in graph if _imports_of(graph, m, "cachedstore.cli")}
    assert importers <= {"cachedstore.__main__"}, importers
    demo_importers = {m for m in graph if _imports_of(graph, m, "cachedstore.demo")
                      and not m.startswith("cachedstore.demo")}
    assert demo_importers <= {"cachedstore.cli"}, demo_importers
    for low in ("cachedstore.console", "cachedstore.client"):
        assert not _imports_of(graph, low, "cachedstore.cli")
        assert not _imports_of(graph, low, "cachedstore.demo")


@pytest.mark.parametrize("exc, code", [
    (errors.KeyNotFoundError("k"), EXIT_NOT_FOUND),
    (errors.InvalidInputError("bad"), EXIT_USAGE),
    (errors.AuthenticationError("no"), EXIT_PERMISSION),
    (errors.TLSError("tls"), EXIT_UNREACHABLE),
    (EtcdStartError("cannot start", "tail"), EXIT_UNREACHABLE),
    (errors.StoreTimeoutError("late"), EXIT_TIMEOUT),
    (errors.EtcdError("odd"), EXIT_ETCD_ERROR),
    (KeyboardInterrupt(), EXIT_INTERRUPTED),
    (DemoError("worker 1 died", 6), 6),
    (CommandError("usage", EXIT_USAGE), EXIT_USAGE),
])
def test_exit_codes(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code


@pytest.mark.parametrize("message, shown", [
    ("etcd range: etcd unreachable (UNAVAILABLE: connection refused)",
     "etcd unreachable (UNAVAILABLE: connection refused)"),
    ("etcd put: etcdserver: permission denied", "etcdserver: permission denied"),
    ("etcd txn: too many operations in txn request",
     "etcd: too many operations in txn request"),
    ("etcd range: TLS handshake with etcd failed (x); check ca_cert and the server's "
     "certificate", "etcd: TLS handshake with etcd failed (x); check --cacert and the "
     "server's "
     "certificate"),
    ("give both cert_key and cert_cert, or neither", "give both --key and --cert, or neither"),
    ("etcd authenticate: invalid auth token (are user and password set?)",
     "etcd: invalid auth token (are --user and --password set?)"),
    ("a message\n  on two lines", "a message"),
])
def test_one_line_is_for_people(message: str, shown: str) -> None:
    assert one_line(errors.EtcdError(message)) == shown


def test_one_line_quotes_the_last_log_line_and_is_bounded() -> None:
    exc = EtcdStartError("etcd exited with code 1", "line one\nthe reason")
    assert one_line(exc) == "etcd exited with code 1 [etcd log: the reason]"
    assert len(one_line(errors.EtcdError("x" * 2000))) == 500
