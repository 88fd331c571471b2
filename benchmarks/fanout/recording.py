"""Which keys each simulated rank reads and writes: :class:`RecordingStore`, :class:`Access`.

A rank's store is wrapped in a :class:`RecordingStore` (a ``torch.distributed.Store`` that
forwards every call to the real store and logs the full key it touched), *below* torch's
``PrefixStore`` so the log holds the etcd-side names. From the logs, :class:`Access` counts
the watch deliveries the ranks actually need: every write of key K is needed by each *other*
rank that reads or waits on K (``get``, ``wait``, ``check``, ``multi_get``, ``add(K, 0)``,
a failed ``compare_set``). A write counts when it changes the key semantically: ``set``,
``multi_set``, ``add(K, n != 0)``, ``append``, ``delete_key``, a ``compare_set`` that
installed the desired value. That is the yardstick of issue 11's goal 3 (watch messages
etcd sends ≤ 2 × the deliveries needed).

Thread-safety: one :class:`RecordingStore` per rank, called from that rank's thread (the
log is a plain list; ``list.append`` is atomic in CPython). :class:`Access` is not
thread-safe; it merges logs after a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Access", "RecordingStore"]

READ, WRITE = "r", "w"


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return bytes(value)  # list[int] from torch's C++ side


class RecordingStore(dist.Store):
    """``inner``'s c10d API, logging ``(READ|WRITE, key)`` into ``log`` for every key.

    ``barrier`` is forwarded as is (it is the store's own, or torch's default built on
    ``add``/``set``/``wait``, which then come back through this wrapper and are logged).
    Exceptions of ``inner`` propagate unchanged.
    """

    def __init__(self, inner: dist.Store, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self._inner = inner
        self._log = log
        #: How many ``barrier`` calls reached this store (a C++ ``PrefixStore`` above it
        #: that runs torch's default barrier sends ``add``/``set``/``wait`` instead).
        self.barrier_calls = 0
        self.set_timeout(inner.timeout)

    @property
    def inner(self) -> dist.Store:
        return self._inner

    def set(self, key: str, value: Any) -> None:
        self._log.append((WRITE, key))
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._log.append((READ, key))
        return self._inner.get(key)  # type: ignore[no-any-return]

    def add(self, key: str, value: int) -> int:
        self._log.append((WRITE if value else READ, key))
        return self._inner.add(key, value)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        result = self._inner.compare_set(key, expected_value, desired_value)
        won = _as_bytes(result) == _as_bytes(desired_value)
        self._log.append((WRITE if won else READ, key))
        return result  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        self._log.extend((READ, k) for k in keys)
        return self._inner.check(keys)  # type: ignore[no-any-return]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._log.extend((READ, k) for k in keys)
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._log.extend((READ, k) for k in keys)
        return self._inner.multi_get(keys)  # type: ignore[no-any-return]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._log.extend((WRITE, k) for k in keys)
        self._inner.multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self._log.append((WRITE, key))
        self._inner.append(key, value)

    def delete_key(self, key: str) -> bool:
        self._log.append((WRITE, key))
        return self._inner.delete_key(key)  # type: ignore[no-any-return]

    def num_keys(self) -> int:
        return self._inner.num_keys()  # type: ignore[no-any-return]

    def has_extended_api(self) -> bool:
        return bool(self._inner.has_extended_api())

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        self.barrier_calls += 1
        if timeout is None:
            self._inner.barrier(key, world_size)
        else:
            self._inner.barrier(key, world_size, timeout)


@dataclass
class Access:
    """Who read and who wrote which key, merged over ranks (picklable, mergeable)."""

    readers: dict[str, set[int]] = field(default_factory=dict)
    writes: dict[str, list[int]] = field(default_factory=dict)

    def add_log(self, rank: int, log: Iterable[tuple[str, str]]) -> None:
        for op, key in log:
            if op == READ:
                self.readers.setdefault(key, set()).add(rank)
            else:
                self.writes.setdefault(key, []).append(rank)

    def merge(self, other: Access) -> None:
        for key, ranks in other.readers.items():
            self.readers.setdefault(key, set()).update(ranks)
        for key, writers in other.writes.items():
            self.writes.setdefault(key, []).extend(writers)

    @property
    def n_writes(self) -> int:
        return sum(len(w) for w in self.writes.values())

    def needed_deliveries(self) -> int:
        """Σ over writes of K: the ranks other than the writer that read or wait on K."""
        total = 0
        for key, writers in self.writes.items():
            readers = self.readers.get(key, set())
            for writer in writers:
                total += len(readers) - (writer in readers)
        return total
