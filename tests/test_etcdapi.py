"""``cachedstore.etcdapi``: the one place etcd requests are built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachedstore import etcdapi

PACKAGE = Path(etcdapi.__file__).parent
#: Modules still building ``etcdrpc`` messages themselves besides etcdapi, and why: the
#: connection (stubs and the auth request) and the watcher (owned by the fault work).
ALLOWED = {"etcdapi.py", "connection.py", "watcher.py"}


def test_no_module_builds_etcd_requests_outside_the_vocabulary() -> None:
    builders = re.compile(r"etcdrpc\.\w+(Request|Compare|RequestOp)\b|etcdrpc\.Compare\(")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ALLOWED and path.parent == PACKAGE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if builders.search(line) or "from etcd3 import etcdrpc" in line:
                offenders.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not offenders, "build it with cachedstore.etcdapi:\n" + "\n".join(offenders)


def test_the_check_above_sees_a_builder() -> None:
    line = "        create = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest("
    assert re.search(r"etcdrpc\.\w+(Request|Compare|RequestOp)\b", line)


def test_watch_create_never_asks_for_fragments() -> None:
    request = etcdapi.watch_create(b"/p/", b"/p0", 7, progress_notify=True)
    create = request.create_request
    assert (create.key, create.range_end, create.start_revision) == (b"/p/", b"/p0", 7)
    assert create.progress_notify
    assert not etcdapi.watch_create(b"k", b"", 1).create_request.progress_notify


def test_status_auth_and_watch_progress() -> None:
    assert type(etcdapi.status()).__name__ == "StatusRequest"
    auth = etcdapi.authenticate("alice", "s3cret")
    assert (auth.name, auth.password) == ("alice", "s3cret")
    assert etcdapi.watch_progress().HasField("progress_request")


@pytest.mark.parametrize(("code", "details", "expected"), [
    # etcd 3.5's own texts, as the connection layer and the watch meet them
    ("UNAVAILABLE", "etcdserver: no leader", "NO_LEADER"),
    ("UNKNOWN", "etcdserver: leader changed", "NO_LEADER"),
    ("UNAVAILABLE", "failed to connect to all addresses; last error: UNKNOWN: "
                    "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
     "UNSENT"),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", "TRANSPORT"),
    ("PERMISSION_DENIED", "etcdserver: permission denied", "PERMISSION"),
    ("INVALID_ARGUMENT", "etcdserver: authentication failed, invalid user ID or password",
     "AUTH_FAILED"),
    ("FAILED_PRECONDITION", "etcdserver: authentication is not enabled", "AUTH_NOT_ENABLED"),
    ("UNAUTHENTICATED", "etcdserver: invalid auth token", "TOKEN"),
    ("INVALID_ARGUMENT", "etcdserver: request is too large", "TOO_LARGE"),
    ("INVALID_ARGUMENT", "etcdserver: too many operations in txn request", "TOO_LARGE"),
    ("NOT_FOUND", "etcdserver: requested lease not found", "LEASE_NOT_FOUND"),
    ("OUT_OF_RANGE", "etcdserver: mvcc: required revision has been compacted", "COMPACTED"),
    ("CANCELLED", "Received RST_STREAM with error code 8", "CANCELLED"),
    ("INVALID_ARGUMENT", "etcdserver: duplicate key given in txn request", "OTHER"),
    # a watch's cancel reasons have no status code
    (None, "rpc error: code = PermissionDenied desc = etcdserver: permission denied",
     "PERMISSION"),
    (None, "etcdserver: invalid auth token", "TOKEN"),
    (None, "etcdserver: mvcc: required revision has been compacted", "COMPACTED"),
])
def test_one_table_says_what_every_failure_means(code, details, expected) -> None:
    import grpc

    from cachedstore.etcdapi import Failure, classify

    status = getattr(grpc.StatusCode, code) if code else None
    assert classify(status, details) is Failure[expected]
