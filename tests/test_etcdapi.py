"""``cachedstore.etcdapi``: the one place etcd requests are built."""

from __future__ import annotations

import re
from pathlib import Path

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
