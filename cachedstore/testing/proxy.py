"""``etcd grpc-proxy`` in front of some endpoints: :class:`GrpcProxy`."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence

from cachedstore.server import TLSFiles
from cachedstore.server.base import ServerProcess
from cachedstore.server.process import DEFAULT_HOST, free_port, hostport


class GrpcProxy(ServerProcess):
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
    ) -> None:
        if not endpoints:
            raise ValueError("grpc-proxy needs at least one endpoint")
        super().__init__(
            label="etcd grpc-proxy",
            tmp_prefix="cachedstore-grpc-proxy-",
            log_name="grpc-proxy.log",
            host=host,
            tls=tls,
            extra_args=extra_args,
            startup_timeout=startup_timeout,
            env=env,
        )
        self.backends = list(endpoints)
        self._auto_port = port is None
        self.port = port or free_port(host)

    @property
    def endpoint(self) -> str:
        """``host:port`` the proxy listens on."""
        return hostport(self.host, self.port)

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

    def _ready_once(self) -> bool:
        """Whether a ``status()`` call through the proxy gets any answer."""
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

    def _exited_message(self, code: int) -> str:
        return f"grpc-proxy exited with code {code}"

    def _stalled_message(self, waited: float) -> str:
        return f"grpc-proxy not serving after {waited:g} s"

    def _may_retry(self) -> bool:
        return self._auto_port

    def _reset_for_retry(self) -> None:
        """After a port clash: kill the proxy and pick a new listen and metrics port."""
        self._proc.kill()
        self.port, self.metrics_port = free_port(self.host), free_port(self.host)
