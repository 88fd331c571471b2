"""What the demo runs (:class:`DemoSettings`), its phases, and its one error type."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from ..config import StoreConfig
from ..connection import Credentials
from ..console import CommandError
from ..metrics import StoreMetrics
from .uncached import UncachedClient

#: The two phases, in the order they run.
MODES = ("cached", "uncached")


class DemoError(CommandError):
    """The demo cannot run or went wrong; ``exit_code`` follows the CLI's exit codes."""


@dataclass(frozen=True)
class DemoSettings:
    """What to run. Times in seconds. ``endpoints=None``: start a throw-away etcd."""

    workers: int = 4
    rounds: int = 20
    hot_reads: int = 200
    endpoints: tuple[str, ...] | None = None
    #: Root of the demo's keys on a real cluster; a random id is appended.
    prefix_root: str = "/cachedstore-demo/"
    #: connect_timeout and request_timeout of every client.
    dial_timeout: float = 5.0
    #: Budget of each blocking wait (all-gather, barrier).
    wait_timeout: float = 30.0
    #: Worker ``rank`` serves its metrics on ``metrics_port + rank``; None: no server.
    metrics_port: int | None = None
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        """Raise :class:`DemoError` (exit code 2) for settings that cannot work."""
        if self.workers < 1 or self.rounds < 1 or self.hot_reads < 0:
            raise DemoError("--workers and --rounds must be >= 1, --hot-reads >= 0", 2)
        if self.workers > 128:
            raise DemoError("--workers is limited to 128 (one etcd Txn per all-gather)", 2)
        if self.dial_timeout <= 0 or self.wait_timeout <= 0:
            raise DemoError("timeouts must be > 0 seconds", 2)
        if self.metrics_port is not None and not (
                self.metrics_port >= 1 and self.metrics_port + self.workers - 1 <= 65535):
            raise DemoError(f"--metrics-port {self.metrics_port}: need {self.workers} ports "
                            f"from there, all within 1..65535", 2)

    def store_config(self) -> StoreConfig:
        return StoreConfig().with_overrides(connect_timeout=self.dial_timeout,
                                            request_timeout=self.dial_timeout)

    def credentials(self) -> Credentials:
        return Credentials(self.ca_cert, self.cert_key, self.cert_cert, self.user,
                           self.password)

    def uncached_client(self, endpoints: Sequence[str], prefix: str,
                        registry: CollectorRegistry | None = None) -> UncachedClient:
        """An :class:`UncachedClient` with these settings' credentials and timeouts, its
        RPCs counted in ``registry`` (a throw-away one when None). Blocks while it
        authenticates; raises what :class:`UncachedClient` raises."""
        metrics = StoreMetrics(CollectorRegistry() if registry is None else registry)
        return UncachedClient(endpoints, self.credentials(), self.store_config(), metrics,
                              prefix)
