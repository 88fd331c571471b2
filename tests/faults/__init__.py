"""Fault-injection tests: a store against real etcd processes that are killed, partitioned,
reset, compacted and clustered, and the randomized consistency checker.

Helpers: :mod:`.proxy` (an in-test TCP proxy that resets or silently stalls connections)
and :mod:`.checker` (the multi-process history checker, also runnable by hand).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["restarts", "sample", "split", "wait_until"]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.005) -> float:
    """Poll ``predicate`` until it is truthy; return the seconds it took. Raises
    AssertionError naming ``what`` when ``timeout`` passes first. Exceptions propagate."""
    started = time.monotonic()
    deadline = started + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - started


def sample(store: Any, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of one sample of ``store``'s private registry (0 when absent)."""
    value = store.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else float(value)


def restarts(store: Any, reason: str) -> float:
    """``cachedstore_watch_restarts_total{reason=...}`` of ``store``."""
    return sample(store, "cachedstore_watch_restarts_total", {"reason": reason})


def split(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``."""
    host, _, port = endpoint.rpartition(":")
    return host, int(port)
