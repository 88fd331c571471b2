"""The demo's contender: :class:`UncachedClient`, a careful etcd v3 client without a cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import grpc
from etcd3 import etcdrpc

from ..config import StoreConfig
from ..connection import Connection, Credentials, parse_endpoint, translate_rpc_error
from ..errors import (
    EtcdConnectionError,
    EtcdError,
    KeyNotFoundError,
    StoreTimeoutError,
)
from ..keys import KeySpace, to_value
from ..metrics import StoreMetrics

#: What "uncached" means, printed under the table and put in the JSON summary.
UNCACHED_MEANS = (
    "uncached = a bare etcd v3 client: every read is one etcd request (mget: one Txn of "
    "ranges); a blocking wait is a range plus one watch stream on the key while it is "
    "absent; add is a read then a compare-and-swap Txn. No polling."
)
_PUT = 0  # etcd mvccpb Event.EventType.PUT


def _timed_out(key: bytes, timeout: float | None) -> StoreTimeoutError:
    """The error of a blocking wait for ``key`` whose ``timeout`` ran out."""
    return StoreTimeoutError(f"timed out after {timeout:g} s waiting for key {key!r}")


class UncachedClient:
    """A bare etcd v3 client on cachedstore's :class:`~cachedstore.connection.Connection`.

    The same calls as the store's (``get``, ``mget``, ``set``, ``add``) with no cache:
    every read is one request; a blocking wait reads the key and, while it is absent,
    watches that one key from the revision of the read (no polling, no missed put). RPCs
    are counted in ``metrics`` like the store's (watch streams as method ``watch``).
    Not thread-safe (one per worker); every call blocks for its round trips.
    """

    def __init__(self, endpoints: Sequence[str], credentials: Credentials,
                 config: StoreConfig, metrics: StoreMetrics, prefix: str) -> None:
        self._conn = Connection([parse_endpoint(e) for e in endpoints], credentials, config,
                                metrics)
        self._keys = KeySpace(prefix, config.max_request_bytes)
        self._metrics = metrics
        #: Watch streams opened by blocking waits so far.
        self.watch_streams = 0
        try:
            self._conn.authenticate(self._conn.deadline(config.connect_timeout))
        except BaseException:
            self._conn.close()
            raise

    def _key(self, name: str | bytes) -> bytes:
        return self._keys.key(self._keys.canonical(name))

    def get(self, name: str | bytes, timeout: float | None = None) -> bytes:
        """One range; if absent and ``timeout`` is given, wait for the key's creation."""
        key = self._key(name)
        response = self._conn.call("range", etcdrpc.RangeRequest(key=key),
                                   deadline=self._conn.deadline())
        if response.kvs:
            return bytes(response.kvs[0].value)
        if timeout is None:
            raise KeyNotFoundError(name)
        return self._wait(key, response.header.revision, time.monotonic() + timeout, timeout)

    def mget(self, names: Sequence[str | bytes], timeout: float | None = None) -> list[bytes]:
        """One Txn of ranges (at most ``max_txn_ops`` names); absent keys waited for."""
        keys = [self._key(n) for n in names]
        ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k)) for k in keys]
        response = self._conn.call("txn", etcdrpc.TxnRequest(success=ops),
                                   deadline=self._conn.deadline())
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
                values.append(self._wait(key, revision, deadline, timeout))
        return values

    def set(self, name: str | bytes, value: str | bytes) -> None:
        """One put."""
        self._conn.call("put", etcdrpc.PutRequest(key=self._key(name), value=to_value(value)),
                        deadline=self._conn.deadline())

    def add(self, name: str | bytes, amount: int = 1) -> int:
        """Read the counter, then compare-and-swap it on its mod_revision until it sticks."""
        key = self._key(name)
        deadline = self._conn.deadline()
        response = self._conn.call("range", etcdrpc.RangeRequest(key=key), deadline=deadline)
        found = response.kvs[0] if response.kvs else None
        while True:
            if found is None:
                new = amount
                compare = etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                                          target=etcdrpc.Compare.CREATE, create_revision=0)
            else:
                new = int(found.value) + amount
                compare = etcdrpc.Compare(key=key, result=etcdrpc.Compare.EQUAL,
                                          target=etcdrpc.Compare.MOD,
                                          mod_revision=found.mod_revision)
            request = etcdrpc.TxnRequest(
                compare=[compare],
                success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                    key=key, value=str(new).encode()))],
                failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))])
            txn = self._conn.call("txn", request, deadline=deadline)
            if txn.succeeded:
                return new
            kvs = txn.responses[0].response_range.kvs
            found = kvs[0] if kvs else None

    def delete_prefix(self) -> int:
        """Delete every key under the prefix; returns how many existed."""
        request = etcdrpc.DeleteRangeRequest(key=self._keys.range_start,
                                             range_end=self._keys.range_end)
        return int(self._conn.call("delete_range", request,
                                   deadline=self._conn.deadline()).deleted)

    def status(self) -> Any:
        """etcd's Maintenance.Status of the endpoint in use (version, db size, leader...)."""
        return self._conn.call("status", etcdrpc.StatusRequest(),
                               deadline=self._conn.deadline())

    def _wait(self, key: bytes, revision: int, deadline: float, timeout: float | None
              ) -> bytes:
        """Watch ``key`` from ``revision + 1`` until it is put; one watch stream."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(key, timeout)
        done = threading.Event()
        create = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=key, start_revision=revision + 1,
            filters=[etcdrpc.WatchCreateRequest.NODELETE]))

        def requests() -> Any:
            yield create
            done.wait()  # keep the send side open: etcd ends a half-closed stream

        _, endpoint = self._conn.endpoint()
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
                    if event.type == _PUT:
                        return bytes(event.kv.value)
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

    def close(self) -> None:
        """Close the channels. Idempotent."""
        self._conn.close()

    def __enter__(self) -> UncachedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
