"""Small helpers shared by the tests (no fixtures here: those live in conftest.py)."""

from __future__ import annotations

import ast
import asyncio
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import etcd3
import grpc
from prometheus_client import CollectorRegistry

from cachedstore.aio import MAX_WORKERS, AsyncFront
from cachedstore.server import LocalEtcd
from cachedstore.server.binaries import find_etcd_binary

T = TypeVar("T")


def raw_client(server: LocalEtcd) -> etcd3.Etcd3Client:
    """A plain python3-etcd3 client: "another process" writing to the same etcd."""
    host, port = server.endpoint.rsplit(":", 1)
    return etcd3.client(host=host, port=int(port), timeout=10)


def eventually(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.005,
               what: str = "condition") -> T:
    """Poll ``check`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s (last: {value!r})")
        time.sleep(interval)


def sample(registry: CollectorRegistry | None, name: str, **labels: str) -> float:
    """The value of one sample of a registry (0.0 when absent)."""
    assert registry is not None
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def rpc_count(registry: CollectorRegistry | None, method: str) -> float:
    """RPCs of ``method`` the store sent to etcd, all codes."""
    assert registry is not None
    total = 0.0
    for family in registry.collect():
        if family.name == "cachedstore_etcd_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("method") == method:
                    total += s.value
    return total


class FakeRpcError(grpc.RpcError):
    """A gRPC status as etcd sends it (pure translation test: no etcd involved)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@contextmanager
def held_watch(store: Any) -> Iterator[threading.Event]:
    """Hold ``store``'s watch thread before it applies anything (its ``apply_events``);
    set the event yielded to release it. A deterministic "the watch is behind"."""
    release = threading.Event()
    cache = store._cache
    original = cache.apply_events

    def held(events: Any, revision: int, scope: Any = None) -> None:
        release.wait(30)
        original(events, revision, scope)

    cache.apply_events = held
    try:
        yield release
    finally:
        release.set()
        cache.apply_events = original


@contextmanager
def held_opening(store: Any, name: str) -> Iterator[threading.Thread]:
    """Start a thread that reads ``name`` from ``store`` (watching what it touched) and
    hold its scope opening after etcd answered, before the scopes open (the opener's
    ``after_read``); yields the thread once it is held, lets it go and joins it on exit.
    The read's own outcome is not kept (a test may close the store under it)."""
    held, release = threading.Event(), threading.Event()

    def hold(keys: list[str]) -> None:
        held.set()
        release.wait(30)

    def read() -> None:
        with suppress(Exception):
            store.get(name)

    store._opener.after_read = hold
    opening = threading.Thread(target=read, name="held-opening")
    opening.start()
    try:
        assert held.wait(10), "the opening never read etcd"
        yield opening
    finally:
        release.set()
        opening.join(10)
        store._opener.after_read = None


# -- the package's import graph (tests/test_layout.py, tests/test_console.py) -------------
def package_modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``package`` (a directory)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: every import, function-level ones
    included, ``if TYPE_CHECKING:`` blocks excepted; ``from . import x`` of submodules
    counts as importing them, not the package's body."""
    modules = package_modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        base_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {id(sub) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for sub in ast.walk(node)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base_package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names]
                candidates = subs if all(s in modules for s in subs) else [target, *subs]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            deps.update(c for c in candidates if c in modules and c != name)
        graph[name] = deps
    return graph


def save_backup(server: LocalEtcd, path: Path) -> int:
    """Save a backup of ``server``'s data (``etcdctl snapshot save``); returns the
    revision it holds."""
    server.etcdctl("snapshot", "save", str(path))
    out = server.etcdctl("endpoint", "status", "-w", "fields").stdout
    return int(next(line for line in out.splitlines() if '"Revision"' in line).split()[-1])


def restore_backup(server: LocalEtcd, backup: Path, scratch: Path) -> None:
    """Stop ``server`` and start it again on ``backup``, as an operator restores one
    without ``--bump-revision``/``--mark-compacted``: same name, peer URL and cluster
    token, so the same cluster and member ids, back at the backup's revision (the
    revisions after it are handed out again). ``scratch``: an empty directory's parent."""
    server.stop()
    restored = scratch / "restored"
    subprocess.run(
        [find_etcd_binary("etcdutl"), "snapshot", "restore", str(backup),
         f"--name={server.name}", f"--data-dir={restored}",
         f"--initial-cluster={server.name}={server.advertised_peer_url}",
         f"--initial-cluster-token={server.initial_cluster_token}",
         f"--initial-advertise-peer-urls={server.advertised_peer_url}"],
        check=True, capture_output=True, timeout=30)
    shutil.rmtree(server.data_dir)
    shutil.move(str(restored), str(server.data_dir))
    server.restart()


class BusyPool:
    """Every thread of ``front``'s executor held by a call that waits for ``release``."""

    def __init__(self, front: AsyncFront) -> None:
        self.release = threading.Event()
        self._started = threading.Semaphore(0)
        self._front = front

    def _hold(self) -> None:
        self._started.release()
        self.release.wait(30)

    async def __aenter__(self) -> BusyPool:
        self._tasks = [asyncio.ensure_future(self._front.run(self._hold))
                       for _ in range(MAX_WORKERS)]
        for _ in range(MAX_WORKERS):  # every thread took one
            assert await asyncio.to_thread(self._started.acquire, True, 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await asyncio.gather(*self._tasks)
