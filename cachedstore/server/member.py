"""One throw-away etcd member: :class:`LocalEtcd`."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .base import ServerProcess
from .binaries import EtcdctlError, EtcdStartError, run_etcdctl
from .process import DEFAULT_HOST, free_port, hostport, http_get
from .tls import TLSFiles


class LocalEtcd(ServerProcess):
    """One local etcd member in a private temporary directory.

    Construction allocates ports and a temporary directory but starts nothing; call
    :meth:`start` or use the object as a context manager. See :mod:`cachedstore.server` for
    blocking behaviour and the cleanup contract.

    Ports left as ``None`` are picked with :func:`free_port`; if etcd then fails because a
    port was taken in the meantime, the start is retried (up to 3 attempts) with new ports.
    Explicit ports are never changed, and :meth:`restart` always reuses the same ports.
    """

    _first_poll = 0.02
    _max_poll = 0.2
    _port_scan_lines = 10_000

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        host: str = DEFAULT_HOST,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "default",
        extra_args: Iterable[str] = (),
        auth_token_ttl: int | None = None,
        enable_v2: bool = False,
        tls: TLSFiles | None = None,
        log_level: str = "error",
        startup_timeout: float = 20.0,
        env: Mapping[str, str] | None = None,
        metrics_port: int | None = None,
        initial_cluster_token: str | None = None,
    ) -> None:
        if tls is not None and tls.client_cert_auth and not (tls.client_cert and tls.client_key):
            raise ValueError("TLSFiles.client_cert_auth needs client_cert and client_key")
        super().__init__(
            label=f"etcd {name}",
            tmp_prefix=f"cachedstore-etcd-{name}-",
            log_name="etcd.log",
            host=host,
            tls=tls,
            extra_args=extra_args,
            startup_timeout=startup_timeout,
            env=env,
            metrics_port=metrics_port,
            # a caller's data dir outlives us: stop etcd gracefully rather than SIGKILL it
            stop_on_close=data_dir is not None,
        )
        self.name = name
        self.auth_token_ttl = auth_token_ttl
        self.enable_v2 = enable_v2
        self.log_level = log_level
        #: ``--initial-cluster`` value; ``None`` means a one-member cluster of this member.
        self.initial_cluster: str | None = None
        self.initial_cluster_token = initial_cluster_token or f"cachedstore-{uuid.uuid4().hex[:12]}"
        self._auto_ports = client_port is None, peer_port is None, metrics_port is None
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self._data_dir = self._tmp_root / "data" if data_dir is None else Path(data_dir)
        #: ``host:port`` peers are told to use instead of the peer port this member listens
        #: on (a proxy forwarding to it); ``None``: the peer port itself.
        self.advertised_peer: str | None = None

    # ---- addresses

    @property
    def scheme(self) -> str:
        """``https`` when serving clients over TLS, else ``http``."""
        return "https" if self.tls is not None else "http"

    @property
    def endpoint(self) -> str:
        """``host:client_port``, as etcd3 clients and ``--endpoints`` expect it."""
        return hostport(self.host, self.client_port)

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{hostport(self.host, self.peer_port)}"

    @property
    def advertised_peer_url(self) -> str:
        """The peer URL in ``--initial-advertise-peer-urls`` and ``--initial-cluster``: the
        listening one unless :attr:`advertised_peer` names a proxy in front of it."""
        if self.advertised_peer is None:
            return self.peer_url
        return f"http://{self.advertised_peer}"

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    @property
    def paused(self) -> bool:
        return self._proc.paused

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid={self.pid}" if self.running else "stopped"
        return f"<LocalEtcd {self.name} {self.client_url} {state}>"

    # ---- lifecycle

    def command(self) -> list[str]:
        """The etcd command line used by :meth:`start`."""
        cluster = self.initial_cluster or f"{self.name}={self.advertised_peer_url}"
        cmd = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.advertised_peer_url}",
            f"--initial-cluster={cluster}",
            f"--initial-cluster-token={self.initial_cluster_token}",
            "--initial-cluster-state=new",
            f"--listen-metrics-urls={self.metrics_url}",
            f"--log-level={self.log_level}",
            "--logger=zap",
        ]
        if self.auth_token_ttl is not None:
            cmd += ["--auth-token=simple", f"--auth-token-ttl={int(self.auth_token_ttl)}"]
        if self.enable_v2:
            cmd.append("--enable-v2=true")
        if self.tls is not None:
            cmd += [f"--cert-file={self.tls.server_cert}", f"--key-file={self.tls.server_key}"]
            if self.tls.client_cert_auth:
                # etcd 3.5 demands a client certificate as soon as --trusted-ca-file is set,
                # even without --client-cert-auth: pass the CA only when certs are wanted.
                cmd += [f"--trusted-ca-file={self.tls.ca_cert}", "--client-cert-auth=true"]
        cmd += list(self.extra_args)
        return cmd

    def _ready_once(self) -> bool:
        """One ``GET /health`` on the client URL (using the TLS files if any)."""
        context = self.tls.ssl_context() if self.tls is not None else None
        try:
            body = http_get(f"{self.client_url}/health", timeout=1.0, context=context)
            return json.loads(body).get("health") == "true"
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return False

    def _exited_message(self, code: int) -> str:
        return f"etcd {self.name} exited with code {code} while starting"

    def _stalled_message(self, waited: float) -> str:
        return f"etcd {self.name} at {self.client_url} not healthy after {waited:g} s"

    def _may_retry(self) -> bool:
        # a retry wipes the data dir, so only a fresh one may be retried
        fresh = not self._data_dir.exists() or not any(self._data_dir.iterdir())
        return any(self._auto_ports) and fresh

    def _reset_for_retry(self) -> None:
        """After a port clash on a fresh start: wipe the data dir and pick new auto ports."""
        self._proc.kill()
        if self._data_dir.exists():
            shutil.rmtree(self._data_dir, ignore_errors=True)
        auto_client, auto_peer, auto_metrics = self._auto_ports
        if auto_client:
            self.client_port = free_port(self.host)
        if auto_peer:
            self.peer_port = free_port(self.host)
        if auto_metrics:
            self.metrics_port = free_port(self.host)

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until ``/health`` reports ``true``; raise :class:`EtcdStartError` otherwise.

        Fails early if the etcd process exits. ``timeout`` defaults to ``startup_timeout``.
        """
        self._wait_ready(timeout)

    def restart(self) -> LocalEtcd:
        """Stop etcd if running, start it again on the same data dir and ports; blocks."""
        self._check_open()
        self.stop()
        self._launch()
        try:
            self.wait_healthy()
        except EtcdStartError:
            self._proc.kill()
            raise
        return self

    def pause(self) -> None:
        """SIGSTOP etcd: it keeps its sockets but answers nothing until :meth:`resume`."""
        self._proc.pause()

    def resume(self) -> None:
        """SIGCONT a paused etcd."""
        self._proc.resume()

    # ---- etcdctl

    def etcdctl(
        self,
        *args: str,
        user: str | None = None,
        password: str | None = None,
        input: str | None = None,  # noqa: A002 - mirrors subprocess.run
        check: bool = True,
        timeout: float = 30.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl <args>`` (API v3) against this member; blocks up to ``timeout``.

        Credentials are passed through the environment, never on the command line.
        Raises :class:`EtcdctlError` on a non-zero exit when ``check`` is true.
        """
        return run_etcdctl(
            self.endpoints,
            args,
            tls=self.tls,
            scheme=self.scheme,
            user=user,
            password=password,
            input=input,
            check=check,
            timeout=timeout,
        )

    def status(self, *, user: str | None = None, password: str | None = None) -> dict[str, Any]:
        """``etcdctl endpoint status -w json`` of this member (the ``Status`` object)."""
        out = self.etcdctl("endpoint", "status", "-w", "json", user=user, password=password)
        return dict(json.loads(out.stdout)[0]["Status"])

    def current_revision(self, *, user: str | None = None, password: str | None = None) -> int:
        """The current store revision."""
        return int(self.status(user=user, password=password)["header"]["revision"])

    def compact(
        self,
        revision: int | None = None,
        *,
        physical: bool = False,
        user: str | None = None,
        password: str | None = None,
    ) -> int:
        """Compact the key-value history up to ``revision`` (default: the current one).

        Compacting to an already compacted revision is not an error. With auth enabled,
        pass root credentials. Returns the revision compacted to.
        """
        if revision is None:
            revision = self.current_revision(user=user, password=password)
        args = ["compact", str(revision)] + (["--physical"] if physical else [])
        result = self.etcdctl(*args, user=user, password=password, check=False)
        if result.returncode != 0 and "required revision has been compacted" not in (
            result.stderr or ""
        ):
            raise EtcdctlError(result.returncode, result.args, result.stdout, result.stderr)
        return revision

    def enable_auth(self, root_password: str) -> None:
        """Create user ``root`` with ``root_password``, grant it role ``root``, enable auth.

        The password is handed to etcdctl on stdin, so it must not contain whitespace.
        """
        if not root_password or any(c.isspace() for c in root_password):
            raise ValueError("root_password must be non-empty and contain no whitespace")
        self.etcdctl("user", "add", "root", "--interactive=false", input=root_password + "\n")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("auth", "enable")
