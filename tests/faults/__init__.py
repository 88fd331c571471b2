"""Fault-injection tests: a store against real etcd processes that are killed, partitioned,
reset, compacted and clustered, and the randomized consistency checker.

Helpers: :mod:`.proxy` (an in-test TCP proxy that resets or silently stalls connections)
and :mod:`.checker` (the multi-process history checker, also runnable by hand).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["follows_by_watch", "misses", "restarts", "sample", "served_from_cache", "split",
           "wait_until"]


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


def misses(store: Any) -> float:
    """How many ``get`` calls of ``store`` were cache misses so far."""
    return sample(store, "cachedstore_cache_requests_total", {"op": "get", "result": "miss"})


def served_from_cache(store: Any, name: str, expected: bytes) -> bool:
    """True if ``store.get(name)`` returns ``expected`` without a cache miss (non-raising)."""
    before = misses(store)
    try:
        value = store.get(name, None)
    except ConnectionError:
        return False
    return bool(value == expected and misses(store) == before)


def follows_by_watch(store: Any, put: Callable[[str], Any], name: str, current: bytes,
                     new: str, timeout: float = 10.0) -> None:
    """Check that ``store`` follows another client's writes through its watch: once
    ``name`` (now ``current``) is served from the cache, ``put(new)`` by the other client
    must show up in ``store`` with no cache miss (pushed by the watch, not re-read)."""
    wait_until(lambda: served_from_cache(store, name, current), timeout,
               f"{name!r}={current!r} to be served from the cache")
    before = misses(store)
    put(new)
    wait_until(lambda: store.get(name, None) == new.encode(), timeout,
               f"the watch to deliver {new!r}")
    assert misses(store) == before, "the update was re-read from etcd, not pushed by the watch"
