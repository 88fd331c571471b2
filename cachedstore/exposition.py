"""Serve cachedstore's Prometheus metrics over HTTP.

Two ways to scrape several processes (say one trainer per GPU, launched by ``torchrun``):

* **One port per process.** Each process calls
  ``start_metrics_server(local_rank_port(9464))`` and serves its own registry on
  ``base_port + LOCAL_RANK``; Prometheus scrapes every port (``grafana/prometheus.yml``) and
  dashboards aggregate with ``sum``/``max`` over ``instance``.
* **Multiprocess mode.** The launcher sets ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory
  *before* any process imports ``prometheus_client``; every process then writes its samples
  to memory-mapped files there, a single process calls ``start_metrics_server(9464)``, which
  serves a fresh registry holding a
  :class:`~prometheus_client.multiprocess.MultiProcessCollector`, and the launcher calls
  :func:`mark_process_dead` when a worker exits so that its ``live*`` gauges disappear.
  Counters and histograms add up over processes; ``cachedstore_cache_entries``,
  ``cachedstore_watch_up`` and ``cachedstore_waiters`` are summed over live processes
  (``livesum``) and ``cachedstore_watch_revision`` is the maximum (``livemax``).

The HTTP server is prometheus-client's own (``start_http_server``, a threading WSGI server
around ``make_wsgi_app``); this module adds a handle to stop it, a named thread, port 0 and the
multiprocess switch.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

__all__ = [
    "MULTIPROC_ENV",
    "MetricsServer",
    "is_multiprocess",
    "local_rank_port",
    "mark_process_dead",
    "start_metrics_server",
]

#: The environment variable that switches prometheus-client to multiprocess mode.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_THREAD_JOIN_TIMEOUT = 5.0


def _multiproc_dir() -> str | None:
    # prometheus-client still honours the old lower-case spelling.
    return os.environ.get(MULTIPROC_ENV) or os.environ.get("prometheus_multiproc_dir") or None  # noqa: SIM112


def is_multiprocess() -> bool:
    """Whether prometheus-client runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set)."""
    return _multiproc_dir() is not None


class MetricsServer:
    """A running ``/metrics`` HTTP server, as returned by :func:`start_metrics_server`.

    Attributes:
        addr: The address the server is bound to.
        port: The TCP port it listens on (the one the OS picked when asked for port 0).
        url: ``http://HOST:PORT/metrics``, with a loopback host when bound to a wildcard address.
        thread: The (daemon) thread running the server's accept loop.
        multiprocess: Whether it serves the aggregate of ``PROMETHEUS_MULTIPROC_DIR``.

    :meth:`close` is thread-safe and idempotent. The handle is also a context manager.
    """

    def __init__(self, server: object, thread: threading.Thread, multiprocess: bool) -> None:
        self._server = server
        self.thread = thread
        self.multiprocess = multiprocess
        host, port = server.server_address[:2]  # type: ignore[attr-defined]
        self.addr: str = str(host)
        self.port: int = int(port)
        url_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.addr, self.addr)
        if ":" in url_host:
            url_host = f"[{url_host}]"
        self.url: str = f"http://{url_host}:{self.port}/metrics"
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    def close(self, timeout: float = _THREAD_JOIN_TIMEOUT) -> None:
        """Stop serving, close the listening socket and join the server thread.

        Blocks until the accept loop has returned (it polls every 0.5 s, so this usually takes
        up to half a second) and the thread has ended, or ``timeout`` seconds have passed.
        Requests already being answered on their own daemon threads are not waited for.
        Thread-safe and idempotent (must not be called from :attr:`thread` itself).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
        self.thread.join(timeout)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<MetricsServer {self.url} {state}>"


def start_metrics_server(
    port: int,
    addr: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve Prometheus metrics on ``http://addr:port/metrics`` from a background thread.

    Args:
        port: TCP port; 0 lets the OS pick a free one (read it back from ``.port``).
            For one server per process use ``local_rank_port(base_port)``.
        addr: Address to bind. The default is loopback only; pass ``"0.0.0.0"`` (or ``"::"``)
            to be scraped from other hosts.
        registry: The registry to expose; the process-wide default
            :data:`prometheus_client.REGISTRY` when None. Ignored in multiprocess mode
            (``PROMETHEUS_MULTIPROC_DIR`` set), where a fresh registry with a
            :class:`~prometheus_client.multiprocess.MultiProcessCollector` serves the samples
            every process wrote to that directory, whatever registry they were created in.

    Returns:
        A :class:`MetricsServer` handle; call :meth:`MetricsServer.close` to stop it.

    Raises:
        OSError: The port is taken or the address cannot be bound.
        ValueError: Multiprocess mode, but the directory does not exist.

    Binding happens before this returns, so the server accepts connections at once; this
    call does not block otherwise. The server answers each scrape on its own daemon thread
    and runs its accept loop on a daemon thread named ``cachedstore-metrics-<port>``, so it
    never keeps the interpreter alive. Safe to call from any thread; each call starts an
    independent server.
    """
    multiprocess = is_multiprocess()
    if multiprocess:
        # Imported lazily: the module reads the environment when it is used, not imported.
        from prometheus_client.multiprocess import MultiProcessCollector

        served = CollectorRegistry()
        MultiProcessCollector(served)
    else:
        served = registry if registry is not None else REGISTRY
    server, thread = start_http_server(port, addr=addr, registry=served)
    handle = MetricsServer(server, thread, multiprocess)
    thread.name = f"cachedstore-metrics-{handle.port}"
    return handle


def local_rank_port(base_port: int) -> int:
    """The port of this process under the one-port-per-process scheme: ``base_port + LOCAL_RANK``.

    ``LOCAL_RANK`` is set by ``torchrun`` (and most launchers) to the index of the process on
    its host; unset means 0. With ``base_port=9464`` and 8 processes a host serves 9464..9471,
    which is what ``grafana/prometheus.yml`` scrapes. Reads the environment only; thread-safe.

    Raises:
        ValueError: ``LOCAL_RANK`` is not a non-negative integer or the port would exceed 65535.
    """
    raw = os.environ.get("LOCAL_RANK", "").strip() or "0"
    try:
        rank = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None
    if rank < 0:
        raise ValueError(f"LOCAL_RANK must not be negative, got {rank}")
    port = base_port + rank
    if not 0 <= port <= 65535:
        raise ValueError(f"base_port {base_port} + LOCAL_RANK {rank} is not a TCP port")
    return port


def mark_process_dead(pid: int | None = None) -> None:
    """Forget a dead process's ``live*`` gauges in multiprocess mode; a no-op otherwise.

    Call it from the launcher (or the process that serves metrics) when a worker exits, with
    the worker's ``pid`` (default: this process). Removes that process's ``livesum``/``livemax``
    gauge files from ``PROMETHEUS_MULTIPROC_DIR``; its counters and histograms stay counted.
    Blocks only for the file removals; safe to call from any thread.
    """
    path = _multiproc_dir()
    if path is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(os.getpid() if pid is None else pid, path)
