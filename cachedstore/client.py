"""A plain etcd v3 client without a cache: :class:`EtcdClient`.

What the CLI's one-shot commands (``get``, ``set``, ``delete``, ``stats``) and the demo's
uncached contender use. It reads nothing it was not asked for (no preload of the prefix,
no watch of it): every call is one request, or a few for a compare-and-swap loop. A blocking
wait reads the key and, while it is absent, watches that one key from the revision of the
read (no polling, no missed put).

Built on :class:`~cachedstore.connection.Connection` (failover, TLS, auth tokens, error
translation) and the request builders of :mod:`cachedstore.etcdapi`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from . import counters, etcdapi
from .config import StoreConfig
from .connection import Connection, Credentials, parse_endpoint, translate_rpc_error
from .errors import (
    EtcdConnectionError,
    EtcdError,
    KeyNotFoundError,
    StoreTimeoutError,
)
from .keys import KeySpace, to_value
from .metrics import NullMetrics, StoreMetrics

__all__ = ["EtcdClient", "KeyValue"]


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it: the value and its revisions (etcd's ``mvccpb.KeyValue``)."""

    value: bytes
    create_revision: int
    mod_revision: int
    version: int


def _timed_out(key: bytes, timeout: float | None) -> StoreTimeoutError:
    """The error of a blocking wait for ``key`` whose ``timeout`` ran out."""
    return StoreTimeoutError(f"timed out after {timeout:g} s waiting for key {key!r}")


def _key_value(kv: Any) -> KeyValue:
    return KeyValue(bytes(kv.value), kv.create_revision, kv.mod_revision, kv.version)


class EtcdClient:
    """A bare etcd v3 client for one prefix: ``get``, ``mget``, ``set``, ``delete``, ``add``.

    Every read is one request; ``add`` is one Txn in the store's counter layout
    (``counters.py``); a blocking wait is one range plus, while the key is absent, one watch stream on
    that key. RPCs are counted in ``metrics`` like the store's (watch streams as method
    ``watch``). Not thread-safe (one per thread); every call blocks for its round trips,
    each bounded by ``config.request_timeout``. The constructor authenticates (when
    credentials are given) within ``config.connect_timeout``. Raises cachedstore errors
    only.
    """

    def __init__(self, endpoints: Sequence[str], credentials: Credentials,
                 config: StoreConfig, metrics: StoreMetrics | NullMetrics, prefix: str) -> None:
        self._keys = KeySpace(prefix, config.max_request_bytes)
        self._conn = Connection([parse_endpoint(e) for e in endpoints], credentials, config,
                                metrics)
        self._metrics = metrics
        #: Watch streams opened by blocking waits so far.
        self.watch_streams = 0
        try:
            self._conn.authenticate(self._conn.deadline(config.connect_timeout))
        except BaseException:
            self._conn.close()
            raise

    @property
    def targets(self) -> list[str]:
        """The endpoints, as ``host:port``."""
        return self._conn.targets

    def _key(self, name: str | bytes) -> bytes:
        return self._keys.key(self._keys.canonical(name))

    def _call(self, method: str, request: Any) -> Any:
        return self._conn.call(method, request, deadline=self._conn.deadline())

    # -- reads --------------------------------------------------------------------------
    def get(self, name: str | bytes, timeout: float | None = None) -> bytes:
        """The value of ``name``: one range; if absent and ``timeout`` is given, wait up to
        ``timeout`` seconds for its creation (StoreTimeoutError), else KeyNotFoundError."""
        return self.get_kv(name, timeout).value

    def get_kv(self, name: str | bytes, timeout: float | None = None) -> KeyValue:
        """Like :meth:`get`, with the key's revisions."""
        key = self._key(name)
        response = self._call("range", etcdapi.range_key(key))
        if response.kvs:
            return self._decoded(name, response.kvs[0])
        if timeout is None:
            raise KeyNotFoundError(name)
        return self._wait(key, response.header.revision, time.monotonic() + timeout, timeout)

    def _decoded(self, name: str | bytes, kv: Any) -> KeyValue:
        """A key as :meth:`get_kv` returns it: a counter's marker (``counters.py``) becomes
        the counter's decimal value, read with one more Txn."""
        if not counters.is_mark(kv.value):
            return _key_value(kv)
        parts = counters.Parts(self._keys, self._keys.canonical(name))
        response = self._call("txn", etcdapi.txn(success=counters.read_ops(parts)))
        found = counters.value_of(response.responses)
        if not isinstance(found, int):  # no longer a counter (set or deleted meanwhile)
            return _key_value(found) if found is not None else _key_value(kv)
        return KeyValue(str(found).encode(), kv.create_revision, kv.mod_revision, kv.version)

    def mget(self, names: Sequence[str | bytes], timeout: float | None = None) -> list[bytes]:
        """One Txn of ranges (at most ``max_txn_ops`` names); absent keys waited for as in
        :meth:`get`, all within one ``timeout``."""
        keys = [self._key(n) for n in names]
        response = self._call("txn", etcdapi.txn(
            success=[etcdapi.op_range(etcdapi.range_key(k)) for k in keys]))
        revision = response.header.revision
        deadline = None if timeout is None else time.monotonic() + timeout
        values = []
        for name, key, op in zip(names, keys, response.responses, strict=True):
            kvs = op.response_range.kvs
            if kvs:
                values.append(bytes(kvs[0].value))
            elif deadline is None:
                raise KeyNotFoundError(name)
            else:
                values.append(self._wait(key, revision, deadline, timeout).value)
        return values

    def count(self) -> int:
        """How many keys are under the prefix (one count-only range)."""
        return int(self._call("range", etcdapi.range_prefix(
            self._keys.range_start, self._keys.range_end, count_only=True)).count)

    def status(self) -> Any:
        """etcd's Maintenance.Status of the endpoint in use (version, db size, leader...)."""
        return self._call("status", etcdapi.status())

    # -- writes -------------------------------------------------------------------------
    def set(self, name: str | bytes, value: str | bytes) -> int:
        """One put; returns the revision etcd assigned."""
        key, data = self._key(name), to_value(value)
        self._keys.check_size(key, data)
        return int(self._call("put", etcdapi.put(key, data)).header.revision)

    def delete(self, name: str | bytes) -> bool:
        """One delete; whether the key existed."""
        return bool(self._call("delete_range", etcdapi.delete(self._key(name))).deleted)

    def add(self, name: str | bytes, amount: int = 1) -> int:
        """Add to the counter ``name`` with the store's layout (``counters.py``): one Txn
        that no other add can make fail; a key holding a plain decimal is converted by one
        compare-and-swap first. Returns the new value; ``amount == 0`` only reads."""
        if amount == 0:
            try:
                return counters.parse_int(self.get(name), name)
            except KeyNotFoundError:
                return 0
        canonical = self._keys.canonical(name)
        parts = counters.Parts(self._keys, canonical)
        deadline = self._conn.deadline()
        while True:
            response = self._conn.call("txn", counters.add_request(parts, amount),
                                       deadline=deadline)
            outcome, result = counters.add_result(response, amount)
            if outcome == "added":
                return int(result)
            if outcome == "created":
                return amount
            plain: Any = result  # the key's kv: a value someone set
            value = counters.parse_int(plain.value, name) + amount
            request = counters.convert_request(parts, plain, value)
            if self._conn.call("txn", request, deadline=deadline).succeeded:
                return value

    def delete_prefix(self) -> int:
        """Delete every key under the prefix, counters' parts included (one Txn); returns
        how many names existed."""
        keys = self._keys
        response = self._call("txn", etcdapi.txn(success=[
            etcdapi.op_delete(etcdapi.delete(keys.range_start, range_end=keys.range_end)),
            etcdapi.op_delete(etcdapi.delete(keys.range_end,  # the counters' parts
                                             range_end=keys.full_range_end))]))
        return int(response.responses[0].response_delete_range.deleted)

    # -- waiting ------------------------------------------------------------------------
    def _wait(self, key: bytes, revision: int, deadline: float, timeout: float | None
              ) -> KeyValue:
        """Watch ``key`` from ``revision + 1`` until it is put; one watch stream."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(key, timeout)
        done = threading.Event()
        create = etcdapi.watch_create(key, b"", revision + 1)

        def requests() -> Any:
            yield create
            done.wait()  # keep the send side open: etcd ends a half-closed stream

        _, endpoint = self._conn.checked_endpoint(deadline)  # never another cluster
        self.watch_streams += 1
        started = time.perf_counter()
        code = "ok"
        call = cast(Any, endpoint).watch.Watch(requests(), timeout=remaining,
                                               metadata=self._conn.metadata())
        try:
            for response in call:
                if response.canceled:
                    code = "CANCELLED"
                    raise EtcdError(f"etcd canceled the watch on {key!r}: "
                                    f"{response.cancel_reason or 'no reason given'}")
                for event in response.events:
                    if event.type == etcdapi.EVENT_PUT:
                        return _key_value(event.kv)
            code = "ENDED"
            raise EtcdConnectionError(f"the watch on {key!r} ended without the key")
        except grpc.RpcError as exc:
            status = exc.code() if hasattr(exc, "code") else None
            code = status.name if status is not None else "UNKNOWN"
            details = (exc.details() if hasattr(exc, "details") else "") or ""
            # etcd may notice the deadline first and answer UNKNOWN "context deadline exceeded"
            if status is grpc.StatusCode.DEADLINE_EXCEEDED \
                    or "deadline exceeded" in details.lower():
                raise _timed_out(key, timeout) from None
            raise translate_rpc_error(exc, "watch") from exc
        finally:
            done.set()
            call.cancel()
            self._metrics.rpc("watch", code, time.perf_counter() - started)

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Close the channels. Idempotent."""
        self._conn.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
