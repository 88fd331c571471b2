"""What every throw-away server shares: lifecycle, readiness polling, addresses, metrics.

:class:`Startable` is the context-manager contract (``__enter__`` starts, ``__exit__``
closes, a failed start closes too). :class:`ServerProcess` is one etcd binary run as a
:class:`~cachedstore.server.process.ManagedProcess` in a private temporary directory; its
subclasses (:class:`~cachedstore.server.LocalEtcd`, and
:class:`~cachedstore.testing.GrpcProxy` for tests) say only how to build the command line,
how to probe readiness and which ports may be re-picked after a clash.
"""

from __future__ import annotations

import abc
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeVar

from .binaries import EtcdStartError, find_etcd_binary
from .process import (
    LOG_TAIL_LINES,
    STOP_GRACE,
    ManagedProcess,
    child_env,
    cleanup,
    free_port,
    hostport,
    http_get,
    log_tail,
)

if TYPE_CHECKING:
    from .tls import TLSFiles

#: How many times a start is attempted with fresh ports when a port was taken meanwhile.
START_ATTEMPTS = 3
#: What etcd logs when a listener cannot bind because its port is taken.
PORT_IN_USE = "address already in use"

_S = TypeVar("_S", bound="Startable")


class Startable(abc.ABC):
    """Something started by :meth:`start` and released by :meth:`close`; a context manager."""

    @abc.abstractmethod
    def start(self: _S) -> _S:
        """Start and block until ready; returns ``self``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (idempotent)."""

    def __enter__(self: _S) -> _S:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def sum_metric(text: str, name: str, labels: Mapping[str, str] | None) -> float:
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


_P = TypeVar("_P", bound="ServerProcess")


class ServerProcess(Startable):
    """One etcd binary (member or proxy) run in its own temporary directory.

    Construction finds the binary, allocates the metrics port and the temporary directory
    but starts nothing. A ``weakref.finalize`` hook kills the process and removes the
    directory if the object is garbage collected without :meth:`close`.

    Subclasses implement :meth:`command`, :attr:`endpoint`, :meth:`_ready_once`, the two
    start-failure messages, :meth:`_may_retry` and :meth:`_reset_for_retry`; the class
    attributes set how readiness is polled and how much log is searched for a port clash.
    """

    #: First and longest sleep between readiness probes (the sleep doubles up to the max).
    _first_poll: ClassVar[float] = 0.05
    _max_poll: ClassVar[float] = 0.05
    #: How many lines of this start's log are searched for :data:`PORT_IN_USE`.
    _port_scan_lines: ClassVar[int] = LOG_TAIL_LINES

    def __init__(
        self,
        *,
        label: str,
        tmp_prefix: str,
        log_name: str,
        host: str,
        tls: TLSFiles | None,
        extra_args: Iterable[str],
        startup_timeout: float,
        env: Mapping[str, str] | None,
        metrics_port: int | None = None,
        stop_on_close: bool = False,
    ) -> None:
        self.binary = find_etcd_binary("etcd")
        self.host = host
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self.metrics_port = metrics_port or free_port(host)
        self._tmp_root = Path(tempfile.mkdtemp(prefix=tmp_prefix))
        self._log_path = self._tmp_root / log_name
        self._stop_on_close = stop_on_close
        self._proc = ManagedProcess(label)
        self._closed = False
        self._finalizer = weakref.finalize(self, cleanup, self._proc, self._tmp_root)

    # ---- addresses and state

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """``host:port`` clients connect to."""

    @property
    def endpoints(self) -> list[str]:
        """``[self.endpoint]``, for code that accepts clusters and single servers alike."""
        return [self.endpoint]

    @property
    def metrics_url(self) -> str:
        """Base URL of the plain-HTTP metrics listener (``GET metrics_url + "/metrics"``)."""
        return f"http://{hostport(self.host, self.metrics_port)}"

    @property
    def pid(self) -> int | None:
        """PID of the running process, or ``None``."""
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        """The file the process's stdout and stderr are appended to (across restarts)."""
        return self._log_path

    @property
    def running(self) -> bool:
        return self._proc.running()

    # ---- what subclasses provide

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""

    @abc.abstractmethod
    def _ready_once(self) -> bool:
        """One readiness probe; ``True`` when the process serves."""

    @abc.abstractmethod
    def _exited_message(self, code: int) -> str:
        """Why the start failed when the process exited with ``code`` while starting."""

    @abc.abstractmethod
    def _stalled_message(self, waited: float) -> str:
        """Why the start failed when the process was not ready after ``waited`` seconds."""

    @abc.abstractmethod
    def _may_retry(self) -> bool:
        """Whether a start that hit a port clash may be retried with new ports."""

    @abc.abstractmethod
    def _reset_for_retry(self) -> None:
        """After a port clash: kill the process and pick new automatic ports."""

    # ---- lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} was closed")

    def _launch(self) -> None:
        self._check_open()
        self._proc.launch(
            self.command(),
            log_path=self._log_path,
            env=child_env(self.env, "ETCD_"),
            cwd=self._tmp_root,
        )

    def _start_error(self, reason: str) -> EtcdStartError:
        return EtcdStartError(
            f"{reason} (log: {self._log_path})",
            log_tail(self._log_path, offset=self._proc.log_offset),
        )

    def _wait_ready(self, timeout: float | None = None) -> None:
        """Poll :meth:`_ready_once` until it passes; raise :class:`EtcdStartError` otherwise.

        Fails early if the process exits. ``timeout`` defaults to ``startup_timeout``.
        """
        waited = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + waited
        delay = self._first_poll
        while True:
            code = self._proc.exit_code()
            if code is not None:
                raise self._start_error(self._exited_message(code))
            if self._ready_once() and self.running:
                return
            if time.monotonic() >= deadline:
                raise self._start_error(self._stalled_message(waited))
            time.sleep(delay)
            delay = min(delay * 2, self._max_poll)

    def _port_conflict(self) -> bool:
        """Whether the log of the last launch says a port was already in use."""
        tail = log_tail(self._log_path, self._port_scan_lines, self._proc.log_offset)
        return PORT_IN_USE in tail

    def start(self: _P) -> _P:
        """Launch the process and block until it is ready; returns ``self``.

        A no-op when already running. If a port picked automatically was taken meanwhile,
        the start is retried with new ports (up to :data:`START_ATTEMPTS` attempts). On
        failure the process is killed and :class:`EtcdStartError` is raised with the tail
        of the log; :class:`RuntimeError` after :meth:`close`.
        """
        self._check_open()
        if self.running:
            return self
        attempts = START_ATTEMPTS if self._may_retry() else 1
        for attempt in range(attempts):
            self._launch()
            try:
                self._wait_ready()
                return self
            except EtcdStartError:
                if attempt + 1 < attempts and self._port_conflict():
                    self._reset_for_retry()
                    continue
                self._proc.kill()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the process, SIGKILL it after ``grace`` seconds; blocks until it is gone.

        The temporary directory (data, log) is kept until :meth:`close`.
        """
        self._proc.terminate(grace)

    def kill(self) -> None:
        """SIGKILL the process (a crash); the temporary directory is kept until :meth:`close`."""
        self._proc.kill()

    def close(self) -> None:
        """Kill the process and remove the temporary directory (idempotent).

        An owner that keeps data outside that directory (``stop_on_close``) stops the
        process gracefully first.
        """
        if self._closed:
            return
        self._closed = True
        if self._stop_on_close:
            self.stop()
        self._finalizer()

    # ---- metrics

    def etcd_metric(
        self, name: str, labels: Mapping[str, str] | None = None, *, timeout: float = 5.0
    ) -> float:
        """Sum the samples of metric ``name`` matching ``labels`` from ``/metrics``.

        ``name`` is a sample name (``grpc_server_handled_total``) or, for counters, the
        family name without ``_total``. Returns ``0.0`` when no sample matches. Blocks for
        one HTTP request (bounded by ``timeout``).
        """
        text = http_get(f"{self.metrics_url}/metrics", timeout=timeout).decode()
        return sum_metric(text, name, labels)
