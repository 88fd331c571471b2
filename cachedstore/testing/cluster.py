"""A throw-away etcd cluster on loopback: :class:`LocalEtcdCluster`."""

from __future__ import annotations

import contextlib
import http.client
import subprocess
import time
import uuid
from collections.abc import Callable

from cachedstore.server import LocalEtcd
from cachedstore.server.base import START_ATTEMPTS, Startable
from cachedstore.server.binaries import EtcdStartError, run_etcdctl
from cachedstore.server.process import DEFAULT_HOST, hostport


class LocalEtcdCluster(Startable):
    """``size`` etcd members on loopback forming one cluster (default 3).

    Each member is a :class:`LocalEtcd` (``members[i]``) that can be killed, restarted,
    stopped, paused and resumed on its own. :meth:`start` launches all members at once and
    blocks until every one is healthy (which needs an elected leader).

    ``peer_proxy``, if given, is called as ``peer_proxy(member_name, "host:peer_port")``
    for every member before each launch (again after a port clash) and returns the
    ``host:port`` its peers must use instead: a proxy forwarding to that peer port. Every
    peer link then runs through proxies the caller controls (to partition one member from
    its peers while its client port stays reachable); the caller owns and closes them.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        startup_timeout: float = 30.0,
        peer_proxy: Callable[[str, str], str] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        self.host = DEFAULT_HOST
        self.startup_timeout = startup_timeout
        self._peer_proxy = peer_proxy
        token = f"cachedstore-{uuid.uuid4().hex[:12]}"
        self.members: list[LocalEtcd] = [
            LocalEtcd(name=f"node{i}", startup_timeout=startup_timeout,
                      initial_cluster_token=token)
            for i in range(size)
        ]
        self._set_initial_cluster()
        self._closed = False

    def _set_initial_cluster(self) -> None:
        if self._peer_proxy is not None:
            for m in self.members:
                m.advertised_peer = self._peer_proxy(m.name, hostport(m.host, m.peer_port))
        cluster = ",".join(f"{m.name}={m.advertised_peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = cluster

    def __repr__(self) -> str:
        return f"<LocalEtcdCluster {self.endpoints}>"

    def __len__(self) -> int:
        return len(self.members)

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member, in member order."""
        return [m.endpoint for m in self.members]

    def start(self) -> LocalEtcdCluster:
        """Launch all members concurrently and block until all are healthy."""
        if self._closed:
            raise RuntimeError(f"{self!r} was closed")
        if all(m.running for m in self.members):
            return self
        for attempt in range(START_ATTEMPTS):
            for member in self.members:
                if not member.running:
                    member._launch()
            try:
                self.wait_healthy()
                return self
            except EtcdStartError:
                clash = any(m._port_conflict() for m in self.members)
                fresh = attempt + 1 < START_ATTEMPTS and clash
                for member in self.members:
                    member.kill()
                if not fresh:
                    raise
                for member in self.members:
                    member._reset_for_retry()
                self._set_initial_cluster()
        raise AssertionError("unreachable")  # pragma: no cover

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until every running, unpaused member reports healthy."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        for member in self.members:
            if member.running and not member.paused:
                member.wait_healthy(max(0.0, deadline - time.monotonic()))

    def leader(self, timeout: float = 10.0) -> int:
        """Index in :attr:`members` of the current leader; blocks until there is one.

        Reads the ``etcd_server_is_leader`` gauge of every running, unpaused member and
        waits until exactly one of them reports 1. Raises :class:`TimeoutError`.
        """
        deadline = time.monotonic() + timeout
        while True:
            leaders = []
            for index, member in enumerate(self.members):
                if not member.running or member.paused:
                    continue
                with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                    if member.etcd_metric("etcd_server_is_leader", timeout=1.0) == 1.0:
                        leaders.append(index)
            if len(leaders) == 1:
                return leaders[0]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no single leader among {self.endpoints} after {timeout} s")
            time.sleep(0.1)

    def etcdctl(
        self,
        *args: str,
        user: str | None = None,
        password: str | None = None,
        check: bool = True,
        timeout: float = 30.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl <args>`` with ``--endpoints`` listing every member."""
        return run_etcdctl(
            self.endpoints,
            args,
            tls=None,
            scheme=self.members[0].scheme,
            user=user,
            password=password,
            input=None,
            check=check,
            timeout=timeout,
        )

    def close(self) -> None:
        """Kill every member and remove their temporary directories (idempotent)."""
        self._closed = True
        for member in self.members:
            member.close()
